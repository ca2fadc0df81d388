"""An operator's controls of a lane (`plurai lane pause|resume|purge`).

Pause: workers take no new entries from the lane (they read keys.PAUSED at each heartbeat,
so it holds within PLURAI_HEARTBEAT_INTERVAL_S); jobs that run go on, and jobs keep being
submitted to it. Resume undoes it. Purge cancels every job that waits in the lane (not yet
taken, handed back by a preempted or drained run, or delayed by `not_before`): each gets
its final `cancelled` result at once, as a cancel of a queued job does, and its entry is
deleted where no worker has read it (else acknowledged by the worker that did). A running
job is not touched: cancel it by its id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import redis

from plurai.broker_config import keys, protocol
from plurai.broker_config.connection import is_cluster
from plurai.broker_config.errors import CodedError
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.broker_config.stats import paused_lanes
from plurai.broker_config.text import text
from plurai.producer.client import cancel_call
from plurai.results import jobs

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

    def cancel(ids: list[str]) -> int:
        # whether each had ended before, then its cancel: in order, on its job's node
        calls: list[Any] = [["HEXISTS", keys.job(j), "final"] for j in ids]
        calls += [cancel_call(settings, j) for j in ids]
        replies = jobs.pipeline(r, calls, cluster) if ids else []
        ended, answers = replies[: len(ids)], replies[len(ids) :]
        return sum(
            1 for e, a in zip(ended, answers, strict=True) if e == 0 and text(a) == "cancelled"
        )

    for shard in range(routes.shards(name)):
        stream = keys.request_stream(lane, name, shard)
        for entries in _waiting(r, stream):
            cancelled += cancel([job_id for _, job_id in entries])
            jobs.run(r, jobs.unqueue(stream=stream, entry_ids=[i for i, _ in entries]))
        delayed = keys.delayed(name, shard)
        for members in _delayed(r, delayed, lane):
            cancelled += cancel([job_id for _, job_id in members])
            r.zrem(delayed, *[m for m, _ in members])
    return cancelled


def _delayed(r: redis.Redis, delayed: str, lane: str) -> Iterator[list[tuple[bytes, str]]]:
    """Pages of (member, job id) of the delayed jobs of `lane` in a shard's delayed set."""
    page: list[tuple[bytes, str]] = []
    for member, _ in r.zscan_iter(delayed, count=PAGE):
        try:
            entry = msgpack.unpackb(member, raw=True)
        except (ValueError, msgpack.UnpackException):
            continue  # not an entry: the worker that meets it dead-letters it
        if not isinstance(entry, list) or len(entry) < 3 or entry[0] != lane.encode():
            continue
        fields = dict(zip(entry[1::2], entry[2::2], strict=False))
        job_id = _job_id(fields)
        if job_id:
            page.append((member, job_id))
        if len(page) >= PAGE:
            yield page
            page = []
    if page:
        yield page


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
