"""The stacks the serving bench starts and stops: Plurai (a Redis, the gateway, K workers)
and the routers (K `vllm serve` behind `vllm-router`), each engine bound to its core; their
processes, CPU time and readiness.

One file, though long: the two kinds of stack share their processes' life (start, bind,
wait for, end, CPU time) and one interface the scenarios drive."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.serving import figures as sf
from bench.serving.workload import (
    BATCH,
    ServingRequest,
)
from plurai.broker_config import keys, stats
from plurai.broker_config.embedded import EmbeddedRedis, find_binary, free_port

ROOT = Path(__file__).resolve().parents[2]

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
            [sys.executable, "-m", "plurai.cli", "gateway", "--url", self.url, "--port", str(port)],
            self.logs / "gateway.log",
        )
        self.base = f"http://127.0.0.1:{port}/v1"
        for _ in range(self.k):
            self.add_engine()
        self.wait_ready([p.pid for p in self.engines], 600)
        wait_http(self.base.removesuffix("/v1") + "/health", [self.front], 60, self.logs)

    def engine_cmd(self, i: int) -> tuple[list[str], dict[str, str]]:
        s = self.spec
        cmd = [
            sys.executable,
            "-m",
            "plurai.cli",
            "worker",
            "--model",
            str(s.model),
            "--url",
            self.url,
        ]
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
