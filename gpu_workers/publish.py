"""A step's outputs to Redis: every running job's new tokens and every finished job's
result, one packed write a step (writer.py); and a job's result when it ends outside a
step (cancelled, expired, refused)."""

from __future__ import annotations

import logging
import time

import redis

from plurai.broker_config import tracing
from plurai.broker_config.protocol import Code
from plurai.broker_config.text import text
from plurai.gpu_workers.backend import Backend, StepOutput
from plurai.gpu_workers.give_back import GiveBack
from plurai.gpu_workers.job import Running, Runs, Stream
from plurai.gpu_workers.metrics import Metrics
from plurai.gpu_workers.pace import Pace
from plurai.gpu_workers.spans import Spans
from plurai.gpu_workers.writer import Writer, now_ms
from plurai.results import jobs, records

log = logging.getLogger("plurai.worker")


class Publisher:
    def __init__(
        self,
        worker_id: str,
        engine: Backend,
        writer: Writer,
        spans: Spans,
        metrics: Metrics,
        running: Runs,
        stream: Stream,
        pace: Pace,
        give_back: GiveBack,
    ) -> None:
        self.id, self.engine, self.writer = worker_id, engine, writer
        self.spans, self.metrics, self.running = spans, metrics, running
        self.stream, self.pace, self.give_back = stream, pace, give_back
        self.jobs_done = 0
        self.lanes_done: dict[str, list[int]] = {}  # lane -> [jobs ended, their tokens]
        self.generated = 0  # tokens generated, for tokens/s between heartbeats

    def step(self, outputs: list[StepOutput]) -> None:
        """One round trip per step: every delta in one script call, then every final result
        (with its XACK), in one packed write."""
        if not outputs:
            return
        items: list[jobs.Delta] = []
        finished: list[Running] = []
        failed: list[tuple[Running, str]] = []
        now, mono, generated = time.time(), time.monotonic(), 0
        # a top-lane job's tokens of this step, for the pace: a backend may give several
        # outputs of one job at once (the vLLM backend collects every engine step since its
        # last call), which are one interval, not several of zero length
        top_made: dict[str, tuple[Running, int]] = {}
        for out in outputs:
            run = self.running.get(out.request_id)
            if run is None:
                continue
            if out.error:  # the backend raised on this job and dropped it
                del self.running[out.request_id]
                self.engine.abort(out.request_id)  # its other choices too
                failed.append((run, out.error))
                continue
            if out.new_token_ids and not run.first_token_s:
                run.first_token_s = now
                if run.span is not None:
                    self.spans.first_token(run, out, now)
                if not run.resumed:  # a resumed job's first token came in an earlier run
                    ttft = max(0.0, now - run.entry.entered_s)
                    self.metrics.ttft.labels(run.entry.lane).observe(ttft)
            if out.new_token_ids and run.entry.lane == self.running.top:
                made = top_made.get(out.request_id, (run, 0))[1]
                top_made[out.request_id] = (run, made + len(out.new_token_ids))
            generated += len(out.new_token_ids)
            items += run.absorb(out, mono, self.stream)
            if out.finished and run.done:  # its last choice ended
                finished.append(run)
        for run, made in top_made.values():
            if run.last_token_s:
                self.pace.tokens(mono - run.last_token_s, made, mono)
            run.last_token_s = mono
        for run in self.running.values():  # tokens held too long by jobs that did not step
            if run.held_since is not None and mono - run.held_since >= self.stream.seconds:
                items += run.unsent()
        self.generated += generated
        self.metrics.generation_tokens.inc(generated)
        calls = self.writer.deltas(items) if items else []
        for run in finished:
            del self.running[run.entry.job_id]
            reason = run.choices[0].finish_reason or ""  # the record's is its first choice's
            calls.append(self.end(run, records.COMPLETED, reason))
        # The backend is done with the finished jobs: from here their results live only in
        # `calls` until Redis has them (the writer keeps them through failures).
        self.writer.send(calls)
        for run, error in failed:
            self.give_back([run], "failed", error)

    def end(
        self, run: Running, state: str, finish_reason: str, code: str = "", message: str = ""
    ) -> jobs.Call:
        """The FINALIZE call of the job's result (and the ack of its entry); counts it."""
        entry = run.entry
        fields = run.result_fields(self.id, now_ms(), finish_reason, code, message)
        if tracing.ON:
            self.spans.ended(run, state, finish_reason, code)
        call = self.writer.final(
            entry.job_id,
            entry.lane,
            (entry.stream, entry.entry_id),
            state,
            finish_reason,
            fields,
            run.resync_mode,
        )
        self.jobs_done += 1
        m, now, lane = self.metrics, time.time(), entry.lane
        m.jobs_finished.labels(lane, state).inc()
        if code:
            m.errors.labels(code).inc()
        m.prompt_tokens.inc(run.prompt_tokens)
        m.cached_tokens.inc(run.cached_tokens)
        m.e2e.labels(lane).observe(max(0.0, now - entry.entered_s))
        made = run.num_tokens - run.resumed  # the tokens of this run
        done = self.lanes_done.setdefault(lane, [0, 0])
        done[0] += 1
        done[1] += made
        each = made / len(run.choices)  # a choice's: they make their tokens side by side
        if each > 1 and run.first_token_s:
            m.tpot.labels(lane).observe((now - run.first_token_s) / (each - 1))
        log.debug(
            "job finished",
            extra={"job_id": entry.job_id, "lane": lane, "state": state, "code": code},
        )
        return call

    def end_now(
        self, run: Running, state: str, finish_reason: str, code: str = "", message: str = ""
    ) -> None:
        """End a job outside a step: its result goes out now (after its deltas, the held
        ones included)."""
        deltas = run.unsent() if run.entry.req.stream else []
        held = self.writer.deltas(deltas) if deltas else []
        self.writer.store(held + [self.end(run, state, finish_reason, code, message)])

    def cancelled(self, cancels: redis.client.PubSub) -> None:
        """End the running jobs whose ids came on the cancel channel (keys.CANCEL_CHANNEL)."""
        for _ in range(1000):  # a flood of messages waits for the next turn, not the backend
            msg = cancels.get_message(timeout=0)
            if msg is None:
                return
            data = msg.get("data")
            if not isinstance(data, bytes) or len(data) > 128:
                continue
            run = self.running.pop(text(data), None)
            if run is not None:  # unknown or malformed ids match nothing
                self.engine.abort(run.entry.job_id)
                self.end_now(run, records.CANCELLED, "abort")

    def expired(self) -> None:
        """End the running jobs whose deadline has passed, with the text so far."""
        now = None
        for job_id, run in list(self.running.items()):
            deadline = run.entry.req.envelope.deadline_ms
            if deadline is None:
                continue
            now = now or now_ms()
            if now > deadline:
                del self.running[job_id]
                self.engine.abort(job_id)
                message = "the job's deadline passed while it ran; the text so far is kept"
                self.end_now(run, records.FAILED, "abort", Code.DEADLINE_EXCEEDED, message)
