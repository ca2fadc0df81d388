"""A new Redis connection costs no package-metadata lookup: redis-py 8 looks its own
version up for every connection it makes unless it is given, about 2 ms of CPU each, which
a gateway whose pool grows under a flood paid per request."""

from __future__ import annotations

import redis.utils

from plurai.broker_config.connection import connect, connect_async


def test_new_connections_do_not_look_up_the_library_version(monkeypatch) -> None:
    looked: list[int] = []

    def lookup() -> str:
        looked.append(1)
        return "8.0.0"

    monkeypatch.setattr(redis.utils, "get_lib_version", lookup)
    for _ in range(3):
        connect("redis://127.0.0.1:1").connection_pool.make_connection()
        connect_async("redis://127.0.0.1:1").connection_pool.make_connection()
    assert looked == []
