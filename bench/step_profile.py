"""Where the throughput workload's time goes, step by step.

Runs the `bench/throughput.py` workload through the engine and groups its steps by kind
(steps with a prefill chunk; decode-only steps by running sequences), with each group's
time in the forward and in the rest of the step. Then it times the model's own linear
layers alone, in order, at every step's row count (lm_head on the rows that sample): the
GEMM-only time of the same steps, which no change outside the matmuls can go below.
The last line is one JSON object. --smoke: two short requests on the tiny test model: a
check that the bench runs, not a measurement.

    python bench/step_profile.py [--requests 32] [--dtype auto|bf16|fp32] [--smoke]

--dtype auto (the default, as the engine's): bf16 where the CPU has it natively, else fp32.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from plurai.gpu_workers.backend import AddRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.workload import (  # noqa: E402
    SMOKE_KV_BYTES,
    add_smoke_arg,
    add_workload_args,
    bench_model,
    json_line,
    mixed,
    smoke_model,
)

PREFILL = 1 << 30  # group key of steps that carry a prefill chunk


def median_time(fn: Callable[[], None], runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests = 2

    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams
    from plurai.gpu_workers.engine.sequence import Sequence
    from plurai.gpu_workers.layers.linear import Linear

    model = smoke_model() if args.smoke else bench_model(args.model)
    kv = {"kv_cache_bytes": SMOKE_KV_BYTES} if args.smoke else {}
    engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, **kv))
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))  # warm-up
    runner = engine.runner
    lengths = {"prompt_median": 16, "output_median": 8} if args.smoke else {}
    reqs = mixed(args.requests, runner.vocab_size, args.seed, **lengths)

    # per step: rows, rows that sample, decode rows, forward seconds (set by the wrapper)
    shape: list[int] = []
    forward = 0.0
    run = runner.run

    def timed_run(seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        nonlocal forward
        decodes = sum(1 for s in seqs if s.num_scheduled == 1)
        rows = sum(s.num_scheduled for s in seqs)
        sampling = sum(1 for s in seqs if s.num_computed_tokens + s.num_scheduled == len(s))
        shape[:] = [rows, sampling, decodes]
        start = time.perf_counter()
        out = run(seqs)
        forward = time.perf_counter() - start
        return out

    runner.run = timed_run  # type: ignore[method-assign]
    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        engine.add(AddRequest(f"p{i}", token_ids=r.prompt, params=params))
    steps: list[tuple[int, int, int, float, float]] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append((*shape, forward, time.perf_counter() - t))
    total = time.perf_counter() - start
    runner.run = run  # type: ignore[method-assign]

    # decode-only steps grouped by running sequences (1-4, 5-8, ...); prefill steps last
    def group(rows: int, decodes: int) -> int:
        return -(-decodes // 4) * 4 if rows == decodes else PREFILL

    groups: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for rows, _, decodes, fwd, step in steps:
        g = groups[group(rows, decodes)]
        g[0] += 1
        g[1] += fwd
        g[2] += step
    names = {k: "with prefill" if k == PREFILL else f"decode {k - 3}-{k}" for k in groups}
    useful = sum(r.max_tokens for r in reqs)

    model = runner.model
    linears = [
        m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"
    ]
    dtype = runner.dtype
    gemm: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        for rows, sampling, *_ in steps:
            if (rows, sampling) in gemm:
                continue
            xs = [torch.randn(rows, m.in_features, dtype=dtype) for m in linears]
            head = torch.randn(sampling, model.lm_head.in_features, dtype=dtype)

            def matmuls(xs=xs, head=head) -> None:
                for m, x in zip(linears, xs, strict=True):
                    m(x)
                model.lm_head(head)

            gemm[(rows, sampling)] = median_time(matmuls)
    gemm_total = sum(gemm[(rows, sampling)] for rows, sampling, *_ in steps)
    for rows, sampling, decodes, *_ in steps:
        groups[group(rows, decodes)][3] += gemm[(rows, sampling)]
    print(f"{len(steps)} steps, {total:.2f} s, {useful / total:.1f} useful tok/s ({dtype})")
    print(
        f"{'steps':14} {'n':>4} {'forward s':>10} {'rest s':>7} {'ms/step':>8} "
        f"{'matmuls s':>10} {'run/matmuls':>12}"
    )
    for k in sorted(groups):
        n, fwd, step, mm = groups[k]
        print(
            f"{names[k]:14} {n:4d} {fwd:10.2f} {step - fwd:7.2f} {1000 * step / n:8.1f} "
            f"{mm:10.2f} {step / mm:12.2f}"
        )
    forward_total = sum(s[3] for s in steps)
    print(
        f"forward {forward_total:.2f} s, of which the same steps' matmuls alone take "
        f"{gemm_total:.2f} s; everything else {total - gemm_total:.2f} s; "
        f"run / matmul-only = {total / gemm_total:.2f}"
    )
    json_line(
        {
            "bench": "step_profile",
            "dtype": str(dtype).removeprefix("torch."),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "steps": len(steps),
            "seconds": round(total, 3),
            "useful_tok_s": round(useful / total, 1),
            "forward_s": round(forward_total, 3),
            "gemm_only_s": round(gemm_total, 3),
            "non_gemm_s": round(total - gemm_total, 3),
            # the run over its matmul-only time: 1.0 would be all GEMM
            "run_over_gemm": round(total / gemm_total, 3),
            "groups": {
                names[k]: {
                    "steps": n,
                    "forward_s": round(f, 3),
                    "step_s": round(st, 3),
                    "gemm_only_s": round(mm, 3),
                }
                for k, (n, f, st, mm) in sorted(groups.items())
            },
        },
        args.smoke,
    )


if __name__ == "__main__":
    main()
