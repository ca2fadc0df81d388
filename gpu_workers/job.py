"""A job while it runs on this worker: what it has produced so far (each of its choices:
n of them for a job that asks for n > 1), and what its stream and its result are to say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plurai.gpu_workers.backend import StepOutput
from plurai.gpu_workers.intake import Entry
from plurai.results import jobs, progress, records


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
class Choice:
    """One choice's output so far (a job has n of them, one unless it asks for more), and
    how much of it its stream and the progress have."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # once it has ended
    sent_pieces: int = 0  # pieces of `text` written
    sent_tokens: int = 0  # tokens written (stream and progress)

    @property
    def has_unsent(self) -> bool:
        return len(self.token_ids) > self.sent_tokens or len(self.text) > self.sent_pieces


@dataclass
class Running:
    entry: Entry
    choices: list[Choice] = field(init=False)  # its request's n
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
    # Whether its progress has been started (header first) since its stream's start or
    # last reset, and since when tokens wait to be written (monotonic seconds; None: none
    # wait). A job's tokens are held back and written together (Stream above), so a job
    # costs Redis a few writes rather than one a token.
    saved: bool = False
    held_since: float | None = None
    span: Any = None  # its open phase span while traced (gpu_workers/spans.py)

    def __post_init__(self) -> None:
        self.choices = [Choice() for _ in range(self.entry.req.n)]

    @property
    def num_tokens(self) -> int:
        """Output tokens of all its choices."""
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def done(self) -> bool:
        """Whether every choice has ended."""
        return all(c.finish_reason is not None for c in self.choices)

    def absorb(self, out: StepOutput, now: float, every: Stream) -> list[jobs.Delta]:
        """Take one step's output (of one choice); returns what to write to the job's stream
        now, if anything."""
        c = self.choices[out.index]
        c.token_ids += out.new_token_ids
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        self.spec_proposed, self.spec_accepted = out.num_spec_proposed, out.num_spec_accepted
        if out.logprobs:
            c.logprobs += out.logprobs
        if out.text_delta:
            c.text.append(out.text_delta)
        if out.finished:
            c.finish_reason = out.finish_reason or ""
        streams = self.entry.req.stream
        if self.done and (self.resync or not streams):
            return []  # its FINALIZE writes the rest (the whole stream after a resync)
        if self.held_since is None and self.has_unsent:
            self.held_since = now
        held = sum(len(c.token_ids) - c.sent_tokens for c in self.choices)
        # until its first text is out, tokens go at once: time to first token
        first = streams and not any(c.sent_pieces for c in self.choices)
        if (
            self.resync
            or self.done
            or first
            or held >= every.tokens
            or (self.held_since is not None and now - self.held_since >= every.seconds)
        ):
            return self.unsent()
        return []

    @property
    def has_unsent(self) -> bool:
        return any(c.has_unsent for c in self.choices)

    def unsent(self) -> list[jobs.Delta]:
        """The writes of everything not yet written, a Delta per choice with something (a
        reset and the whole text after a resync, and the whole progress); [] when there is
        nothing to write."""
        if not (self.resync or self.has_unsent):
            return []
        reset, self.resync = self.resync, False
        if reset:
            self.saved = False
        e = self.entry
        asked = e.req.params.get("logprobs") is not None
        several = len(self.choices) > 1
        out: list[jobs.Delta] = []
        for i, c in enumerate(self.choices):
            start_piece = 0 if reset else c.sent_pieces
            start_token = 0 if reset else c.sent_tokens
            # a reset is written (with the first choice's whole text) even when empty
            if not (c.has_unsent or reset and (i == 0 or c.token_ids)):
                continue
            c.sent_pieces, c.sent_tokens = len(c.text), len(c.token_ids)
            ids = c.token_ids[start_token:]
            lps = c.logprobs[start_token:] if asked else None
            out.append(
                jobs.Delta(
                    job_id=self.entry.job_id,
                    text="".join(c.text[start_piece:]),
                    token_ids=ids,
                    reset=reset and not out,
                    stream=self.entry.req.stream,
                    progress=progress.chunk(ids, lps, i if several else None),
                    whole=not self.saved,
                    index=i if several else None,
                )
            )
            self.saved = True
        self.held_since = None
        return out

    def resume(self, saved: list[progress.Progress], texts: list[str]) -> None:
        """Take over the output a previous run made, of each choice (its stream and progress
        have it all)."""
        for c, p, text in zip(self.choices, saved, texts, strict=True):
            c.token_ids = list(p.token_ids)
            c.logprobs = list(p.logprobs or [])
            c.text = [text] if text else []
            c.sent_pieces, c.sent_tokens = len(c.text), len(c.token_ids)
        self.resumed = self.num_tokens
        self.saved = True

    def result_fields(
        self, worker: str, finished_ms: int, finish_reason: str, code: str, message: str
    ) -> list[Any]:
        """The record's final fields; a choice that has not ended (the job was cancelled,
        or failed) ends with the job's `finish_reason`."""
        asked = self.entry.req.params.get("logprobs") is not None
        choices = [
            records.Choice(
                index=i,
                text="".join(c.text),
                token_ids=c.token_ids,
                finish_reason=finish_reason if c.finish_reason is None else c.finish_reason,
                logprobs=c.logprobs if asked else None,
            )
            for i, c in enumerate(self.choices)
        ]
        first = choices[0]
        return records.final_fields(
            text=first.text,
            token_ids=first.token_ids,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            spec_proposed=self.spec_proposed,
            spec_accepted=self.spec_accepted,
            worker=worker,
            finished_ms=finished_ms,
            first_token_ms=round(self.first_token_s * 1000),  # 0 (left out): none
            hops_us=[
                round(t * 1e6) for t in (self.entry.taken_s, self.entry.added_s, self.first_token_s)
            ],
            error_code=code,
            error_message=message,
            logprobs=first.logprobs,
            choices=choices if len(choices) > 1 else None,
        )

    @property
    def resync_mode(self) -> jobs.Resync:
        """How its FINALIZE treats the stream: see jobs.finalize."""
        if not self.entry.req.stream:
            return jobs.RESYNC_NEVER
        return jobs.RESYNC_ALWAYS if self.resync else jobs.RESYNC_AUTO


class Runs(dict[str, Running]):
    """The jobs running on this worker by job id, with the figures admission reads of them
    (gpu_workers/admission.py, `Jobs`)."""

    def __init__(self, top: str) -> None:
        super().__init__()
        self.top = top  # the top lane

    def top_backlog(self) -> int:
        return sum(
            r.entry.req.prompt_tokens
            for r in self.values()
            if r.entry.lane == self.top and not r.num_tokens
        )

    def lower_running(self) -> bool:
        return any(r.entry.lane != self.top for r in self.values())

    def top_making(self) -> bool:
        return any(r.entry.lane == self.top and r.num_tokens for r in self.values())

    def resync(self) -> None:
        """Redis failed: each job's next stream write first resets its stream to the whole
        text so far (Writer.lost_writes)."""
        for run in self.values():
            run.resync = True
