"""broker_config/routes.py: what clients read from plurai:models to route a request."""

from __future__ import annotations

import json
import time

import pytest

from plurai.broker_config.routes import Routes, registry_value
from plurai.broker_config.settings import Settings


def test_shards_liveness_and_refusal() -> None:
    now = int(time.time() * 1000)
    routes = Routes(Settings(unserved="refuse", heartbeat_interval_s=1))
    assert routes.stale()
    entries = {
        "live": registry_value(4, now),
        "old": registry_value(2, now - 60_000),
        "named": registry_value(1, 0),  # a client named it; no worker ever served it
        "partial": json.dumps({"shards": 3}),
        "huge": registry_value(10**9, now),
        "inf": '{"shards": Infinity, "beat_ms": 1}',  # json.loads takes it: not a count
        "late": '{"shards": 2, "beat_ms": 1e999}',
        "negative": '{"shards": -2, "beat_ms": 1}',
        "names": '{"shards": 1, "beat_ms": 1, "names": [1]}',
    }
    raw = {k.encode(): v.encode() for k, v in entries.items()}
    raw[b"junk"] = b"\xff not json"
    raw[b"\xff"] = registry_value(1, now).encode()  # a name that is not UTF-8: skipped
    routes.load(raw)
    assert not routes.stale()
    assert routes.shards("live") == 4 and routes.shards("old") == 2
    assert routes.shards("unknown") == 1 and routes.shards("junk") == 1
    assert routes.shards("inf") == 1 and routes.shards("late") == 1
    assert routes.shards("huge") == 256  # bounded
    assert set(routes.models) == {"live", "old", "named", "huge"}
    assert routes.live() == ["huge", "live"]
    assert not routes.refused("live") and routes.refused("old") and routes.refused("named")
    assert not Routes(Settings()).refused("anything")  # the default: jobs wait


def test_a_model_is_routed_by_any_of_its_names_while_live() -> None:
    """The gateway's routing: a request may name a live model by its queue, its folder's
    name or any name its workers answer to; a stale entry routes nothing."""
    now = int(time.time() * 1000)
    routes = Routes(Settings(heartbeat_interval_s=1))
    value = registry_value(2, now, model_id="tiny-llama", names={"llama", "q"}, max_model_len=512)
    stale = registry_value(1, now - 60_000, model_id="gone")
    routes.load({b"q": value.encode(), b"g": stale.encode()})
    assert [(m.id, m.queue, m.max_model_len) for m in routes.served()] == [("tiny-llama", "q", 512)]
    assert routes.route("llama") == routes.route("tiny-llama") == routes.route("q") == "q"
    assert routes.route("gone") is None and routes.route("g") is None
    assert routes.shards("q") == 2


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

    from plurai.broker_config import keys, stats
    from plurai.producer import AsyncClient, Client

    r = fakeredis.FakeRedis()
    r.set(keys.MODELS, "not a hash")
    assert Client(redis=r).fresh_routes().models == {}
    assert [m.model for m in stats.snapshot(r, ["standard"]).lanes] == ["default"]

    async def aio() -> None:
        ar = fakeredis.aioredis.FakeRedis()
        await ar.set(keys.MODELS, "not a hash")
        assert (await AsyncClient(redis=ar).fresh_routes()).models == {}

    asyncio.run(aio())
