"""The queue layer at fleet scale: the real Redis, client and Worker, simulated engines.

A real redis-server (EmbeddedRedis; or --redis-url; or --cluster, a LocalCluster of 3
primaries), real `Client.submit_many` / `wait_all` in a producer process, and W real
`Worker`s (intake, lanes, leases, reclaim scans, deltas, FINALIZE) driving `SimBackend`s:
continuous batching over `max_num_seqs` slots and a KV budget in tokens, whose step
sleeps `base + per_seq * batch` ms and yields one token per running request. The workers
run as threads, each with its own connection, spread over P spawned processes.

    python bench/fleet_sim.py [--workers 8,64,256] [--seconds 30] [--procs P]
        [--step-base-ms 30] [--step-per-seq-ms 0.6] [--models 1|2]
        [--redis-url URL [--flush] | --cluster [N]] [--shards N]

The producer keeps about K = 2 * workers * max_num_seqs jobs outstanding (closed loop)
for --seconds; after --warmup the steady window is measured: completed jobs/s (by the
records' finished_ms), Redis commands and Redis CPU (main thread) per job, intake latency
(started_ms - created_ms; under a closed loop it is mostly the wait in the backlog), the
engines' busy share and batch occupancy, and whether every job has exactly one final
result. Scaling efficiency of size W against the smallest size W0 is
(jobs/s(W) / jobs/s(W0)) / (W / W0); the target from 8 to 64 workers is >= 0.8. From the
Redis CPU per job it also works out, on paper, the jobs/s and the worker count at which
one Redis core saturates. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.workload import cpu_isa  # noqa: E402
from broker_config import keys  # noqa: E402
from broker_config.connection import connect, is_cluster  # noqa: E402
from broker_config.errors import ErrorCode  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from gpu_workers.backend import RequestError, StepOutput  # noqa: E402

WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()
LANES = (("interactive", 0.2), ("standard", 0.5), ("batch", 0.3))
MODELS = ("sim-a", "sim-b")

# Step time of the simulated engine: base + per_seq * running sequences, in ms. The shape
# comes from `bench/step_profile.py --model models/tiny-llama --requests 32` on the 2-core
# avx512_bf16 machine: decode steps of 1.1 ms at 1-4 sequences and 1.7 ms at 29-32, i.e.
# about 1.05 ms + 0.021 ms per sequence (per-sequence cost ~2% of the base, as on a GPU,
# where decode is bound by reading the weights). Its absolute size is that of a GPU decode
# step of a mid-size model, 30 ms: one worker then does ~25 steps/s, so 64 of them make
# ~1,600 worker-loop turns/s, which 2 cores carry; the tiny model's own 1-2 ms steps would
# make this bench measure Python, not the queue.
STEP_BASE_MS = 30.0
STEP_PER_SEQ_MS = 0.6
STEP_SOURCE = (
    "shape from bench/step_profile.py on models/tiny-llama (2-core avx512_bf16): "
    "1.05 ms + 0.021 ms/seq; scaled to a 30 ms base (a GPU decode step)"
)


# -- the simulated engine ------------------------------------------------------------


@dataclass
class _Seq:
    id: str
    prompt_tokens: int
    max_tokens: int
    priority: int
    order: int
    output: int = 0

    @property
    def need(self) -> int:
        return self.prompt_tokens + self.max_tokens


def estimate_tokens(
    prompt: str | None, token_ids: list[int] | None, messages: list[dict] | None
) -> int:
    """A cheap prompt length: exact for token ids, ~4 characters a token for text, plus 4
    per chat message for its template."""
    if token_ids is not None:
        return len(token_ids)
    if messages is not None:
        return sum(4 + len(str(m.get("content", ""))) // 4 for m in messages)
    return max(1, len(prompt or "") // 4)


class SimBackend:
    """A Backend whose step sleeps the simulated step time: continuous batching over
    `max_num_seqs` slots and `kv_tokens` of KV (each request reserves prompt + max_tokens
    when admitted), one token per running request per step, finish 'length' at
    max_tokens. Lower `priority` runs first."""

    def __init__(
        self,
        *,
        max_num_seqs: int = 16,
        kv_tokens: int = 4096,
        max_model_len: int = 2048,
        step_base_ms: float = STEP_BASE_MS,
        step_per_seq_ms: float = STEP_PER_SEQ_MS,
        model_fingerprint: str = "sim",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if kv_tokens < max_model_len:
            raise ValueError("kv_tokens must hold at least one request of max_model_len")
        self.model_fingerprint = model_fingerprint
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_tokens = kv_tokens
        self.step_base_ms = step_base_ms
        self.step_per_seq_ms = step_per_seq_ms
        self._sleep = sleep
        self._running: dict[str, _Seq] = {}
        self._waiting: dict[str, _Seq] = {}
        self._order = 0
        self.steps = 0
        # per wall-clock second: [steps, sequences stepped, seconds inside steps]
        self.per_second: dict[int, list[float]] = {}

    def add(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        params: dict[str, Any] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        special_tokens: bool = False,
    ) -> None:
        if request_id in self._running or request_id in self._waiting:
            raise RequestError(ErrorCode.DUPLICATE_ID, f"{request_id} is already here")
        max_tokens = (params or {}).get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(ErrorCode.INVALID_PARAMS, "max_tokens must be an integer >= 1")
        n = estimate_tokens(prompt, token_ids, messages)
        if n + 1 > self.max_model_len:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG, f"{n} prompt tokens; at most {self.max_model_len - 1}"
            )
        max_tokens = min(max_tokens, self.max_model_len - n)
        self._order += 1
        self._waiting[request_id] = _Seq(
            id=request_id,
            prompt_tokens=n,
            max_tokens=max_tokens,
            priority=priority,
            order=self._order,
        )

    def _reserved(self) -> int:
        return sum(s.need for s in self._running.values()) + sum(
            s.need for s in self._waiting.values()
        )

    def can_admit(self, prompt_tokens: int, max_tokens: int) -> bool:
        if len(self._running) + len(self._waiting) >= self.max_num_seqs:
            return False
        need = prompt_tokens + min(max_tokens, self.max_model_len)
        return self._reserved() + need <= self.kv_tokens

    def _admit(self) -> None:
        used = sum(s.need for s in self._running.values())
        for seq in sorted(self._waiting.values(), key=lambda s: (s.priority, s.order)):
            if len(self._running) >= self.max_num_seqs or used + seq.need > self.kv_tokens:
                break
            del self._waiting[seq.id]
            self._running[seq.id] = seq
            used += seq.need

    def step(self) -> list[StepOutput]:
        self._admit()
        if not self._running:
            return []
        batch = len(self._running)
        seconds = (self.step_base_ms + self.step_per_seq_ms * batch) / 1000
        start = time.time()
        self._sleep(seconds)
        self.steps += 1
        bucket = self.per_second.setdefault(int(start), [0, 0, 0.0])
        bucket[0] += 1
        bucket[1] += batch
        bucket[2] += seconds
        outs = []
        for seq in list(self._running.values()):
            token = 16 + (seq.output * 7 + seq.order) % 1000
            seq.output += 1
            done = seq.output >= seq.max_tokens
            if done:
                del self._running[seq.id]
            outs.append(
                StepOutput(
                    request_id=seq.id,
                    new_token_ids=[token],
                    text_delta=" " + WORDS[token % len(WORDS)],
                    finished=done,
                    finish_reason="length" if done else None,
                    num_prompt_tokens=seq.prompt_tokens,
                    num_output_tokens=seq.output,
                    num_cached_tokens=0,
                )
            )
        return outs

    def abort(self, request_id: str) -> bool:
        return (
            self._running.pop(request_id, None) or self._waiting.pop(request_id, None)
        ) is not None

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def prompt_backlog(self) -> int:
        return sum(s.prompt_tokens for s in self._waiting.values())

    def stats(self) -> dict[str, Any]:
        used = self._reserved()
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "steps": self.steps,
            "kv_tokens_used": used,
            "kv_tokens_total": self.kv_tokens,
            "blocks_total": self.kv_tokens // 16,  # as the heartbeat shows KV, in 16s
            "blocks_used": -(-used // 16),
            "blocks_free": (self.kv_tokens - used) // 16,
        }

    def close(self) -> None:
        self._running.clear()
        self._waiting.clear()


# -- Redis: embedded, given, or a local cluster ---------------------------------------


@contextmanager
def redis_target(a: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(url, what it is) of the Redis to run on."""
    if a.redis_url:
        yield a.redis_url, "given --redis-url"
        return
    with tempfile.TemporaryDirectory() as d:
        if a.cluster:
            from broker_config.embedded import LocalCluster

            with LocalCluster(Path(d) / "cluster", n=a.cluster) as url:
                yield url, f"LocalCluster of {a.cluster} primaries"
        else:
            from broker_config.embedded import EmbeddedRedis

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


