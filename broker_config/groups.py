"""Consumer-group bootstrap for the request streams."""

from __future__ import annotations

import redis

from plurai.broker_config import keys
from plurai.broker_config.memory import is_oom
from plurai.broker_config.text import text


def ensure_groups(r: redis.Redis, streams: list[str]) -> None:
    """Create the `workers` group on these request streams, creating the streams too.

    The group starts at id 0 so entries added before any worker existed are delivered.
    Idempotent: an existing group (BUSYGROUP) is left as it is. A Redis at its maxmemory
    refuses even a group that exists (OOM): that one is looked up instead, so a worker
    restarted while Redis is full starts all the same.
    """
    for stream in streams:
        try:
            r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" in str(e) or (is_oom(e) and _has_group(r, stream)):
                continue
            raise


def _has_group(r: redis.Redis, stream: str) -> bool:
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return False
    return any(text(g["name"]) == keys.GROUP for g in groups)


def request_streams(r: redis.Redis, lanes: list[str]) -> list[str]:
    """The request streams of the default model and of every model workers have served
    (plurai:models), every shard: what maintenance looks at."""
    from plurai.broker_config.routes import Routes
    from plurai.broker_config.settings import Settings

    settings = Settings()
    routes = Routes(settings)
    routes.load(routes.read(r))
    models = dict.fromkeys([settings.default_model, *sorted(routes.models)])
    return [
        keys.request_stream(lane, model, shard)
        for model in models
        for lane in lanes
        for shard in range(routes.shards(model))
    ]


def forget_dead_consumers(r: redis.Redis, lanes: list[str], min_idle_ms: int) -> list[str]:
    """Remove group consumers that hold no entries, have no live heartbeat and have been
    idle at least `min_idle_ms`: what dead workers leave behind. Their entries were already
    reclaimed by live workers (XPENDING IDLE, XCLAIM), so nothing pending is dropped; a worker that
    comes back under the same name is re-added by its next read."""
    removed = []
    for stream in request_streams(r, lanes):
        try:
            consumers = r.xinfo_consumers(stream, keys.GROUP)
        except redis.ResponseError:  # no stream or group yet
            continue
        for c in consumers:
            name = text(c["name"])
            if c["pending"] == 0 and c["idle"] >= min_idle_ms and not r.exists(keys.worker(name)):
                r.xgroup_delconsumer(stream, keys.GROUP, name)
                removed.append(f"{stream}/{name}")
    return removed


def forget_dead_workers(r: redis.Redis) -> list[str]:
    """Drop from `plurai:workers` the ids whose heartbeat hash has expired (workers killed
    before they could remove themselves), so `plurai status` lists only live ones."""
    ids = [text(i) for i in r.smembers(keys.WORKERS)]
    dead = [i for i in ids if not r.exists(keys.worker(i))]
    if dead:
        r.srem(keys.WORKERS, *dead)
    return sorted(dead)
