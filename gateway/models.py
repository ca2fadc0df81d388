"""The models the live workers serve, from their heartbeats (refreshed at most once a
second, so a burst of requests costs Redis one look)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import redis.asyncio
from redis.client import NEVER_DECODE

from broker_config import keys

REFRESH_S = 1.0
_COUNT = re.compile(r"[0-9]{1,15}")
_FIELDS = ("model", "model_id", "max_model_len", "state", "beat_ms", "served_model")


@dataclass
class Model:
    id: str  # the model directory's name
    max_model_len: int
    names: set[str] = field(default_factory=set)  # every name a job may give it by
    served: str = ""  # the queue its workers read (PLURAI_SERVED_MODEL)
    workers: int = 0
    created: int = 0  # the earliest heartbeat's worker start, unix seconds


class Models:
    def __init__(self, r: redis.asyncio.Redis) -> None:
        self.r = r
        self.cached: list[Model] = []
        self.at = -REFRESH_S

    async def live(self) -> list[Model]:
        if time.monotonic() - self.at < REFRESH_S:
            return self.cached
        # read undecoded: a heartbeat that is not UTF-8 is skipped, not a failed reply
        found = await self.r.execute_command("SMEMBERS", keys.WORKERS, **{NEVER_DECODE: []})
        ids = [w for w in map(_utf8, found) if w is not None]
        pipe = self.r.pipeline(transaction=False)
        for w in ids:
            pipe.execute_command("HMGET", keys.worker(w), *_FIELDS, **{NEVER_DECODE: []})
        by_id: dict[str, Model] = {}
        for reply in await pipe.execute(raise_on_error=False):
            if not isinstance(reply, list):
                continue  # a key of another type: not a worker's
            fields = [_utf8(v) if v else "" for v in reply]
            if None in fields:
                continue  # not UTF-8: not a worker's
            model, model_id, max_len, state, beat, served = fields
            if not model or state != "serving" or not served:
                continue  # expired, or stopping
            names = set(model.split(","))
            mid = model_id or min(names, key=len)
            m = by_id.setdefault(mid, Model(mid, _count(max_len), created=10**10, served=served))
            m.names |= names | {mid, served}
            m.workers += 1
            if _count(beat):
                m.created = min(m.created, _count(beat) // 1000)
        self.cached = sorted(by_id.values(), key=lambda m: m.id)
        self.at = time.monotonic()
        return self.cached

    async def names(self) -> set[str]:
        return {n for m in await self.live() for n in m.names}

    async def route(self, name: str) -> str | None:
        """The queue of the model a request names (any of its names), None if not served."""
        return next((m.served for m in await self.live() if name in m.names), None)


def _count(v: str) -> int:
    """A heartbeat's count field; 0 when it is not one (str.isdigit takes '²', which int
    refuses)."""
    return int(v) if _COUNT.fullmatch(v) else 0


def _utf8(v: bytes | str) -> str | None:
    if isinstance(v, str):
        return v
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return None