# -- worker processes: threads of Worker + SimBackend ----------------------------------


def worker_proc(cfg: dict[str, Any], stop: Any, out: Any) -> None:
    """Run cfg['ids'] workers as threads until `stop`; put a JSON line of their figures."""
    logging.basicConfig(level=logging.WARNING)
    from gpu_workers.worker import Worker

    workers: list[tuple[Worker, SimBackend]] = []
    for wid, model in cfg["ids"]:
        overrides: dict[str, Any] = {"redis_url": cfg["url"]}
        if model:
            overrides["served_model"] = model
        if cfg["shards"] > 1:
            overrides["shards"] = cfg["shards"]
        backend = SimBackend(
            max_num_seqs=cfg["max_num_seqs"],
            kv_tokens=cfg["kv_tokens"],
            max_model_len=cfg["max_model_len"],
            step_base_ms=cfg["step_base_ms"],
            step_per_seq_ms=cfg["step_per_seq_ms"],
            model_fingerprint=f"sim-{model or 'default'}",
        )
        names = {model} if model else {"sim"}
        w = Worker(backend, connect(cfg["url"]), Settings(**overrides), wid, model_names=names)
        workers.append((w, backend))
    errors: list[str] = []

    def run(w: Worker) -> None:
        try:
            w.run()
        except BaseException:
            errors.append(f"{w.id}: {traceback.format_exc(limit=6)}")

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w, _ in workers]
    for t in threads:
        t.start()
    stop.wait()
    for w, _ in workers:
        w.request_stop(cfg["grace_s"])
    for t in threads:
        t.join(cfg["grace_s"] + 10)
    per_second: dict[int, list[float]] = {}
    for _, b in workers:
        for sec, v in b.per_second.items():
            acc = per_second.setdefault(sec, [0, 0, 0.0])
            for i in range(3):
                acc[i] += v[i]
    result = {
        "jobs_done": sum(w.jobs_done for w, _ in workers),
        "alive": sum(t.is_alive() for t in threads),
        "errors": errors,
        "per_second": {str(k): v for k, v in per_second.items()},
    }
    out.put(json.dumps(result))


