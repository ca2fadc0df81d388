"""Cache salts isolate tenants in the shared Redis KV tier too: two engines, one real
redis-server."""

from __future__ import annotations

import random

import redis

from broker_config import keys
from gpu_workers.engine.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=8, ignore_eos=True)


def run(engine, rid: str, prompt: list[int], salt: str | None) -> tuple[int, list[int]]:
    engine.add(rid, token_ids=prompt, params=SP, cache_salt=salt)
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
