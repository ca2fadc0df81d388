"""The Redis KV tier against hostile bytes and faults, on real redis-servers: a KV Redis
Cluster that goes away, and entries far larger than any block."""

from __future__ import annotations

import pytest
import redis
import torch

from broker_config.connection import connect
from broker_config.embedded import LocalCluster
from gpu_workers.engine.kv_tiers import KVTiers
from kv_store import block_format
from kv_store.redis_tier import RedisTier

FP = bytes(range(32))
SHAPE = (2, 2, 2, 4, 8)  # [K/V, layers, kv_heads, block_size, head_dim]
HASHES = [bytes([i]) * 16 for i in range(4)]
SIZE = block_format.size(SHAPE, torch.float32)


def tiers(r: redis.Redis, secret: bytes | None = None) -> KVTiers:
    cache = torch.zeros(2, SHAPE[1], SHAPE[2], 8, SHAPE[3], SHAPE[4])
    return KVTiers(cache, FP, 0, RedisTier(r, FP.hex(), secret=secret), write_through=False)


def sent(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def test_a_kv_cluster_that_is_down_is_a_miss_and_a_dropped_write(tmp_path):
    cluster = LocalCluster(tmp_path / "cluster")
    url = cluster.start()
    try:
        r = connect(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        t = RedisTier(r, FP.hex(), secret=None)
        for h in HASHES[:3]:
            t.put(h, torch.randn(SHAPE))
        t.flush()
        for size in (None, SIZE):  # blocks on several nodes, read whole or bounded
            assert [x is not None for x in t.get_many(HASHES, size)] == [True] * 3 + [False]
    finally:
        cluster.stop()
    # no node left: redis-py raises RedisClusterException, which is not a RedisError
    for i, size in enumerate((None, SIZE)):
        t.down_until = 0.0
        assert t.get_many(HASHES, size) == [None] * len(HASHES)
        assert t.errors == i + 1 and t.down_until > 0  # skipped a while
    t.down_until = 0.0
    t.put(HASHES[3], torch.randn(SHAPE))
    t.flush()
    assert t.dropped == 1 and t.errors == 3 and t.down_until > 0  # skipped after it too
    t.close()


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_an_oversized_entry_is_refused_without_being_read_whole(redis_url, secret):
    r = redis.Redis.from_url(redis_url)
    kv = tiers(r, secret)
    blocks = [torch.randn(SHAPE) for _ in HASHES]
    for h, b in zip(HASHES, blocks, strict=True):
        kv.remote.put(h, b)
    kv.remote.flush()
    valid = r.get(kv.remote.key(HASHES[1]))
    r.set(kv.remote.key(HASHES[1]), valid + bytes(32 << 20))  # a valid block, 32 MB longer
    before = sent(r)
    got, from_host = kv.lookup(HASHES)
    assert sent(r) - before < 1 << 20
    assert from_host == 0 and len(got) == 1 and torch.equal(got[0], blocks[0])
    assert kv.counters.bad_entries + kv.remote.refused == 1


def test_an_entry_of_another_redis_type_is_a_miss_not_an_outage(redis_url):
    r = redis.Redis.from_url(redis_url)
    kv = tiers(r)
    for h in HASHES:
        kv.remote.put(h, torch.randn(SHAPE))
    kv.remote.flush()
    r.delete(kv.remote.key(HASHES[2]))
    r.rpush(kv.remote.key(HASHES[2]), b"x")
    got, _ = kv.lookup(HASHES)
    assert len(got) == 2 and kv.remote.errors == 0
    assert len(kv.lookup(HASHES[:2])[0]) == 2  # the tier was not taken for down
    kv.close()
