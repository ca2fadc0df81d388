"""The queue layer at fleet scale: the real Redis, client and Worker, simulated engines.

A real redis-server (EmbeddedRedis; or --redis-url; or --cluster, a LocalCluster of 3
primaries), real `Client.submit_many` / `wait_all` in a producer process, and W real
`Worker`s (intake, lanes, leases, reclaim scans, deltas, FINALIZE) driving `SimBackend`s:
continuous batching over `max_num_seqs` slots and a KV budget in tokens, whose step
sleeps `base + per_seq * batch` ms and yields one token per running request. The workers
run as threads, each with its own connection, spread over P spawned processes.

    python bench/fleet_sim.py [--workers 8,64,256] [--seconds 30] [--procs P]
        [--step-base-ms 30] [--step-per-seq-ms 0.6] [--models 1|2]
        [--redis-url URL [--flush] | --cluster [N]] [--shards N] [--smoke]

The producer keeps about K = 2 * workers * max_num_seqs jobs outstanding (closed loop)
for --seconds; after --warmup the steady window is measured: completed jobs/s (by the
records' finished_ms), Redis commands and Redis CPU (main thread) per job, intake latency
(started_ms - created_ms; under a closed loop it is mostly the wait in the backlog), the
engines' busy share and batch occupancy, and whether every job has exactly one final
result. Scaling efficiency of size W against the smallest size W0 is
(jobs/s(W) / jobs/s(W0)) / (W / W0); the target from 8 to 64 workers is >= 0.8. From the
Redis CPU per job it also works out, on paper, the jobs/s and the worker count at which
one Redis core saturates. The last line is one JSON object. --smoke: fleets of 2 and 4
workers in one process, 3 s each: a check that the bench runs, not a measurement.

One file, though long: the producer, the worker processes and the report share one run's
settings.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.fleet_procs import LANES, producer_proc, worker_proc  # noqa: E402
from bench.sim_backend import STEP_BASE_MS, STEP_PER_SEQ_MS, STEP_SOURCE  # noqa: E402
from bench.workload import add_smoke_arg, json_line  # noqa: E402
from plurai.broker_config import keys  # noqa: E402
from plurai.broker_config.connection import connect, is_cluster  # noqa: E402
from plurai.broker_config.settings import Settings  # noqa: E402

MODELS = ("sim-a", "sim-b")


# -- Redis: embedded, given, or a local cluster ---------------------------------------


@contextmanager
def redis_target(a: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(url, what it is) of the Redis to run on."""
    if a.redis_url:
        yield a.redis_url, "given --redis-url"
        return
    with tempfile.TemporaryDirectory() as d:
        if a.cluster:
            from plurai.broker_config.embedded import LocalCluster

            with LocalCluster(Path(d) / "cluster", n=a.cluster) as url:
                yield url, f"LocalCluster of {a.cluster} primaries"
        else:
            from plurai.broker_config.embedded import EmbeddedRedis

            with EmbeddedRedis(Path(d) / "redis") as url:
                yield url, "EmbeddedRedis (one redis-server, AOF on)"


def nodes(r: Any) -> list[redis.Redis]:
    """One client per primary: the client itself, or each primary of a cluster."""
    if is_cluster(r):
        return [r.get_redis_connection(n) for n in r.get_primaries()]
    return [r]


@dataclass
class Snap:
    t: float
    calls: dict[str, int]  # command -> calls, summed over primaries
    redis_main_cpu_s: list[float]  # per primary: its main thread's user + sys seconds
    redis_cpu_s: list[float]  # per primary: the whole process's
    proc_cpu_s: dict[str, float] = field(default_factory=dict)  # our processes, by role
    machine_busy_s: float = 0.0


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc); 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (Linux /proc/stat); 0 elsewhere."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


def snapshot(prims: list[redis.Redis], pids: dict[str, list[int]]) -> Snap:
    calls: dict[str, int] = {}
    main, whole = [], []
    for r in prims:
        for name, v in r.info("commandstats").items():
            calls[name] = calls.get(name, 0) + int(v["calls"])
        cpu = r.info("cpu")
        whole.append(float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))
        main.append(
            float(cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]))
            + float(cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"]))
        )
    procs = {role: sum(_proc_cpu_s(p) for p in ps) for role, ps in pids.items()}
    return Snap(
        t=time.time(),
        calls=calls,
        redis_main_cpu_s=main,
        redis_cpu_s=whole,
        proc_cpu_s=procs,
        machine_busy_s=_machine_busy_s(),
    )


