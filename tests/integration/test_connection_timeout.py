"""Blocking reads run their whole wait: redis-py 8 gives a connection a 5 s read timeout
unless told otherwise, which failed every blocking read that waited 5 s or more (the
gateway's shared XREAD blocks 5 s: its streams, all waiting in the queue, got 503s)."""

from __future__ import annotations

import asyncio
import time

from plurai.broker_config.connection import SOCKET_TIMEOUT_S, connect, connect_async
from plurai.broker_config.settings import BLOCK_LIMIT_MS, Settings
from plurai.gateway import streams

WAIT_MS = 5_500  # past redis-py 8's own default


def test_blocking_reads_wait_their_whole_time(redis_url):
    async def both() -> tuple[object, object]:
        r = connect_async(redis_url)
        sync = connect(redis_url)
        try:
            return await asyncio.gather(
                r.xread({"nothing-here": "0-0"}, block=WAIT_MS),
                asyncio.to_thread(sync.xread, {"nothing-either": "0-0"}, block=WAIT_MS),
            )
        finally:
            await r.aclose()
            sync.close()

    start = time.monotonic()
    got = asyncio.run(both())
    assert [x or [] for x in got] == [[], []]  # nothing came: no timeout raised
    assert time.monotonic() - start >= WAIT_MS / 1000


def test_every_blocking_wait_is_under_the_read_timeout():
    # a read that waits its longest still has a wide margin before the connection's timeout
    assert streams.BLOCK_MS / 1000 + 10 <= SOCKET_TIMEOUT_S
    assert BLOCK_LIMIT_MS / 1000 + 10 <= SOCKET_TIMEOUT_S
    s = Settings()
    assert s.block_ms <= BLOCK_LIMIT_MS and s.submit_replicas_timeout_ms <= BLOCK_LIMIT_MS


def test_a_blocking_wait_past_the_bound_is_refused():
    import pytest
    from pydantic import ValidationError

    for field in ("block_ms", "submit_replicas_timeout_ms"):
        with pytest.raises(ValidationError, match=field):
            Settings(**{field: BLOCK_LIMIT_MS + 1})
