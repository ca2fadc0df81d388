"""A redis+cluster:// URL against a real 3-node cluster: keys spread over the nodes by hash
slot, a script runs on keys that share a {hash tag}, and the asyncio client works too."""

from __future__ import annotations

import asyncio

import pytest
import redis

from broker_config.connection import connect, connect_async, is_cluster

pytestmark = pytest.mark.integration


def test_keys_spread_over_nodes_and_a_tagged_script_runs(cluster_url: str) -> None:
    r = connect(cluster_url, decode=True)
    assert is_cluster(r)
    for i in range(30):
        r.set(f"{{job{i}}}:state", "queued")
    per_node = [r.dbsize(target_nodes=node) for node in r.get_primaries()]
    assert len(per_node) == 3 and sum(per_node) == 30 and all(per_node), per_node

    script = "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('INCRBY', KEYS[2], ARGV[2])"
    assert r.eval(script, 2, "{x}:a", "{x}:b", "v", 5) == 5
    assert r.get("{x}:a") == "v"
    with pytest.raises(redis.RedisClusterException, match="same key slot"):
        r.eval(script, 2, "{x}:a", "{y}:b", "v", 5)
    r.close()


def test_the_async_client_reaches_the_cluster(cluster_url: str) -> None:
    async def go() -> list[str | None]:
        r = connect_async(cluster_url, decode=True)
        assert is_cluster(r)
        try:
            await r.set("{a}:k", "1")
            await r.set("{b}:k", "2")
            return [await r.get("{a}:k"), await r.get("{b}:k")]
        finally:
            await r.aclose()

    assert asyncio.run(go()) == ["1", "2"]
