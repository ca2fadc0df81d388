"""The shared Redis KV tier against a real redis-server: reuse across engines and worker
processes, corrupt entries, and Redis being down or full."""

from __future__ import annotations

import random

import pytest
import redis

from broker_config import keys
from gpu_workers.engine.sampling_params import SamplingParams
from results import wait

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
    from gpu_workers.engine.sequence import Sequence

    seq = Sequence("probe", list(p), SamplingParams())
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
    theirs = Sequence("probe", list(p), SamplingParams())
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
    from broker_config.embedded import EmbeddedRedis

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
    from producer.client import Client

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
