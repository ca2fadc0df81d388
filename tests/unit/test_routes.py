"""broker_config/routes.py: what clients read from plurai:models to route a request."""

from __future__ import annotations

import json
import time

import pytest

from broker_config.routes import Routes, registry_value
from broker_config.settings import Settings


def test_shards_liveness_and_refusal() -> None:
    now = int(time.time() * 1000)
    routes = Routes(Settings(unserved="refuse", heartbeat_interval_s=1))
    assert routes.stale()
    routes.load(
        {
            b"live": registry_value(4, now).encode(),
            "old": registry_value(2, now - 60_000),
            "named": registry_value(1, 0),  # a client named it; no worker ever served it
            "junk": b"\xff not json",
            "partial": json.dumps({"shards": 3}),
            "huge": registry_value(10**9, now),
            "inf": '{"shards": Infinity, "beat_ms": 1}',  # json.loads takes it: int() overflows
            "late": '{"shards": 2, "beat_ms": 1e999}',
        }
    )
    assert not routes.stale()
    assert routes.shards("live") == 4 and routes.shards("old") == 2
    assert routes.shards("unknown") == 1 and routes.shards("junk") == 1
    assert routes.shards("inf") == 1 and routes.shards("late") == 1
    assert routes.shards("huge") == 256  # bounded
    assert routes.live() == ["huge", "live"]
    assert not routes.refused("live") and routes.refused("old") and routes.refused("named")
    assert not Routes(Settings()).refused("anything")  # the default: jobs wait


def test_model_names_are_checked() -> None:
    assert Settings(served_model="org/tiny-llama_1.5").model == "org/tiny-llama_1.5"
    assert Settings().model == "default" and Settings(default_model="m").model == "m"
    for bad in ("has:colon", "{tag}", "", "x" * 129, "space s"):
        with pytest.raises(ValueError, match="model name"):
            Settings(served_model=bad)


def test_a_models_key_of_another_type_reads_as_empty() -> None:
    """Something wrote plurai:models as a string: submits still go to shard 0 and status
    still reads; the next worker heartbeat takes the key back."""
    import asyncio

    import fakeredis
    import fakeredis.aioredis

    from broker_config import keys, stats
    from producer import AsyncClient, Client

    r = fakeredis.FakeRedis()
    r.set(keys.MODELS, "not a hash")
    assert Client(redis=r).fresh_routes().models == {}
    assert [m.model for m in stats.snapshot(r, ["standard"]).lanes] == ["default"]

    async def aio() -> None:
        ar = fakeredis.aioredis.FakeRedis()
        await ar.set(keys.MODELS, "not a hash")
        assert (await AsyncClient(redis=ar).fresh_routes()).models == {}

    asyncio.run(aio())
