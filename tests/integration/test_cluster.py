"""Redis Cluster: a real 3-master cluster (redis-server binaries started by the fixture),
the default model's lanes sharded over 3 streams. Every key of one job shares a hash tag,
so each script touches one slot: 300 jobs through 2 workers get one result each, and the
fault suite's worker-crash test passes on the cluster too. KV tier blocks spread over the
masters by their hash."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import torch

from plurai.broker_config import keys
from plurai.broker_config.connection import connect, connect_async, is_cluster
from plurai.kv_store.redis_tier import RedisTier
from plurai.producer import AsyncClient, Client
from plurai.results import records

from .conftest import Workers
from .faults import FAST, drained, end_entries, final_records
from .test_faults_worker_crash import sigkill_mid_run

SHARDS = 3


@pytest.fixture
def cluster_workers(cluster_url, tiny_model, tmp_path):
    w = Workers(cluster_url, tiny_model, tmp_path)
    yield w
    w.stop()
    r = connect(cluster_url)
    r.flushall(target_nodes=r.ALL_NODES)  # the cluster is shared by the module's tests


def test_300_jobs_through_two_workers(cluster_url, cluster_workers):
    cluster_workers.start(2, env={**FAST, "PLURAI_SHARDS": str(SHARDS)})
    client = Client(cluster_url)
    assert is_cluster(client.redis)
    reqs = [
        {"prompt": f"cluster job {i}", "max_tokens": 6, "ignore_eos": True, "lane": "standard"}
        for i in range(290)
    ]
    jobs = client.submit_many(reqs)
    # idempotency keys pick the shard, so a repeat finds its key
    keyed = [client.submit(f"keyed {i}", max_tokens=6, idempotency_key=f"k{i}") for i in range(10)]
    again = [client.submit("other text", max_tokens=6, idempotency_key=f"k{i}") for i in range(10)]
    assert [j.id for j in again] == [j.id for j in keyed]
    ids = [j.id for j in jobs + keyed]
    recs = final_records(cluster_url, ids)
    assert [rec.state for rec in recs] == [records.COMPLETED] * 300
    r = connect(cluster_url)
    assert end_entries(r, ids) == [1] * 300  # one result each
    # the shards spread the intake over the masters: each master holds a shard's stream
    nodes = {r.keyslot(keys.request_stream("standard", keys.DEFAULT_MODEL, n)) for n in range(3)}
    assert len(nodes) == 3
    per_master = [r.dbsize(target_nodes=n) for n in r.get_primaries()]
    assert all(per_master), per_master
    assert {rec.worker for rec in recs} == {
        w.decode() for w in r.smembers(keys.WORKERS)
    }  # both workers took work
    assert drained(r, SHARDS)
    # the dashboard's index of recent jobs, written beside BEGIN on its own node
    recent = {f[b"id"].decode() for _, f in r.xrange(keys.RECENT)}
    assert set(ids) <= recent

    async def use_async() -> None:  # the asyncio client routes by slot as well
        async with AsyncClient(cluster_url) as aclient:
            job = await aclient.submit("async on the cluster", max_tokens=4, ignore_eos=True)
            assert (await job.result(timeout=60)).output_tokens == 4
        ar = connect_async(cluster_url)
        assert is_cluster(ar)
        await ar.aclose()

    asyncio.run(use_async())
    client.close()


def test_sigkill_worker_mid_run_on_the_cluster(cluster_url, cluster_workers):
    sigkill_mid_run(cluster_url, cluster_workers, shards=SHARDS)


def test_kv_tier_blocks_spread_over_the_masters(cluster_url):
    r = connect(cluster_url)
    tier = RedisTier(r, "ab12", secret=None)
    hashes = [bytes([i]) * 16 for i in range(30)]
    for i, h in enumerate(hashes):
        tier.put(h, torch.full((2, 1, 2, 4, 8), float(i)))
    tier.flush()
    got = tier.get_many([*hashes, b"\xff" * 16])
    assert all(got[:30]) and got[30] is None and tier.errors == 0
    assert all(r.dbsize(target_nodes=n) for n in r.get_primaries())  # spread by block hash
    tier.close()
    # a script may touch keys of one hash tag only: what every Plurai script keeps to
    script = "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('INCRBY', KEYS[2], 5)"
    assert r.eval(script, 2, "{x}:a", "{x}:b", "v") == 5
    with pytest.raises(redis.RedisClusterException, match="same key slot"):
        r.eval(script, 2, "{x}:a", "{y}:b", "v")
    r.flushall(target_nodes=r.ALL_NODES)


def test_webhooks_on_the_cluster(cluster_url, cluster_workers):
    """The watch keys share one slot, the records are elsewhere, the done channels reach the
    notifier from any master: each job's webhook is POSTed once."""
    from plurai.broker_config.settings import Settings

    from .test_webhooks import Receiver, Running, _settings, _until

    cluster_workers.start(1, env={**FAST, "PLURAI_SHARDS": str(SHARDS)})
    rx = Receiver()
    settings: Settings = _settings(cluster_url, webhook_poll_s=300.0)  # ends heard, not polled
    notifier = Running(cluster_url, settings)
    try:
        client = Client(cluster_url, settings=settings)
        jobs = [client.submit(f"hook {i}", max_tokens=4, webhook=rx.url) for i in range(6)]
        cancelled = client.submit("cancelled", webhook=rx.url, not_before=time.time() + 60)
        cancelled.cancel()
        _until(lambda: len(rx.posts) == 7, timeout=120)
        told = {j["id"]: j["state"] for j in rx.jobs()}
        assert told == {**{j.id: "completed" for j in jobs}, cancelled.id: "cancelled"}
        r = connect(cluster_url)
        _until(lambda: r.zcard(keys.WEBHOOKS_DUE) == 0)
        assert all(j.record().raw["webhook_state"] == "delivered" for j in jobs)
    finally:
        notifier.close()
        rx.server.shutdown()
