"""What the queue holds and what the workers report, read from Redis.

One reading serves `plurai status` (terminal and --json) and the queue gauges of every
worker's /metrics endpoint, so both always agree.

A lane's entries are either waiting (not yet delivered to any worker, or handed over by
a worker that preempted their job) or pending (taken by a worker, not yet acknowledged). Workers delete the entries they acknowledge, so the
stream's length is waiting + pending. Each model has its own lanes (summed over its
shards): the default model's, and those of every model in plurai:models (served now or
before, or named by a client while no worker served it).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import redis

from plurai.broker_config import keys
from plurai.broker_config.text import text as _s


@dataclass
class Lane:
    name: str
    model: str = keys.DEFAULT_MODEL
    workers: int = 0  # live workers serving the model
    waiting: int = 0  # entries no worker has taken yet (the queue depth)
    pending: int = 0  # entries taken by a worker and not yet acknowledged
    oldest_waiting_age_s: float | None = None  # since the oldest waiting entry was added
    consumers: int = 0  # group consumers known to Redis (live or not yet forgotten)
    paused: bool = False  # workers take no new entries from it (`plurai lane pause`)


@dataclass
class WorkerInfo:
    id: str
    host: str = ""
    pid: int = 0
    state: str = ""  # starting, serving, stopping
    stage: str = ""  # while starting: the step it is in (loading model, ...)
    model: str = ""  # every name the worker answers to
    served_model: str = ""  # the queue it reads
    beat_age_s: float = 0.0
    running: int = 0
    waiting: int = 0
    held: int = 0
    jobs_done: int = 0
    # lane -> [jobs ended, tokens they generated here] (the heartbeat's JSON)
    lanes_done: dict[str, list[int]] = field(default_factory=dict)
    jobs_resumed: int = 0  # begun from another run's output (its progress)
    jobs_handed_over: int = 0  # preempted there and handed over with their output
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    generation_tokens: int = 0
    tokens_per_s: float = 0.0
    prefix_hit_rate: float = 0.0
    spec_proposed: int = 0  # speculative decoding: tokens proposed and accepted
    spec_accepted: int = 0
    metrics_port: int = 0  # 0: no /metrics endpoint


@dataclass
class Snapshot:
    time_s: float
    lanes: list[Lane]
    workers: list[WorkerInfo]
    dead_letters: int
    stale_workers: int = 0  # ids in plurai:workers whose heartbeat has expired
    totals: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms_of(entry_id: Any) -> int:
    return int(_s(entry_id).split("-", 1)[0])


def lane(r: redis.Redis, name: str, now_ms: int, model: str, shards: int = 1) -> Lane:
    """One lane of a model's queue, its shards summed."""
    out = Lane(name=name, model=model)
    for shard in range(shards):
        part = _stream(r, keys.request_stream(name, model, shard), name, now_ms)
        out.waiting += part.waiting
        out.pending += part.pending
        out.consumers += part.consumers
        if part.oldest_waiting_age_s is not None:
            out.oldest_waiting_age_s = max(
                out.oldest_waiting_age_s or 0.0, part.oldest_waiting_age_s
            )
    return out


def _stream(r: redis.Redis, stream: str, name: str, now_ms: int) -> Lane:
    out = Lane(name=name)
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream yet
        return out
    length = r.xlen(stream)
    group = next((g for g in groups if _s(g["name"]) == keys.GROUP), None)
    if group is None:  # entries added before any worker created the group: all waiting
        first = r.xrange(stream, count=1)
        out.waiting = length
    else:
        out.pending = int(group["pending"])
        out.consumers = int(group["consumers"])
        # preempted and drained jobs' entries, pending to keys.HANDED_OVER, wait too
        handed = 0
        if out.pending:
            held = r.xpending(stream, keys.GROUP).get("consumers") or []
            handed = sum(int(c["pending"]) for c in held if _s(c["name"]) == keys.HANDED_OVER)
        out.pending -= handed
        out.waiting = max(0, length - out.pending)
        last = _s(group["last-delivered-id"])
        first = r.xrange(stream, "-" if last == "0-0" else f"({last}", count=1)
        if handed:
            oldest = r.xpending_range(
                stream, keys.GROUP, "-", "+", 1, consumername=keys.HANDED_OVER
            )
            first = [(oldest[0]["message_id"], {})] if oldest else first
    if first and out.waiting:
        out.oldest_waiting_age_s = max(0.0, (now_ms - _ms_of(first[0][0])) / 1000)
    return out


def workers(r: redis.Redis, now_ms: int) -> tuple[list[WorkerInfo], int]:
    """Live workers (those whose heartbeat hash has not expired), and how many listed ids
    have none."""
    ids = sorted(_s(i) for i in r.smembers(keys.WORKERS))
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(keys.worker(worker_id))
    live, stale = [], 0
    for worker_id, raw in zip(ids, pipe.execute(), strict=True):
        if not raw:
            stale += 1
            continue
        h = {_s(k): _s(v) for k, v in raw.items()}
        info = WorkerInfo(worker_id)
        for f in fields(WorkerInfo):  # the heartbeat hash uses the same names
            if f.name == "lanes_done":
                info.lanes_done = _lanes_done(h.get(f.name, ""))
            elif h.get(f.name) and f.name != "id":
                setattr(info, f.name, _figure(type(f.default), h[f.name], f.default))
        beat_ms = _figure(int, h.get("beat_ms", ""), now_ms)
        info.beat_age_s = max(0.0, (now_ms - beat_ms) / 1000)
        live.append(info)
    return live, stale


