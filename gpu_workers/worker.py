"""The long-lived worker loop. Each turn: take entries while the engine can start them
(admission.py says which, intake.py reads and begins them, starter.py puts them in the
engine), step, publish the step's tokens and results in one packed write (publish.py),
give back the jobs the engine preempted (give_back.py), end cancelled and expired jobs,
and beat (heartbeat.py: figures, leases). Bad input ends only its job. On SIGTERM it stops
taking work, lets running jobs run on for the grace period (none by default) and gives the
rest back with their progress, from which other workers resume them. The life of a job,
failures counted per job, leases and reclaiming: docs/architecture.md ("The worker").
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import redis

from plurai.broker_config import keys, memory
from plurai.broker_config.groups import ensure_groups
from plurai.broker_config.protocol import Code
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.admission import Admission, moving
from plurai.gpu_workers.backend import Backend
from plurai.gpu_workers.give_back import GiveBack
from plurai.gpu_workers.heartbeat import Heartbeat
from plurai.gpu_workers.intake import BAD_RECORD, Entry, Intake
from plurai.gpu_workers.job import Runs, Stream
from plurai.gpu_workers.metrics import Metrics
from plurai.gpu_workers.publish import Publisher
from plurai.gpu_workers.spans import Spans
from plurai.gpu_workers.starter import Starter
from plurai.gpu_workers.take import Taker
from plurai.gpu_workers.writer import Outage, Writer
from plurai.results import jobs, progress, records

log = logging.getLogger("plurai.worker")


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    def __init__(
        self,
        engine: Backend,
        r: redis.Redis,
        settings: Settings,
        worker_id: str | None = None,
        model_names: set[str] | None = None,
    ) -> None:
        self.engine, self.r, self.settings = engine, r, settings
        self.id = worker_id or settings.worker_id or new_worker_id()
        self.model = settings.model  # the queue it serves (keys.request_stream)
        self.model_names = (model_names or set()) | {self.model}
        self.model_id = Path(settings.model_dir).name if settings.model_dir else ""  # /v1/models
        self.lanes = list(settings.lanes)
        self.running = Runs(self.lanes[0])
        # taken, not yet in the backend: at most a turn's takes, or one per lane after a wait
        self.held: list[Entry] = []
        self.stopping, self.stop_deadline = False, 0.0
        self.metrics = Metrics(self.id, self.lanes)
        self.metrics_port = 0  # where /metrics is served (serve.py sets it), 0: nowhere
        self.writer = Writer(r, settings, self.id)
        self.writer.progress_head = progress.header(engine.model_fingerprint)
        self.spans = Spans(self.id, self.model, self.writer)  # while tracing.ON
        limits = settings.limits(engine.max_model_len - 1)
        self.intake = Intake(
            r, settings, self.id, self.metrics, self.writer, limits, self.model_names
        )
        self.intake.load = lambda: len(self.running) + len(self.held)
        self.beat = Heartbeat(r, settings, self.id, self.model_names)
        self.cancels = r.pubsub(ignore_subscribe_messages=True)
        self.admission = Admission.of(settings, engine, self.running)
        self.give_back = GiveBack(
            engine, self.intake, self.writer, self.spans, self.metrics, self.running
        )
        stream = Stream(
            tokens=settings.stream_flush_tokens, seconds=settings.stream_flush_ms / 1000
        )
        self.publisher = Publisher(
            self.id, engine, self.writer, self.spans, self.metrics, self.running, stream,
            self.admission.pace, self.give_back,
        )  # fmt: skip
        self.starter = Starter(
            engine, self.intake, self.spans, self.metrics, self.running, self.held, self.lanes,
            self.admission.pace, self.publisher, self.give_back,
        )  # fmt: skip
        self.taker = Taker(
            engine, self.intake, self.admission, self.starter, self.running, self.held,
            self.lanes, lambda: self.stopping,
        )  # fmt: skip
        self._turn_s = 0.0  # mean length of a turn that stepped the engine (moving)
        self._turn_start, self._stepped = 0.0, False
        self._next_beat = self._next_stats = 0.0

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Consumer groups, scripts and the cancel channel: what a turn needs."""
        ensure_groups(self.r, self.intake.streams())
        jobs.load(self.r, "BEGIN", "DELTAS", "FINALIZE")  # pipelined, not sent by jobs.run
        self.cancels.subscribe(keys.CANCEL_CHANNEL)
        self.intake.listen(self.engine.wake)

    def request_stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.grace_period_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        self.stop_deadline = min(self.stop_deadline, deadline) if self.stopping else deadline
        self.stopping = True

    def run(self) -> None:
        try:
            self.start()
        except BaseException:
            self.beat.forget(self.model)  # the `starting` heartbeat: gone from `plurai status` now
            raise
        self._heartbeat()
        shards = self.settings.shards
        log.info(
            "worker %s ready: model %r, lanes %s, %d shard(s)",
            self.id,
            self.model,
            self.lanes,
            shards,
        )
        outage = Outage(self.settings.redis_retry_s)
        crashed = True
        try:
            while not self.stopping or (
                (self.engine.has_unfinished() or self.writer.unsent)
                and time.monotonic() < self.stop_deadline
            ):
                try:
                    self.iterate()
                    outage.over()
                    continue
                except redis.ResponseError as e:
                    if "NOGROUP" in str(e):
                        log.warning("consumer groups are gone (Redis lost its data?); recreating")
                        ensure_groups(self.r, self.intake.streams())
                        continue
                    if memory.is_oom(e):
                        self._redis_full(e, outage)
                        continue
                    failure: redis.RedisError = e
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    failure = e
                self.metrics.redis_errors.inc()
                self.running.resync()
                self.writer.lost_writes()
                # once back: renew this worker's leases at once, and reclaim nothing until
                # the others have had the time to renew theirs (Intake.hold_reclaims)
                self._next_beat = 0.0
                self.intake.hold_reclaims(self.settings.reclaim_idle_ms / 1000)
                outage.wait(failure, len(self.writer.unsent))
            crashed = False
        finally:
            self._shut(crashed)

    def _shut(self, crashed: bool) -> None:
        try:
            self.writer.flush()
        except redis.RedisError:
            log.exception(
                "%d result(s) not stored; their entries stay pending", len(self.writer.unsent)
            )
        else:
            if self.writer.unsent:  # refused for now (a full Redis): rerun elsewhere
                log.error(
                    "%d result(s) not stored (Redis refused them); their entries stay "
                    "pending and are run again",
                    len(self.writer.unsent),
                )
        # After a crash every job it ran is a suspect: its attempt counts.
        reason = "crashed" if crashed else "drained"
        self.give_back(list(self.running.values()), reason, held=self.held)
        self.held.clear()
        self.cancels.close()
        self.intake.close()
        self.writer.close()
        self.beat.forget(self.model)
        log.info("worker %s stopped after %d jobs", self.id, self.publisher.jobs_done)

    def iterate(self) -> None:
        """One turn: kept results, new work, cancels and deadlines, one step, heartbeat."""
        start = time.monotonic()
        if self._stepped:  # the turn's length, from one read to the next: other workers
            # leave a new entry to this one for about that long when it runs fewer jobs
            self._turn_s = moving(self._turn_s, start - self._turn_start)
            self.intake.turn_ms = round(1000 * self._turn_s)
        self._turn_start, self._stepped = start, False
        self.writer.flush()  # results kept through a Redis outage
        idle = not self.engine.has_unfinished()
        if idle and self.writer.unsent and self.writer.refusal is not None:
            raise self.writer.refusal  # nothing to step: back off before sending them again
        if idle:
            self.writer.settle()  # the last step's acks, before waiting for work
        if not self.stopping:
            try:
                self.taker.fill()
            except redis.ResponseError as e:
                # a full Redis refuses to start new jobs, not to step the running ones
                if not (memory.is_oom(e) and self.engine.has_unfinished()):
                    raise
        self.publisher.cancelled(self.cancels)
        self.publisher.expired()
        if self.engine.has_unfinished():
            outputs = self.engine.step()
            self._stepped = True
            if not self.engine.has_unfinished():
                # drained: the metrics get the engine's last figures before its jobs' results
                self._refresh_stats()
                self._next_stats = time.monotonic() + 1.0
            self.publisher.step(outputs)
            preempted = [self.running[j] for j in self.engine.preempted() if j in self.running]
            self.give_back(preempted, "preempted")
        now = time.monotonic()
        if now >= self._next_stats:
            self._refresh_stats()
            self._next_stats = now + 1.0
        if now >= self._next_beat:
            self._heartbeat()

    # -- outside the step ------------------------------------------------------------

    def _redis_full(self, e: redis.ResponseError, outage: Outage) -> None:
        """Redis is at its maxmemory: it refused this turn's writes, and made none of them
        (a script's first write refused ends it). The running jobs step on; their streams
        are rewritten from the whole text at their next write that Redis takes, and the
        results of finished ones are kept and sent again every turn, their entries left
        pending until stored. Nothing new starts (BEGIN is refused)."""
        self.metrics.redis_errors.inc()
        self.running.resync()
        self.writer.lost_writes()
        if time.monotonic() >= self._next_beat:  # a turn cut short still renews the leases
            try:
                self._heartbeat()
            except redis.RedisError as beat_failed:
                log.warning("heartbeat failed while Redis is full: %s", beat_failed)
        outage.full(e, len(self.writer.unsent), idle=not self.engine.has_unfinished())

    # -- heartbeat ------------------------------------------------------------------

    def _refresh_stats(self) -> dict[str, Any]:
        """Copy the backend's figures for the metrics endpoint (read by its own thread)."""
        s = self.engine.stats()
        self.metrics.engine.stats = s
        return s

    def _heartbeat(self) -> None:
        """Publish this worker's figures, renew its leases, and end the jobs whose entry is
        another worker's now or whose record asks for a cancel or was replaced."""
        s = self._refresh_stats()
        generated = self.publisher.generated
        rate = self.beat.rate(generated)
        self.metrics.tokens_per_s.set(rate)
        self.beat.publish(
            s,
            running=len(self.running),
            held=len(self.held),
            jobs_done=self.publisher.jobs_done,
            lanes_done=json.dumps(self.publisher.lanes_done, separators=(",", ":")),
            jobs_resumed=self.starter.jobs_resumed,
            jobs_handed_over=self.give_back.handed_over,
            state="stopping" if self.stopping else "serving",
            generation_tokens=generated,
            tokens_per_s=rate,
            metrics_port=self.metrics_port,
            model_id=self.model_id,
            max_model_len=self.engine.max_model_len,
        )
        for entry in self.beat.renew([run.entry for run in self.running.values()] + self.held):
            run = self.running.get(entry.job_id)
            if run is not None and run.entry is entry:  # dropped unwritten: not ours now
                del self.running[entry.job_id]
                self.engine.abort(entry.job_id)
                if run.span is not None:
                    self.spans.stopped(run, "lost")
            self.held[:] = [e for e in self.held if e is not entry]
        for stream, ids in self.writer.kept_entries().items():  # results Redis refused
            jobs.run(self.r, jobs.renew(stream=stream, consumer=self.id, entry_ids=ids))
        for job_id, flag in self.beat.check(list(self.running)):
            run = self.running.pop(job_id)
            self.engine.abort(job_id)
            if flag == 1:
                self.publisher.end_now(run, records.CANCELLED, "abort")
            else:
                self.publisher.end_now(run, records.FAILED, "", Code.BAD_RECORD, BAD_RECORD)
        self.intake.paused = self.beat.paused()
        self.metrics.heartbeats.inc()
        self.metrics.last_heartbeat.set(time.time())
        self._next_beat = time.monotonic() + self.settings.heartbeat_interval_s
