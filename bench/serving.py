"""The serving bench: Plurai against `vllm serve` instances behind `vllm-router`, on the same
engine (vLLM's CPU build), the same model, the same per-engine KV budget and cores, and the
same OpenAI requests, driven open-loop from one seeded workload file per run. One file,
though long: the stacks it starts and stops, its scenarios and its client are one run's
life; the workload (serving_workload.py) and the figures (serving_figures.py) are apart.

    python bench/serving.py [--k 2] [--stacks plurai-vllm,plurai-native,round_robin,...]
        [--scenarios idle,sweep,flood,add,kill] [--duration 40] [--scales 0.3,0.6,0.9,1.3]
        [--repeats 1] [--capacity REQ_S] [--model DIR] [--dtype auto] [--bind-peers] [--out DIR]
        [--smoke]

Stacks (each started fresh, K engines, engine i bound to core i mod cores):
- plurai-vllm: a Redis, `plurai gateway`, K `plurai worker --backend vllm` with the Redis KV
  tier on a Redis of its own (PLURAI_KV_REDIS_URL: allkeys-lru, no persistence, as
  docs/operations.md deploys a cache); plurai-native: the same with the native engine;
  plurai-vllm-notier, plurai-native-notier: without the KV tier.
- round_robin, power_of_two, cache_aware (any vllm-router policy): K `vllm serve
  --scheduling-policy priority --enable-prefix-caching` behind `vllm-router --policy P`
  (`make peers` installs the router into vLLM's environment). Each engine's ranks are bound
  to its core (VLLM_CPU_OMP_THREADS_BIND, as vLLM's CPU docs run it); a Plurai worker also
  binds vLLM's engine core there (gpu_workers/vllm_backend/cores.py); --bind-peers does it
  for `vllm serve` by hand, with taskset over the whole instance.

Scenarios, run in this order on every stack, so each stack's caches see the same history
(after a burst of --warmup unmeasured requests per engine: a fresh engine's first batches
stall while kernels are built for their shapes):
- idle: a few requests one at a time on every stack; the SLOs are multiples of the first
  stack's medians (interactive: TTFT and TPOT 5x; batch: end to end 10x; --slo-*), or an
  earlier run's (--slos-from, to compare a run on fewer stacks with it). The
  routers come first by default; a Plurai stack started once the SLOs are known is given
  a top-lane TPOT target a little under the interactive one (--plurai-tpot-share), as an
  operator sets PLURAI_TOP_LANE_TPOT_MS from their objective (a router has no such knob),
  and a bound on the wait for it under the TTFT one (--plurai-wait-share,
  PLURAI_TOP_LANE_WAIT_MS: a request held past its TTFT objective misses it anyway).
- sweep: the mixed workload (interactive chats on shared system prompts, growing multi-turn
  sessions, batch-lane document extraction; gamma arrivals, --burstiness) offered at each
  --scales multiple of the calibrated capacity; goodput is the highest offered rate whose
  requests met their lane's SLO in >= 90% of cases (with --repeats R, the sweep goes round R
  times with other seeds and a load's attainment pools its rounds: one 40 s gamma run is a few
  bursts, and where they fall decides it; each round runs every stack in turn, restarting
  it, so that a slow stretch of the shared machine does not land on the last stack alone).
  The capacity (--capacity, else measured once on the first stack with a saturating burst)
  is the same for every stack.
- flood: steady interactive traffic at 0.5x capacity with a burst of batch extraction on top;
  the interactive lane's TTFT p99 is the figure.
- add: a K+1th engine started at a third of the run under 1.2x capacity, arrivals going on
  until 10 s after it carries load (at most --add-wait s after its start, the same for
  every stack: a new engine on cores its peers keep busy starts minutes slower); the seconds from
  its being ready (the worker's heartbeat, the engine's /health) to its first request (the
  worker took a job; vLLM's running gauge), counting the router's /add_worker call, which a
  router needs and a worker does not.
- kill: one engine SIGKILLed at a third of the run under 0.5x capacity; failed and lost
  requests and the seconds until completions per second are back to 80% of before.
- trace (not in the default list): a production trace's requests (--trace, any
  Mooncake-format trace; by default the conversation trace in ../shared/traces, else its
  first 500 requests in bench/traces), as many as --duration holds at the capacity, at
  each --scales multiple of the capacity: the same requests at every load, with the
  trace's own timing squeezed to that rate and its lengths times --trace-scale
  (bench/trace_replay.py: requests that share the trace's blocks share token blocks here),
  each sent as a completion of token ids; round r of --repeats replays the trace's r-th
  window. Its SLOs are the same multiples of its own first requests sent one at a time
  (with idle; `trace_slos`); goodput and prompt tokens computed over its loads, as the
  sweep's.

Every request of a run is in one seeded JSON-lines file (bench/serving_workload.py) that
every stack replays. Batch requests go to the batch lane (Plurai: `lane`; vLLM: a lower
`priority`). Figures per stack, lane and run: TTFT, TPOT and end-to-end p50/p99, SLO
attainment, failed and lost requests, prompt tokens computed and served from a cache
(the usage's cached_tokens; Plurai's worker figures also split the Redis tier's share), and
CPU seconds per process kind (engines, front: gateway or router, Redis, load generator).
The last line is one JSON object with the ISA and the ratios of plurai-vllm against the best
router policy on each target figure.

--smoke: every scenario (the trace's too) on one engine per stack, on the factory's small
random Llama (the smallest vLLM runs) in float32, with short prompts and outputs, 2 s runs,
one load of the sweep, a flood of 4, arrivals ending 1 s after an added engine carries load; by default
every stack whose programs are installed (plurai-native always; plurai-vllm with vLLM's
environment; round_robin with vllm-router), the others named in the JSON with why. A check
that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import redis  # noqa: E402

from bench import serving_figures as sf  # noqa: E402
from bench.serving_workload import (  # noqa: E402
    BATCH,
    INTERACTIVE,
    ServingRequest,
    Tokens,
    WorkloadConfig,
    flood_scenario,
    generate,
    write_jsonl,
)
from bench.trace_replay import read_trace  # noqa: E402
from bench.trace_replay import replay as replay_trace  # noqa: E402
from bench.workload import add_smoke_arg, bench_model, cpu_isa, smoke_model  # noqa: E402
from broker_config import keys, stats  # noqa: E402
from broker_config.embedded import EmbeddedRedis, find_binary, free_port  # noqa: E402
from broker_config.settings import Settings  # noqa: E402

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# the production trace beside the checkout (Mooncake's conversation trace: its NOTICE)
# the full production trace beside the checkout, else its first 500 requests kept here
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
if not TRACE.is_file():
    TRACE = ROOT / "bench" / "traces" / "conversation_head.jsonl"
PLURAI_STACKS = ("plurai-vllm", "plurai-native")
ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware")
ALL_STACKS = (*ROUTER_POLICIES, *PLURAI_STACKS)  # the routers first: they set the SLOs
# Plurai's fault settings for the bench (printed in the JSON): a dead worker's jobs are
# taken over after 10 s of silence instead of the default 60 s.
PLURAI_ENV = {"PLURAI_HEARTBEAT_INTERVAL_S": "1", "PLURAI_RECLAIM_IDLE_MS": "10000"}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- processes ------------------------------------------------------------------------


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=open(log, "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # its children (vLLM's engine core) go with its group
    )


def end(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def cpu_s(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) used so far by each of these processes with its
    descendants, by its pid."""
    out = {}
    for root in pids:
        total = 0
        for p in tree(root):
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
        out[root] = total / CLK_TCK
    return out


