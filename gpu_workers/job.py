"""A job while it runs on this worker: what it has produced so far, and what its stream
and its result are to say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_workers.backend import StepOutput
from gpu_workers.intake import Entry
from results import jobs, records


@dataclass
class Running:
    entry: Entry
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token_s: float = 0.0  # wall clock, for the time-per-output-token histogram
    # The job's token stream may lack deltas (Redis failed while they were sent): its next
    # write is a reset followed by the whole text so far.
    resync: bool = False

    def absorb(self, out: StepOutput) -> jobs.Delta | None:
        """Take one step's output; returns what to write to the job's stream, if anything."""
        self.token_ids += out.new_token_ids
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.text_delta:
            self.text.append(out.text_delta)
        new = self.resync or out.text_delta or out.new_token_ids
        # A job that finishes with a resync pending is rewritten by its FINALIZE instead.
        if not (self.entry.req.stream and new) or (out.finished and self.resync):
            return None
        job_id = self.entry.job_id
        if self.resync:
            self.resync = False
            return jobs.Delta(job_id, "".join(self.text), list(self.token_ids), reset=True)
        return jobs.Delta(job_id, out.text_delta, out.new_token_ids)

    def result_fields(self, worker: str, finished_ms: int, code: str, message: str) -> list[Any]:
        asked = self.entry.req.params.get("logprobs") is not None
        return records.final_fields(
            text="".join(self.text),
            token_ids=self.token_ids,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            worker=worker,
            finished_ms=finished_ms,
            error_code=code,
            error_message=message,
            logprobs=self.logprobs if asked else None,
        )

    @property
    def resync_mode(self) -> jobs.Resync:
        """How its FINALIZE treats the stream: see jobs.finalize."""
        if not self.entry.req.stream:
            return jobs.RESYNC_NEVER
        return jobs.RESYNC_ALWAYS if self.resync else jobs.RESYNC_AUTO
