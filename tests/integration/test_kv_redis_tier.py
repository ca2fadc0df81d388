"""The shared Redis KV tier against a real redis-server: reuse across engines and worker
processes, corrupt entries, Redis being down or full, PLURAI_KV_SECRET (blocks shared only
between engines that hold the same secret), and hostile bytes and faults (a KV Redis
Cluster that goes away, entries far larger than any block or of another Redis type)."""

from __future__ import annotations

import random

import pytest
import redis
import torch

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.embedded import LocalCluster
from plurai.gpu_workers.engine.kv_tiers import KVTiers
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.kv_store import block_format
from plurai.kv_store.redis_tier import SECRET_ENV, RedisTier
from plurai.results import wait

SP = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 2000) for _ in range(length)]


@pytest.fixture
def cold(model_factory, engine_factory):
    path = model_factory("llama")

    def run(p: list[int]) -> list[int]:
        return engine_factory(path, kv_host_bytes=0).generate([p], SP)[0].token_ids

    return run


def test_another_engine_loads_the_prefix_from_redis(redis_url, model_factory, engine_factory, cold):
    path = model_factory("llama")
    p = prompt(120, 1)
    a = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url, kv_write_through=True)
    assert a.generate([p], SP)[0].token_ids == cold(p)
    a.close()  # flushes the writer
    r = redis.Redis.from_url(redis_url)
    assert len(r.keys(keys.kv_block(a.model_fingerprint, "*"))) >= 7

    b = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url)
    got = b.generate([p + [9, 9]], SP)[0]
    assert got.num_cached_tokens == 112  # the 7 full blocks, computed by the other engine
    assert b.stats()["kv_redis_hits"] == 7
    assert got.token_ids == cold(p + [9, 9])


def test_spill_reaches_redis_without_write_through(redis_url, model_factory, engine_factory, cold):
    path = model_factory("llama")
    p = prompt(100, 2)
    a = engine_factory(path, num_kv_blocks=10, kv_host_bytes=1, kv_redis_url=redis_url)
    a.generate([p], SP)
    a.generate([prompt(140, 3)], SP)  # evicts p's blocks; a 1-byte host tier passes them on
    a.close()
    b = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url)
    got = b.generate([p], SP)[0]
    assert got.num_cached_tokens > 0 and b.stats()["kv_redis_hits"] > 0
    assert got.token_ids == cold(p)


def test_corrupt_or_foreign_entries_are_recomputed(redis_url, model_factory, engine_factory, cold):
    path = model_factory("llama")
    p = prompt(100, 4)
    a = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url, kv_write_through=True)
    a.generate([p], SP)
    a.close()
    r = redis.Redis.from_url(redis_url)
    from plurai.gpu_workers.engine.sequence import Sequence

    seq = Sequence(request_id="probe", token_ids=list(p), params=SamplingParams())
    a.blocks._hash_full_blocks(seq)
    k = [keys.kv_block(a.model_fingerprint, h.hex()) for h in seq.block_hashes]
    flipped = bytearray(r.get(k[1]))
    flipped[100] ^= 0xFF
    r.set(k[1], bytes(flipped))  # flipped bytes
    r.set(k[3], r.get(k[3])[:-10])  # truncated
    other = model_factory("mistral")  # a block another model wrote, under this model's key
    o = engine_factory(other, kv_host_bytes=0, kv_redis_url=redis_url, kv_write_through=True)
    o.generate([p], SP)
    o.close()
    theirs = Sequence(request_id="probe", token_ids=list(p), params=SamplingParams())
    o.blocks._hash_full_blocks(theirs)
    r.set(k[0], r.get(keys.kv_block(o.model_fingerprint, theirs.block_hashes[0].hex())))

    b = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url)
    got = b.generate([p], SP)[0]
    assert got.num_cached_tokens == 0  # block 0 is foreign, so nothing after it is used
    assert b.stats()["kv_bad_entries"] == 1
    assert got.token_ids == cold(p)
    r.delete(k[0])
    b2 = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url)
    assert b2.generate([p], SP)[0].num_cached_tokens == 0  # block 0 now missing: a plain miss


