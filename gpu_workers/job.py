"""A job while it runs on this worker: what it has produced so far, and what its stream
and its result are to say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_workers.backend import StepOutput
from gpu_workers.intake import Entry
from results import jobs, progress, records


@dataclass(frozen=True)
class Stream:
    """When a running job's held-back tokens are written to its stream and its progress: its
    first tokens at once (to the stream); then whenever `tokens` are held, or the oldest
    held one is `seconds` old; the rest with its result (PLURAI_STREAM_FLUSH_TOKENS,
    PLURAI_STREAM_FLUSH_MS; 1 token: every step's tokens as they come). A job that does
    not stream writes its progress by the same rule."""

    tokens: int = 16
    seconds: float = 0.1


@dataclass
class Running:
    entry: Entry
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_proposed: int = 0  # speculative decoding: tokens proposed, and accepted
    spec_accepted: int = 0
    # wall clock, when this run made its first token (0: not yet), for the record and the
    # time-per-output-token histogram; a resumed run counts from the tokens it took over
    first_token_s: float = 0.0
    resumed: int = 0  # output tokens taken over from a previous run
    last_token_s: float = 0.0  # monotonic, when its latest tokens came (gpu_workers/pace.py)
    # The job's token stream may lack deltas (Redis failed while they were sent): its next
    # write is a reset followed by the whole text so far.
    resync: bool = False
    # What the stream and the progress have (pieces of `text`, tokens) and since when tokens
    # wait to be written (monotonic seconds; None: none wait). A job's tokens are held back
    # and written together (Stream above), so a job costs Redis a few writes rather than one
    # a token.
    sent_pieces: int = 0
    sent_tokens: int = 0
    held_since: float | None = None
    span: Any = None  # its open phase span while traced (gpu_workers/spans.py)

    def absorb(self, out: StepOutput, now: float, every: Stream) -> jobs.Delta | None:
        """Take one step's output; returns what to write to the job's stream now, if anything."""
        self.token_ids += out.new_token_ids
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        self.spec_proposed, self.spec_accepted = out.num_spec_proposed, out.num_spec_accepted
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.text_delta:
            self.text.append(out.text_delta)
        streams = self.entry.req.stream
        if out.finished and (self.resync or not streams):
            return None  # its FINALIZE writes the rest (the whole stream after a resync)
        if self.held_since is None and self.has_unsent:
            self.held_since = now
        first = streams and self.sent_pieces == 0  # until its first text is out: TTFT
        if (
            self.resync
            or out.finished
            or first
            or len(self.token_ids) - self.sent_tokens >= every.tokens
            or (self.held_since is not None and now - self.held_since >= every.seconds)
        ):
            return self.unsent()
        return None

    @property
    def has_unsent(self) -> bool:
        return len(self.token_ids) > self.sent_tokens or len(self.text) > self.sent_pieces

    def unsent(self) -> jobs.Delta | None:
        """The write of everything not yet written (a reset and the whole text after a
        resync, and the whole progress); None when there is nothing to write."""
        if not (self.resync or self.has_unsent):
            return None
        reset, self.resync = self.resync, False
        start_piece = 0 if reset else self.sent_pieces
        start_token = 0 if reset else self.sent_tokens
        self.sent_pieces, self.sent_tokens = len(self.text), len(self.token_ids)
        self.held_since = None
        ids = self.token_ids[start_token:]
        asked = self.entry.req.params.get("logprobs") is not None
        return jobs.Delta(
            job_id=self.entry.job_id,
            text="".join(self.text[start_piece:]),
            token_ids=ids,
            reset=reset,
            stream=self.entry.req.stream,
            progress=progress.chunk(ids, self.logprobs[start_token:] if asked else None),
            whole=start_token == 0,
        )

    def resume(self, saved: progress.Progress, text: str) -> None:
        """Take over the output a previous run made (its stream and progress have it all)."""
        self.token_ids = list(saved.token_ids)
        self.resumed = len(self.token_ids)
        self.logprobs = list(saved.logprobs or [])
        self.text = [text] if text else []
        self.sent_pieces, self.sent_tokens = len(self.text), len(self.token_ids)

    def result_fields(self, worker: str, finished_ms: int, code: str, message: str) -> list[Any]:
        asked = self.entry.req.params.get("logprobs") is not None
        return records.final_fields(
            text="".join(self.text),
            token_ids=self.token_ids,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            spec_proposed=self.spec_proposed,
            spec_accepted=self.spec_accepted,
            worker=worker,
            finished_ms=finished_ms,
            first_token_ms=round(self.first_token_s * 1000),  # 0 (left out): none
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
