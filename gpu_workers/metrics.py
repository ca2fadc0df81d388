"""Prometheus metrics of one worker, served on http://<host>:<port>/metrics.

Three sources, one registry:
- what the worker does (jobs, tokens, errors, latencies, reclaims, dead letters,
  heartbeats): counters and histograms updated as it happens;
- the engine (KV blocks, sequences, prefix-cache hits per tier): copied from
  `Engine.stats()` by the worker loop at most once a second, and exported as they are at
  scrape time, so the HTTP thread never touches the engine;
- the queue (depth, oldest age, pending per lane, dead letters, live workers): read from
  Redis at scrape time (broker_config.stats), the same figures `plurai status` shows.

docs/operations.md lists every metric and the alerts worth setting on them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plurai.broker_config import stats

log = logging.getLogger("plurai.metrics")

# TTFT and queue wait reach hours on a backlogged batch lane
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    def __init__(self, worker_id: str, lanes: list[str]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.jobs_started = Counter(
            "plurai_jobs_started", "Jobs this worker began running.", ["lane"], registry=reg
        )
        self.jobs_resumed = Counter(
            "plurai_jobs_resumed",
            "Jobs this worker began from the output another run had made (its progress).",
            ["lane"],
            registry=reg,
        )
        self.jobs_handed_over = Counter(
            "plurai_jobs_handed_over",
            "Jobs this worker's engine preempted and handed over, with their progress, to the "
            "next worker with room (this one too).",
            ["lane"],
            registry=reg,
        )
        self.resumed_tokens = Counter(
            "plurai_resumed_tokens",
            "Output tokens of resumed jobs that were not generated again.",
            registry=reg,
        )
        self.jobs_finished = Counter(
            "plurai_jobs_finished",
            "Jobs this worker ended, by lane and final state (a job rerun after a reclaim "
            "counts on each worker that ran it; only the first result is stored).",
            ["lane", "state"],
            registry=reg,
        )
        self.errors = Counter(
            "plurai_errors", "Jobs that ended with an error, by error code.", ["code"], registry=reg
        )
        self.prompt_tokens = Counter(
            "plurai_prompt_tokens", "Prompt tokens of finished jobs.", registry=reg
        )
        self.cached_tokens = Counter(
            "plurai_cached_prompt_tokens",
            "Prompt tokens of finished jobs served from the prefix cache (any tier).",
            registry=reg,
        )
        self.generation_tokens = Counter(
            "plurai_generation_tokens", "Tokens generated (rate() gives tokens/s).", registry=reg
        )
        self.tokens_per_s = Gauge(
            "plurai_generation_tokens_per_second",
            "Tokens generated per second over the last heartbeat interval.",
            registry=reg,
        )
        self.reclaimed = Counter(
            "plurai_reclaimed_entries",
            "Entries this worker took over from a dead worker (XCLAIM).",
            ["lane"],
            registry=reg,
        )
        self.dead_lettered = Counter(
            "plurai_dead_lettered_entries",
            "Entries this worker moved to the dead-letter stream, by reason.",
            ["reason"],
            registry=reg,
        )
        self.heartbeats = Counter("plurai_heartbeats", "Heartbeats written.", registry=reg)
        self.last_heartbeat = Gauge(
            "plurai_last_heartbeat_timestamp_seconds",
            "Unix time of the last heartbeat written to Redis.",
            registry=reg,
        )
        self.redis_errors = Counter(
            "plurai_redis_errors",
            "Times the worker lost Redis and retried with back-off.",
            registry=reg,
        )
        self.ttft = Histogram(
            "plurai_time_to_first_token_seconds",
            "From the job's entry entering its lane to its first generated token.",
            ["lane"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "plurai_time_per_output_token_seconds",
            "Mean time between a job's output tokens after the first (jobs of 2+ tokens).",
            ["lane"],
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "plurai_e2e_request_latency_seconds",
            "From the job's entry entering its lane to its final result.",
            ["lane"],
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.queue_wait = Histogram(
            "plurai_queue_wait_seconds",
            "From the job's entry entering its lane to a worker starting it.",
            ["lane"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        info = Gauge(
            "plurai_worker_info",
            "Constant 1, labelled with the worker id.",
            ["worker"],
            registry=reg,
        )
        info.labels(worker_id).set(1)
        for lane in lanes:  # series exist (at 0) from the start, so rate() works at once
            self.jobs_started.labels(lane)
            self.jobs_resumed.labels(lane)
            self.jobs_handed_over.labels(lane)
            self.reclaimed.labels(lane)
        self.engine = _EngineCollector()
        reg.register(self.engine)
        self.queue: _QueueCollector | None = None

    def watch_queue(self, r: redis.Redis, lanes: list[str], default_model: str = "default") -> None:
        """Export the queue's state, read from `r` at each scrape (its own connection)."""
        self.queue = _QueueCollector(r, lanes, default_model)
        self.registry.register(self.queue)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint in a daemon thread; returns the port it listens on."""
        server, _thread = start_http_server(port, host, registry=self.registry)
        return int(server.server_port)


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}  # replaced whole by the worker loop

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        gauges = {
            "plurai_kv_blocks_capacity": ("KV cache blocks on the device.", "blocks_total"),
            "plurai_kv_blocks_used": ("KV blocks held by sequences.", "blocks_used"),
            "plurai_kv_blocks_free": (
                "KV blocks free for new sequences (includes cached blocks, reused LRU first).",
                "blocks_free",
            ),
            "plurai_kv_blocks_cached": (
                "KV blocks holding a full block of a hashed prefix (in use or not).",
                "blocks_cached",
            ),
            "plurai_running_sequences": ("Sequences in the running batch.", "running"),
            "plurai_waiting_sequences": ("Sequences waiting for KV blocks.", "waiting"),
        }
        for name, (doc, key) in gauges.items():
            if key in s:  # the vLLM backend does not report cached blocks
                yield GaugeMetricFamily(name, doc, value=s[key])
        total = s["blocks_total"]
        yield GaugeMetricFamily(
            "plurai_kv_usage_ratio",
            "Share of device KV blocks held by sequences.",
            value=s["blocks_used"] / total if total else 0.0,
        )
        hits = CounterMetricFamily(
            "plurai_prefix_cache_hit_blocks",
            "Prompt blocks served from a prefix cache, by tier (device, host, redis).",
            labels=["tier"],
        )
        hits.add_metric(["device"], s["prefix_hit_blocks"])
        hits.add_metric(["host"], s.get("kv_host_hits", 0))
        hits.add_metric(["redis"], s.get("kv_redis_hits", 0))
        yield hits
        yield CounterMetricFamily(
            "plurai_prefix_cache_lookup_blocks",
            "Full prompt blocks looked up in the prefix cache (hit rate = hits / lookups).",
            value=s["prefix_lookup_blocks"],
        )
        yield CounterMetricFamily(
            "plurai_preemptions", "Sequences preempted for KV blocks.", value=s["preemptions"]
        )
        yield CounterMetricFamily("plurai_engine_steps", "Engine steps run.", value=s["steps"])
        if "spec_proposed_tokens" in s:
            yield CounterMetricFamily(
                "plurai_spec_proposed_tokens",
                "Tokens proposed by speculative decoding (prompt lookup or a draft model).",
                value=s["spec_proposed_tokens"],
            )
            yield CounterMetricFamily(
                "plurai_spec_accepted_tokens",
                "Proposed tokens accepted (acceptance = accepted / proposed).",
                value=s["spec_accepted_tokens"],
            )
        if "kv_bad_entries" in s:
            yield CounterMetricFamily(
                "plurai_kv_bad_entries",
                "KV blocks from Redis refused by their checks (recomputed).",
                value=s["kv_bad_entries"],
            )
        if "kv_spilled" in s:
            yield CounterMetricFamily(
                "plurai_kv_spilled_blocks",
                "Device KV blocks saved to the host tier on eviction.",
                value=s["kv_spilled"],
            )


class _QueueCollector(Collector):
    def __init__(self, r: redis.Redis, lanes: list[str], default_model: str) -> None:
        self.r, self.lanes, self.default_model = r, lanes, default_model

    def collect(self) -> Iterator[Metric]:
        try:
            snap = stats.snapshot(self.r, self.lanes, self.default_model)
        except redis.RedisError as e:
            log.warning("queue metrics unavailable: %s", e)
            yield GaugeMetricFamily(
                "plurai_redis_up", "1 when the last scrape could read Redis.", value=0
            )
            return
        yield GaugeMetricFamily(
            "plurai_redis_up", "1 when the last scrape could read Redis.", value=1
        )
        labels = ["model", "lane"]
        depth = GaugeMetricFamily(
            "plurai_queue_depth", "Entries waiting in the lane (not yet taken).", labels=labels
        )
        pending = GaugeMetricFamily(
            "plurai_queue_pending",
            "Entries taken by workers and not yet acknowledged.",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "plurai_queue_oldest_age_seconds",
            "Age of the oldest waiting entry (0 when none waits).",
            labels=labels,
        )
        served = GaugeMetricFamily(
            "plurai_model_workers",
            "Live workers serving the model (0: its jobs wait).",
            labels=["model"],
        )
        for lane in snap.lanes:
            depth.add_metric([lane.model, lane.name], lane.waiting)
            pending.add_metric([lane.model, lane.name], lane.pending)
            age.add_metric([lane.model, lane.name], lane.oldest_waiting_age_s or 0.0)
        for model, n in {lane.model: lane.workers for lane in snap.lanes}.items():
            served.add_metric([model], n)
        yield depth
        yield pending
        yield age
        yield served
        yield GaugeMetricFamily(
            "plurai_dead_letters", "Entries in the dead-letter stream.", value=snap.dead_letters
        )
        yield GaugeMetricFamily(
            "plurai_workers", "Workers with a live heartbeat.", value=len(snap.workers)
        )
        yield GaugeMetricFamily(
            "plurai_workers_starting",
            "Workers in their start (loading a model, ...): one that stays here does not serve.",
            value=sum(1 for w in snap.workers if w.state == "starting"),
        )
