"""An operator's controls of a lane (`plurai lane pause|resume|purge`).

Pause: workers take no new entries from the lane (they read keys.PAUSED at each heartbeat,
so it holds within PLURAI_HEARTBEAT_INTERVAL_S); jobs that run go on, and jobs keep being
submitted to it. Resume undoes it. Purge cancels every job that waits in the lane (not yet
taken, or handed back by a preempted or drained run): each gets its final `cancelled`
result at once, as a cancel of a queued job does, and its entry is acknowledged by the next
worker that reads it. A running job is not touched: cancel it by its id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis

from broker_config import keys, protocol
from broker_config.connection import is_cluster
from broker_config.errors import CodedError
from broker_config.routes import Routes
from broker_config.settings import Settings
from broker_config.stats import paused_lanes
from broker_config.text import text
from producer.client import cancel_call
from results import jobs

PAGE = 1000  # entries read and cancelled in one round trip


class LaneCode:
    """Why a lane control was refused (LaneError.code)."""

    UNKNOWN_LANE = "unknown_lane"  # not one of the deployment's lanes (PLURAI_LANES)
    BAD_MODEL = "bad_model"  # not a model name


class LaneError(CodedError):
    """A lane control refused: `code` (LaneCode) and what to give instead."""


def _member(settings: Settings, lane: str, model: str | None) -> tuple[str, str]:
    if lane not in settings.lanes:
        raise LaneError(
            LaneCode.UNKNOWN_LANE, f"no lane {lane[:64]!r}: the lanes are {list(settings.lanes)}"
        )
    name = model if model is not None else settings.default_model
    try:
        protocol.model_name(name)
    except ValueError as e:
        raise LaneError(LaneCode.BAD_MODEL, str(e)) from e
    return name, lane


def pause(
    r: redis.Redis, lane: str, model: str | None = None, settings: Settings | None = None
) -> bool:
    """Stop workers taking new entries from `model`'s `lane`; False if it was paused."""
    name, lane = _member(settings or Settings(), lane, model)
    return bool(r.sadd(keys.PAUSED, keys.paused_member(name, lane)))


def resume(
    r: redis.Redis, lane: str, model: str | None = None, settings: Settings | None = None
) -> bool:
    """Let workers take from the lane again; False if it was not paused."""
    name, lane = _member(settings or Settings(), lane, model)
    return bool(r.srem(keys.PAUSED, keys.paused_member(name, lane)))


def paused(r: redis.Redis) -> list[tuple[str, str]]:
    """The paused lanes, as (model, lane)."""
    return sorted(tuple(m.split(":", 1)) for m in paused_lanes(r) if ":" in m)  # type: ignore[misc]


def purge(
    r: redis.Redis, lane: str, model: str | None = None, settings: Settings | None = None
) -> int:
    """Cancel every job waiting in `model`'s `lane`, of every shard, and delete their
    entries no worker has read; how many jobs were cancelled here (one that had ended, or
    began meanwhile, is left as it is)."""
    settings = settings or Settings()
    name, lane = _member(settings, lane, model)
    routes = Routes(settings)
    routes.load(routes.read(r))
    cluster, cancelled = is_cluster(r), 0
    for shard in range(routes.shards(name)):
        stream = keys.request_stream(lane, name, shard)
        for entries in _waiting(r, stream):
            ids = [job_id for _, job_id in entries]
            # whether each had ended before, then its cancel: in order, on its job's node
            calls: list[Any] = [["HEXISTS", keys.job(j), "final"] for j in ids]
            calls += [cancel_call(settings, j) for j in ids]
            replies = jobs.pipeline(r, calls, cluster) if ids else []
            ended, answers = replies[: len(ids)], replies[len(ids) :]
            cancelled += sum(
                1 for e, a in zip(ended, answers, strict=True) if e == 0 and text(a) == "cancelled"
            )
            jobs.run(r, jobs.unqueue(stream=stream, entry_ids=[i for i, _ in entries]))
    return cancelled


def _waiting(r: redis.Redis, stream: str) -> Iterator[list[tuple[bytes, str]]]:
    """Pages of (entry id, job id) of the jobs that wait in `stream`: entries the group has
    not delivered, then those handed over (preempted or drained jobs, which keep their
    place; UNQUEUE leaves those to the worker that takes them)."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return
    group = next((g for g in groups if text(g["name"]) == keys.GROUP), None)
    start = "-" if group is None else "(" + text(group["last-delivered-id"])
    while True:
        rows = r.xrange(stream, start, "+", count=PAGE)
        if not rows:
            break
        yield [(i, j) for i, j in ((i, _job_id(f)) for i, f in rows) if j]
        start = "(" + text(rows[-1][0])
    if group is None:
        return
    after = "-"
    while True:
        pending = r.xpending_range(stream, keys.GROUP, after, "+", PAGE, keys.HANDED_OVER)
        if not pending:
            break
        wanted = {text(p["message_id"]) for p in pending}
        first, last = pending[0]["message_id"], pending[-1]["message_id"]
        rows = r.xrange(stream, first, last)
        yield [(i, j) for i, j in ((i, _job_id(f)) for i, f in rows if text(i) in wanted) if j]
        after = "(" + text(last)


def _job_id(fields: dict[Any, Any]) -> str | None:
    try:
        return protocol.job_id_of(
            {k if isinstance(k, bytes) else k.encode(): v for k, v in fields.items()}
        )
    except protocol.NoJobId:
        return None
