"""Giving jobs back to the queue: one path for every reason a worker lets a job go.

The reason picks the mechanism (intake.py):
- "preempted": the engine stopped the job to run a better lane's, "drained": the worker
  stops. Its tokens so far are written first (stream and progress), then its entry keeps
  its place in its lane (HAND_OVER), no attempt counted; the next worker to take from the
  lane resumes it where it stopped (results/progress.py).
- "crashed": the worker goes down abnormally. Likewise written first, but the job is a
  suspect: its attempt counts and its entry goes to the lane's tail (REQUEUE), or past
  max_deliveries to the dead letters.
- "failed": the backend raised on this job (a bug met on it). Its attempt counts as for a
  crash; it starts over, so nothing of it is written.
An entry whose worker dies without giving it back is reclaimed by another worker once its
lease lapses (intake.py, `_reclaim`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis

from plurai.broker_config import tracing
from plurai.broker_config.protocol import Code
from plurai.gpu_workers.backend import Backend
from plurai.gpu_workers.intake import Entry, Intake
from plurai.gpu_workers.job import Running, Runs
from plurai.gpu_workers.metrics import Metrics
from plurai.gpu_workers.spans import Spans
from plurai.gpu_workers.writer import Writer

log = logging.getLogger("plurai.worker")

CRASHED = "the worker crashed while running it"


class GiveBack:
    def __init__(
        self,
        engine: Backend,
        intake: Intake,
        writer: Writer,
        spans: Spans,
        metrics: Metrics,
        running: Runs,
    ) -> None:
        self.engine, self.intake, self.writer = engine, intake, writer
        self.spans, self.metrics, self.running = spans, metrics, running
        self.handed_over = 0  # jobs preempted here and handed over with their progress

    def __call__(
        self, runs: Iterable[Running], reason: str, error: str = "", held: Iterable[Entry] = ()
    ) -> None:
        """Give these jobs back for `reason` (the module's docstring), and with them `held`,
        entries taken and not started here; `error`: a failed job's. Each job leaves the
        engine and the running jobs. Preempted jobs whose writes Redis refuses for now stay
        here, to go on and rewrite their streams."""
        runs, held = list(runs), list(held)
        if not runs and not held:
            return
        try:
            self.writer.collect()  # the last step's writes first: the progress goes after
            refused = self.checkpoint(runs) if reason != "failed" else []
        except redis.RedisError:
            if reason == "preempted":
                raise  # the turn's failure: the loop waits the outage out
            log.warning("the last step's writes are unconfirmed")
            refused = []
        if refused and reason == "preempted":
            for run in runs:
                run.resync = True
            return
        start = time.time()
        code = Code.INTERNAL if reason == "failed" else ""
        for run in runs:
            job_id = run.entry.job_id
            if self.running.get(job_id) is run:
                del self.running[job_id]
                self.engine.abort(job_id)
            self.spans.stopped(run, reason, code)
            self._send(run.entry, reason, error, run.num_tokens)
            if tracing.ON:
                self.spans.handed_back(run.entry, reason, start, code)
        for entry in held:
            self._send(entry, reason, error, 0)
        if reason in ("drained", "crashed"):
            log.info("handed %d unfinished job(s) back to the queue", len(runs) + len(held))

    def checkpoint(self, runs: Iterable[Running]) -> list:
        """Write the jobs' tokens not written yet (stream and progress), so that whichever
        worker takes a job next resumes it where it stopped here. Returns what Redis
        refused for now (Writer.execute)."""
        items = [d for run in runs for d in run.unsent()]
        return self.writer.execute(self.writer.deltas(items)) if items else []

    def _send(self, entry: Entry, reason: str, error: str, tokens: int) -> None:
        try:
            if reason in ("failed", "crashed"):
                self.intake.retry(entry, error or CRASHED)
                return
            handed = self.intake.hand_over(entry)
        except redis.RedisError as e:
            if reason == "preempted":
                raise  # left pending here, unrenewed: reclaimed later
            log.warning(
                "could not hand back a job (%s); it stays pending and is reclaimed later",
                e,
                extra={"job_id": entry.job_id},
            )
            return
        if reason != "preempted":
            return
        if handed:
            self.handed_over += 1
            self.metrics.jobs_handed_over.labels(entry.lane).inc()
        log.info(
            "job preempted: %s with %d token(s)",
            "handed over" if handed else "dropped (done, or another worker's now)",
            tokens,
            extra={"job_id": entry.job_id, "lane": entry.lane},
        )