def cpu_used(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]):
    """CPU seconds of each process kind between two readings, counting the processes alive
    at the second (a process killed in between took its time with it: not counted)."""
    return {
        kind: round(sum(v - before.get(kind, {}).get(pid, 0.0) for pid, v in pids.items()), 2)
        for kind, pids in after.items()
    }


def client_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def wait_http(url: str, procs: list[subprocess.Popen], timeout: float, log: Path) -> None:
    give_up = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process of the stack exited; see {log}")
        if time.monotonic() > give_up:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f}s; see {log}")
        time.sleep(0.5)


@dataclass
class EngineSpec:
    """What every engine of every stack gets."""

    model: Path
    name: str  # the model name clients send
    dtype: str
    max_model_len: int
    kv_gib: int = 1
    eager: bool = True  # vLLM without torch.compile: an engine starts in ~20 s, not ~90 s
    # each `vllm serve` wholly on its engine's core (taskset: API server and engine core
    # too), as its user can do by hand; vLLM's CPU docs bind only the ranks
    bind_peers: bool = False

    def core(self, i: int) -> int:
        return i % (os.cpu_count() or 1)


# -- stacks ---------------------------------------------------------------------------


class Stack:
    name: str
    base: str  # the OpenAI base URL, .../v1
    kind: str  # plurai | router
    wall0 = 0.0  # the last replay's start on the wall clock, which job records use

    def __init__(self, spec: EngineSpec, k: int, logs: Path) -> None:
        self.spec, self.k, self.logs = spec, k, logs
        self.engines: list[subprocess.Popen] = []
        self.front: subprocess.Popen | None = None
        self.start_s = 0.0  # how long the stack's start took

    def cpu(self) -> dict[str, dict[int, float]]:
        return {
            "engines": cpu_s([p.pid for p in self.engines if p.poll() is None]),
            "front": cpu_s([self.front.pid]) if self.front else {},
            "redis": {},
        }

    def body(self, req: ServingRequest) -> dict[str, Any]:
        prompt = (
            {"messages": req.messages} if req.prompt_ids is None else {"prompt": req.prompt_ids}
        )
        return {
            "model": self.spec.name,
            **prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def kill_engine(self, i: int) -> None:
        os.killpg(self.engines[i].pid, signal.SIGKILL)

    def extra(self) -> dict[str, Any]:
        return {}


class PluraiStack(Stack):
    kind = "plurai"

    def __init__(self, backend: str, spec: EngineSpec, k: int, logs: Path) -> None:
        super().__init__(spec, k, logs)
        self.backend, _, variant = backend.partition("-")
        self.tier = variant != "notier"  # plurai-vllm-notier: without the Redis KV tier
        self.name = f"plurai-{backend}"
        # in a session of its own, as the gateway, workers and KV Redis are (spawn): in the
        # load generator's, the kernel's per-session CPU share (autogroup) put the queue's
        # Redis and the client in one share, and the client fell seconds behind at bursts
        self.redis = EmbeddedRedis(logs / "redis", own_session=True)
        self.url = ""
        self.kv_url = ""  # the KV tier's Redis; "": none
        self.kv_redis: subprocess.Popen | None = None
        self.r: redis.Redis | None = None
        self.tpot_ms = 0.0  # PLURAI_TOP_LANE_TPOT_MS, the operator's objective; 0: none
        self.wait_ms: float | None = None  # PLURAI_TOP_LANE_WAIT_MS; None: the default
        self.since_ms = 0  # job records created up to then are in an earlier run's figures
        # per request of the last run, from its record: created_ms, ms queued (created to
        # started) and ms from then to the worker's first token (engine_ms; None: none)
        self.queue_waits: dict[str, dict[str, int | None]] = {}

    def start(self) -> None:
        # a fresh queue at each start: an earlier round's jobs are not this one's
        shutil.rmtree(self.redis.data_dir, ignore_errors=True)
        self.url = self.redis.start()
        self.r = redis.Redis.from_url(self.url)
        if self.tier:  # a cache, deployed as docs/operations.md says: a Redis of its own,
            # evicting (allkeys-lru), with nothing written to disk
            port = free_port()
            cmd = [find_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1"]
            cmd += ["--appendonly", "no", "--save", "", "--maxmemory", f"{2 * self.spec.kv_gib}gb"]
            cmd += ["--maxmemory-policy", "allkeys-lru"]
            self.kv_redis = spawn(cmd, self.logs / "kv-redis.log")
            self.kv_url = f"redis://127.0.0.1:{port}/0"
            give_up = time.monotonic() + 10
            while True:
                try:
                    redis.Redis.from_url(self.kv_url).ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > give_up or self.kv_redis.poll() is not None:
                        raise RuntimeError(f"the KV Redis did not start; see {self.logs}") from None
                    time.sleep(0.05)
        port = free_port()
        self.front = spawn(
            [sys.executable, "-m", "cli", "gateway", "--url", self.url, "--port", str(port)],
            self.logs / "gateway.log",
        )
        self.base = f"http://127.0.0.1:{port}/v1"
        for _ in range(self.k):
            self.add_engine()
        self.wait_ready([p.pid for p in self.engines], 600)
        wait_http(self.base.removesuffix("/v1") + "/health", [self.front], 60, self.logs)

    def engine_cmd(self, i: int) -> tuple[list[str], dict[str, str]]:
        s = self.spec
        cmd = [sys.executable, "-m", "cli", "worker", "--model", str(s.model), "--url", self.url]
        cmd += ["--metrics-port", "-1", "--backend", self.backend]
        env = {**PLURAI_ENV, "PLURAI_KV_REDIS_URL": self.kv_url}
        if self.tpot_ms:
            env["PLURAI_TOP_LANE_TPOT_MS"] = f"{self.tpot_ms:.0f}"
        if self.wait_ms is not None:
            env["PLURAI_TOP_LANE_WAIT_MS"] = f"{self.wait_ms:.0f}"
        if self.backend == "vllm":
            cmd = [str(VLLM_PY)] + cmd[1:]
            for kv in (f"dtype={s.dtype}", f"max_model_len={s.max_model_len}"):
                cmd += ["--vllm", kv]
            if s.eager:
                cmd += ["--vllm", "enforce_eager=true"]
            env |= {
                "VLLM_CPU_OMP_THREADS_BIND": str(s.core(i)),
                "VLLM_CPU_KVCACHE_SPACE": str(s.kv_gib),
            }
        else:
            for kv in (
                f"dtype={s.dtype}",
                f"max_model_len={s.max_model_len}",
                f"kv_cache_bytes={s.kv_gib * 2**30}",
                "threads=1",
            ):
                cmd += ["--engine", kv]
            cmd = ["taskset", "-c", str(s.core(i))] + cmd if shutil.which("taskset") else cmd
        return cmd, env

    def add_engine(self) -> subprocess.Popen:
        i = len(self.engines)
        cmd, env = self.engine_cmd(i)
        p = spawn(cmd, self.logs / f"worker-{i}.log", env)
        self.engines.append(p)
        return p

    def serving(self) -> dict[int, stats.WorkerInfo]:
        assert self.r is not None
        live, _ = stats.workers(self.r, stats.redis_now_ms(self.r))
        return {w.pid: w for w in live if w.state == "serving"}

    def wait_ready(self, pids: list[int], timeout: float) -> None:
        give_up = time.monotonic() + timeout
        while not set(pids) <= set(self.serving()):
            if any(p.poll() is not None for p in self.engines if p.pid in pids):
                raise RuntimeError(f"a worker exited during its start; see {self.logs}")
            if time.monotonic() > give_up:
                raise TimeoutError(f"workers not serving after {timeout:.0f}s; see {self.logs}")
            time.sleep(0.2)

    def carries_load(self, pid: int) -> bool:
        w = self.serving().get(pid)
        return w is not None and (w.running > 0 or w.jobs_done > 0)

    def body(self, req: ServingRequest) -> dict[str, Any]:
        # the request's id travels in its job record, for the queue waits (extra)
        return {**super().body(req), "lane": req.lane, "metadata": {"bench_id": req.id}}

    def cpu(self) -> dict[str, dict[int, float]]:
        out = super().cpu()
        if self.redis.proc is not None:
            out["redis"] = cpu_s([self.redis.proc.pid])
        if self.kv_redis is not None:
            out["kv_redis"] = cpu_s([self.kv_redis.pid])
        return out

    def extra(self) -> dict[str, Any]:
        """Blocks served from each KV tier so far, summed over the live workers; and per
        lane, how long the jobs finished since the last call waited in the queue (from
        their records: created to started), the part of a time to first token spent
        before any worker took the job."""
        assert self.r is not None
        names = ("kv_device_hits", "kv_host_hits", "kv_redis_hits")
        out: dict[str, Any] = dict.fromkeys(names, 0)
        for w in self.serving().values():
            beat = self.r.hmget(keys.worker(w.id), names)
            for name, v in zip(names, beat, strict=True):
                out[name] += int(v or 0)
        waits: dict[str, list[float]] = {}
        newest = self.since_ms
        self.queue_waits = {}
        for key in self.r.scan_iter(match=keys.job("*"), count=1000):
            fields = ("lane", "created_ms", "started_ms", "metadata", "first_token_ms")
            lane, created, started, meta, first = self.r.hmget(key, fields)
            if lane is None or created is None or started is None:
                continue
            if int(created) <= self.since_ms:
                continue
            newest = max(newest, int(created))
            wait = int(started) - int(created)
            waits.setdefault(lane.decode(), []).append(wait)
            times = {
                "job": keys.job_of(key),
                "created_ms": int(created),
                "queue_ms": wait,
                "engine_ms": int(first) - int(started) if first is not None else None,
            }
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                self.queue_waits[json.loads(meta)["bench_id"]] = times
        self.since_ms = newest
        # the queue's Redis commands over 10 ms since the last call (Redis's slow log): a
        # slow one holds every client of that Redis meanwhile
        out["redis_slow"] = [
            {
                "ms": e["duration"] / 1000,
                "command": bytes(e["command"])[:120].decode(errors="replace"),
            }
            for e in self.r.slowlog_get(32)
        ]
        self.r.slowlog_reset()
        out["queue_wait_ms"] = {
            lane: {"p50": sf.percentile(w, 50), "p99": sf.percentile(w, 99), "n": len(w)}
            for lane, w in sorted(waits.items())
        }
        return out

    def stop(self) -> None:
        for p in self.engines:
            end(p, signal.SIGTERM, 60)
        if self.front is not None:
            end(self.front)
        if self.kv_redis is not None:
            end(self.kv_redis)
        self.redis.stop()


class RouterStack(Stack):
    kind = "router"

    def __init__(self, policy: str, spec: EngineSpec, k: int, logs: Path) -> None:
        super().__init__(spec, k, logs)
        self.policy = self.name = policy
        self.ports: list[int] = []
        self.router_port = 0

    def engine_cmd(self, i: int, port: int) -> tuple[list[str], dict[str, str]]:
        s = self.spec
        cmd = [str(VLLM_PY), str(ROOT / "bench" / "vllm_cli.py"), "serve", str(s.model)]
        cmd += ["--port", str(port), "--served-model-name", s.name, "--dtype", s.dtype]
        cmd += ["--max-model-len", str(s.max_model_len), "--scheduling-policy", "priority"]
        cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
        cmd += ["--enforce-eager"] if s.eager else []
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(s.core(i)), "VLLM_CPU_KVCACHE_SPACE": str(s.kv_gib)}
        if s.bind_peers and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(s.core(i))] + cmd
        return cmd, env

    def add_engine(self) -> subprocess.Popen:
        i, port = len(self.engines), free_port()
        cmd, env = self.engine_cmd(i, port)
        p = spawn(cmd, self.logs / f"engine-{i}.log", env)
        self.engines.append(p)
        self.ports.append(port)
        return p

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def start(self) -> None:
        for _ in range(self.k):
            self.add_engine()
        for i in range(self.k):
            wait_http(self.engine_url(i) + "/health", self.engines, 600, self.logs)
        self.router_port = free_port()
        cmd = [str(VLLM_PY.parent / "vllm-router"), "--policy", self.policy]
        cmd += ["--port", str(self.router_port), "--prometheus-port", str(free_port())]
        cmd += ["--worker-urls"]
        cmd += [self.engine_url(i) for i in range(self.k)]
        self.front = spawn(cmd, self.logs / "router.log")
        self.base = f"http://127.0.0.1:{self.router_port}/v1"
        wait_http(f"http://127.0.0.1:{self.router_port}/health", [self.front], 60, self.logs)

    def body(self, req: ServingRequest) -> dict[str, Any]:
        return {**super().body(req), "priority": 1 if req.lane == BATCH else 0}

    def join(self, i: int) -> None:
        """What an operator does for a new engine: tell the router."""
        url = f"http://127.0.0.1:{self.router_port}/add_worker"
        httpx.post(url, params={"url": self.engine_url(i)}, timeout=10).raise_for_status()

    def carries_load(self, i: int) -> bool:
        try:
            text = httpx.get(self.engine_url(i) + "/metrics", timeout=2).text
        except httpx.HTTPError:
            return False
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:request_success_total")):
                if float(line.rsplit(" ", 1)[1]) > 0:
                    return True
        return False

    def extra(self) -> dict[str, Any]:
        hits = queries = 0.0
        for i, p in enumerate(self.engines):
            if p.poll() is not None:
                continue
            try:
                text = httpx.get(self.engine_url(i) + "/metrics", timeout=2).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
        return {"prefix_cache_hit_tokens": int(hits), "prefix_cache_query_tokens": int(queries)}

    def stop(self) -> None:
        if self.front is not None:
            end(self.front)
        for p in self.engines:
            end(p, signal.SIGTERM, 60)


