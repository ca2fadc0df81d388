"""Step time of tensor- and pipeline-parallel engine groups against one rank, on the same
batch.

For each group shape (TPxPP), starts an engine (rank 0 here, the other ranks as processes),
brings --batch requests into steady decoding and reports the median decode step time and
the prefill time of the batch. On a 2-core CPU the ranks share two cores, every layer adds
two all-reduces (TP) and stages take turns (PP), so groups are slower there; the script is the same on a machine with
several GPUs (device auto picks cuda:rank for each rank, NCCL for the collectives).
The last line is one JSON object. --smoke: every shape on the tiny test model, two
requests, two steps: a check that the bench runs, not a measurement.

    python bench/parallel.py [--model DIR] [--groups 1x1,2x1,1x2] [--batch 16] [--steps 20]
        [--smoke]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from plurai.gpu_workers.backend import AddRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import (  # noqa: E402
    SMOKE_KV_BYTES,
    add_smoke_arg,
    bench_model,
    json_line,
    mixed,
    smoke_model,
)
from plurai.gpu_workers.engine.engine import Engine, EngineConfig  # noqa: E402
from plurai.gpu_workers.engine.sampling_params import SamplingParams  # noqa: E402


def measure(model: str, tp: int, pp: int, args: argparse.Namespace) -> dict:
    engine = Engine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            kv_cache_bytes=SMOKE_KV_BYTES if args.smoke else 256 << 20,
        )
    )
    try:
        engine.generate([list(range(16, 600))], SamplingParams(max_tokens=4))  # warm-up
        lengths = {"prompt_median": 16} if args.smoke else {}
        reqs = mixed(args.batch, engine.vocab_size, seed=2, output_median=100000, **lengths)
        sp = SamplingParams(max_tokens=args.steps + 50, ignore_eos=True)
        for i, r in enumerate(reqs):
            engine.add(AddRequest(f"r{i}", token_ids=r.prompt, params=sp))
        start = time.perf_counter()
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
            engine.step()
        prefill = time.perf_counter() - start
        steps = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        return {
            "tp": tp,
            "pp": pp,
            "decode_step_ms": round(statistics.median(steps) * 1000, 2),
            "prefill_s": round(prefill, 3),
            "device": str(engine.runner.device),
            "dtype": str(engine.runner.dtype).removeprefix("torch."),
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--groups", default="1x1,2x1,1x2", help="TPxPP shapes, the first is the base")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps = 2, 2
    model = str(smoke_model() if args.smoke else bench_model(args.model))
    runs = []
    for shape in args.groups.split(","):
        tp, pp = (int(x) for x in shape.split("x"))
        r = measure(model, tp, pp, args)
        runs.append(r)
        print(
            f"TP{tp}xPP{pp}: decode step {r['decode_step_ms']} ms at batch {args.batch}, "
            f"prefill of the batch {r['prefill_s']} s ({r['device']}, {r['dtype']})",
            flush=True,
        )
    base = runs[0]["decode_step_ms"]
    json_line(
        {
            "bench": "parallel",
            "batch": args.batch,
            "runs": runs,
            "step_ratio_vs_first": [round(r["decode_step_ms"] / base, 2) for r in runs],
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        },
        args.smoke,
    )


if __name__ == "__main__":
    main()
