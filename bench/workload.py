"""The benchmarks' shared workload: seeded requests with lognormal prompt and output
lengths, as token ids, so every peer sees exactly the same requests."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the widest vector ISA of this CPU, for every bench's JSON: speed-ups must hold on AVX2-only
# machines as well as on AVX-512 (with or without native bf16)
from plurai.gpu_workers.kernels import cpu_isa  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
STARTED = time.monotonic()  # about when the bench started: each imports this module first


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


BENCH_MODEL = "models/bench-llama"
# --model folders the benches make when missing: the factory's sizes under models/
MADE = {BENCH_MODEL: "bench", "models/qwen-0.5b": "0.5b", "models/llama-1b": "1b"}


def bench_model(path: str | Path = BENCH_MODEL) -> Path:
    """A bench's --model folder: any model folder, or one of MADE's, made once if missing
    (the ~46M-parameter bench Llama by default; Qwen2.5-0.5B's and Llama-3.2-1B's shapes)."""
    from plurai.gpu_workers.models.factory import make_model

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    size = MADE.get(path.as_posix().rstrip("/"))
    if size is None:
        raise SystemExit(
            f"--model {path}: no config.json there; give a model folder, or one of "
            f"{', '.join(MADE)} (made on first use), or make one with `plurai make-model "
            f"{path} --size 0.5b`"
        )
    make_model(path, size=size)
    return path


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options that pick the mixed workload, shared by the benches that run it."""
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)


# an engine's KV budget in a --smoke run: a few requests need little, and the default (up
# to 1 GiB) takes a second to allocate at every engine's start
SMOKE_KV_BYTES = 32 << 20


def add_smoke_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run through every step of the bench (the tiny test model, a few "
        "requests, short runs): a check that it runs to its end, not a measurement",
    )


def json_line(figures: dict[str, Any], smoke: bool = False) -> None:
    """A bench's last line, one JSON object: its figures, the CPU's ISA, the run's seconds
    and, after a --smoke run, `"smoke": true` (a check that it runs, not a measurement)."""
    figures.setdefault("isa", cpu_isa())
    figures.setdefault("wall_s", round(time.monotonic() - STARTED, 1))
    if smoke:
        figures["smoke"] = True
    print(json.dumps(figures), flush=True)


def smoke_model(size: str = "tiny") -> Path:
    """The factory's random-weight Llama of this size for --smoke runs ("small": the
    smallest that vLLM's CPU attention takes), made once under models/. It is written to a
    folder of its own and then renamed into place, so that smoke runs started at once (the
    test suites run side by side) never read a half-written model."""
    from plurai.gpu_workers.models.factory import factory_record, make_model

    path = ROOT / "models" / f"smoke-{size}-llama"
    if factory_record(path) is None:  # written last: a whole model
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        make_model(tmp, family="llama", size=size)
        tmp.with_name(f".{tmp.name}.lock").unlink(missing_ok=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another run put it there first
            shutil.rmtree(tmp, ignore_errors=True)
    return path
