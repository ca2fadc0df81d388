"""PLURAI_KV_SECRET against a real redis-server: engines share Redis KV blocks only with
engines that hold the same secret; blocks without a valid MAC are recomputed."""

from __future__ import annotations

import random

import pytest

from gpu_workers.engine.sampling_params import SamplingParams
from kv_store.redis_tier import SECRET_ENV

SP = SamplingParams(max_tokens=8, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 2000) for _ in range(length)]


@pytest.fixture
def run(redis_url, model_factory, engine_factory, monkeypatch):
    path = model_factory("llama")

    def run(secret: str | None, p: list[int], write: bool) -> tuple[list[int], int, dict]:
        """Generate with an engine whose environment holds `secret` (the engine builds its
        Redis tier without one, so the tier reads it from there)."""
        if secret is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        e = engine_factory(path, kv_host_bytes=0, kv_redis_url=redis_url, kv_write_through=write)
        out = e.generate([p], SP)[0]
        stats = e.stats()
        refused = e.blocks.tiers.remote.refused
        e.close()
        return out.token_ids, out.num_cached_tokens, {**stats, "refused": refused}

    return run


def test_same_secret_shares_other_secret_or_none_does_not(run, engine_factory, model_factory):
    plain = engine_factory(model_factory("llama"), kv_host_bytes=0)

    def cold(p: list[int]) -> list[int]:
        return plain.generate([p], SP)[0].token_ids

    p = prompt(100, 11)
    tokens, cached, _ = run("tenant-a", p, write=True)
    assert tokens == cold(p) and cached == 0

    tokens, cached, stats = run("tenant-a", p, write=False)
    assert cached == 96 and stats["kv_redis_hits"] == 6 and stats["refused"] == 0
    assert tokens == cold(p)

    for other in ("tenant-b", None):
        tokens, cached, stats = run(other, p + [7], write=False)
        if other is None:  # no secret: the MAC is not checked, the blocks are used
            assert cached == 96
        else:
            assert cached == 0 and stats["kv_redis_hits"] == 0 and stats["refused"] == 1
        assert tokens == cold(p + [7])
    # blocks written without a secret are refused by an engine that has one
    q = prompt(100, 12)
    run(None, q, write=True)
    tokens, cached, stats = run("tenant-a", q, write=False)
    assert cached == 0 and stats["refused"] == 1
