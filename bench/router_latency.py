"""Everyday latency: vLLM's own load generator (`vllm bench serve`) against Plurai's gateway
and against `vllm-router` over the same engines, with default settings on every stack.

    .venv-vllm/bin/python bench/router_latency.py [--k 2]
        [--stacks round_robin,cache_aware,plurai-vllm-notier,plurai-vllm]
        [--datasets prefix_repetition,random]
        [--loads 0.5,0.9,1.2] [--num-prompts 600] [--repeats 1] [--capacity DATASET=REQ_S]
        [--model DIR] [--out DIR] [--smoke]

The stacks are bench/serving/'s (K engines of vLLM's CPU build, each on its own core,
the same KV budget; Plurai: a Redis, `plurai gateway`, K `plurai worker --backend vllm`;
routers: K `vllm serve` behind `vllm-router --policy P`), here with no Plurai objective
set: what a team that deploys with the defaults gets (plurai-vllm-notier: no KV tier, as
the defaults), and with the one knob an operator of many workers sets first, the Redis
KV tier on a Redis of its own (plurai-vllm). Each
stack is started once and warmed up (a short unmeasured run); then, for each dataset,
`vllm bench serve` at each --loads multiple of the dataset's capacity (completed
requests/s of a burst of --num-prompts sent at once to the first stack, unless given):

- prefix_repetition: 4 prefixes x 512 tokens + 64 tokens of suffix, 32 out;
- random: 512 tokens in, 64 out;

both with `--burstiness 0.5 --ignore-eos`, as chat traffic comes in bursts. With
--repeats R the loads go round R times, each round every stack in turn (restarted), and
a figure is the median of its rounds.

Figures per stack, dataset and load: throughput (req/s), TTFT, TPOT and end-to-end p50 and
p99 (vLLM's own figures); for Plurai, from its job records, each request's queue hop in
ms (p50, p99): gateway (its receipt to the submit), queue (the submit to a worker's
take), intake (the take to the engine's add), hop (the gateway's receipt to the engine's
add) and engine (the add to the first token). The last line is one JSON object with the
ISA and, per dataset and load, Plurai's ratios against the best router on each figure.

--smoke: one engine per stack (round_robin and plurai-vllm), the factory's small random
Llama in float32, prefix_repetition with short prompts, no warm-up, 8 requests at one
load; a check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving.figures import percentile  # noqa: E402
from bench.serving.stacks import VLLM_PY, EngineSpec, PluraiStack, Stack, make_stack  # noqa: E402
from bench.workload import add_smoke_arg, bench_model, cpu_isa, json_line, smoke_model  # noqa: E402
from plurai.broker_config import keys  # noqa: E402
from plurai.results.records import HOPS  # noqa: E402

STACKS = ("round_robin", "cache_aware", "plurai-vllm-notier", "plurai-vllm")
# what the figures below come from in vLLM's result file
FIGURES = {
    "req_s": "request_throughput",
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
    "e2e_p50_ms": "median_e2el_ms",
    "e2e_p99_ms": "p99_e2el_ms",
}
# the queue hop's parts: (from, to) of HOPS' record fields
PARTS = {
    "gateway": ("received_us", "queued_us"),
    "queue": ("queued_us", "taken_us"),
    "intake": ("taken_us", "added_us"),
    "hop": ("received_us", "added_us"),
    "engine": ("added_us", "first_token_us"),
}


def dataset_args(name: str, smoke: bool) -> list[str]:
    if name == "prefix_repetition":
        prefix, suffix, out = (32, 8, 4) if smoke else (512, 64, 32)
        return [
            *("--dataset-name", "prefix_repetition"),
            *("--prefix-repetition-prefix-len", str(prefix)),
            *("--prefix-repetition-suffix-len", str(suffix)),
            *("--prefix-repetition-num-prefixes", "4"),
            *("--prefix-repetition-output-len", str(out)),
        ]
    if name == "random":
        n_in, n_out = (32, 4) if smoke else (512, 64)
        return [
            *("--dataset-name", "random"),
            *("--random-input-len", str(n_in)),
            *("--random-output-len", str(n_out)),
        ]
    raise SystemExit(f"--datasets: {name!r} is not prefix_repetition or random")


def bench_serve(
    stack: Stack, spec: EngineSpec, dataset: list[str], n: int, rate: str, out: Path, seed: int
) -> dict[str, Any]:
    """One `vllm bench serve` run against the stack; its result file's figures."""
    cmd = [str(VLLM_PY), str(ROOT / "bench" / "vllm_cli.py"), "bench", "serve"]
    cmd += ["--backend", "openai", "--endpoint", "/v1/completions"]
    cmd += ["--base-url", stack.base.removesuffix("/v1"), "--model", spec.name]
    cmd += ["--tokenizer", str(spec.model), *dataset, "--num-prompts", str(n)]
    cmd += ["--request-rate", rate, "--burstiness", "0.5", "--ignore-eos", "--seed", str(seed)]
    cmd += ["--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99"]
    cmd += ["--disable-tqdm", "--save-result", "--result-dir", str(out.parent)]
    cmd += ["--result-filename", out.name]
    with open(stack.logs / "bench-serve.log", "a") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {done.returncode}; see {stack.logs}")
    return json.loads(out.read_text())


