"""Redis at its maxmemory (policy noeviction), on a real redis-server: submits through the
SDK and the gateway are refused with `redis_oom`; a worker whose job finishes while Redis
is full keeps the result, leaves the job's entry pending, and stores the result exactly
once when memory frees; every job queued before is completed, once. An evicting policy
stops a worker and a gateway at start; a Redis that refuses CONFIG GET does not."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import httpx
import pytest
import redis

from plurai.broker_config import keys, memory
from plurai.broker_config.connection import connect
from plurai.gpu_workers.writer import passing
from plurai.producer.client import Client
from plurai.producer.errors import QueueFull, RedisFull
from plurai.results import jobs, records

from .conftest import ROOT
from .faults import drained, final_records, pending
from .test_gateway import Gateway

FILLER = "test:filler"  # not a Plurai key: the test's own, to fill Redis with and free
LONG = 2000  # tokens of the job that finishes while Redis is full
SETTLE_S = 60.0  # most a step of the scenario may take (never a timing assertion)


def fill(r: redis.Redis) -> None:
    """Make Redis full: 16 MiB under FILLER (in pieces: one 16 MiB command would leave a
    query buffer that Redis frees a moment later), and its maxmemory 8 MiB below what it
    holds. Deleting FILLER frees it."""
    for _ in range(32):
        r.append(FILLER, b"x" * (512 << 10))
    r.config_set("maxmemory", r.info("memory")["used_memory"] - (8 << 20))


def until(what: str, check, timeout: float = SETTLE_S) -> None:
    give_up = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < give_up, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def stream_problems(r: redis.Redis, rec: records.JobRecord) -> list[str]:
    """One `end` entry, the last; the deltas after the last `reset` spell the record."""
    entries = [f for _, f in r.xrange(keys.output(rec.id))]
    types = [f[b"type"] for f in entries]
    if types.count(b"end") != 1 or types[-1] != b"end":
        return [f"job {rec.id}: stream types {types[-5:]}"]
    cut = max((i for i, t in enumerate(types) if t == b"reset"), default=-1)
    deltas = [f for f in entries[cut + 1 :] if f[b"type"] == b"delta"]
    text = "".join(f[b"text"].decode() for f in deltas)
    ids = [t for f in deltas for t in json.loads(f[b"token_ids"])]
    if text != rec.text or ids != rec.token_ids:
        return [f"job {rec.id}: its deltas do not spell its record"]
    return []


def test_full_redis_refuses_submits_and_keeps_results(workers, redis_url, tiny_model, tmp_path):
    r = redis.Redis.from_url(redis_url)
    r.config_set("maxmemory-policy", "noeviction")
    # one sequence at a time: the jobs queued behind the long one wait in their lane
    workers.start(1, "--engine", "max_num_seqs=1", "--log-level", "DEBUG")
    client = Client(redis_url)

    long = client.submit("Once upon a time", max_tokens=LONG, temperature=0, ignore_eos=True)
    until("the long job runs", lambda: r.exists(keys.output(long.id)))
    queued = client.submit_many(
        [{"prompt": f"Story {i}:", "max_tokens": 24, "lane": "batch"} for i in range(6)]
    )
    fill(r)

    # Submits are refused with the clear error, and leave nothing behind.
    with pytest.raises(RedisFull) as refused:
        client.submit("Hello", max_tokens=4)
    assert refused.value.code == "redis_oom" and isinstance(refused.value, QueueFull)
    assert "out of memory" in str(refused.value) and refused.value.retry_after > 0
    with pytest.raises(RedisFull) as many:
        client.submit_many([{"prompt": "a", "max_tokens": 4}, {"prompt": "b", "max_tokens": 4}])
    assert many.value.accepted == []

    # The gateway answers 503 with Retry-After, in OpenAI's error shape.
    gateway = Gateway(redis_url, tmp_path / "gateway.log")
    try:
        reply = httpx.post(
            gateway.base + "/v1/completions",
            json={"model": tiny_model.name, "prompt": "Hello", "max_tokens": 4},
            timeout=30,
        )
    finally:
        gateway.stop()
    assert reply.status_code == 503, reply.text
    assert int(reply.headers["Retry-After"]) >= 1
    assert reply.json()["error"]["code"] == "redis_oom"

    # The long job finishes in the engine while Redis is full: its result is kept, its
    # entry stays pending, nothing of it is stored. The jobs behind it stay queued.
    until("the long job ends in the worker", lambda: f"job_id={long.id}" in _finished(workers))
    time.sleep(1.0)  # a few turns of the worker retrying
    assert not records.get(r, long.id).final
    assert [rec.state for rec in client.records([j.id for j in queued])] == ["queued"] * 6
    assert pending(r) >= 1
    assert workers.procs[0].poll() is None
    assert "Redis is out of memory" in workers.log()

    r.delete(FILLER)  # memory frees

    ids = [long.id] + [j.id for j in queued]
    recs = final_records(redis_url, ids, timeout=SETTLE_S)
    assert [rec.state for rec in recs] == ["completed"] * len(ids)
    assert len(recs[0].token_ids) == LONG
    assert [p for rec in recs for p in stream_problems(r, rec)] == []
    assert drained(r, timeout=SETTLE_S)
    assert r.xlen(keys.DEAD_LETTER) == 0
    assert client.submit("After", max_tokens=4).result(timeout=SETTLE_S).state == "completed"
    assert workers.procs[0].poll() is None


def _finished(workers) -> str:
    return "\n".join(line for line in workers.log().splitlines() if "job finished" in line)


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_an_evicting_redis_stops_worker_and_gateway(policy, redis_url, tiny_model, tmp_path):
    r = redis.Redis.from_url(redis_url)
    r.config_set("maxmemory-policy", policy)
    for cmd, code in (
        (["worker", "--model", str(tiny_model), "--metrics-port", "-1"], 7),  # REDIS_CONFIG
        (["gateway", "--port", "0"], 1),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "plurai.cli", *cmd, "--url", redis_url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == code, done.stderr[-2000:]
        assert f"maxmemory-policy is '{policy}'" in done.stderr, done.stderr[-2000:]
        assert "noeviction" in done.stderr
    assert r.scard(keys.WORKERS) == 0


def test_a_refused_config_get_is_a_warning(redis_url, caplog):
    admin = connect(redis_url)
    admin.acl_setuser(
        "limited", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
    )
    where = admin.connection_pool.connection_kwargs
    limited = redis.Redis(host=where["host"], port=where["port"], username="limited", password="pw")
    with caplog.at_level(logging.WARNING, logger="plurai.memory"):
        memory.check_policy(limited)  # no exception: the policy cannot be known
    assert "cannot read Redis's maxmemory-policy" in caplog.text
    admin.config_set("maxmemory-policy", "allkeys-lfu")
    with pytest.raises(memory.EvictingRedis, match="allkeys-lfu"):
        memory.check_policy(admin)


def test_a_group_that_exists_is_kept_while_redis_is_full(redis_url):
    from plurai.broker_config.groups import ensure_groups

    r = redis.Redis.from_url(redis_url)
    streams = [keys.request_stream("standard", keys.DEFAULT_MODEL, 0)]
    ensure_groups(r, streams)
    fill(r)
    ensure_groups(r, streams)  # a worker restarted while Redis is full starts
    with pytest.raises(redis.ResponseError) as refused:
        ensure_groups(r, [keys.request_stream("batch", keys.DEFAULT_MODEL, 0)])
    assert memory.is_oom(refused.value)
    r.delete(FILLER)


def test_a_full_redis_pauses_kv_writes_not_reads(redis_url):
    import torch

    from plurai.kv_store.redis_tier import RedisTier

    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    tier = RedisTier(r, "ab" * 16, secret=None)
    blocks = {i: torch.full((2, 2, 2, 16, 8), float(i)) for i in range(1, 5)}

    def put(i: int) -> None:
        tier.put(bytes([i]) * 32, blocks[i])
        tier.flush()

    def stored(i: int) -> bool:
        return tier.get_many([bytes([i]) * 32])[0] is not None

    put(1)
    fill(r)
    put(2)  # refused: writes pause, reads do not
    assert tier.writes_paused_until > time.monotonic() and tier.down_until == 0.0
    assert stored(1) and not stored(2)
    dropped = tier.dropped
    put(3)  # dropped at once while paused, never queued
    assert tier.dropped == dropped + 1 and not stored(3)
    r.delete(FILLER)
    until("the pause ends", lambda: time.monotonic() >= tier.writes_paused_until)
    put(4)
    assert stored(4) and tier.full_backoff_s == 0.0
    tier.close()


def test_each_primary_of_a_cluster_is_checked(cluster_url):
    r = connect(cluster_url)
    memory.check_policy(r)
    node = r.get_primaries()[-1]
    r.config_set("maxmemory-policy", "allkeys-lru", target_nodes=node)
    try:
        with pytest.raises(memory.EvictingRedis) as refused:
            memory.check_policy(r)
        assert refused.value.node == node.name and refused.value.policy == "allkeys-lru"
    finally:
        r.config_set("maxmemory-policy", "noeviction", target_nodes=node)


def test_a_full_redis_refuses_a_job_script_whole(redis_url):
    """BEGIN, DELTAS and FINALIZE on a full Redis: refused with Redis's OOM error (a
    refusal the worker retries, not 'badkey' or a silent 0), and nothing written."""
    r = redis.Redis.from_url(redis_url)
    started, fresh = "oom-started-0123456789", "oom-fresh-01234567890"

    def begin(job_id: str) -> jobs.Call:
        return jobs.begin(
            job_id=job_id,
            worker="w1",
            now_ms=1,
            ttl_s=600,
            deadline_ms=None,
            lane="standard",
            priority=0,
            metadata_json=None,
        )

    delta = jobs.deltas(worker="w1", maxlen=100, items=[jobs.Delta(started, "Hi", [7])])
    fields = records.final_fields(worker="w1", finished_ms=2, text="Hi", token_ids=[7])
    result = jobs.finalize(
        job_id=started,
        state="completed",
        finish_reason="length",
        fields=fields,
        ttl_s=600,
        stream_ttl_s=600,
        stream_maxlen=100,
    )
    assert jobs.run(r, begin(started)) == b"run"
    fill(r)
    for call in (begin(fresh), delta, result):
        with pytest.raises(redis.ResponseError) as refused:
            jobs.run(r, call)
        assert memory.is_oom(refused.value) and passing(refused.value), call.script
    assert not r.exists(keys.job(fresh)) and not r.exists(keys.output(fresh))
    assert [f[b"type"] for _, f in r.xrange(keys.output(started))] == [b"start"]
    assert not records.get(r, started).final
    r.delete(FILLER)
    assert jobs.run(r, delta) == 1 and jobs.run(r, result) == 1


@pytest.mark.parametrize("idempotency_key", [None, "invoice-7"])
def test_a_full_redis_refuses_a_submit_whole(redis_url, idempotency_key):
    """ENQUEUE (a submit on one Redis) on a full Redis: Redis's OOM error, which the SDK
    raises as RedisFull, and no entry, record or idempotency key written."""
    r = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    fill(r)
    with pytest.raises(RedisFull):
        client.submit("Hello", max_tokens=4, idempotency_key=idempotency_key)
    assert r.keys("plurai:*") == []
    r.delete(FILLER)
    job = client.submit("Hello", max_tokens=4, idempotency_key=idempotency_key)
    assert records.get(r, job.id).state == "queued"
    assert r.xlen(keys.request_stream("standard")) == 1
    client.close()
