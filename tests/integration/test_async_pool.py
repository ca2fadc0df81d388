"""The asyncio client under a flood: hundreds of concurrent commands (blocking reads among
them, as a gateway has while requests wait for their jobs) wait for a connection instead of
failing; redis-py's own pool refuses the 101st at once (MaxConnectionsError), which a
gateway answered with 503 `unavailable`."""

from __future__ import annotations

import asyncio

from plurai.broker_config.connection import connect_async


def test_hundreds_of_blocking_commands_at_once(redis_url):
    async def flood() -> list:
        r = connect_async(redis_url)
        try:
            # 300 blocking reads that each hold a connection for a quarter of a second
            return await asyncio.gather(*(r.blpop([f"nothing:{i}"], 0.25) for i in range(300)))
        finally:
            await r.aclose()

    assert asyncio.run(flood()) == [None] * 300
