"""Which queue a model's requests go to: the models workers serve, read from
`plurai:models` (each worker writes its model's shard count and its last heartbeat there)
and kept for a few seconds, so a submit costs no extra round trip."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from broker_config import keys
from broker_config.settings import Settings
from broker_config.text import text

REFRESH_S = 2.0  # how long a reading of plurai:models is used


class Routes:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, dict[str, int]] = {}  # model -> {"shards", "beat_ms"}
        self._read_at = -REFRESH_S

    def stale(self) -> bool:
        return time.monotonic() - self._read_at >= REFRESH_S

    def read(self, r: Any) -> dict[Any, Any]:
        """HGETALL of plurai:models; {} when the key holds another type (written by
        something else: the next worker heartbeat takes it back)."""
        try:
            return r.hgetall(keys.MODELS)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            return {}

    async def read_async(self, r: Any) -> dict[Any, Any]:
        """`read`, awaited."""
        try:
            return await r.hgetall(keys.MODELS)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            return {}

    def load(self, raw: dict[Any, Any]) -> None:
        """Take a reading of plurai:models (HGETALL); malformed values are skipped."""
        models = {}
        for name, value in raw.items():
            try:
                info = json.loads(text(value))
                models[text(name)] = {
                    "shards": max(1, min(int(info["shards"]), 256)),
                    "beat_ms": int(info["beat_ms"]),
                }
            except (ValueError, KeyError, TypeError, OverflowError):  # Infinity: OverflowError
                continue
        self.models, self._read_at = models, time.monotonic()

    def live(self) -> list[str]:
        """Models with a worker that beat within three heartbeat intervals (plus 5 s of
        clock skew between hosts)."""
        window_ms = 1000 * (3 * self.settings.heartbeat_interval_s + 5)
        now = time.time() * 1000
        return sorted(m for m, info in self.models.items() if now - info["beat_ms"] < window_ms)

    def shards(self, model: str) -> int:
        """The model's shard count: its workers' setting; 1 before any worker served it."""
        info = self.models.get(model)
        return info["shards"] if info else 1

    def refused(self, model: str) -> bool:
        """Whether a request for `model` is refused at submit: PLURAI_UNSERVED=refuse and no
        live worker serves it."""
        return self.settings.unserved == "refuse" and model not in self.live()


def registry_value(shards: int, beat_ms: int) -> str:
    """A worker's entry in plurai:models."""
    return json.dumps({"shards": shards, "beat_ms": beat_ms}, separators=(",", ":"))


__all__ = ["REFRESH_S", "Routes", "registry_value"]
