"""Queue overhead: the same workload offline through the engine and end to end through
Redis with one worker; and the enqueue rate of submit_many beside a plain XADD peer.

    python bench/queue_overhead.py [--model DIR] [--jobs 200] [--enqueue 20000]
        [--cost-model DIR] [--cost-jobs 200] [--parts e2e,enqueue,cost] [--smoke]

Redis cost: commands per job and per generated token (INFO commandstats; the slope between
jobs of 16 and 64 tokens) on the tiny model, whose fast steps are where a GPU fleet is
heading, with the stream's default holding of tokens and with one write per token
(PLURAI_STREAM_FLUSH_TOKENS=1); TTFT p50 as Redis saw it (jobs sent one at a time to an
idle worker, and the burst of --cost-jobs); whether every stream spells its record's text.

Peer for the enqueue rate: `redis-benchmark -t xadd` when redis-benchmark is on PATH;
otherwise raw pipelined XADD from redis-py with the same entry fields (said in the output).
Both rates come with the CPU time per job of the client and of Redis (INFO cpu): where the
machine's cores are busy with other work, the client and Redis cannot run at once and the
rates follow the sum of the two.
The last line is one JSON object of measured figures and ratios. --smoke: every part
with a few jobs on the smoke runs' tiny model (random weights, for the cost runs too): a
check that the bench runs, not a measurement.

One file, though long: its three parts share one Redis, one model and the JSON line.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import add_smoke_arg, json_line, smoke_model  # noqa: E402
from plurai.broker_config import (  # noqa: E402
    fastpipe,  # noqa: E402
    keys,
    protocol,
)
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.broker_config.stats import serving_workers  # noqa: E402
from plurai.producer.client import Client  # noqa: E402

PARTS = ("e2e", "enqueue", "cost")
WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()


def workload(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 96))),
            "max_tokens": rng.randint(16, 96),
            "temperature": 0.0,
            "ignore_eos": True,
            "lane": rng.choice(["interactive", "standard", "batch"]),
        }
        for _ in range(n)
    ]


def engine_args(a: argparse.Namespace) -> dict:
    return {"kv_cache_bytes": a.kv_bytes, "threads": a.threads}


def offline(a: argparse.Namespace, reqs: list[dict]) -> dict:
    from plurai.gpu_workers.engine.config import EngineConfig
    from plurai.gpu_workers.engine.engine import Engine
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=a.model, **engine_args(a)))
    engine.generate(["warm up the engine"], SamplingParams(max_tokens=8))
    params = [
        SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in reqs
    ]
    t = time.perf_counter()
    out = engine.generate([r["prompt"] for r in reqs], params)
    dt = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in out)
    del engine, out
    gc.collect()
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def end_to_end(a: argparse.Namespace, url: str, reqs: list[dict]) -> dict:
    extra = [x for k, v in engine_args(a).items() for x in ("--engine", f"{k}={v}")]
    worker = start_worker(a.model, url, {}, extra)
    try:
        client = Client(url)
        t = time.perf_counter()
        jobs = client.submit_many(reqs)
        recs = client.wait_all(jobs, timeout=3600)
        dt = time.perf_counter() - t
        assert all(r.state == "completed" for r in recs), {r.state for r in recs}
        tokens = sum(r.output_tokens or 0 for r in recs)
        return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}
    finally:
        worker.terminate()
        worker.wait(timeout=120)


def enqueue(url: str, n: int) -> dict:
    client = Client(url)
    reqs = [
        {
            "prompt": f"Summarize document {i}: the quick brown fox jumps over the lazy dog.",
            "max_tokens": 64,
            "lane": "batch",
            "temperature": 0.0,
        }
        for i in range(n)
    ]
    client.redis.flushall()
    cpu = CPU(client.redis)
    t = time.perf_counter()
    client.submit_many(reqs)
    sdk = n / (time.perf_counter() - t)
    sdk_cpu = cpu.per_job(n)

    # The peer: the same entries (same fields, same body size) as bare XADDs.
    body = protocol.encode_body({"prompt": reqs[0]["prompt"], "temperature": 0.0})
    stream = keys.request_stream("batch")
    bench = shutil.which("redis-benchmark")
    client.redis.flushall()
    peer_cpu = {}  # redis-benchmark: another process
    if bench:
        port = re.search(r":(\d+)/", url).group(1)  # type: ignore[union-attr]
        # redis-benchmark has no built-in XADD test; give it the entry itself: the same
        # fields and a body of the same size, 1000 commands per pipeline
        xadd = [
            "XADD",
            stream,
            "MAXLEN",
            "~",
            "1000000",
            "*",
            "v",
            "1",
            "id",
            "__rand_int__",
            "priority",
            "0",
            "lane",
            "batch",
            "prompt_tokens",
            "20",
            "max_tokens",
            "64",
            "content_type",
            protocol.MSGPACK,
            "body",
            "x" * len(body),
        ]
        out = subprocess.run(
            [bench, "-p", port, "-n", str(n), "-P", "1000", "-r", "100000000", "-q", *xadd],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        m = re.findall(r"([\d.]+) requests per second", out)
        if not m:
            raise SystemExit(f"could not read redis-benchmark's output: {out[-300:]!r}")
        peer, peer_name = float(m[-1]), "redis-benchmark XADD (same fields, -P 1000)"
    else:
        pipe = client.redis.pipeline(transaction=False)
        cpu = CPU(client.redis)
        t = time.perf_counter()
        for i in range(n):
            pipe.xadd(
                stream,
                {
                    "v": "1",
                    "id": protocol.new_job_id(),
                    "priority": 0,
                    "lane": "batch",
                    "prompt_tokens": 20,
                    "max_tokens": 64,
                    "content_type": protocol.MSGPACK,
                    "body": body,
                },
                maxlen=1_000_000,
                approximate=True,
            )
            if i % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        peer, peer_name = (
            n / (time.perf_counter() - t),
            "redis-py pipelined XADD (redis-benchmark not found)",
        )
        peer_cpu = cpu.per_job(n)
    # The wire ceiling for one Python process: pre-encoded XADDs, written in bulk.
    client.redis.flushall()
    t = time.perf_counter()
    cmds = [
        fastpipe.pack(
            [
                "XADD",
                stream,
                "MAXLEN",
                "~",
                1_000_000,
                "*",
                "v",
                "1",
                "id",
                protocol.new_job_id(),
                "body",
                body,
            ]
        )
        for _ in range(n)
    ]
    for i in range(0, n, 5000):
        fastpipe.run(client.redis, cmds[i : i + 5000])
    raw = n / (time.perf_counter() - t)
    client.close()
    return {
        "submit_many_jobs_per_s": sdk,
        "peer_xadd_per_s": peer,
        "peer": peer_name,
        "raw_packed_xadd_per_s": raw,
        "submit_many_cpu_us_per_job": sdk_cpu,
        "peer_cpu_us_per_job": peer_cpu,
    }


class CPU:
    """CPU time spent from now by this process (the client) and by Redis (INFO cpu): on a
    machine whose cores are busy with other work the two cannot overlap, and wall-clock
    rates say less than these."""

    def __init__(self, r) -> None:
        self.r = r
        self.client, self.redis = time.process_time(), self._redis()

    def _redis(self) -> float:
        info = self.r.info("cpu")
        return info["used_cpu_user"] + info["used_cpu_sys"]

    def per_job(self, n: int) -> dict:
        client, redis = time.process_time() - self.client, self._redis() - self.redis
        return {"client": round(1e6 * client / n, 1), "redis": round(1e6 * redis / n, 1)}


def start_worker(
    model: str, url: str, env: dict[str, str], extra: list[str] | None = None
) -> subprocess.Popen:
    """A worker process on `url`, once it has served a warm-up job."""
    cmd = [sys.executable, "-m", "plurai.cli", "worker", "--model", model, "--url", url]
    worker = subprocess.Popen(
        [*cmd, "--log-level", "WARNING", *(extra or [])],
        cwd=ROOT,
        env={**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1", **env},
    )
    client = Client(url)
    while not serving_workers(client.redis):
        if worker.poll() is not None:
            raise SystemExit("worker exited")
        time.sleep(0.1)
    client.submit("warm up the engine", max_tokens=8).result(timeout=120)
    client.close()
    return worker


def commands(r) -> int:
    return sum(v["calls"] for v in r.info("commandstats").values())


def cost_run(url: str, n: int, max_tokens: int) -> dict:
    """n jobs of max_tokens through the running worker: Redis commands (INFO commandstats,
    every client's and the scripts' inner ones), tokens, TTFT as Redis saw it (the job's
    first delta entry, whose id is Redis's clock, less its created_ms), and whether every
    stream spells its record's text."""
    from plurai.results import records, tokens

    client = Client(url)
    reqs = [
        {
            "prompt": f"Note {i}: {' '.join(WORDS[: 4 + i % 9])}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "lane": "interactive",
        }
        for i in range(n)
    ]
    time.sleep(1.2)  # past a heartbeat, so its commands fall before the reset
    client.redis.config_resetstat()
    jobs = client.submit_many(reqs)
    recs = client.wait_all(jobs, timeout=600)
    used = commands(client.redis)
    assert all(r.state == "completed" for r in recs), {r.state for r in recs}
    ttft, spelled = [], True
    for rec in recs:
        entries = client.redis.xrange(keys.output(rec.id))
        ttft.append(first_delta_ms(client, rec.id))
        follower = tokens.TextFollower()
        got = "".join(
            follower.feed(ev) or ""
            for ev in tokens.Reader(rec.id).feed({keys.output(rec.id): entries})
        )
        spelled &= got == records.get(client.redis, rec.id).text
    client.close()
    return {
        "commands": used,
        "tokens": sum(r.output_tokens or 0 for r in recs),
        "ttft_ms": ttft,
        "streams_spell_results": spelled,
    }


def first_delta_ms(client: Client, job_id: str) -> int:
    """When the job's first delta reached Redis (its entry id is Redis's clock), less the
    job's created_ms."""
    from plurai.results import records

    entries = client.redis.xrange(keys.output(job_id))
    first = next(eid for eid, f in entries if f.get("type") == "delta")
    return int(first.split("-")[0]) - (records.get(client.redis, job_id).created_ms or 0)


def idle_ttft(url: str, n: int) -> list[int]:
    """TTFT of n jobs sent one at a time to the idle worker, in ms, as Redis saw it."""
    client = Client(url)
    out = []
    for i in range(n):
        job = client.submit(f"Note {i}: the river", max_tokens=16, lane="interactive")
        job.result(timeout=60)
        out.append(first_delta_ms(client, job.id))
    client.close()
    return out


def redis_cost(model: str, url: str, n: int, idle_jobs: int = 30) -> dict:
    """Redis commands per job and per generated token (the slope between jobs of 16 and of
    64 tokens), with the stream's default holding of tokens and with a write per token
    (PLURAI_STREAM_FLUSH_TOKENS=1, as before holding), on one worker."""
    out: dict = {}
    for name, env in (("held", {}), ("every_token", {"PLURAI_STREAM_FLUSH_TOKENS": "1"})):
        worker = start_worker(model, url, env)
        try:
            short, long = cost_run(url, n, 16), cost_run(url, n, 64)
            idle = sorted(idle_ttft(url, idle_jobs))
        finally:
            worker.terminate()
            worker.wait(timeout=120)
        slope = (long["commands"] - short["commands"]) / (long["tokens"] - short["tokens"])
        out[name] = {
            "commands_per_job_16_tokens": round(short["commands"] / n, 1),
            "commands_per_job_64_tokens": round(long["commands"] / n, 1),
            "commands_per_generated_token": round(slope, 3),
            "ttft_ms_p50_idle": idle[len(idle) // 2],
            "ttft_ms_p50_burst": sorted(short["ttft_ms"])[n // 2],
            "streams_spell_results": short["streams_spell_results"]
            and long["streams_spell_results"],
        }
        print(f"redis cost, {name}: {out[name]}", flush=True)
    return out


def e2e_part(a: argparse.Namespace) -> dict:
    """The workload offline through the engine, then end to end through Redis."""
    if not (Path(a.model) / "config.json").exists():
        from bench.workload import bench_model

        bench_model(a.model)
    reqs = workload(a.jobs)
    off = offline(a, reqs)
    print(
        f"offline:    {off['tokens']} tokens in {off['seconds']:.2f}s = "
        f"{off['tokens_per_s']:.1f} tokens/s"
    )
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        e2e = end_to_end(a, url, reqs)
    print(
        f"end to end: {e2e['tokens']} tokens in {e2e['seconds']:.2f}s = "
        f"{e2e['tokens_per_s']:.1f} tokens/s"
    )
    return {
        "model": Path(a.model).name,
        "jobs": a.jobs,
        "offline_tokens_per_s": round(off["tokens_per_s"], 1),
        "e2e_tokens_per_s": round(e2e["tokens_per_s"], 1),
        "e2e_vs_offline": round(e2e["tokens_per_s"] / off["tokens_per_s"], 3),
    }


def cost_part(a: argparse.Namespace) -> dict:
    """The Redis cost runs on the cost model, and their ratios."""
    if not (Path(a.cost_model) / "config.json").exists():
        from plurai.gpu_workers.models.factory import make_model

        make_model(Path(a.cost_model), family="llama", size="tiny", train=True)
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        cost = redis_cost(a.cost_model, url, a.cost_jobs, 3 if a.smoke else 30)
    held, every = cost["held"], cost["every_token"]
    return {
        "redis_cost_model": Path(a.cost_model).name,
        "redis_cost": cost,
        "commands_per_generated_token": held["commands_per_generated_token"],
        "commands_per_token_vs_every_token": round(
            held["commands_per_generated_token"] / every["commands_per_generated_token"], 3
        ),
        "ttft_p50_idle_vs_every_token": round(
            held["ttft_ms_p50_idle"] / max(every["ttft_ms_p50_idle"], 1), 3
        ),
        "ttft_p50_burst_vs_every_token": round(
            held["ttft_ms_p50_burst"] / max(every["ttft_ms_p50_burst"], 1), 3
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=str(ROOT / "models" / "bench-llama"),
        help="default: the ~46M-parameter benchmark Llama (made if missing)",
    )
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--enqueue", type=int, default=20000)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--kv-bytes", type=int, default=256 << 20)
    p.add_argument(
        "--cost-model",
        default=str(ROOT / "models" / "tiny-llama"),
        help="model of the Redis-cost runs: fast steps, as a GPU fleet's (made if missing)",
    )
    p.add_argument("--cost-jobs", type=int, default=200)
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which measurements, comma-separated (default: all): e2e (offline and end to "
        "end), enqueue (submit_many and its peer), cost (Redis commands, TTFT)",
    )
    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.model = a.cost_model = str(smoke_model())
        a.jobs, a.enqueue, a.cost_jobs, a.threads = 8, 200, 4, 1
    parts = set(a.parts.split(","))
    if not parts or parts - set(PARTS):
        p.error(f"--parts takes {', '.join(PARTS)}, got {a.parts!r}")
    result: dict = {"threads": a.threads, "cpus": os.cpu_count()}
    if "e2e" in parts:
        result.update(e2e_part(a))
    if "enqueue" in parts:
        with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
            enq = enqueue(url, a.enqueue)
        print(
            f"enqueue:    submit_many {enq['submit_many_jobs_per_s']:.0f} jobs/s; "
            f"{enq['peer']} {enq['peer_xadd_per_s']:.0f}/s; "
            f"raw packed XADD {enq['raw_packed_xadd_per_s']:.0f}/s; CPU µs per job "
            f"(client, Redis): submit_many {enq['submit_many_cpu_us_per_job']}, "
            f"peer {enq['peer_cpu_us_per_job']}"
        )
        result.update(
            {
                "submit_many_jobs_per_s": round(enq["submit_many_jobs_per_s"]),
                "peer_xadd_per_s": round(enq["peer_xadd_per_s"]),
                "peer": enq["peer"],
                "raw_packed_xadd_per_s": round(enq["raw_packed_xadd_per_s"]),
                "submit_many_vs_peer": round(
                    enq["submit_many_jobs_per_s"] / enq["peer_xadd_per_s"], 3
                ),
                "submit_many_cpu_us_per_job": enq["submit_many_cpu_us_per_job"],
                "peer_cpu_us_per_job": enq["peer_cpu_us_per_job"],
            }
        )
    if "cost" in parts:
        result.update(cost_part(a))
    json_line(result, a.smoke)


if __name__ == "__main__":
    main()