def rounds(stacks: list[str], scenarios: list[str], repeats: int) -> list[tuple[int, str]]:
    """The order of the stacks' starts, (round, stack): with --repeats R the sweep goes round
    R times, and each round runs every stack in turn (a stack restarts for each), so a slow
    stretch of the shared machine lands on every stack's rounds, not on the last stack's
    alone (the trace's rounds likewise). The other scenarios run in the first round."""
    n = max(1, repeats) if {"sweep", "trace"} & set(scenarios) else 1
    return [(r, name) for r in range(n) for name in stacks]


def make_stack(name: str, spec: EngineSpec, k: int, logs: Path) -> Stack:
    logs.mkdir(parents=True, exist_ok=True)
    if name.startswith("plurai-"):
        return PluraiStack(name.split("-", 1)[1], spec, k, logs)
    return RouterStack(name, spec, k, logs)


# -- the client -----------------------------------------------------------------------


def client_late_ms(reqs: list[ServingRequest], results: list[sf.Result]) -> dict[str, float]:
    """How late the load generator sent requests after their arrival times (p50, max): on
    a busy machine it shares the cores with the stack, and latencies count from the send."""
    due = {r.id: r.arrival_s for r in reqs}
    late = sorted(1000 * max(0.0, r.sent_s - due[r.id]) for r in results if r.id in due)
    if not late:
        return {"p50": 0.0, "max": 0.0}
    return {"p50": round(late[len(late) // 2], 1), "max": round(late[-1], 1)}


def slowest_share(results: list[sf.Result], times: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Of the slowest 5% of interactive first tokens (at least one): how many, their TTFT,
    and the shares of it (medians) spent in the gateway's intake (send to the job's
    record), the queue (record to a worker's start), the engine (start to the worker's
    first token); the rest is delivery (Redis, the gateway's stream, the client): where
    the tail of a time to first token is. `times`: per request id, what the records say
    (intake_ms, queue_ms, engine_ms; None where unknown)."""
    its = sorted(
        (r for r in results if r.lane == INTERACTIVE and r.ttft is not None and r.id in times),
        key=lambda r: r.ttft or 0.0,
    )
    tail = its[len(its) - max(1, len(its) // 20) :] if its else []
    if not tail:
        return {"n": 0}
    out: dict[str, Any] = {
        "n": len(tail),
        "ttft_ms": round(sf.percentile([1000 * (r.ttft or 0.0) for r in tail], 50), 1),
    }
    for part in ("intake", "queue", "engine"):
        shares = [
            times[r.id][f"{part}_ms"] / max(1e-9, 1000 * (r.ttft or 0.0))
            for r in tail
            if times[r.id].get(f"{part}_ms") is not None
        ]
        out[f"{part}_share"] = round(sf.percentile(shares, 50), 3) if shares else None
    return out


async def _one(
    http: aiohttp.ClientSession,
    stack: Stack,
    req: ServingRequest,
    t0: float,
    stop: asyncio.Event | None = None,
) -> sf.Result | None:
    delay = t0 + req.arrival_s - time.monotonic()
    if stop is None:
        await asyncio.sleep(max(0.0, delay))
    elif delay > 0:
        with contextlib.suppress(asyncio.TimeoutError):  # the arrival time came
            await asyncio.wait_for(stop.wait(), delay)
    if stop is not None and stop.is_set():
        return None  # the scenario ended its arrivals early: never sent
    sent = time.monotonic()
    first = None
    usage: dict[str, Any] = {}
    error = None
    try:
        path = "/chat/completions" if req.prompt_ids is None else "/completions"
        async with http.post(stack.base + path, json=stack.body(req)) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"])[:200]
                        break
                    if first is None and any(
                        (c.get("delta") or {}).get("content") or c.get("text")
                        for c in chunk.get("choices", [])
                    ):
                        first = time.monotonic()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: JSON
        error = f"{type(e).__name__}: {e}"[:200]
    done = time.monotonic()
    out = int(usage.get("completion_tokens") or 0)
    if error is None and out < req.max_tokens:
        error = f"short output: {out} of {req.max_tokens} tokens"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return sf.Result(
        id=req.id,
        lane=req.lane,
        sent_s=sent - t0,
        first_token_s=(first or done) - t0 if error is None else None,
        end_s=done - t0 if error is None else None,
        output_tokens=out,
        ok=error is None,
        error=error,
        prompt_tokens=int(usage.get("prompt_tokens") or req.prompt_tokens),
        cached_tokens=int(cached),
    )


async def replay(
    stack: Stack, reqs: list[ServingRequest], drain_s: float, during: Any = None
) -> tuple[list[sf.Result], float, set[str]]:
    """Send every request at its arrival time; results of those done within drain_s of the
    last arrival (the rest are lost). `during(t0, stop)`: a coroutine run beside (faults);
    setting `stop` ends the arrivals early: the ids of requests never sent are returned.

    The client is aiohttp, as `vllm bench serve`'s: with a few hundred streams open, httpx's
    per-chunk cost held a new request for ~0.6 s on 2 cores that engines keep busy (aiohttp: ~5 ms),
    which counted in every stack's time to first token."""
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)  # no cap: an open-loop client
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=1 << 20
    ) as http:
        t0 = time.monotonic()
        stack.wall0 = time.time()
        tasks = {r.id: asyncio.create_task(_one(http, stack, r, t0, stop)) for r in reqs}
        side = asyncio.create_task(during(t0, stop)) if during else None
        last = max((r.arrival_s for r in reqs), default=0.0)
        done, pending = set(), set()
        if tasks:  # a short burst may draw no arrival at all
            done, pending = await asyncio.wait(tasks.values(), timeout=last + drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if side is not None:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
    unsent = {i for i, t in tasks.items() if t in done and t.result() is None}
    return [r for t in done if (r := t.result()) is not None], t0, unsent


# -- scenarios --------------------------------------------------------------------------


@dataclass
class Run:
    scenario: str
    offered_req_s: float
    results: list[sf.Result]
    expected: dict[str, str]
    cpu_s: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)


def slos_from(path: str) -> tuple[dict[str, sf.Slo], dict[str, sf.Slo] | None]:
    """The SLOs of an earlier run (its out.json), and its trace's if it had them, so that a
    later one, on fewer stacks, is judged by the same targets."""
    lines = Path(path).read_text().strip().splitlines()
    try:
        out = json.loads(lines[-1])
        got, trace = out["slos"], out.get("trace_slos")
        return (
            {lane: sf.Slo(**got[lane]) for lane in (INTERACTIVE, BATCH)},
            {INTERACTIVE: sf.Slo(**trace[INTERACTIVE])} if trace else None,
        )
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"--slos-from {path}: no SLOs of a finished run there ({e!r})") from None


def one_at_a_time(stack: Stack, reqs: list[ServingRequest], ids: list[str]) -> list[sf.Result]:
    """Each request sent alone once the one before has ended (nothing waits), as `ids`."""
    results: list[sf.Result] = []
    for r, rid in zip(reqs, ids, strict=True):
        one = ServingRequest(**{**asdict(r), "arrival_s": 0.0, "id": rid})
        results += asyncio.run(replay(stack, [one], 300))[0]
    return results


class Bench:
    def __init__(self, a: argparse.Namespace, spec: EngineSpec, work: Path) -> None:
        self.a, self.spec, self.work = a, spec, work
        self.tokens = Tokens(spec.model)
        self.capacity: float | None = a.capacity
        self.slos: dict[str, sf.Slo] | None = None
        self.trace_slos: dict[str, sf.Slo] | None = None  # the trace scenario's own
        if a.slos_from:
            self.slos, self.trace_slos = slos_from(a.slos_from)
        self.idle: dict[str, Any] = {}
        # requests one at a time on the idle stack; the flood's shortest run (enough
        # interactive requests for a p99); how long arrivals go on once an added engine
        # carries load
        self.idle_n, self.flood_min_s, self.add_after_s = (
            (4, 0.0, 1.0) if a.smoke else (10, 40.0, 10.0)
        )

    def config(self, **kw: Any) -> WorkloadConfig:
        lo, hi = map(int, self.a.prompt.split("-"))
        olo, ohi = map(int, self.a.output.split("-"))
        base = dict(
            seed=self.a.seed,
            duration_s=self.a.duration,
            burstiness=self.a.burstiness,
            min_prompt=lo,
            max_prompt=hi,
            min_output=olo,
            max_output=ohi,
        )
        return WorkloadConfig(**{**base, **kw})

    def workload(self, name: str, cfg: WorkloadConfig) -> list[ServingRequest]:
        reqs = generate(cfg, self.tokens)
        for r in reqs:  # ids unique across scenarios: records are matched to requests by id
            r.id = f"{name}-{r.id}"
        write_jsonl(self.work / f"{name}.jsonl", reqs)  # what every stack replays
        return reqs

    def measure(
        self, stack: Stack, scenario: str, reqs: list[ServingRequest], rate: float, during=None
    ) -> tuple[Run, float]:
        before, client = stack.cpu(), client_cpu_s()
        results, t0, unsent = asyncio.run(replay(stack, reqs, self.a.drain, during))
        cpu = cpu_used(before, stack.cpu())
        cpu["load_generator"] = round(client_cpu_s() - client, 2)
        expected = {r.id: r.lane for r in reqs if r.id not in unsent}
        extra = {**stack.extra(), "client_late_ms": client_late_ms(reqs, results)}
        waits = getattr(stack, "queue_waits", {})
        for r in results:  # the gateway's intake: from the send to the job's record
            if r.id in waits:
                created = waits[r.id]["created_ms"] or 0
                waits[r.id]["intake_ms"] = round(created - 1000 * (stack.wall0 + r.sent_s))
        if waits:
            extra["slowest_interactive"] = slowest_share(results, waits)
        run = Run(scenario, round(rate, 3), results, expected, cpu, extra)
        with open(stack.logs / f"{scenario}.results.jsonl", "w") as f:
            for r in sorted(results, key=lambda x: x.id):
                f.write(json.dumps({**asdict(r), **waits.get(r.id, {})}) + "\n")
        ok = sum(r.ok for r in results)
        sent = len(expected)
        print(f"  {stack.name} {scenario} @ {rate:.2f} req/s: {ok}/{sent} ok", file=sys.stderr)
        return run, t0

    # the scenarios; each returns the runs it made

    def run_idle(self, stack: Stack) -> list[Run]:
        cfg = self.config(rate=1.0, duration_s=12.0, batch_share=0.3)
        reqs = self.workload("idle", cfg)
        ids = [f"idle{i}" for i in range(self.idle_n)]
        results = one_at_a_time(stack, reqs[: self.idle_n], ids)
        lanes = {
            lane: sf.latency([r for r in results if r.lane == lane])
            for lane in (INTERACTIVE, BATCH)
        }
        self.idle[stack.name] = lanes
        if self.slos is None:  # from the first stack
            a = self.a
            interactive = [r for r in results if r.lane == INTERACTIVE]
            slos = sf.slos_from_idle(interactive, a.slo_ttft, a.slo_tpot)
            batch = [r.e2e for r in results if r.lane == BATCH and r.e2e is not None]
            e2e = sf.percentile(batch, 50) if batch else float("nan")
            slos[BATCH] = sf.Slo(e2e_s=None if math.isnan(e2e) else a.slo_batch_e2e * e2e)
            slos.setdefault(INTERACTIVE, sf.Slo())
            self.slos = slos
        return []

    def warm_up(self, stack: Stack) -> None:
        """A burst of --warmup requests per engine, not measured, before anything is: a
        fresh engine's first batches of new shapes stall for seconds (kernels built for
        them), which would land on whichever run comes first. The same seeded burst on
        every stack, so their caches still see the same history."""
        n = self.a.warmup * stack.k
        if n > 0:
            results = self.burst(stack, "warmup", n, self.a.seed + 1000)
            print(f"  warm-up: {sum(r.ok for r in results)}/{len(results)} ok", file=sys.stderr)

    def burst(self, stack: Stack, name: str, n: int, seed: int) -> list[sf.Result]:
        """n requests of the mixed workload sent at once (100 per second), unmeasured."""
        cfg = self.config(rate=100.0, duration_s=n / 100.0, seed=seed)
        return asyncio.run(replay(stack, self.workload(name, cfg), 600))[0]

    def calibrate(self, stack: Stack) -> None:
        """Capacity: completed requests/s of a saturating burst of the mixed workload, while
        it saturates (sf.saturated_rate)."""
        results = self.burst(stack, "calibrate", max(16, 12 * stack.k), self.a.seed)
        ends = [r.end_s for r in results if r.ok and r.end_s is not None]
        self.capacity = round(sf.saturated_rate(ends), 3) if ends else 0.1
        print(f"  capacity {self.capacity} req/s ({len(ends)} requests)", file=sys.stderr)

    def run_sweep(self, stack: Stack, rep: int = 0) -> list[Run]:
        """Round `rep` of the sweep: every load once, with the round's seeds."""
        assert self.capacity is not None
        runs = []
        for i, scale in enumerate(self.a.scales):
            seed = self.a.seed + 1 + i + 1000 * rep
            cfg = self.config(rate=self.capacity, scale=scale, seed=seed)
            name = f"sweep@{scale}" + (f"#{rep}" if rep else "")
            reqs = self.workload(name.replace("@", "-"), cfg)
            runs.append(self.measure(stack, name, reqs, cfg.offered_rate)[0])
        return runs

    def trace_workload(
        self, name: str, rate: float, n: int, skip: int = 0, seed: int = 0
    ) -> list[ServingRequest]:
        """The trace's requests `skip` to `skip + n`, replayed at `rate` (bench/
        trace_replay.py); all interactive (its conversations), each a completion of its
        token ids. `seed` draws the blocks' tokens: runs of another seed share no prefix."""
        vocab = len(self.tokens.tokenizer)
        entries = read_trace(self.a.trace, limit=n, skip=skip)
        if len(entries) < n:
            raise SystemExit(f"--trace {self.a.trace}: {skip + n} requests needed, fewer there")
        got = replay_trace(entries, vocab, self.a.trace_scale, rate, seed=seed)
        hi = int(self.a.prompt.split("-")[1])
        ohi = int(self.a.output.split("-")[1])
        for r in got:  # within the context the stacks' engines were started with
            r.prompt_ids, r.max_tokens = r.prompt_ids[:hi], min(r.max_tokens, ohi)
        reqs = [
            ServingRequest(
                id=f"{name}-{i}",
                arrival_s=r.arrival_s,
                lane=INTERACTIVE,
                kind="trace",
                messages=[],
                max_tokens=r.max_tokens,
                prompt_tokens=len(r.prompt_ids),
                prompt_ids=r.prompt_ids,
            )
            for i, r in enumerate(got)
        ]
        write_jsonl(self.work / f"{name}.jsonl", reqs)
        return reqs

    def trace_n(self) -> int:
        """Requests of a trace run: as many as --duration holds at the capacity."""
        assert self.capacity is not None
        return max(2, round(self.capacity * self.a.duration))

    def run_trace(self, stack: Stack, rep: int = 0) -> list[Run]:
        """Round `rep` of the trace at every load of --scales: every load replays the same
        requests, only faster or slower, and round r the trace's r-th window of them (past
        the idle run's). Each load's blocks are drawn afresh (their sharing the trace's),
        so that no load finds the prefixes of the one before in the engines' caches."""
        assert self.capacity is not None
        runs = []
        n = self.trace_n()
        for i, scale in enumerate(self.a.scales):
            name = f"trace@{scale}" + (f"#{rep}" if rep else "")
            rate = self.capacity * scale
            file = name.replace("@", "-").replace("#", "-")
            seed = 1 + rep * len(self.a.scales) + i  # (the idle requests': 0)
            reqs = self.trace_workload(file, rate, n, skip=self.idle_n + rep * n, seed=seed)
            runs.append(self.measure(stack, name, reqs, rate)[0])
        return runs

    def run_trace_idle(self, stack: Stack) -> None:
        """The trace's first requests one at a time: its SLOs (the mixed workload's do not
        fit prompts of another length), the same multiples of the idle figures."""
        reqs = self.trace_workload("trace-idle", 1.0, self.idle_n)
        results = one_at_a_time(stack, reqs, [r.id for r in reqs])
        self.idle.setdefault(stack.name, {})["trace"] = sf.latency(results)
        if self.trace_slos is None:
            self.trace_slos = sf.slos_from_idle(results, self.a.slo_ttft, self.a.slo_tpot)

    def run_flood(self, stack: Stack) -> list[Run]:
        assert self.capacity is not None
        base = self.config(rate=self.capacity, scale=0.5, seed=self.a.seed + 100)
        base.batch_share = 0.0  # steady interactive traffic; the batch comes as the flood
        base.duration_s = max(base.duration_s, self.flood_min_s)
        cfg = flood_scenario(**asdict(base))
        cfg.flood_requests = self.a.flood or max(20, round(self.capacity * cfg.duration_s))
        cfg.flood_at_s = cfg.duration_s / 3
        reqs = self.workload("flood", cfg)
        return [self.measure(stack, "flood", reqs, cfg.offered_rate)[0]]

    def run_add(self, stack: Stack) -> list[Run]:
        assert self.capacity is not None
        # arrivals go on until 10 s after the new engine carries load (a router sends it new
        # requests only), at most --add-wait s after it was started: the same for every
        # stack (an engine started on cores its peers keep busy takes minutes)
        at = self.a.duration / 3
        span = at + self.a.add_wait + self.add_after_s
        cfg = self.config(rate=self.capacity, scale=1.2, seed=self.a.seed + 200, duration_s=span)
        reqs = self.workload("add", cfg)
        times: dict[str, float | None] = {"started_s": None, "ready_s": None, "first_load_s": None}

        async def add(t0: float, stop: asyncio.Event) -> None:
            await asyncio.sleep(at)
            times["started_s"] = time.monotonic() - t0
            p = stack.add_engine()
            i = len(stack.engines) - 1
            loop = asyncio.get_running_loop()
            give_up = t0 + span + self.a.drain
            while time.monotonic() < give_up and p.poll() is None:
                if isinstance(stack, PluraiStack):
                    ready = p.pid in await loop.run_in_executor(None, stack.serving)
                else:
                    try:
                        ready = (
                            await loop.run_in_executor(
                                None, lambda: httpx.get(stack.engine_url(i) + "/health", timeout=2)
                            )
                        ).status_code == 200
                    except httpx.HTTPError:
                        ready = False
                if ready:
                    times["ready_s"] = time.monotonic() - t0
                    if isinstance(stack, RouterStack):
                        await loop.run_in_executor(None, stack.join, i)
                    break
                await asyncio.sleep(0.2)
            key = p.pid if isinstance(stack, PluraiStack) else i
            while times["ready_s"] is not None and time.monotonic() < give_up:
                if await loop.run_in_executor(None, stack.carries_load, key):
                    times["first_load_s"] = time.monotonic() - t0
                    await asyncio.sleep(self.add_after_s)
                    stop.set()
                    return
                await asyncio.sleep(0.2)

        run, _ = self.measure(stack, "add", reqs, cfg.offered_rate, add)
        r, f = times["ready_s"], times["first_load_s"]
        run.extra["add"] = {
            "offered_s": round(span, 1),
            **times,
            "ready_to_load_s": None if r is None or f is None else round(f - r, 2),
        }
        return [run]

    def run_kill(self, stack: Stack) -> list[Run]:
        assert self.capacity is not None
        cfg = self.config(rate=self.capacity, scale=0.5, seed=self.a.seed + 300)
        reqs = self.workload("kill", cfg)
        at = self.a.duration / 3

        async def kill(t0: float, stop: asyncio.Event) -> None:
            await asyncio.sleep(at)
            stack.kill_engine(0)

        run, _ = self.measure(stack, "kill", reqs, cfg.offered_rate, kill)
        run.extra["kill"] = {"at_s": round(at, 2), "recovery_s": recovery_s(run.results, at)}
        return [run]


def recovery_s(results: list[sf.Result], at: float, window: float = 3.0) -> float | None:
    """Seconds from `at` (a kill) to the first completion of the first `window` after it
    whose completions per second are back to 80% of the rate before `at`; None: never
    within the run."""
    ends = sorted(r.end_s for r in results if r.ok and r.end_s is not None)
    before = sum(1 for e in ends if 0 < e <= at) / at if at > 0 else 0.0
    if before <= 0 or not ends:
        return None
    t = at + window
    while t <= ends[-1] + window:
        inside = [e for e in ends if t - window < e <= t]
        if len(inside) / window >= 0.8 * before:
            return round(max(0.0, inside[0] - at), 2)
        t += 0.25
    return None


# -- the report -------------------------------------------------------------------------


def run_figures(run: Run, slos: dict[str, sf.Slo]) -> dict[str, Any]:
    return {
        "offered_req_s": run.offered_req_s,
        **sf.stack_figures(run.results, slos, run.expected),
        "cpu_s": run.cpu_s,
        **run.extra,
    }


def loads(
    rs: list[Run], scenario: str, slos: dict[str, sf.Slo], good_key: str, share_key: str
) -> dict[str, Any]:
    """Goodput over a scenario's loads, and each load's attainment (a load's repeats pooled,
    over every request sent at that rate). With --repeats, goodput is each round's own
    (`<good_key>_rounds`) and their median."""
    pooled: dict[float, list[sf.Result]] = {}
    offered: dict[float, int] = {}
    by_round: dict[int, list[Run]] = {}
    for r in rs:
        if r.scenario.startswith(f"{scenario}@"):
            pooled.setdefault(r.offered_req_s, []).extend(r.results)
            offered[r.offered_req_s] = offered.get(r.offered_req_s, 0) + len(r.expected)
            by_round.setdefault(int(r.scenario.partition("#")[2] or 0), []).append(r)
    rounds = [
        sf.goodput(
            [(r.offered_req_s, r.results) for r in runs],
            slos,
            offered={r.offered_req_s: len(r.expected) for r in runs},
        )
        for _, runs in sorted(by_round.items())
    ]
    good = median_of(rounds)
    out: dict[str, Any] = {
        good_key: good,
        share_key: {
            str(rate): round(sf.attainment(res, slos, offered[rate]), 4)
            for rate, res in sorted(pooled.items())
        },
    }
    if len(rounds) > 1:
        out[f"{good_key}_rounds"] = rounds
    return out


def median_of(values: list[float | None]) -> float | None:
    """The median, a round that met no SLO at any load counted as 0; None if none did."""
    if all(v is None for v in values):
        return None
    return round(statistics.median(v or 0.0 for v in values), 4)


def summary(
    runs: dict[str, list[Run]], slos: dict[str, sf.Slo], trace_slos: dict[str, sf.Slo]
) -> dict[str, Any]:
    """Per stack: every run's figures, goodput over the sweep and the trace (by the
    trace's own SLOs), and the target figures."""
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        by = {r.scenario: r for r in rs}
        s: dict[str, Any] = {
            **loads(rs, "sweep", slos, "goodput_req_s", "sweep_attainment"),
            "runs": {
                k: run_figures(v, trace_slos if k.startswith("trace@") else slos)
                for k, v in by.items()
            },
        }
        if any(r.scenario.startswith("trace@") for r in rs):
            s.update(loads(rs, "trace", trace_slos, "trace_goodput_req_s", "trace_attainment"))
            computed = [
                f["all"].get("computed_tokens")
                for k, f in s["runs"].items()
                if k.startswith("trace@")
            ]
            s["trace_prefill_computed_tokens"] = sum(c for c in computed if c is not None)
        if "flood" in by:
            p99 = s["runs"]["flood"][INTERACTIVE]["ttft_p99_ms"]
            s["flood_interactive_ttft_p99_s"] = None if p99 is None else round(p99 / 1000, 3)
        if "kill" in by:
            k = s["runs"]["kill"]["all"]
            s["kill_failed"], s["kill_lost"] = k["failed"], k["lost"]
            s["kill_recovery_s"] = by["kill"].extra["kill"]["recovery_s"]
        if "add" in by:
            s["add_ready_to_load_s"] = by["add"].extra["add"]["ready_to_load_s"]
        computed = [f["all"].get("computed_tokens") for f in s["runs"].values()]
        s["prefill_computed_tokens"] = sum(c for c in computed if c is not None)
        out[name] = s
    return out


def ratios(stacks: dict[str, Any], ours: str = "plurai-vllm") -> dict[str, Any]:
    """Ours against the best router policy on each target figure."""
    routers = {k: v for k, v in stacks.items() if not k.startswith("plurai-")}
    if ours not in stacks or not routers:
        return {}
    me = stacks[ours]

    def best(key: str, high: bool) -> tuple[str, Any] | None:
        vals = [(k, v.get(key)) for k, v in routers.items() if v.get(key) is not None]
        vals = [(k, v) for k, v in vals if not (isinstance(v, float) and math.isnan(v))]
        if not vals:
            return None
        return max(vals, key=lambda x: x[1]) if high else min(vals, key=lambda x: x[1])

    out: dict[str, Any] = {}
    for key, high, target in (
        ("goodput_req_s", True, ">= 1.3"),
        ("trace_goodput_req_s", True, ">= 1.3"),
        ("flood_interactive_ttft_p99_s", False, "<= 0.5"),
        ("prefill_computed_tokens", False, "<= 1.0"),
        ("trace_prefill_computed_tokens", False, "<= 0.9"),
    ):
        b, mine = best(key, high), me.get(key)
        if b is None or mine is None or not b[1]:
            continue
        out[key] = {"ratio": round(mine / b[1], 3), "best_router": b[0], "target": target}
        per = round_ratios(me, routers, f"{key}_rounds")
        if per:  # each round's against that round's best router: their median and spread
            out[key] |= {"ratio": median_of(per), "rounds": per, "spread": [min(per), max(per)]}
    if "kill_failed" in me:
        out["kill_failed_or_lost"] = {
            "plurai": me["kill_failed"] + me["kill_lost"],
            **{k: v.get("kill_failed", 0) + v.get("kill_lost", 0) for k, v in routers.items()},
            "target": "0 for plurai",
        }
    if "add_ready_to_load_s" in me:
        out["add_ready_to_load_s"] = {
            "plurai": me["add_ready_to_load_s"],
            **{k: v.get("add_ready_to_load_s") for k, v in routers.items()},
            "target": "<= 5 s",
        }
    return out


def round_ratios(me: dict[str, Any], routers: dict[str, Any], key: str) -> list[float]:
    """Per round of --repeats, our goodput over the best router's in that round."""
    mine = me.get(key) or []
    out = []
    for i, g in enumerate(mine):
        theirs = [v[key][i] for v in routers.values() if len(v.get(key) or []) > i]
        best = max((t for t in theirs if t is not None), default=None)
        if best:
            out.append(round((g or 0.0) / best, 3))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    print(json.dumps(out))


if __name__ == "__main__":
    main()
