"""A job's spans on a worker (broker_config/tracing.py). Each ends as its phase ends, so a
worker SIGKILLed mid-job loses only the span of the phase it was in; every one is a child
of the submit's context (the entry's traceparent) and carries the job's attempt and the
worker's id, so each run of a job, on whichever worker, lands in its one trace:

    queue wait  the entry added, or let go by its last worker (hand-over, reclaim) → taken
    intake      taken → BEGIN's answer (held for room, the backend's add, the round trip),
                with an "engine add" event when the backend had the job
    prefill     BEGIN → the run's first token (a resumed run computes its output so far too),
                marked by a "first token" event (the time since the entry entered its lane)
    decode      the first token → the run's end: its result, or the job given up
    result      the final write (FINALIZE) → Redis's reply (ended by writer.py)
    hand back   the job given back to the queue: preempted, drained, failed or crashed

Only jobs whose entry carries a valid traceparent are traced (Entry.trace), and only while
tracing is on: the worker checks `tracing.ON` before calling here.
"""

from __future__ import annotations

import time
from typing import Any

from plurai.broker_config import tracing
from plurai.broker_config.text import text
from plurai.gpu_workers.backend import StepOutput
from plurai.gpu_workers.intake import Entry
from plurai.gpu_workers.job import Running
from plurai.gpu_workers.writer import Writer


class Spans:
    def __init__(self, worker_id: str, model: str, writer: Writer) -> None:
        self.worker, self.model, self.writer = worker_id, model, writer

    def attributes(self, entry: Entry) -> dict[str, Any]:
        env = entry.req.envelope
        return tracing.job_attributes(
            entry.job_id,
            entry.lane,
            env.priority,
            self.model,
            env.attempts,
            self.worker,
            env.tenant,
        )

    def taken(self, entry: Entry, now: float) -> None:
        """The queue wait and the intake of an entry BEGIN answered."""
        if entry.trace is None:
            return
        attrs = self.attributes(entry)
        tracing.done("queue wait", entry.trace, entry.waited_from_s, entry.taken_s, attrs)
        attrs |= {
            "messaging.system": "redis",
            "messaging.destination.name": entry.stream,
            "messaging.message.id": text(entry.entry_id),
            "gen_ai.request.max_tokens": entry.req.envelope.max_tokens,
        }
        span = tracing.span("intake", entry.trace, entry.taken_s, attrs, kind="consumer")
        if entry.added_s:
            tracing.event(span, "engine add", entry.added_s)
        tracing.end(span, max(now, entry.taken_s))

    def started(self, run: Running, now: float) -> None:
        """The run's prefill begins."""
        if run.entry.trace is not None:
            attrs = self.attributes(run.entry) | {"plurai.resumed_tokens": run.resumed}
            run.span = tracing.span("prefill", run.entry.trace, now, attrs)

    def first_token(self, run: Running, out: StepOutput, now: float) -> None:
        """Prefill ends and decode begins, marked by a "first token" event on the prefill
        span, with the job's time to first token from its entry entering its lane (none
        for a resumed run, whose job had its first token in an earlier run)."""
        ttft = None if run.resumed else max(0.0, now - run.entry.entered_s)
        tracing.event(run.span, "first token", now, **{"plurai.time_to_first_token_s": ttft})
        tracing.end(
            run.span,
            now,
            **{
                "plurai.prompt_tokens": out.num_prompt_tokens,
                "gen_ai.usage.input_tokens": out.num_prompt_tokens,
                "plurai.cached_tokens": out.num_cached_tokens,
            },
        )
        run.span = tracing.span("decode", run.entry.trace, now, self.attributes(run.entry))

    def ended(self, run: Running, state: str, finish_reason: str, code: str) -> None:
        """The run's result: its open span ends, and the result span is open until Redis
        replies to its FINALIZE (Writer.replied)."""
        entry = run.entry
        if entry.trace is None:
            return
        now = time.time()
        usage = {
            "plurai.state": state,
            "plurai.finish_reason": finish_reason or None,
            "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else None,
            "plurai.prompt_tokens": run.prompt_tokens,
            "gen_ai.usage.input_tokens": run.prompt_tokens,
            "plurai.cached_tokens": run.cached_tokens,
            "plurai.output_tokens": run.num_tokens,
            "gen_ai.usage.output_tokens": run.num_tokens,
        }
        if run.span is not None:
            tracing.end(run.span, now, code, **usage)
            run.span = None
        span = tracing.span("result", entry.trace, now, self.attributes(entry) | usage)
        if code:
            tracing.failed(span, code)
        self.writer.results[entry.job_id] = span

    def stopped(self, run: Running, outcome: str, error: str = "") -> None:
        """The run ends without a result: preempted, drained, crashed, failed (the backend
        raised on it) or lost (another worker owns its entry now)."""
        if run.span is not None:
            tokens = run.num_tokens
            attrs = {"plurai.outcome": outcome, "plurai.output_tokens": tokens}
            tracing.end(run.span, None, error, **attrs)
            run.span = None

    def handed_back(self, entry: Entry, reason: str, start_s: float, error: str = "") -> None:
        """The job given back to the queue from `start_s` to now: `reason` preempted or
        drained (its place kept), failed or crashed (its attempt counted)."""
        if entry.trace is not None:
            attrs = self.attributes(entry) | {"plurai.reason": reason}
            tracing.done("hand back", entry.trace, start_s, time.time(), attrs, error=error)
