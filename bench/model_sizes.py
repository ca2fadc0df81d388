"""Engine figures at a model's real size: Plurai's engine against vLLM's CPU build on the same
model folder, dtype, threads and requests, each peer in a process of its own.

Per peer and dtype: decode tok/s at 1 and at 32 requests (16-token prompts, 128 tokens out:
the prompts' compute is a small share), prefill tok/s on 512- and 2,048-token prompts (one
token out), the seconds from the engine's construction to its first output, and the
resident memory at the end (KV caches of 1 GiB on both). Decode at one request reads every
weight once a step, so its steps/s times the weights' bytes is the weight-read bandwidth it
achieved; the JSON puts it beside the machine's read bandwidth measured here (a sum over
1 GiB with torch's threads: the floor no decode step can beat).

    python bench/model_sizes.py [--model models/llama-1b] [--dtypes bf16,fp32] [--runs 3]
        [--skip-vllm] [--smoke]

--model: any model folder; models/qwen-0.5b and models/llama-1b (the default) are made on
first use (`plurai make-model --size`). Random weights decide nothing about text, so every
request ignores EOS. With --runs N the peers run N times, interleaved; figures are medians.
--smoke: the factory's small Llama in fp32, a few short requests, vLLM eager: a check that the bench
runs, not a measurement. The last line is one JSON object of the figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.throughput import ROOT, peer, vllm_env, vllm_python  # noqa: E402
from bench.workload import add_smoke_arg, bench_model, cpu_isa, json_line, smoke_model  # noqa: E402

KV_GIB = 1
MAX_MODEL_LEN = 4096
BYTES = {"fp32": 4, "bf16": 2}


def phases(vocab: int, seed: int, smoke: bool) -> dict[str, list[list]]:
    """Each phase's requests, [prompt ids, max_tokens]; random ids above the factory
    tokenizer's special tokens, and no prompt shared with another phase."""
    rng = random.Random(seed)

    def reqs(n: int, prompt: int, out: int) -> list[list]:
        return [[[rng.randrange(16, vocab) for _ in range(prompt)], out] for _ in range(n)]

    if smoke:
        return {
            "decode_1": reqs(1, 8, 8),
            "decode_32": reqs(4, 8, 8),
            "prefill_512": reqs(2, 32, 1),
        }
    return {
        "decode_1": reqs(1, 16, 128),
        "decode_32": reqs(32, 16, 128),
        "prefill_512": reqs(4, 512, 1),
        "prefill_2048": reqs(2, 2048, 1),
    }


def rate(name: str, requests: list[list], seconds: float) -> float:
    """tok/s of a phase: output tokens for decode, prompt tokens for prefill."""
    if name.startswith("prefill"):
        return sum(len(p) for p, _ in requests) / seconds
    return sum(n for _, n in requests) / seconds


def weight_bytes(model: Path, dtype: str) -> int:
    """Bytes of weights a decode step reads: every tensor in the checkpoint, but the
    embedding table where the output head is a matrix of its own (a step reads one row)."""
    config = json.loads((model / "config.json").read_text())
    numel = 0
    for path in sorted(model.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if "embed_tokens" in name and not config.get("tie_word_embeddings", False):
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            numel += n
    return numel * BYTES[dtype]


def read_bandwidth_gb_s(gib: float = 1.0, tries: int = 5) -> float:
    """The best of `tries` sums over `gib` GiB of float32 with torch's threads, GB/s."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return round(x.numel() * 4 / best / 1e9, 2)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="models/llama-1b")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-vllm", action="store_true")
    add_smoke_arg(ap)
    a = ap.parse_args()
    if a.smoke:
        a.runs, a.dtypes = 1, "fp32"  # fp32: what vLLM's CPU build runs on every ISA
    model = (smoke_model("small") if a.smoke else bench_model(a.model)).resolve()
    config = json.loads((model / "config.json").read_text())
    work = phases(config["vocab_size"], a.seed, a.smoke)
    threads = torch.get_num_threads()
    py = None if a.skip_vllm else vllm_python()
    if not a.skip_vllm and py is None:
        print("vllm skipped: no .venv-vllm (make vllm-install) nor PLURAI_VLLM_PYTHON")
    result: dict = {
        "bench": "model_sizes",
        "isa": cpu_isa(),
        "threads": threads,
        "model": model.name,
        "architecture": config["architectures"][0],
        "read_bandwidth_gb_s": read_bandwidth_gb_s(0.125 if a.smoke else 1.0),
        "dtypes": {},
    }
    from plurai.gpu_workers.kernels import build_isa

    result["kernels_isa"] = build_isa()
    for dtype in a.dtypes.split(","):
        spec = {"model": str(model), "dtype": dtype, "phases": work}
        kv = KV_GIB << 30 if not a.smoke else 64 << 20
        peers = {
            "plurai": (
                [sys.executable, str(ROOT / "bench" / "plurai_peer.py")],
                {**spec, "options": {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": kv}},
                None,
            )
        }
        if py is not None:
            options = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": a.smoke}
            env, _ = vllm_env(py, threads, KV_GIB)
            peers["vllm"] = (
                [str(py), str(ROOT / "bench" / "vllm_peer.py")],
                {**spec, "options": options},
                env,
            )
        runs: dict[str, list[dict]] = {name: [] for name in peers}
        for run in range(a.runs):
            for name, (cmd, s, env) in peers.items():
                out, log = peer(cmd, s, env)
                if out is None:
                    raise SystemExit(f"the {name} peer failed ({dtype}):\n{log[-3000:]}")
                figures = {p: rate(p, work[p], out["seconds"][p]) for p in work}
                runs[name].append({**out, "tok_s": figures})
                shown = ", ".join(f"{p} {v:.1f}" for p, v in figures.items())
                print(
                    f"{dtype} run {run + 1}: {name:7} tok/s {shown}; start {out['start_s']:.1f} s, {out['rss_mib']:.0f} MiB",
                    flush=True,
                )
        per: dict = {}
        for name, rs in runs.items():
            per[name] = {
                **{f"{p}_tok_s": round(median(r["tok_s"][p] for r in rs), 1) for p in work},
                "runs_tok_s": {p: [round(r["tok_s"][p], 1) for r in rs] for p in work},
                "start_s": round(median(r["start_s"] for r in rs), 1),
                "rss_mib": round(median(r["rss_mib"] for r in rs)),
            }
            steps = per[name]["decode_1_tok_s"]  # one request: a token a step
            achieved = weight_bytes(model, dtype) * steps / 1e9
            per[name]["decode_1_weight_gb_s"] = round(achieved, 2)
            per[name]["decode_1_of_read_bandwidth"] = round(
                achieved / result["read_bandwidth_gb_s"], 2
            )
        if "vllm" in per:
            per["ratio_vs_vllm"] = {
                p: round(per["plurai"][f"{p}_tok_s"] / per["vllm"][f"{p}_tok_s"], 2) for p in work
            }
            per["vllm_version"] = runs["vllm"][0].get("vllm")
        per["plurai_kernels"] = runs["plurai"][0]["kernels"]
        per["weight_bytes_per_step"] = weight_bytes(model, dtype)
        result["dtypes"][dtype] = per
    json_line(result, a.smoke)


if __name__ == "__main__":
    main()
