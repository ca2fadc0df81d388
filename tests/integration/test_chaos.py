"""Chaos: 300 streaming jobs while workers are SIGKILLed and restarted every few seconds and
Redis (append-only file, fsync always) is SIGKILLed and restarted once from its AOF.

What a client relies on, through all of it: every job has exactly one completed result,
its token stream exactly one `end` entry, and the stream's deltas after its last `reset`
(before the end) concatenate to exactly the record's text and token ids. Nothing stays
pending."""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.embedded import EmbeddedRedis
from plurai.producer.client import Client
from plurai.results import records

from .faults import FAST, LANES, drained, pending

pytestmark = pytest.mark.slow

JOBS = 300
MAX_TOKENS = 16
WORKERS = 3
KILL_EVERY_S = 2.5
MAX_KILLS = 8
REDIS_KILL_AT = 2  # Redis goes down after this many worker kills
GIVE_UP_S = 150.0
WAVE, WAVE_EVERY_S = 10, 0.5  # submitted over ~15 s
# At the default poison limit (5 failures): a run cut off by a kill at random, or by a
# lapsed lease, while it made progress is no failure of its job (test_faults_poison).
ENV = FAST


def stream_problems(r: redis.Redis, rec: records.JobRecord) -> list[str]:
    """What is wrong with one completed job's token stream against its record."""
    entries = [f for _, f in r.xrange(keys.output(rec.id))]
    types = [f.get(b"type") for f in entries]
    problems = []
    if types.count(b"end") != 1:
        problems.append(f"{types.count(b'end')} end entries")
    if not types or types[-1] != b"end":
        problems.append(f"the stream does not finish with its end entry: {types[-3:]}")
    if b"end" in types:
        end = entries[types.index(b"end")]
        if end.get(b"state") != b"completed":
            problems.append(f"end entry {end}")
    cut = max((i for i, t in enumerate(types) if t == b"reset"), default=-1)
    last = types.index(b"end") if b"end" in types else len(types)
    deltas = [f for f in entries[cut + 1 : last] if f.get(b"type") == b"delta"]
    text = "".join(f[b"text"].decode() for f in deltas)
    token_ids = [t for f in deltas for t in json.loads(f[b"token_ids"])]
    if text != rec.text:
        problems.append(f"deltas after the last reset give {text!r}, the record {rec.text!r}")
    if token_ids != rec.token_ids:
        problems.append(
            f"deltas after the last reset give tokens {token_ids}, the record {rec.token_ids}"
        )
    return [f"job {rec.id}: {p} (stream types: {b' '.join(types).decode()})" for p in problems]


def test_chaos(tmp_path, tiny_model, workers_class):
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    w = workers_class(url, tiny_model, tmp_path)
    rng = random.Random(3)
    r = redis.Redis.from_url(url, socket_timeout=5)
    try:
        r.config_set("appendfsync", "always")  # an accepted write is on disk before the reply
        w.start(WORKERS, env=ENV)
        client = Client(url)
        requests = [
            {
                "prompt": f"chaos job {i}: the river rose overnight",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
                "lane": LANES[i % 3],
            }
            for i in range(JOBS)
        ]
        ids: list[str] = []  # jobs are submitted a wave at a time, so the chaos meets them all

        ready: set[int] = {p.pid for p in w.procs}  # started by us and through start-up
        killed: set[int] = set()
        start_errors: list[str] = []
        starting: list[threading.Thread] = []

        def replace_one() -> None:
            try:
                (p,) = w.start(1, env=ENV)
                ready.add(p.pid)
            except Exception as e:  # reported below; the run may still complete
                start_errors.append(repr(e))

        kills = 0
        redis_restarted = False
        done = 0
        next_kill = time.monotonic() + KILL_EVERY_S / 2
        next_wave = time.monotonic()
        give_up = time.monotonic() + GIVE_UP_S
        while True:
            if len(ids) < JOBS and time.monotonic() >= next_wave:
                ids += [j.id for j in client.submit_many(requests[len(ids) : len(ids) + WAVE])]
                next_wave = time.monotonic() + WAVE_EVERY_S
            try:
                done = sum(rec.final for rec in records.get_many(r, ids))
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if done == JOBS:
                break
            if time.monotonic() > give_up:
                recs = records.get_many(r, ids)
                unfinished = [(rec.id, rec.state, rec.worker) for rec in recs if not rec.final]
                pytest.fail(
                    f"{len(unfinished)} of {JOBS} jobs unfinished after {GIVE_UP_S:.0f} s "
                    f"({kills} worker kills, redis restarted: {redis_restarted}): "
                    f"{unfinished[:20]}; pending {pending(r)}; start errors {start_errors}"
                )
            victims = [p for p in w.procs if p.poll() is None and p.pid in ready]
            if kills < MAX_KILLS and time.monotonic() >= next_kill and victims:
                victim = rng.choice(victims)
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                killed.add(victim.pid)
                kills += 1
                if kills == REDIS_KILL_AT:
                    for t in starting:  # no worker mid start-up while Redis is down
                        t.join()
                    assert server.proc is not None
                    server.proc.kill()  # no shutdown, no final save: only what the AOF holds
                    server.proc.wait()
                    time.sleep(1.0)
                    assert server.start() == url
                    r.config_set("appendfsync", "always")  # not kept in the AOF
                    redis_restarted = True
                t = threading.Thread(target=replace_one, daemon=True)
                t.start()
                starting.append(t)
                next_kill = time.monotonic() + KILL_EVERY_S
            time.sleep(0.1)
        for t in starting:
            t.join()

        assert redis_restarted and kills >= REDIS_KILL_AT, (
            f"the jobs finished before the chaos ({kills} kills): make the run longer"
        )
        recs = records.get_many(r, ids)
        states = {rec.id: (rec.state, rec.error_code, rec.error_message) for rec in recs}
        bad_states = {k: v for k, v in states.items() if v[0] != records.COMPLETED}
        assert not bad_states, (
            f"{len(bad_states)} jobs not completed: {list(bad_states.items())[:10]}"
        )
        short = [(rec.id, rec.output_tokens) for rec in recs if rec.output_tokens != MAX_TOKENS]
        assert not short, f"jobs without {MAX_TOKENS} tokens: {short[:10]}"
        problems = [p for rec in recs for p in stream_problems(r, rec)]
        assert not problems, f"{len(problems)} token-stream problem(s):\n" + "\n".join(
            problems[:30]
        )
        assert drained(r)
        crashed = [p.pid for p in w.procs if p.poll() is not None and p.pid not in killed]
        assert not crashed, f"workers died without being killed: {crashed}; see {tmp_path}"
        assert not start_errors, start_errors
    finally:
        w.stop()
        server.stop()