def hops(stack: PluraiStack, since_us: int) -> dict[str, Any]:
    """Per part of the queue hop, p50 and p99 in ms over the jobs submitted since then."""
    assert stack.r is not None
    got: dict[str, list[float]] = {k: [] for k in PARTS}
    for key in stack.r.scan_iter(match=keys.job("*"), count=1000):
        raw = stack.r.hmget(key, HOPS)
        t = {k: int(v) for k, v in zip(HOPS, raw, strict=True) if v}
        if t.get("queued_us", 0) < since_us:
            continue
        for part, (a, b) in PARTS.items():
            if a in t and b in t:
                got[part].append((t[b] - t[a]) / 1000)
    return {
        part: {"p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3), "n": len(v)}
        for part, v in got.items()
        if v
    }


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, and its spread (min, max) where R > 1."""
    out: dict[str, Any] = {}
    for key in rounds[0]:
        vals = [r[key] for r in rounds if isinstance(r.get(key), int | float)]
        if vals:
            out[key] = round(statistics.median(vals), 2)
            if len(vals) > 1:
                out[key + "_spread"] = [round(min(vals), 2), round(max(vals), 2)]
    return out


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Plurai against the best router on each figure (lowest time, highest throughput)."""
    routers = {k: v for k, v in figures.items() if not k.startswith("plurai-")}
    out: dict[str, Any] = {}
    for ours in (k for k in figures if k.startswith("plurai-")):
        me, mine = figures[ours], {}
        for key in FIGURES:
            vals = [(v[key], k) for k, v in routers.items() if v.get(key)]
            if not vals or me.get(key) is None:
                continue
            best, who = max(vals) if key == "req_s" else min(vals)
            mine[key] = {
                "ratio": round(me[key] / best, 3),
                "best": who,
                "diff": round(me[key] - best, 1),
            }
        out[ours] = mine
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/bench-llama")
    p.add_argument("--k", type=int, default=2, help="engines per stack")
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--datasets", default="prefix_repetition,random")
    p.add_argument("--loads", default="0.5,0.9,1.2", help="multiples of the capacity")
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--capacity", action="append", default=[], help="DATASET=REQ_S")
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for logs and result files")
    add_smoke_arg(p)
    a = p.parse_args()
    if not VLLM_PY.exists() or not (VLLM_PY.parent / "vllm-router").exists():
        sys.exit("vLLM's environment or vllm-router is missing: run `make vllm-install peers`")
    isa = cpu_isa()
    if a.smoke:
        a.k, a.loads, a.num_prompts, a.repeats = 1, "0.9", 8, 1
        a.stacks, a.datasets = "round_robin,plurai-vllm", "prefix_repetition"
        model, dtype, max_len = smoke_model("small"), "float32", 256
    else:
        model = bench_model(a.model)
        dtype, max_len = ("bfloat16" if isa in ("avx512_bf16", "amx") else "float32"), 1024
    spec = EngineSpec(model=model, name=model.name, dtype=dtype, max_model_len=max_len)
    spec.kv_gib = a.kv_gib
    stacks = [s for s in a.stacks.split(",") if s]
    datasets = [d for d in a.datasets.split(",") if d]
    loads = [float(x) for x in a.loads.split(",")]
    capacity = {d: float(r) for d, r in (c.split("=", 1) for c in a.capacity)}
    work = Path(a.out or tempfile.mkdtemp(prefix="plurai-router-latency-"))
    warm = 0 if a.smoke else 20 * a.k
    # stack -> dataset -> load -> one dict of figures per round
    got: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    for rnd in range(a.repeats):
        for name in stacks:
            stack = make_stack(name, spec, a.k, work / f"{name}-{rnd}")
            print(f"{name}: starting {a.k} engines (round {rnd})", file=sys.stderr)
            stack.start()
            try:
                for d in datasets:
                    args = dataset_args(d, a.smoke)
                    if warm:
                        res = work / f"{name}-{rnd}-{d}-warm.json"
                        bench_serve(stack, spec, args, warm, "inf", res, a.seed + 99)
                    if d not in capacity:
                        res = work / f"{name}-{d}-capacity.json"
                        n = 8 if a.smoke else 200
                        capacity[d] = bench_serve(stack, spec, args, n, "inf", res, a.seed + 98)[
                            "request_throughput"
                        ]
                        print(f"  {d}: capacity {capacity[d]:.2f} req/s", file=sys.stderr)
                    for load in loads:
                        rate = capacity[d] * load
                        since_us = time.time_ns() // 1000
                        res = work / f"{name}-{rnd}-{d}-{load}.json"
                        seed = a.seed + rnd
                        r = bench_serve(stack, spec, args, a.num_prompts, f"{rate:.3f}", res, seed)
                        fig = {k: r.get(v) for k, v in FIGURES.items()}
                        fig["failed"] = r.get("failed", 0)
                        if isinstance(stack, PluraiStack):
                            fig["hops_ms"] = hops(stack, since_us)
                        got.setdefault(name, {}).setdefault(d, {}).setdefault(str(load), [])
                        got[name][d][str(load)].append(fig)
                        print(
                            f"  {name} {d} @ {load}x ({rate:.1f}/s): TTFT p50/p99 "
                            f"{fig['ttft_p50_ms']:.0f}/{fig['ttft_p99_ms']:.0f} ms",
                            file=sys.stderr,
                        )
            finally:
                stack.stop()
    figures: dict[str, Any] = {}
    for name, by_d in got.items():
        for d, by_load in by_d.items():
            for load, rounds in by_load.items():
                fig = median_of([{k: v for k, v in r.items() if k != "hops_ms"} for r in rounds])
                if "hops_ms" in rounds[0]:
                    fig["hops_ms"] = rounds[len(rounds) // 2]["hops_ms"]  # the median round's
                figures.setdefault(d, {}).setdefault(load, {})[name] = fig
    out = {
        "bench": "router_latency",
        "isa": isa,
        "cores": os.cpu_count(),
        "k": a.k,
        "model": model.name,
        "dtype": dtype,
        "num_prompts": a.num_prompts,
        "repeats": a.repeats,
        "burstiness": 0.5,
        "plurai_settings": "defaults",
        "capacity_req_s": {d: round(c, 3) for d, c in capacity.items()},
        "figures": figures,
        "ratios": {d: {ld: ratios(f) for ld, f in by.items()} for d, by in figures.items()},
    }
    json_line(out, a.smoke)


if __name__ == "__main__":
    main()
