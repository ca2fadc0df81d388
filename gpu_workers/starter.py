"""Starting the entries a worker took: each job goes into the backend, then BEGIN marks
them running here in one round trip (intake.py); a job BEGIN does not let run is answered
(done, cancelled, expired), one the backend refuses fails with its code, and one that
another run had begun resumes from its progress (results/progress.py)."""

from __future__ import annotations

import logging
import time

import redis

from plurai.broker_config import protocol, tracing
from plurai.broker_config.protocol import Code
from plurai.gpu_workers.backend import AddRequest, Backend, RequestError
from plurai.gpu_workers.give_back import GiveBack
from plurai.gpu_workers.intake import BAD_RECORD, Entry, Intake
from plurai.gpu_workers.job import Running, Runs
from plurai.gpu_workers.metrics import Metrics
from plurai.gpu_workers.pace import Pace
from plurai.gpu_workers.publish import Publisher
from plurai.gpu_workers.spans import Spans
from plurai.results import progress, records

log = logging.getLogger("plurai.worker")

Batch = list[tuple[Entry, Exception | None]]  # entries added, with what the backend raised


class Starter:
    def __init__(
        self,
        engine: Backend,
        intake: Intake,
        spans: Spans,
        metrics: Metrics,
        running: Runs,
        held: list[Entry],
        lanes: list[str],
        pace: Pace,
        publisher: Publisher,
        give_back: GiveBack,
    ) -> None:
        self.engine, self.intake, self.spans, self.metrics = engine, intake, spans, metrics
        self.running, self.held, self.lanes, self.pace = running, held, lanes, pace
        self.publisher, self.give_back = publisher, give_back
        self.jobs_resumed = 0  # begun from another run's progress

    def duplicate(self, entry: Entry, batch: Batch) -> bool:
        """Whether the entry's job already runs here (or is in `batch`): a second entry of
        the job is acked; this worker's own entry, reclaimed after a stall, runs on."""
        run = self.running.get(entry.job_id)
        if run is None and all(e.job_id != entry.job_id for e, _ in batch):
            return False
        if run is None or run.entry.entry_id != entry.entry_id:
            self.intake.ack(entry)
        return True

    def add(self, entry: Entry) -> Exception | None:
        """Put the entry's job into the backend ahead of its BEGIN, so that the backend's
        room for the next entry counts it (`start` takes it out again unless BEGIN says
        run). Returns what the backend raised on it, if anything."""
        try:
            self._engine_add(entry)
        except RequestError as e:
            return e
        except Exception as e:  # a Plurai bug met on this job
            log.exception("engine.add failed", extra={"job_id": entry.job_id})
            return e
        return None

    def _engine_add(self, entry: Entry, output_ids: list[list[int]] | None = None) -> list[str]:
        req, env = entry.req, entry.req.envelope
        texts = self.engine.add(
            AddRequest(
                entry.job_id,
                prompt=req.prompt,
                token_ids=req.token_ids,
                messages=req.messages,
                params=req.params,
                priority=protocol.engine_priority(self.lanes.index(entry.lane), env.priority),
                cache_salt=req.cache_salt,
                special_tokens=req.special_tokens,
                output_ids=output_ids,
            ),
        )
        entry.added_s = time.time()
        return texts

    def start(self, batch: Batch) -> int:
        """BEGIN the jobs of `batch` in one round trip; returns how many run. A job BEGIN
        does not let run leaves the backend and is answered (`_not_run`), one the backend
        refused fails with its code, one it raised on otherwise is handed back as a failed
        attempt; entries Redis refused for now (OOM, ...) are held, taken again once it
        takes writes."""
        try:
            verdicts = self.intake.begin([entry for entry, _ in batch])
        except BaseException:
            for entry, error in batch:
                if error is None:
                    self.engine.abort(entry.job_id)
            self.held[:0] = [entry for entry, _ in batch]  # begun again later
            raise
        refused: redis.ResponseError | None = None
        again: list[Entry] = []
        answers: list[tuple[Entry, Exception | None, str]] = []
        started = 0
        now = time.time() if tracing.ON else 0.0
        for (entry, error), (verdict, saved) in zip(batch, verdicts, strict=True):
            if error is None and verdict != "run":
                self.engine.abort(entry.job_id)
            if tracing.ON and not isinstance(verdict, redis.ResponseError):
                self.spans.taken(entry, now)
            if isinstance(verdict, redis.ResponseError):
                refused = refused or verdict
                again.append(entry)
            elif verdict != "run" or error is not None:
                answers.append((entry, error, verdict))
            else:
                run = Running(entry)
                if saved is not None:
                    error = self._resume(run, saved)
                    if error is not None:  # not even as a new run now: a failed attempt
                        answers.append((entry, error, verdict))
                        continue
                self.running[entry.job_id] = run
                if tracing.ON:
                    self.spans.started(run, now)
                if entry.lane == self.lanes[0]:
                    self.pace.seen(time.monotonic())
                self.metrics.jobs_started.labels(entry.lane).inc()
                wait = max(0.0, time.time() - entry.entered_s)
                self.metrics.queue_wait.labels(entry.lane).observe(wait)
                log.debug("job started", extra={"job_id": entry.job_id, "lane": entry.lane})
                started += 1
        self.held[:0] = again
        for entry, error, verdict in answers:
            if verdict != "run":
                self._not_run(entry, verdict)
            elif isinstance(error, RequestError):
                log.info(
                    "job refused: %s: %s",
                    error.code,
                    error.message,
                    extra={"job_id": entry.job_id, "lane": entry.lane, "code": error.code},
                )
                self.publisher.end_now(
                    Running(entry), records.FAILED, "", error.code, error.message
                )
            else:  # a Plurai bug met on this job: it counts as a failed attempt
                self.give_back(
                    [Running(entry)], "failed", f"{type(error).__name__}: {str(error)[:300]}"
                )
        if refused is not None:
            raise refused
        return started

    def _resume(self, run: Running, blob: bytes) -> Exception | None:
        """Continue the job from the output its previous run made (BEGIN found its
        progress): the backend computes prompt and output so far and goes on from there,
        and the stream goes on without a reset. Where the progress cannot be trusted or
        the backend cannot continue the job exactly, the job starts over: its next write
        resets the stream and rewrites the progress. Returns what the backend raised
        adding it as a new run, if anything (it was added once already)."""
        entry = run.entry
        req = entry.req
        asked = req.params.get("logprobs") is not None
        head = self.intake.writer.progress_head
        saved = progress.parse(blob, head, req.envelope.max_tokens, asked, req.n)
        why = "its progress is damaged"
        if saved is not None and any(c.token_ids for c in saved):
            self.engine.abort(entry.job_id)
            try:
                made = self._engine_add(entry, [c.token_ids for c in saved])
            except RequestError as e:
                why = e.message
            except Exception as e:  # a Plurai bug met on this job: start it over
                log.exception("resuming a job failed", extra={"job_id": entry.job_id})
                why = f"{type(e).__name__}: {str(e)[:300]}"
            else:
                run.resume(saved, made)
                self.jobs_resumed += 1
                self.metrics.jobs_resumed.labels(entry.lane).inc()
                self.metrics.resumed_tokens.inc(run.resumed)
                log.info(
                    "job resumed after %d output tokens",
                    run.resumed,
                    extra={"job_id": entry.job_id, "lane": entry.lane},
                )
                return None
            error = self.add(entry)
            if error is not None:
                return error
        elif saved is not None:
            return None  # no token yet: a run like any other
        log.info("job starts over: %s", why, extra={"job_id": entry.job_id, "lane": entry.lane})
        run.resync = True
        return None

    def _not_run(self, entry: Entry, verdict: str) -> None:
        """BEGIN's answer for a job that must not run."""
        end_now = self.publisher.end_now
        if verdict == "done":  # a result exists: only the entry is left
            self.intake.ack(entry)
        elif verdict == "cancelled":
            end_now(Running(entry), records.CANCELLED, "abort")
        elif verdict == "expired":
            message = "the job's deadline passed before a worker could start it"
            end_now(Running(entry), records.FAILED, "", Code.DEADLINE_EXCEEDED, message)
        else:  # "badkey"
            end_now(Running(entry), records.FAILED, "", Code.BAD_RECORD, BAD_RECORD)