# -- one fleet size -------------------------------------------------------------------


def pct(xs: list[int], q: float) -> int | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_size(a: argparse.Namespace, url: str, rc: Any, prims: list[redis.Redis], w: int) -> dict:
    procs = a.procs or max(1, min(os.cpu_count() or 1, math.ceil(w / 16)))
    models = list(MODELS[: a.models]) if a.models > 1 else []
    served = [models[i % len(models)] if models else "" for i in range(w)]
    ids = [(f"sim-{w}-{i}-{m or 'default'}", m) for i, m in enumerate(served)]
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    for r in prims if not a.redis_url or a.flush else []:
        r.flushall()
    common = {
        "url": url,
        "max_num_seqs": a.max_num_seqs,
        "kv_tokens": a.kv_tokens,
        "max_model_len": a.max_model_len,
        "step_base_ms": a.step_base_ms,
        "step_per_seq_ms": a.step_per_seq_ms,
        "grace_s": 10.0,
        "shards": a.shards,
    }
    workers = [
        ctx.Process(target=worker_proc, args=({**common, "ids": ids[p::procs]}, stop, out))
        for p in range(procs)
    ]
    for p in workers:
        p.start()
    # ready: every worker has heartbeated (so its consumer groups exist)
    deadline = time.monotonic() + 60 + w / 4
    while not all(rc.smismember(keys.WORKERS, [i for i, _ in ids]) or [False]):
        if time.monotonic() > deadline or not all(p.is_alive() for p in workers):
            stop.set()
            raise SystemExit(f"{w} workers did not all start")
        time.sleep(0.2)

    outstanding = round(a.outstanding * w * a.max_num_seqs)
    threads = max(2, min(64, outstanding // 64))
    depth = 2
    batch = max(1, math.ceil(outstanding / (threads * depth)))
    start = time.time()
    pcfg = {
        "url": url,
        "end": start + a.seconds,
        "threads": threads,
        "depth": depth,
        "batch": batch,
        "max_tokens": a.max_tokens,
        "models": models,
        "seed": w,
        "wait_s": 30.0 if a.smoke else 300.0,  # a job without its result by then: not final
    }
    pout = ctx.Queue()
    prod = ctx.Process(target=producer_proc, args=(pcfg, pout))
    prod.start()
    pids = {"workers": [p.pid or 0 for p in workers], "producer": [prod.pid or 0]}
    print(
        f"{w} workers in {procs} process(es); producer: {threads} threads x {depth} x "
        f"{batch} jobs = {threads * depth * batch} outstanding",
        flush=True,
    )
    time.sleep(max(0.0, start + a.warmup - time.time()))
    s0 = snapshot(prims, pids)
    time.sleep(max(0.0, start + a.seconds - time.time()))
    s1 = snapshot(prims, pids)
    try:
        produced = json.loads(take(pout, [prod], 600))
    finally:
        stop.set()
    prod.join(30)
    fleet = [json.loads(take(out, workers, 120)) for _ in workers]
    for p in workers:
        p.join(30)
    return measure(a, w, procs, s0, s1, produced, fleet, outstanding)


def take(q: Any, procs: list[Any], timeout: float) -> str:
    """The next line on `q`; SystemExit if it does not come or its processes all died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=1)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                raise SystemExit("a bench process died (its traceback is above)") from None
    raise SystemExit(f"no answer from a bench process in {timeout} s")


def measure(
    a: argparse.Namespace,
    w: int,
    procs: int,
    s0: Snap,
    s1: Snap,
    produced: dict,
    fleet: list[dict],
    outstanding: int,
) -> dict:
    t0, t1 = s0.t * 1000, s1.t * 1000
    window = s1.t - s0.t
    rows = produced["rows"]
    done = [r for r in rows if t0 <= r[2] < t1]
    started = [r for r in rows if t0 <= r[1] < t1 and r[0]]  # r[0] 0: no created_ms
    intake = [r[1] - r[0] for r in started]
    by_lane = {
        name: [r[1] - r[0] for r in started if r[4] == i] for i, (name, _) in enumerate(LANES)
    }
    jobs = len(done)
    calls = {k: s1.calls.get(k, 0) - s0.calls.get(k, 0) for k in s1.calls}
    total_calls = sum(calls.values())
    main_cpu = [b - c for b, c in zip(s1.redis_main_cpu_s, s0.redis_main_cpu_s, strict=True)]
    whole_cpu = sum(s1.redis_cpu_s) - sum(s0.redis_cpu_s)
    # engine figures over the whole seconds inside the window
    steps = seqs = busy = 0.0
    for f in fleet:
        for sec, (n, b, s) in f["per_second"].items():
            if s0.t <= int(sec) and int(sec) + 1 <= s1.t:
                steps, seqs, busy = steps + n, seqs + b, busy + s
    secs = max(1, math.floor(s1.t) - math.ceil(s0.t))
    jobs_done = sum(f["jobs_done"] for f in fleet)
    per_job = max(jobs, 1)
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:12]
    return {
        "workers": w,
        "procs": procs,
        "outstanding": outstanding,
        "window_s": round(window, 2),
        "jobs_in_window": jobs,
        "jobs_per_s": round(jobs / window, 1),
        "jobs_per_s_per_worker": round(jobs / window / w, 3),
        "redis_commands_per_job": round(total_calls / per_job, 2),
        "redis_commands_per_s": round(total_calls / window),
        "top_commands_per_job": {k.removeprefix("cmdstat_"): round(v / per_job, 2) for k, v in top},
        "redis_cpu_us_per_job": round(1e6 * sum(main_cpu) / per_job, 1),
        "redis_cpu_us_per_job_all_threads": round(1e6 * whole_cpu / per_job, 1),
        "redis_busiest_core_share": round(max(main_cpu) / window, 3),
        "redis_busiest_core_us_per_job": round(1e6 * max(main_cpu) / per_job, 1),
        "intake_ms_p50": pct(intake, 0.5),
        "intake_ms_p99": pct(intake, 0.99),
        "intake_ms_p50_p99_by_lane": {k: [pct(v, 0.5), pct(v, 0.99)] for k, v in by_lane.items()},
        "engine_busy_share": round(busy / (w * secs), 3),  # of wall time inside steps
        "batch_occupancy": round(seqs / steps / a.max_num_seqs, 3) if steps else 0.0,
        "cores_busy": {
            "machine": round((s1.machine_busy_s - s0.machine_busy_s) / window, 2),
            "redis": round(whole_cpu / window, 2),
            **{
                role: round((s1.proc_cpu_s[role] - s0.proc_cpu_s[role]) / window, 2)
                for role in s1.proc_cpu_s
            },
        },
        "records_without_created_ms": sum(1 for r in rows if not r[0]),
        "submitted": produced["submitted"],
        "final": produced["final"],
        "completed_as_asked": produced["ok"],
        "finalized_by_workers": jobs_done,
        "one_final_result_each": produced["final"] == produced["submitted"] == produced["ok"]
        and jobs_done == produced["submitted"],
        "errors": [e[-400:] for f in fleet for e in f["errors"]] + produced["errors"],
        "workers_not_stopped": sum(f["alive"] for f in fleet),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default="8,64,256", help="fleet sizes, comma-separated")
    p.add_argument("--seconds", type=float, default=30.0, help="submitting time per size")
    p.add_argument("--warmup", type=float, default=None, help="default: a quarter of --seconds")
    p.add_argument("--procs", type=int, default=0, help="worker processes; 0: min(cores, W/16)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=2048, help="KV budget of each engine")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--step-base-ms", type=float, default=STEP_BASE_MS)
    p.add_argument("--step-per-seq-ms", type=float, default=STEP_PER_SEQ_MS)
    p.add_argument("--max-tokens", type=int, nargs=2, default=[16, 48], metavar=("LO", "HI"))
    p.add_argument(
        "--outstanding", type=float, default=2.0, help="jobs kept in flight per engine slot"
    )
    p.add_argument("--models", type=int, default=1, choices=[1, 2])
    p.add_argument(
        "--shards", type=int, default=1, help="request streams per lane and model (Settings)"
    )
    p.add_argument("--redis-url", default=None, help="an existing Redis (not flushed)")
    p.add_argument("--flush", action="store_true", help="FLUSHALL --redis-url before each size")
    p.add_argument(
        "--cluster",
        type=int,
        nargs="?",
        const=3,
        default=0,
        help="start a LocalCluster of N primaries (default 3)",
    )
    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.workers, a.seconds, a.procs, a.max_num_seqs = "2,4", 3.0, 1, 4
    a.warmup = a.seconds / 4 if a.warmup is None else a.warmup
    sizes = [int(x) for x in a.workers.split(",")]
    if a.models > 1 and "served_model" not in Settings.model_fields:
        raise SystemExit("--models 2 needs model routing (Settings.served_model)")

    results: dict[str, dict] = {}
    with redis_target(a) as (url, what):
        rc = connect(url, decode=True)
        prims = nodes(rc)
        print(f"redis: {what}, {len(prims)} primar{'y' if len(prims) == 1 else 'ies'}")
        for w in sizes:
            res = run_size(a, url, rc, prims, w)
            results[str(w)] = res
            print(
                f"{w:4d} workers: {res['jobs_per_s']:8.1f} jobs/s "
                f"({res['jobs_per_s_per_worker']:.2f}/worker), engines busy "
                f"{res['engine_busy_share']:.2f}, batch {res['batch_occupancy']:.2f}, "
                f"{res['redis_commands_per_job']:.1f} cmds/job, "
                f"{res['redis_cpu_us_per_job']:.0f} us Redis CPU/job, intake p50/p99 "
                f"{res['intake_ms_p50']}/{res['intake_ms_p99']} ms, cores {res['cores_busy']}, "
                f"one final each: {res['one_final_result_each']}",
                flush=True,
            )
            for e in res["errors"][:3]:
                print(f"  error: {e}", flush=True)

    base = sizes[0]
    eff = {
        str(w): round(
            (results[str(w)]["jobs_per_s"] / results[str(base)]["jobs_per_s"]) / (w / base), 3
        )
        for w in sizes[1:]
        if results[str(base)]["jobs_per_s"]
    }
    cores = os.cpu_count() or 1
    notes = []
    for w in sizes:
        busy = dict(results[str(w)]["cores_busy"])
        machine = busy.pop("machine")
        ours = round(sum(busy.values()), 2)
        if machine < 0.9 * cores:
            continue
        if ours >= 0.7 * machine:
            notes.append(
                f"{w} workers: this bench saturated the machine's {cores} cores ({ours} "
                "busy): the figure is this machine's CPU limit on worker threads, not the "
                "queue's"
            )
        else:
            notes.append(
                f"{w} workers: the {cores} cores were saturated by other work ({machine} "
                f"busy, {ours} of it this bench's): figures disturbed, run again"
            )
    # on paper: the fleet at which one Redis core saturates, from the size nearest 64
    ref = min(sizes, key=lambda w: abs(w - 64))
    r = results[str(ref)]
    cpu_per_job = r["redis_busiest_core_us_per_job"] / 1e6  # its busiest primary's
    redis_jobs_s = 1 / cpu_per_job if cpu_per_job else None
    paper = {
        "from_workers": ref,
        "redis_cpu_us_per_job": r["redis_cpu_us_per_job"],
        "busiest_core_us_per_job": r["redis_busiest_core_us_per_job"],
        "redis_commands_per_job": r["redis_commands_per_job"],
        "jobs_per_s_one_redis_core": round(redis_jobs_s) if redis_jobs_s else None,
        "commands_per_s_then": round(redis_jobs_s * r["redis_commands_per_job"])
        if redis_jobs_s
        else None,
        "workers_one_redis_core": round(redis_jobs_s / r["jobs_per_s_per_worker"])
        if redis_jobs_s and r["jobs_per_s_per_worker"]
        else None,
    }
    print(
        f"on paper (from {ref} workers): one Redis core saturates at "
        f"{paper['jobs_per_s_one_redis_core']} jobs/s = {paper['workers_one_redis_core']} "
        f"workers of {r['jobs_per_s_per_worker']} jobs/s each"
    )
    if eff:
        print("scaling efficiency vs " + str(base) + " workers: " + json.dumps(eff))
    for n in notes:
        print("note: " + n)
    json_line(
        {
            "bench": "fleet_sim",
            "machine": f"{platform.machine()} {cores} cpus",
            "redis": what,
            "models": a.models,
            "step_model": {
                "base_ms": a.step_base_ms,
                "per_seq_ms": a.step_per_seq_ms,
                "source": STEP_SOURCE,
            },
            "max_num_seqs": a.max_num_seqs,
            "kv_tokens": a.kv_tokens,
            "max_tokens": a.max_tokens,
            "seconds": a.seconds,
            "warmup_s": a.warmup,
            "jobs_per_s": {w: results[w]["jobs_per_s"] for w in results},
            "efficiency_vs_smallest": eff,
            "efficiency_8_to_64": eff.get("64") if base == 8 else None,
            "target_efficiency": 0.8,
            "on_paper": paper,
            "all_one_final_result": all(x["one_final_result_each"] for x in results.values()),
            "notes": notes,
            "sizes": results,
        },
        a.smoke,
    )


if __name__ == "__main__":
    main()
