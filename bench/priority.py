"""Interactive time to first token while the batch lane saturates the workers, beside the
same interactive requests on idle workers; with preemption (PLURAI_PREEMPT, the default)
and without it, each on fresh workers and a fresh Redis.

    python bench/priority.py [--model DIR] [--workers 1] [--requests 100] [--batch 200]

Each interactive request is submitted alone and timed from submit to its first token-stream
delta (`plurai:out:<id>`), one after another with a short pause. First on idle workers,
then again while a backlog of long batch jobs keeps every worker's KV cache full (one that
holds `--kv-jobs` batch jobs and leaves no room for an interactive one, so that without
preemption an interactive job waits for a batch job to finish; the backlog is checked to
outlast the measurement), then the backlog is
drained and the tokens the engines generated (their heartbeats' counts) are set against the
tokens the jobs delivered: a preempted batch job is handed over with its output (another
worker, or this one, resumes it), so none is made twice.
The model defaults to the tiny test Llama, made in a temporary folder. The last line is one
JSON object; the targets are loaded p99 <= 2x idle p99 and computed <= 1.05x delivered,
with preemption. --smoke: three interactive requests and twelve batch jobs on the smoke
runs' tiny model: a check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import add_smoke_arg, cpu_isa, json_line, smoke_model  # noqa: E402
from plurai.broker_config import keys  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.broker_config.stats import serving_workers, workers  # noqa: E402
from plurai.producer.client import Client  # noqa: E402
from plurai.results import tokens  # noqa: E402

BATCH_PROMPT_TOKENS = 64  # at most (59 with the tiny tokenizer), for "batch document N: " + WORDS
WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()


def interactive(n: int, max_tokens: int, words: int) -> list[dict]:
    return [
        {
            "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words + i % 24)),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "lane": "interactive",
        }
        for i in range(n)
    ]


def ttfts(client: Client, reqs: list[dict], pause_s: float) -> list[float]:
    """Seconds from submit to the first delta, one request at a time."""
    out = []
    for req in reqs:
        t = time.perf_counter()
        job = client.submit(**req)
        for ev in tokens.events(client.redis, job.id, block_ms=60000):
            if ev.type == tokens.DELTA:
                out.append(time.perf_counter() - t)
                break
            if ev.type == tokens.END:
                raise SystemExit(f"job {job.id} ended without a token: {job.record()}")
        job.result(timeout=120)
        time.sleep(pause_s)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict:
    return {"p50_ms": round(1000 * pct(xs, 0.5), 2), "p99_ms": round(1000 * pct(xs, 0.99), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local HF model dir; default: the tiny test Llama")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--requests", type=int, default=100, help="interactive requests per phase")
    p.add_argument("--batch", type=int, default=200, help="batch jobs in the backlog")
    p.add_argument("--batch-tokens", type=int, default=256, help="max_tokens of a batch job")
    p.add_argument(
        "--interactive-tokens",
        type=int,
        default=128,
        help="max_tokens of an interactive job (more than the KV cache a full worker has left)",
    )
    p.add_argument(
        "--interactive-words",
        type=int,
        default=8,
        help="words of an interactive prompt, plus 0-23 (about 3 tokens a word)",
    )
    p.add_argument("--pause", type=float, default=0.05, help="seconds between requests")
    p.add_argument(
        "--fill", type=float, default=2.0, help="seconds for the batch work to fill the workers"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--kv-jobs", type=int, default=8, help="batch jobs a worker's KV cache holds at once"
    )
    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.requests, a.batch, a.interactive_tokens, a.kv_jobs, a.fill = 3, 12, 16, 2, 0.5
        a.model = a.model or str(smoke_model())

    result: dict = {}
    with tempfile.TemporaryDirectory() as d:
        model = a.model
        if model is None:
            from plurai.gpu_workers.models.factory import make_model

            model = str(make_model(Path(d) / "tiny-llama", family="llama", size="tiny"))
        for preempt in (True, False):
            name = "preempt" if preempt else "no_preempt"
            print(f"-- {name}", flush=True)
            with EmbeddedRedis(Path(d) / f"redis-{name}") as url:
                result[name] = run(a, model, url, preempt)
    on, off = result["preempt"], result["no_preempt"]
    result.update(
        model=Path(model).name,
        workers=a.workers,
        requests=a.requests,
        target_p99_ratio=2.0,
        target_computed_ratio=1.05,
        p99_ratio=on["p99_ratio"],
        computed_ratio=on["computed_ratio"],
        p99_ratio_without_preemption=off["p99_ratio"],
        isa=cpu_isa(),
    )
    json_line(result, a.smoke)


def run(a: argparse.Namespace, model: str, url: str, preempt: bool) -> dict:
    cmd = [sys.executable, "-m", "plurai.cli", "worker", "--model", model, "--url", url]
    cmd += ["--grace", "0", "--log-level", "WARNING", "--engine", f"threads={a.threads}"]
    # a KV cache that a few batch jobs fill, with no room left for an interactive job
    per_job = -(-(BATCH_PROMPT_TOKENS + a.batch_tokens) // 16)
    cmd += ["--engine", "block_size=16", "--engine", f"num_kv_blocks={a.kv_jobs * per_job + 2}"]
    env = {
        **os.environ,
        "PLURAI_HEARTBEAT_INTERVAL_S": "1",
        "PLURAI_PREEMPT": "1" if preempt else "0",
    }
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env) for _ in range(a.workers)]
    try:
        client = Client(url)
        while serving_workers(client.redis) < a.workers:
            if any(proc.poll() is not None for proc in procs):
                raise SystemExit("a worker exited")
            time.sleep(0.1)
        reqs = interactive(a.requests, a.interactive_tokens, a.interactive_words)
        warm = reqs[:5]
        ttfts(client, warm, 0.0)  # warm up
        idle = ttfts(client, reqs, a.pause)
        print(f"idle:   {summary(idle)}", flush=True)

        batch = client.submit_many(
            [
                {
                    "prompt": f"batch document {i}: " + " ".join(WORDS),
                    "max_tokens": a.batch_tokens,
                    "ignore_eos": True,
                    "lane": "batch",
                }
                for i in range(a.batch)
            ]
        )
        time.sleep(a.fill)  # the workers fill up with batch work
        t = time.perf_counter()
        loaded = ttfts(client, reqs, a.pause)
        seconds = time.perf_counter() - t
        stream = keys.request_stream("batch")
        waiting = client.redis.xlen(stream) - client.redis.xpending(stream, keys.GROUP)["pending"]
        done = sum(rec.final for rec in client.records([j.id for j in batch]))
        print(f"loaded: {summary(loaded)}", flush=True)
        if waiting <= 0:
            print("warning: the batch backlog ran out; raise --batch", flush=True)
        for job in batch:  # the backlog drained: every token made is in a result
            job.result(timeout=600)
        time.sleep(2.5)  # a heartbeat after the last step
        now = int(client.redis.time()[0] * 1000)
        beats = workers(client.redis, now)[0]
        made = sum(w.generation_tokens for w in beats)
        moved = sum(w.jobs_handed_over for w in beats)
        jobs = client.records([j.id for j in batch])
        answered = a.interactive_tokens * (len(warm) + 2 * len(reqs))  # warm-up, idle, loaded
        delivered = sum(rec.output_tokens for rec in jobs) + answered
        result = {
            "idle": summary(idle),
            "loaded": summary(loaded),
            "p50_ratio": round(pct(loaded, 0.5) / pct(idle, 0.5), 3),
            "p99_ratio": round(pct(loaded, 0.99) / pct(idle, 0.99), 3),
            "batch_done_during_loaded_phase": done,
            "batch_still_waiting": waiting,
            "jobs_handed_over": moved,
            "loaded_phase_s": round(seconds, 2),
            "tokens_computed": made,
            "tokens_delivered": delivered,
            "computed_ratio": round(made / delivered, 4),
        }
        client.close()
        return result
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
