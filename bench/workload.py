"""The benchmarks' shared workload: seeded requests with lognormal prompt and output
lengths, as token ids, so every peer sees exactly the same requests."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

# the widest vector ISA of this CPU, for every bench's JSON: speed-ups must hold on AVX2-only
# machines as well as on AVX-512 (with or without native bf16)
from gpu_workers.kernels import cpu_isa  # noqa: F401


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def mixed(
    n: int,
    vocab: int,
    seed: int = 0,
    prompt_median: int = 128,
    output_median: int = 96,
    sigma: float = 0.6,
    max_prompt: int = 768,
    max_output: int = 384,
) -> list[Request]:
    """n requests; lengths lognormal around the medians, clipped to [8, max_*]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(max_prompt, max(8, round(rng.lognormvariate(math.log(prompt_median), sigma))))
        o = min(max_output, max(8, round(rng.lognormvariate(math.log(output_median), sigma))))
        # skip the lowest ids, where the factory's tokenizer keeps its special tokens
        out.append(Request([rng.randrange(16, vocab) for _ in range(p)], o))
    return out


def bench_model(path: str | Path = "models/bench-llama") -> Path:
    """The ~46M-parameter Llama the benchmarks run on, made once if missing."""
    from gpu_workers.models.factory import make_model

    path = Path(path)
    if not (path / "config.json").is_file():
        make_model(path, family="llama", size="bench")
    return path


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options that pick the mixed workload, shared by the benches that run it."""
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
