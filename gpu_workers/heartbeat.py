"""A worker's heartbeat: its figures for `plurai status` and the metrics, its model's entry
in `plurai:models` (what clients route by), the lease on the entries it holds, and a look
at its jobs' records."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import redis

from broker_config import keys
from broker_config.connection import is_cluster
from broker_config.routes import registry_value
from broker_config.settings import Settings
from gpu_workers.intake import Entry
from gpu_workers.writer import now_ms
from results import jobs

log = logging.getLogger("plurai.worker")


class Heartbeat:
    def __init__(
        self, r: redis.Redis, settings: Settings, worker_id: str, model_names: set[str]
    ) -> None:
        self.r, self.settings, self.id, self.model_names = r, settings, worker_id, model_names
        self.cluster = is_cluster(r)

    def publish(self, s: dict[str, Any], **figures: Any) -> None:
        """The worker's hash (expiring after three beats) and its name in the workers set.
        Keys of the wrong type (written by something else) are taken back."""
        hits = s.get("prefix_hit_blocks", 0) + s.get("kv_host_hits", 0) + s.get("kv_redis_hits", 0)
        lookups = s.get("prefix_lookup_blocks", 0)
        beat = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "beat_ms": now_ms(),
            "model": ",".join(sorted(self.model_names)),
            "served_model": self.settings.model,
            "shards": self.settings.shards,
            "waiting": s.get("waiting", 0),
            "kv_blocks_total": s.get("blocks_total", 0),
            "kv_blocks_used": s.get("blocks_used", 0),
            "kv_blocks_free": s.get("blocks_free", 0),
            "kv_blocks_cached": s.get("blocks_cached", 0),
            "prefix_hit_rate": round(hits / lookups, 4) if lookups else 0.0,
            # blocks served from each cache tier so far (device, host, the Redis pool)
            "kv_device_hits": s.get("prefix_hit_blocks", 0),
            "kv_host_hits": s.get("kv_host_hits", 0),
            "kv_redis_hits": s.get("kv_redis_hits", 0),
            # speculative decoding: tokens proposed and accepted so far
            "spec_proposed": s.get("spec_proposed_tokens", 0),
            "spec_accepted": s.get("spec_accepted_tokens", 0),
            **figures,
        }
        beat["tokens_per_s"] = round(beat.get("tokens_per_s", 0.0), 2)
        ttl = max(1, int(3 * self.settings.heartbeat_interval_s))
        for _ in range(2):  # a second time only after taking back keys of the wrong type
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(keys.worker(self.id), mapping=beat)
            pipe.expire(keys.worker(self.id), ttl)
            pipe.sadd(keys.WORKERS, self.id)
            if beat["state"] == "serving":
                value = registry_value(
                    self.settings.shards,
                    beat["beat_ms"],
                    model_id=beat.get("model_id", ""),
                    names=self.model_names,
                    max_model_len=beat.get("max_model_len", 0),
                )
                pipe.hset(keys.MODELS, self.settings.model, value)
            replies = pipe.execute(raise_on_error=False)
            names = (keys.worker(self.id), "", keys.WORKERS, keys.MODELS)
            bad = {
                k
                for k, rep in zip(names, replies, strict=False)
                if k and isinstance(rep, redis.ResponseError) and "WRONGTYPE" in str(rep)
            }
            if not bad:
                return
            log.error("heartbeat keys %s held another type; replaced", sorted(bad))
            self.r.delete(*bad)

    def renew(self, entries: list[Entry]) -> Iterator[Entry]:
        """Renew the lease on these entries, so only a dead (or stalled) worker's entries
        pass reclaim_idle_ms; yields those another worker owns now (it reclaimed them while
        this one stalled): their jobs are to be dropped here, unwritten."""
        by_stream: dict[str, list[Entry]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry)
        for stream, held in by_stream.items():
            ids = [e.entry_id for e in held]
            lost = set(jobs.run(self.r, jobs.renew(stream=stream, consumer=self.id, entry_ids=ids)))
            for entry in held:
                if entry.entry_id in lost:
                    log.warning(
                        "job's entry is another worker's now (reclaimed after a stall?); dropped",
                        extra={"job_id": entry.job_id, "lane": entry.lane},
                    )
                    yield entry

    def check(self, job_ids: list[str]) -> list[tuple[str, int]]:
        """The jobs to end: (job id, 1) where a cancel was asked (its message may have been
        lost), (job id, 2) where the record is no longer a hash."""
        if not job_ids:
            return []
        # one call per hash slot: every job at once on one Redis, a job each on a Cluster
        by_slot: dict[int, list[str]] = {}
        for j in job_ids:
            slot = self.r.keyslot(keys.job(j)) if self.cluster else 0
            by_slot.setdefault(slot, []).append(j)
        out = []
        for ids in by_slot.values():
            flags = jobs.run(self.r, jobs.check(job_ids=ids))
            out += [(j, f) for j, f in zip(ids, flags, strict=True) if f]
        return out