# -- the producer: a closed loop of submit_many / wait_all ----------------------------


def producer_proc(cfg: dict[str, Any], out: Any) -> None:
    """Threads that each keep `depth` batches of `batch` jobs in flight (submit_many, then
    wait_all on the oldest) until cfg['end'], then wait for the rest; puts one JSON line:
    per job [created_ms, started_ms, finished_ms, ok, lane index], and counts."""
    logging.basicConfig(level=logging.WARNING)
    from producer.client import Client

    rows: list[list[int]] = []
    lanes = [n for n, _ in LANES]
    counts = {"submitted": 0, "final": 0, "ok": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def one(seed: int) -> None:
        rng = random.Random(seed)
        client = Client(cfg["url"])
        want: dict[str, tuple[int, str]] = {}  # job id: max_tokens, model
        inflight: deque[list[str]] = deque()

        def submit() -> None:
            reqs = []
            for _ in range(cfg["batch"]):
                req: dict[str, Any] = {
                    "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 64))),
                    "max_tokens": rng.randint(*cfg["max_tokens"]),
                    "temperature": 0.0,
                    "lane": rng.choices([n for n, _ in LANES], [w for _, w in LANES])[0],
                }
                if cfg["models"]:
                    req["model"] = rng.choice(cfg["models"])
                reqs.append(req)
            jobs = client.submit_many(reqs)
            for j, r in zip(jobs, reqs, strict=True):
                want[j.id] = (r["max_tokens"], r.get("model", "default"))
            inflight.append([j.id for j in jobs])

        def settle() -> None:
            ids = inflight.popleft()
            recs = client.wait_all(ids, timeout=cfg["wait_s"])
            got = []
            for rec in recs:
                max_tokens, model = want.pop(rec.id)
                ok = (
                    rec.final
                    and rec.state == "completed"
                    and rec.finish_reason == "length"
                    and rec.output_tokens == max_tokens
                    and (rec.worker or "").endswith("-" + model)  # a worker of its model
                )
                lane = lanes.index(rec.lane) if rec.lane in lanes else -1
                got.append(
                    [rec.created_ms or 0, rec.started_ms or 0, rec.finished_ms or 0, ok, lane]
                )
            with lock:
                rows.extend(got)
                counts["submitted"] += len(ids)
                counts["final"] += sum(r.final for r in recs)
                counts["ok"] += sum(int(g[3]) for g in got)

        try:
            while time.time() < cfg["end"]:
                while len(inflight) < cfg["depth"]:
                    submit()
                settle()
            while inflight:
                settle()
        except BaseException:
            errors.append(traceback.format_exc(limit=6))
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(cfg["seed"] + i,)) for i in range(cfg["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(json.dumps({**counts, "errors": errors, "rows": rows}))


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
        "wait_s": 300.0,
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
    a = p.parse_args()
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
    print(
        json.dumps(
            {
                "bench": "fleet_sim",
                "isa": cpu_isa(),
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
            }
        )
    )


if __name__ == "__main__":
    main()