def _figure(kind: type, raw: str, default: Any) -> Any:
    """A heartbeat field as its type; the default where it holds no finite number."""
    if kind is str:
        return raw[:1024]
    try:
        value = float(raw)
    except ValueError:
        return default
    if not math.isfinite(value):
        return default
    return int(value) if kind is int else value


def _lanes_done(raw: str) -> dict[str, list[int]]:
    """The heartbeat's per-lane counts; {} for anything else (an older worker's none)."""
    try:
        value = json.loads(raw[:65536]) if raw else {}
    except (ValueError, RecursionError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {
        str(lane)[:64]: [int(c[0]), int(c[1])]
        for lane, c in list(value.items())[:64]
        if isinstance(c, list) and len(c) == 2 and all(type(x) is int for x in c)
    }


def paused_lanes(r: redis.Redis) -> set[str]:
    """The members of plurai:paused ("<model>:<lane>"); none when the key holds another
    type (written by something else: then no lane is paused)."""
    try:
        return {_s(m)[:256] for m in r.smembers(keys.PAUSED)}
    except redis.ResponseError:
        return set()


def serving_workers(r: redis.Redis) -> int:
    """How many workers are ready (state serving): a worker is listed from the start of its
    start, so a count of the workers set is not a count of the ready ones."""
    ids = list(r.smembers(keys.WORKERS))
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hget(keys.worker(_s(worker_id)), "state")
    return sum(1 for state in pipe.execute() if state and _s(state) == "serving")


def redis_now_ms(r: redis.Redis) -> int:
    """Redis's clock: stream ids carry it, so entry ages are right whatever this host's is."""
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def models(r: redis.Redis, default: str) -> dict[str, int]:
    """model -> shard count: the default model and those in plurai:models."""
    from plurai.broker_config.routes import Routes
    from plurai.broker_config.settings import Settings

    routes = Routes(Settings())
    routes.load(routes.read(r))
    return {m: routes.shards(m) for m in dict.fromkeys([default, *sorted(routes.models)])}


def snapshot(r: redis.Redis, lanes: list[str], default_model: str = keys.DEFAULT_MODEL) -> Snapshot:
    now_ms = redis_now_ms(r)
    ws, stale = workers(r, now_ms)
    serving: dict[str, int] = {}
    for w in ws:
        if w.state == "serving":
            serving[w.served_model] = serving.get(w.served_model, 0) + 1
    served = models(r, default_model)
    queues = [
        lane(r, name, now_ms, model, shards) for model, shards in served.items() for name in lanes
    ]
    scheduled = sum(
        _scheduled(r, model, shard) for model, n in served.items() for shard in range(n)
    )
    paused = paused_lanes(r)
    for q in queues:
        q.workers = serving.get(q.model, 0)
        q.paused = keys.paused_member(q.model, q.name) in paused
    snap = Snapshot(
        time_s=time.time(),
        lanes=queues,
        workers=ws,
        dead_letters=int(r.xlen(keys.DEAD_LETTER)),
        stale_workers=stale,
    )
    snap.totals = {
        "waiting": sum(x.waiting for x in snap.lanes),
        "pending": sum(x.pending for x in snap.lanes),
        "workers": len(ws),
        "running": sum(w.running for w in ws),
        "kv_blocks_total": sum(w.kv_blocks_total for w in ws),
        "kv_blocks_used": sum(w.kv_blocks_used for w in ws),
        "tokens_per_s": round(sum(w.tokens_per_s for w in ws), 1),
        "jobs_done": sum(w.jobs_done for w in ws),
        "scheduled": scheduled,  # delayed jobs whose time has not come (not_before)
        **{f"webhooks_{k}": v for k, v in webhook_counts(r).items()},
    }
    return snap


def webhook_counts(r: redis.Redis) -> dict[str, int]:
    """Webhooks waiting (their job not ended, or a try due) and those delivered, failed and
    dropped (no record) since the deployment began (results/webhooks.py)."""
    out = dict.fromkeys(("waiting", "delivered", "failed", "dropped"), 0)
    try:
        out["waiting"] = int(r.zcard(keys.WEBHOOKS_DUE))
        for k, v in r.hgetall(keys.WEBHOOKS_COUNTS).items():
            if _s(k) in out:
                out[_s(k)] = int(v)
    except (redis.ResponseError, ValueError):  # another type, or not counts: written by hand
        pass
    return out


def _scheduled(r: redis.Redis, model: str, shard: int) -> int:
    try:
        return int(r.zcard(keys.delayed(model, shard)))
    except redis.ResponseError:  # another type: nothing a worker would move
        return 0
