"""Redis running out of memory: how its refusals look, and the start-up check of its
eviction policy.

With `maxmemory` and the policy `noeviction`, a full Redis refuses each command that could
grow it (OOM) and keeps every key: submits fail with a clear error, workers keep their
results and retry them. Any other policy makes a full Redis delete keys instead, job
records and queued entries among them: that loses work, so workers and gateways refuse to
start on such a Redis (docs/operations.md, "Memory").
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from plurai.broker_config.connection import is_cluster
from plurai.broker_config.text import text

log = logging.getLogger("plurai.memory")

# A plain command refused by a full Redis raises redis-py's OutOfMemoryError (its "OOM"
# cut off the message); a Lua script's call refused on Redis 6 fails the script, the reply
# inside its error: "Error running script ...: -OOM command not allowed ...".
OOM_TEXT = "OOM command not allowed"
SAFE_POLICY = "noeviction"


def is_oom(error: Any) -> bool:
    """Whether `error` (an exception or an error reply) is Redis refusing a write because
    it is at `maxmemory`."""
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return True
    return isinstance(error, redis.ResponseError) and OOM_TEXT in str(error)


class EvictingRedis(RuntimeError):
    """The queue's Redis deletes keys when full (a maxmemory-policy other than noeviction)."""

    def __init__(self, policy: str, node: str = "") -> None:
        where = f" on {node}" if node else ""
        super().__init__(
            f"Redis's maxmemory-policy is {policy!r}{where}: when full it deletes keys, "
            "job records, results and queued jobs among them, so work would be lost. "
            f"Set it to {SAFE_POLICY} (redis.conf `maxmemory-policy {SAFE_POLICY}`, or "
            f"CONFIG SET maxmemory-policy {SAFE_POLICY}): a full Redis then refuses new "
            "jobs and keeps every one it holds. Give the KV tier its own Redis if it "
            "should evict (PLURAI_KV_REDIS_URL)"
        )
        self.policy = policy
        self.node = node


def check_policy(r: redis.Redis) -> None:
    """Raise EvictingRedis unless every node of `r` has maxmemory-policy noeviction. Where
    CONFIG GET is refused (a managed Redis, an ACL user without it), log a warning and
    return: the policy cannot be known."""
    try:
        found = _policies(r)
    except redis.ResponseError as e:
        found = [("", f"unknown: {e}")]
    for node, policy in found:
        if policy.startswith("unknown"):
            log.warning(
                "cannot read Redis's maxmemory-policy (%s); make sure it is %s, or a full "
                "Redis deletes job records and queued jobs",
                policy,
                SAFE_POLICY,
            )
        elif policy != SAFE_POLICY:
            raise EvictingRedis(policy, node)


def _policies(r: redis.Redis) -> list[tuple[str, str]]:
    """(node, policy) of each primary; node '' on a single Redis."""
    if not is_cluster(r):
        return [("", _policy(r.config_get("maxmemory-policy")))]
    out = []
    for node in r.get_primaries():  # type: ignore[attr-defined]
        got = r.config_get("maxmemory-policy", target_nodes=node)  # type: ignore[call-arg]
        out.append((node.name, _policy(got)))
    return out


def _policy(reply: Any) -> str:
    if not isinstance(reply, dict) or not reply:  # a Redis that hides the setting: {}
        return "unknown: CONFIG GET maxmemory-policy returned nothing"
    return text(next(iter(reply.values()))).lower()
