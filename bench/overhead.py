"""Engine overhead: a whole decode step against the bare model forward inside it.

Runs --batch requests into steady decoding, then for each measured step times
`Engine.step()` and, within it, the model's forward plus lm_head on that same batch.
Everything else (scheduling, block bookkeeping, input preparation, sampling, stop checks,
detokenization) is the overhead. Also reports the same forward run alone on the prepared
inputs of a step, as a check that timing inside the step does not distort it.
The last line is one JSON object.

    python bench/overhead.py [--batch 32] [--steps 40] [--dtype auto] [--smoke]
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

import torch  # noqa: E402

from bench.workload import add_smoke_arg, bench_model, json_line, mixed, smoke_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps = 4, 3

    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    model = smoke_model() if args.smoke else bench_model(args.model)
    engine = Engine(EngineConfig(model=str(model), dtype=args.dtype))
    # realistic sampling work too: half greedy, half top-p with penalties and a stop string
    for i, r in enumerate(mixed(args.batch, engine.vocab_size, seed=1, output_median=100000)):
        sp = (
            SamplingParams(max_tokens=args.steps + 200, ignore_eos=True)
            if i % 2
            else SamplingParams(
                max_tokens=args.steps + 200,
                ignore_eos=True,
                temperature=0.8,
                top_p=0.9,
                repetition_penalty=1.1,
                stop=["never-said"],
                seed=i,
            )
        )
        engine.add(AddRequest(f"r{i}", token_ids=r.prompt, params=sp))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()  # through prefill

    model = engine.runner.model
    forward_times: list[float] = []
    inner_forward, inner_logits = model.forward, model.logits

    def timed_forward(*a, **k):
        t = time.perf_counter()
        out = inner_forward(*a, **k)
        forward_times.append(time.perf_counter() - t)
        return out

    def timed_logits(*a, **k):
        t = time.perf_counter()
        out = inner_logits(*a, **k)
        forward_times[-1] += time.perf_counter() - t
        return out

    model.forward, model.logits = timed_forward, timed_logits
    steps, fwd = [], []
    for _ in range(args.steps):
        assert engine.num_running == args.batch
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        fwd.append(forward_times[-1])
    model.forward, model.logits = inner_forward, inner_logits

    # the bare forward alone, on one step's prepared inputs
    seqs = list(engine.scheduler.running)
    for s in seqs:
        s.num_scheduled = 1
        engine.blocks.grow(s, s.num_computed_tokens + 1)
    input_ids, positions, ctx, rows = engine.runner.prepare(seqs)
    # the rows that sample, per sequence (one each here: plain decodes)
    idx = torch.tensor([r for rs in rows for r in rs])
    bare = []
    with torch.inference_mode():
        for _ in range(args.steps):
            t = time.perf_counter()
            model.logits(model(input_ids, positions, ctx)[idx])
            bare.append(time.perf_counter() - t)
    for s in seqs:
        s.num_scheduled = 0

    step_ms = statistics.median(steps) * 1000
    fwd_ms = statistics.median(fwd) * 1000
    over = [(s - f) / s for s, f in zip(steps, fwd, strict=True)]
    result = {
        "bench": "overhead",
        "batch": args.batch,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "step_ms_median": round(step_ms, 2),
        "forward_ms_median": round(fwd_ms, 2),
        "bare_forward_ms_median": round(statistics.median(bare) * 1000, 2),
        "overhead_ms_median": round(
            statistics.median(s - f for s, f in zip(steps, fwd, strict=True)) * 1000, 2
        ),
        "overhead_share_median": round(statistics.median(over), 4),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}",
    }
    print(
        f"step {step_ms:.1f} ms, forward {fwd_ms:.1f} ms, everything else "
        f"{result['overhead_ms_median']:.2f} ms ({100 * result['overhead_share_median']:.1f}% of the step)"
    )
    json_line(result, args.smoke)


if __name__ == "__main__":
    main()
