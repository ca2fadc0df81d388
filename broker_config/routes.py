"""The model directory: which models live workers serve, and where a request for one goes.

Every serving worker writes its model's entry in `plurai:models` at each heartbeat (the
shard count its workers read, the names it answers to, its context length, the beat's
time); a client writes `beat_ms` 0 for a model it names before any worker served it. The
SDK, the gateway and `plurai status` read this one key, keep a reading for REFRESH_S (so a
submit costs no extra round trip) and judge a model live by one rule (`live`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import NEVER_DECODE

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings

REFRESH_S = 2.0  # how long a reading of plurai:models is used
MAX_SHARDS = 256
_RAW: dict[str, Any] = {NEVER_DECODE: []}  # an option of execute_command: reply as bytes


@dataclass(frozen=True, slots=True)
class Model:
    """One entry of plurai:models."""

    queue: str  # the name its workers read requests under (PLURAI_SERVED_MODEL)
    shards: int = 1
    beat_ms: int = 0  # a worker's last heartbeat (0: named by a client, never served)
    id: str = ""  # the model folder's name (GET /v1/models)
    names: frozenset[str] = frozenset()  # every name a request may give it by
    max_model_len: int = 0


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def parse_entry(field: bytes, value: bytes) -> Model | None:
    """The Model of an entry (read undecoded); None when it is not one a worker or client
    writes."""
    try:
        queue = field.decode("utf-8")
        info = json.loads(value.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(info, dict):
        return None
    shards, beat_ms = _count(info.get("shards")), _count(info.get("beat_ms"))
    mid, names = info.get("id", ""), info.get("names", [])
    max_len = _count(info.get("max_model_len", 0))
    if shards is None or beat_ms is None or max_len is None or not isinstance(mid, str):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    mid = mid or queue
    return Model(
        queue=queue,
        shards=max(1, min(shards, MAX_SHARDS)),
        beat_ms=beat_ms,
        id=mid,
        names=frozenset(names) | {mid, queue},
        max_model_len=max_len,
    )


class Routes:
    """A reading of the model directory (plurai:models)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, Model] = {}  # queue -> its entry
        self._read_at = -REFRESH_S

    def stale(self) -> bool:
        return time.monotonic() - self._read_at >= REFRESH_S

    def read(self, r: Any) -> dict[bytes, bytes]:
        """HGETALL of plurai:models, undecoded whatever the connection decodes (an entry
        that is not UTF-8 is skipped, never a failed reply); {} when the key holds another
        type (written by something else: the next worker heartbeat takes it back)."""
        try:
            return r.execute_command("HGETALL", keys.MODELS, **_RAW)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            return {}

    async def read_async(self, r: Any) -> dict[bytes, bytes]:
        """`read`, awaited."""
        try:
            return await r.execute_command("HGETALL", keys.MODELS, **_RAW)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            return {}

    def load(self, raw: dict[bytes, bytes]) -> None:
        """Take a reading of plurai:models (`read`); malformed entries are skipped."""
        found = (parse_entry(k, v) for k, v in raw.items())
        self.models = {m.queue: m for m in found if m is not None}
        self._read_at = time.monotonic()

    def is_live(self, m: Model) -> bool:
        """The liveness rule: a worker serving it beat within three heartbeat intervals
        (plus 5 s of clock skew between hosts)."""
        window_ms = 1000 * (3 * self.settings.heartbeat_interval_s + 5)
        return time.time() * 1000 - m.beat_ms < window_ms

    def served(self) -> list[Model]:
        """The live models, by id."""
        return sorted((m for m in self.models.values() if self.is_live(m)), key=_by_id)

    def live(self) -> list[str]:
        """The queues of the live models."""
        return sorted(m.queue for m in self.served())

    def route(self, name: str) -> str | None:
        """The queue of the live model a request names (by any of its names); None when no
        live worker answers to it."""
        return next((m.queue for m in self.served() if name in m.names), None)

    def shards(self, model: str) -> int:
        """The model's shard count: its workers' setting; 1 before any worker served it."""
        m = self.models.get(model)
        return m.shards if m is not None else 1

    def refused(self, model: str) -> bool:
        """Whether a request for `model` is refused at submit: PLURAI_UNSERVED=refuse and no
        live worker serves it."""
        return self.settings.unserved == "refuse" and model not in self.live()


def _by_id(m: Model) -> tuple[str, str]:
    return m.id, m.queue


def registry_value(
    shards: int,
    beat_ms: int,
    *,
    model_id: str = "",
    names: Iterable[str] = (),
    max_model_len: int = 0,
) -> str:
    """A model's entry in plurai:models."""
    entry: dict[str, Any] = {"shards": shards, "beat_ms": beat_ms}
    if model_id:
        entry["id"] = model_id
    if names:
        entry["names"] = sorted(names)
    if max_model_len:
        entry["max_model_len"] = max_model_len
    return json.dumps(entry, separators=(",", ":"))


__all__ = ["REFRESH_S", "Model", "Routes", "parse_entry", "registry_value"]