def test_redis_down_or_full_degrades_to_recompute(tmp_path, model_factory, engine_factory, cold):
    from plurai.broker_config.embedded import EmbeddedRedis

    path = model_factory("llama")
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    r = redis.Redis.from_url(url)
    r.set("ballast", b"x" * 2_000_000)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1mb")  # full: every write is refused with OOM
    engine = engine_factory(path, kv_host_bytes=0, kv_redis_url=url, kv_write_through=True)
    p = prompt(90, 5)
    assert engine.generate([p], SP)[0].token_ids == cold(p)
    engine.blocks.tiers.remote.flush()
    assert engine.blocks.tiers.remote.dropped > 0
    server.stop()  # down
    q = prompt(70, 6)
    assert engine.generate([q], SP)[0].token_ids == cold(q)
    engine.close()


def test_a_fresh_worker_reuses_what_another_worker_computed(redis_url, workers, tiny_model):
    from plurai.producer.client import Client

    shared = "Background for every question: " + " ".join(f"w{i}" for i in range(150))
    kv = ["--engine", f"kv_redis_url={redis_url}", "--engine", "kv_write_through=true"]
    workers.start(1, *kv)
    client = Client(redis_url)
    first = client.submit(shared + " First question?", max_tokens=8).result(timeout=120)
    assert first.state == "completed"
    assert workers.stop() == [0]

    workers.start(1, *kv)  # a new process: its device cache is empty
    second = client.submit(shared + " Second question?", max_tokens=8).result(timeout=120)
    assert second.state == "completed"
    assert second.worker != first.worker
    assert second.cached_tokens and second.cached_tokens >= 128  # loaded from the Redis tier
    rec = wait.wait(client.redis, second.id, 5)
    assert rec.cached_tokens == second.cached_tokens


# -- PLURAI_KV_SECRET: engines share Redis KV blocks only with engines that hold the same
# secret; blocks without a valid MAC are recomputed.

SHORT = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def secret_run(redis_url, model_factory, engine_factory, monkeypatch):
    path = model_factory("llama")

    def run(secret: str | None, p: list[int], write: bool) -> tuple[list[int], int, dict]:
        """Generate with an engine whose environment holds `secret` (the engine builds its
        Redis tier without one, so the tier reads it from there)."""
        if secret is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        e = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url, kv_write_through=write)
        out = e.generate([p], SHORT)[0]
        stats = e.stats()
        refused = e.blocks.tiers.remote.refused
        e.close()
        return out.token_ids, out.num_cached_tokens, {**stats, "refused": refused}

    return run


def test_same_secret_shares_other_secret_or_none_does_not(
    secret_run, engine_factory, model_factory
):
    plain = engine_factory(model_factory("llama"), kv_host_bytes=0)

    def cold(p: list[int]) -> list[int]:
        return plain.generate([p], SHORT)[0].token_ids

    p = prompt(100, 11)
    tokens, cached, _ = secret_run("tenant-a", p, write=True)
    assert tokens == cold(p) and cached == 0

    tokens, cached, stats = secret_run("tenant-a", p, write=False)
    assert cached == 96 and stats["kv_redis_hits"] == 6 and stats["refused"] == 0
    assert tokens == cold(p)

    for other in ("tenant-b", None):
        tokens, cached, stats = secret_run(other, p + [7], write=False)
        if other is None:  # no secret: the MAC is not checked, the blocks are used
            assert cached == 96
        else:
            assert cached == 0 and stats["kv_redis_hits"] == 0 and stats["refused"] == 1
        assert tokens == cold(p + [7])
    # blocks written without a secret are refused by an engine that has one
    q = prompt(100, 12)
    secret_run(None, q, write=True)
    tokens, cached, stats = secret_run("tenant-a", q, write=False)
    assert cached == 0 and stats["refused"] == 1


# -- hostile bytes and faults, on the tier itself

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
    # the server appends every write to its AOF: a slow disk may take seconds over one
    r = redis.Redis.from_url(redis_url, socket_timeout=120)
    kv = tiers(r, secret)
    blocks = [torch.randn(SHAPE) for _ in HASHES]
    for h, b in zip(HASHES, blocks, strict=True):
        kv.remote.put(h, b)
    kv.remote.flush()
    valid = r.get(kv.remote.key(HASHES[1]))
    r.set(kv.remote.key(HASHES[1]), valid + bytes(4 << 20))  # a valid block, 4 MB longer
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
