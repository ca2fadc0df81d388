"""Resuming under real faults, with worker processes whose engines count every token they
generate (tests/integration/counting_worker.py), so that tokens computed across all runs
can be set against tokens delivered:

- chaos: 200 streaming jobs of 256 tokens, three workers, one SIGKILLed every few seconds
  and replaced: every job one result whose stream spells it, and the work lost with the
  killed workers (made after their last write) stays small;
- drain: SIGTERM to a worker running 16 jobs of 256 tokens: it exits within 3 s and
  another worker finishes every job, computing nothing twice."""

from __future__ import annotations

import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from plurai.broker_config import keys
from plurai.producer.client import Client
from plurai.results import records

from .conftest import Workers
from .faults import FAST, LANES, drained, pending
from .test_chaos import stream_problems

pytestmark = pytest.mark.slow

MAX_TOKENS = 256


class CountingWorkers(Workers):
    command = [sys.executable, "-m", "tests.integration.counting_worker"]


def computed(log: Path) -> int:
    return sum(int(line) for line in log.read_text().split()) if log.exists() else 0


def stream_tokens(r: redis.Redis, job_id: str) -> int:
    return sum(
        len(json.loads(f[b"token_ids"]))
        for _, f in r.xrange(keys.output(job_id))
        if f[b"type"] == b"delta"
    )


def job(i: int, **over) -> dict:
    return {
        "prompt": f"job {i}: the river rose overnight and the town woke to water",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        **over,
    }


def test_chaos_resumes_jobs_of_killed_workers(redis_url, tiny_model, tmp_path):
    jobs, kill_every_s, max_kills, give_up_s = 200, 2.0, 6, 240.0
    log = tmp_path / "tokens.log"
    env = {**FAST, "PLURAI_MAX_DELIVERIES": "20", "PLURAI_TEST_TOKEN_LOG": str(log)}
    w = CountingWorkers(redis_url, tiny_model, tmp_path)
    r = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    rng = random.Random(5)
    try:
        ready = {p.pid for p in w.start(3, env=env)}  # through start-up: killable
        ids = [j.id for j in client.submit_many([job(i, lane=LANES[i % 3]) for i in range(jobs)])]
        kills, starting, errors = 0, [], []

        def replace_one() -> None:
            try:
                ready.update(p.pid for p in w.start(1, env=env))
            except Exception as e:  # reported below
                errors.append(repr(e))

        next_kill = time.monotonic() + kill_every_s
        give_up = time.monotonic() + give_up_s
        while sum(rec.final for rec in records.get_many(r, ids)) < jobs:
            assert time.monotonic() < give_up, f"unfinished after {give_up_s} s: {pending(r)}"
            alive = [p for p in w.procs if p.poll() is None and p.pid in ready]
            if kills < max_kills and time.monotonic() >= next_kill and len(alive) >= 2:
                rng.choice(alive).send_signal(signal.SIGKILL)
                kills += 1
                starting.append(threading.Thread(target=replace_one, daemon=True))
                starting[-1].start()
                next_kill = time.monotonic() + kill_every_s
            time.sleep(0.1)
        for t in starting:
            t.join()

        recs = records.get_many(r, ids)
        assert all(rec.state == records.COMPLETED for rec in recs)
        assert all(rec.output_tokens == MAX_TOKENS for rec in recs)
        problems = [p for rec in recs for p in stream_problems(r, rec)]
        assert not problems, "\n".join(problems[:20])
        # (a loaded machine starts replacements slowly: at least two kills hit running work)
        assert kills >= 2, f"the jobs finished before the chaos ({kills} kills)"
        assert drained(r) and not errors, errors
        delivered = jobs * MAX_TOKENS
        made = computed(log)
        print(
            f"chaos: {kills} kills, tokens computed {made}, delivered {delivered}, "
            f"ratio {made / delivered:.3f}"
        )
        assert delivered <= made <= 1.15 * delivered
    finally:
        client.close()
        w.stop()


def test_drain_hands_jobs_back_with_their_progress(redis_url, tiny_model, tmp_path):
    log = tmp_path / "tokens.log"
    env = {"PLURAI_TEST_TOKEN_LOG": str(log)}  # leases of a minute: nothing is reclaimed
    w = CountingWorkers(redis_url, tiny_model, tmp_path)
    r = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    try:
        (first,) = w.start(1, env=env)
        ids = [j.id for j in client.submit_many([job(i) for i in range(16)])]
        give_up = time.monotonic() + 60
        while True:  # every job running on the first worker, well into its output
            recs = records.get_many(r, ids)
            lengths = [stream_tokens(r, rec.id) for rec in recs]
            if all(rec.state == records.RUNNING for rec in recs) and min(lengths) >= 32:
                break
            assert not any(rec.final for rec in recs), "a job finished before the drain"
            assert time.monotonic() < give_up, f"jobs not running: {[x.state for x in recs]}"
            time.sleep(0.02)
        first.send_signal(signal.SIGSTOP)  # held mid-run while the second one starts
        w.start(1, env=env)
        first.send_signal(signal.SIGCONT)
        sent = time.monotonic()
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
        exit_s = time.monotonic() - sent
        give_up = time.monotonic() + 120
        while not all(rec.final for rec in records.get_many(r, ids)):
            assert time.monotonic() < give_up, "the other worker did not finish the jobs"
            time.sleep(0.1)
        recs = records.get_many(r, ids)
        assert all(rec.state == records.COMPLETED for rec in recs)
        assert all(rec.output_tokens == MAX_TOKENS for rec in recs)
        assert all(f"-{first.pid}-" not in rec.worker for rec in recs)  # all moved
        assert not [p for rec in recs for p in stream_problems(r, rec)]
        types = [f[b"type"] for rec in recs for _, f in r.xrange(keys.output(rec.id))]
        assert b"reset" not in types
        delivered, made = 16 * MAX_TOKENS, computed(log)
        print(f"drain: exit {exit_s:.2f} s, tokens computed {made}, delivered {delivered}")
        assert first.returncode == 0 and exit_s <= 3.0
        assert made <= 1.05 * delivered
    finally:
        client.close()
        for p in w.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        w.stop()
