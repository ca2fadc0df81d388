"""Beat's consumer-group maintenance: dead, empty consumers are forgotten; live ones and
ones that still hold entries are kept. Worker ids without a heartbeat leave plurai:workers."""

from __future__ import annotations

import time

from plurai.broker_config import keys
from plurai.broker_config.groups import ensure_groups, forget_dead_consumers, forget_dead_workers
from tests.helpers import beat


def test_forget_dead_consumers(r):
    ensure_groups(r, [keys.request_stream("standard")])
    stream = keys.request_stream("standard")
    first = r.xadd(stream, {"v": "1"})
    r.xadd(stream, {"v": "1"})
    r.xreadgroup(keys.GROUP, "dead", {stream: ">"}, count=1)
    r.xack(stream, keys.GROUP, first)  # "dead" finished its entry, then died
    r.xreadgroup(keys.GROUP, "holder", {stream: ">"}, count=1)  # keeps one entry pending
    third = r.xadd(stream, {"v": "1"})
    r.xreadgroup(keys.GROUP, "alive", {stream: ">"}, count=1)
    r.xack(stream, keys.GROUP, third)  # idle and empty too, but with a live heartbeat
    beat(r, "alive", beat_ms=1)
    time.sleep(0.05)
    assert forget_dead_consumers(r, ["standard", "batch"], min_idle_ms=10) == [f"{stream}/dead"]
    names = {c["name"].decode() for c in r.xinfo_consumers(stream, keys.GROUP)}
    assert names == {"holder", "alive"}
    assert forget_dead_consumers(r, ["standard"], min_idle_ms=60_000) == []
    r.sadd(keys.WORKERS, "alive", "dead")
    assert forget_dead_workers(r) == ["dead"]
    assert r.smembers(keys.WORKERS) == {b"alive"}
