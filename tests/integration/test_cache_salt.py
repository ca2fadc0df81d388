"""Cache salts isolate tenants in the shared Redis KV tier too: two engines, one real
redis-server."""

from __future__ import annotations

import random

import redis

from plurai.broker_config import keys
from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=8, ignore_eos=True)


def run(engine, rid: str, prompt: list[int], salt: str | None) -> tuple[int, list[int]]:
    engine.add(AddRequest(rid, token_ids=prompt, params=SP, cache_salt=salt))
    cached, out = 0, []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    return cached, out


def test_salts_never_share_redis_blocks(redis_url, model_factory, engine_factory):
    path = model_factory("llama")
    rng = random.Random(7)
    p = [rng.randrange(16, 2000) for _ in range(120)]
    tier = dict(kv_host_bytes=0, kv_redis_url=redis_url, kv_write_through=True)

    one = engine_factory(path, **tier)
    cached, expected = run(one, "a", p, "tenant-a")
    assert cached == 0
    one.close()  # flushes the writer
    r = redis.Redis.from_url(redis_url)
    written = set(r.keys(keys.kv_block(one.model_fingerprint, "*")))
    assert len(written) == 7  # the 7 full blocks of salt A, and nothing else

    two = engine_factory(path, **tier)
    assert run(two, "b", p, "tenant-b") == (0, expected)
    assert two.stats()["kv_redis_hits"] == 0
    assert run(two, "none", p, None) == (0, expected)  # no salt is a tenant of its own
    assert two.stats()["kv_redis_hits"] == 0
    # what B and no-salt wrote are other keys: three tenants, three sets of blocks
    two.blocks.tiers.remote.flush()
    assert len(set(r.keys(keys.kv_block(one.model_fingerprint, "*")))) == 21

    # salt A finds engine one's blocks (engine two's device cache holds only B's and none's)
    longer = p + [5, 6]
    cold = engine_factory(path, kv_host_bytes=0).generate([longer], SP)[0]
    assert cold.num_cached_tokens == 0
    assert run(two, "a", longer, "tenant-a") == (112, cold.token_ids)
    assert two.stats()["kv_redis_hits"] == 7
    two.close()


def test_salts_across_two_worker_processes(redis_url, workers):
    """Through the queue: a second worker process reuses a prefix from Redis only for the
    tenant that computed it, and `cached_tokens` tells another tenant nothing."""
    from plurai.producer.client import Client

    shared = "Tenant handbook, page one: " + " ".join(f"w{i}" for i in range(150))
    kv = ["--engine", f"kv_redis_url={redis_url}", "--engine", "kv_write_through=true"]
    client = Client(redis_url)
    workers.start(1, *kv)
    first = client.submit(shared + " First?", max_tokens=4, cache_salt="tenant-a")
    assert first.result(timeout=120).state == "completed"
    assert workers.stop() == [0]

    workers.start(1, *kv)  # a new process: its device cache is empty
    other = client.submit(shared + " Second?", max_tokens=4, cache_salt="tenant-b")
    plain = client.submit(shared + " Second?", max_tokens=4)
    same = client.submit(shared + " Second?", max_tokens=4, cache_salt="tenant-a")
    ro, rp = other.result(timeout=120), plain.result(timeout=120)
    rs = same.result(timeout=120)
    assert rs.worker != first.record().worker
    assert ro.cached_tokens == 0 and rp.cached_tokens == 0
    assert rs.cached_tokens and rs.cached_tokens >= 128  # tenant A's blocks, from Redis
    assert ro.text == rp.text == rs.text  # the salt changes what is shared, not the output
    client.close()
