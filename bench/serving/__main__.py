"""`python -m bench.serving`: the serving bench (bench/serving/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench import serving
from bench.serving import figures as sf
from bench.serving.client import Run
from bench.serving.report import ratios, summary
from bench.serving.scenarios import Bench
from bench.serving.stacks import (
    ALL_STACKS,
    PLURAI_ENV,
    TRACE,
    VLLM_PY,
    EngineSpec,
    PluraiStack,
    make_stack,
    rounds,
)
from bench.serving.workload import (
    BATCH,
    INTERACTIVE,
)
from bench.workload import add_smoke_arg, bench_model, cpu_isa, json_line, smoke_model
from plurai.broker_config.settings import Settings


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving", description=serving.__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default="models/bench-llama")
    p.add_argument("--k", type=int, default=2, help="engines per stack")
    p.add_argument(
        "--stacks",
        default=None,
        help="default: " + ",".join(ALL_STACKS) + "; with --smoke, those installed",
    )
    p.add_argument("--scenarios", default="idle,sweep,flood,add,kill")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=120.0, help="seconds after the last arrival")
    p.add_argument("--scales", default="0.3,0.6,0.9,1.3")
    p.add_argument("--capacity", type=float, default=None, help="req/s; default: measured")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="sweep rounds, each load with another seed; a load's attainment pools its rounds",
    )
    p.add_argument("--burstiness", type=float, default=0.3)
    p.add_argument("--prompt", default="128-2048", help="tokens in, lo-hi")
    p.add_argument("--output", default="16-128", help="tokens out, lo-hi")
    p.add_argument(
        "--flood", type=int, default=0, help="batch requests; default capacity x duration"
    )
    p.add_argument(
        "--dtype", default="auto", help="auto: bfloat16 where the CPU has bf16, else float32"
    )
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument(
        "--add-wait", type=float, default=900.0, help="add: most seconds to wait for the new engine"
    )
    p.add_argument(
        "--warmup", type=int, default=6, help="unmeasured requests per engine first; 0: none"
    )
    p.add_argument("--compile", action="store_true", help="vLLM with torch.compile (slow starts)")
    p.add_argument(
        "--bind-peers",
        action="store_true",
        help="each `vllm serve` wholly on its engine's core (taskset), engine core included",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=5.0, help="x the idle interactive TTFT")
    p.add_argument("--slo-tpot", type=float, default=5.0, help="x the idle interactive TPOT")
    p.add_argument("--slo-batch-e2e", type=float, default=10.0, help="x the idle batch e2e")
    p.add_argument(
        "--slos-from",
        default=None,
        help="an earlier run's out.json: its SLOs instead of this run's first stack's",
    )
    p.add_argument(
        "--plurai-tpot-share",
        type=float,
        default=0.8,
        help="Plurai's top-lane TPOT target (PLURAI_TOP_LANE_TPOT_MS) as a share of the "
        "interactive TPOT SLO, as an operator sets it from their objective; only for Plurai "
        "stacks started after the SLOs are known (after the first stack); 0: none",
    )
    p.add_argument(
        "--plurai-wait-share",
        type=float,
        default=0.5,
        help="with that target, the bound on a top-lane request's wait for it "
        "(PLURAI_TOP_LANE_WAIT_MS) as a share of the interactive TTFT SLO, the rest left "
        "for its prompt; 0: the product's default",
    )
    p.add_argument(
        "--trace",
        default=str(TRACE),
        help="the trace scenario's requests: a Mooncake-format trace (bench/trace_replay.py)",
    )
    p.add_argument(
        "--trace-scale",
        type=float,
        default=1 / 16,
        help="the trace's lengths times this (its 512-token blocks: 32 at 1/16), then "
        "within --prompt's and --output's upper bounds",
    )
    p.add_argument("--out", default=None, help="folder for logs and workload files")
    add_smoke_arg(p)
    a = p.parse_args()
    skipped: dict[str, str] = {}  # stacks a smoke run leaves out, and why
    if a.smoke:
        a.k, a.duration, a.drain, a.scales = 1, 2.0, 5.0, "1.0"
        a.prompt, a.output, a.flood, a.add_wait, a.dtype = "32-256", "4-8", 4, 30.0, "float32"
        if a.stacks is None:
            a.stacks = "plurai-native"
            if VLLM_PY.exists():
                a.stacks += ",plurai-vllm"
            else:
                skipped["plurai-vllm"] = f"no {VLLM_PY} (make vllm-install)"
            if (VLLM_PY.parent / "vllm-router").exists():
                a.stacks += ",round_robin"
            else:
                skipped["round_robin"] = "no vllm-router (make peers)"
    a.scales = [float(x) for x in a.scales.split(",")]
    stacks = [s for s in (a.stacks or ",".join(ALL_STACKS)).split(",") if s]
    scenarios = [s for s in a.scenarios.split(",") if s]
    if a.smoke and "trace" not in scenarios:
        scenarios.append("trace")
    if "trace" in scenarios and not Path(a.trace).is_file():
        sys.exit(f"--trace {a.trace}: no such file (the trace scenario replays it)")
    if any(s != "plurai-native" for s in stacks) and not VLLM_PY.exists():
        sys.exit("vLLM's environment is missing: run `make vllm-install peers` first")
    routed = [s for s in stacks if not s.startswith("plurai-")]
    if routed and not (VLLM_PY.parent / "vllm-router").exists():
        sys.exit(f"vllm-router is missing (stacks {', '.join(routed)}): run `make peers` first")

    isa = cpu_isa()
    dtype = (
        a.dtype
        if a.dtype != "auto"
        else ("bfloat16" if isa in ("avx512_bf16", "amx") else "float32")
    )
    if a.smoke:
        model = smoke_model("small")
    elif a.model == "models/bench-llama":
        model = bench_model(a.model)
    else:
        model = Path(a.model)
    lo, hi = map(int, a.prompt.split("-"))
    olo, ohi = map(int, a.output.split("-"))
    max_len = -(-(hi + ohi + 64) // 256) * 256
    spec = EngineSpec(
        model=model,
        name=model.name,
        dtype=dtype,
        max_model_len=max_len,
        kv_gib=a.kv_gib,
        eager=not a.compile,
        bind_peers=a.bind_peers,
    )
    work = Path(a.out or tempfile.mkdtemp(prefix="plurai-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(a, spec, work)
    runs: dict[str, list[Run]] = {}
    failed: dict[str, str] = {}  # stacks that did not start, and why
    tpot_targets: dict[str, int] = {}  # PLURAI_TOP_LANE_TPOT_MS of each Plurai stack given one
    wait_bounds: dict[str, int] = {}  # and its PLURAI_TOP_LANE_WAIT_MS
    started = time.monotonic()
    for rnd, name in rounds(stacks, scenarios, a.repeats):
        if name in failed:
            continue
        stack = make_stack(name, spec, a.k, work / name)
        slo = bench.slos and bench.slos[INTERACTIVE].tpot_s
        if isinstance(stack, PluraiStack) and slo and a.plurai_tpot_share > 0:
            stack.tpot_ms = 1000 * a.plurai_tpot_share * slo
            tpot_targets[name] = round(stack.tpot_ms)
            ttft = bench.slos[INTERACTIVE].ttft_s
            if ttft and a.plurai_wait_share > 0:
                stack.wait_ms = 1000 * a.plurai_wait_share * ttft
            wait_bounds[name] = round(stack.wait_ms or Settings().top_lane_wait_ms)
        print(f"{name}: starting {a.k} engines (round {rnd})", file=sys.stderr)
        t = time.monotonic()
        try:
            stack.start()
        except (RuntimeError, TimeoutError) as e:  # reported; the other stacks run on
            print(f"{name}: {e}", file=sys.stderr)
            failed[name] = str(e)
            stack.stop()
            continue
        stack.start_s = time.monotonic() - t
        print(f"{name}: ready in {stack.start_s:.0f}s", file=sys.stderr)
        try:
            bench.warm_up(stack)
            if rnd == 0 and "idle" in scenarios:
                bench.run_idle(stack)
                if "trace" in scenarios:
                    bench.run_trace_idle(stack)
            if bench.slos is None:
                bench.slos = {
                    INTERACTIVE: sf.Slo(ttft_s=2.0, tpot_s=0.5),
                    BATCH: sf.Slo(e2e_s=60.0),
                }
            if bench.capacity is None:
                bench.calibrate(stack)
            done = runs.setdefault(name, [])
            for sc in scenarios:
                if sc in ("sweep", "trace"):
                    done += getattr(bench, f"run_{sc}")(stack, rnd)
                elif sc != "idle" and rnd == 0:
                    done += getattr(bench, f"run_{sc}")(stack)
        finally:
            stack.stop()
    assert bench.slos is not None
    trace_slos = bench.trace_slos or bench.slos
    figures = summary(runs, bench.slos, trace_slos)
    out = {
        "bench": "serving",
        "isa": isa,
        "cores": os.cpu_count(),
        "k": a.k,
        "model": str(model.name),
        "dtype": dtype,
        "max_model_len": max_len,
        "kv_gib_per_engine": a.kv_gib,
        "vllm_enforce_eager": spec.eager,
        "peers_bound": spec.bind_peers,
        "capacity_req_s": bench.capacity,
        "slos": {k: asdict(v) for k, v in bench.slos.items()},
        **(
            {"trace_slos": {k: asdict(v) for k, v in trace_slos.items()}}
            if "trace" in scenarios
            else {}
        ),
        "idle": bench.idle,
        "plurai_env": PLURAI_ENV,
        "plurai_top_lane_tpot_ms": tpot_targets,
        "plurai_prefill_backlog_tokens": Settings().prefill_backlog_tokens,
        "plurai_top_lane_wait_ms": wait_bounds,
        "workload": {
            "prompt": a.prompt,
            "output": a.output,
            "burstiness": a.burstiness,
            "duration_s": a.duration,
            "repeats": a.repeats,
            "seed": a.seed,
            **({"trace": a.trace, "trace_scale": a.trace_scale} if "trace" in scenarios else {}),
        },
        "stacks": figures,
        "stacks_not_started": failed,
        **({"smoke": True, "stacks_not_installed": skipped} if a.smoke else {}),
        "ratios": ratios(figures),
        # every Plurai stack's against the routers (plurai-vllm's are "ratios" above)
        "ratios_by_stack": {k: ratios(figures, k) for k in figures if k.startswith("plurai-")},
        "work_dir": str(work),
        "wall_s": round(time.monotonic() - started, 1),
    }
    (work / "out.json").write_text(json.dumps(out) + "\n")  # beside the runs it sums up
    json_line(out)  # smoke, where it was one, is in out already


if __name__ == "__main__":
    main()
