"""The one engine interface the worker talks to. The native engine (gpu_workers/engine) and
vLLM (gpu_workers/vllm_backend) implement the same few calls; the worker does not change.

A backend refuses bad input for one request with `RequestError` (stable `code`, a
`message` that says what to fix) and nothing else is affected; an exception met while
stepping ends only the request it was raised on, as a `StepOutput` with `error` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from plurai.broker_config.errors import CodedError

__all__ = ["AddRequest", "Backend", "RequestError", "StepOutput"]


class RequestError(CodedError):
    """A request a backend refuses; `code` is stable, `message` says what to fix."""


@dataclass
class AddRequest:
    """One request for a backend: give exactly one of `prompt`, `token_ids`, `messages`."""

    request_id: str
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None  # chat turns, rendered by the model's template
    # the wire's sampling fields, or the native engine's SamplingParams (None: defaults)
    params: Any = None
    priority: int = 0  # lower runs first (the lane and the job's own priority)
    cache_salt: str | None = None  # prefix-cache blocks are shared only under equal salts
    special_tokens: bool = False  # the prompt's text may name special tokens
    output_ids: list[list[int]] | None = None  # per choice: a cut-off run's output tokens


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" while finished, else None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[dict] | None = None  # one entry per new token when asked for
    error: str | None = None  # with finish_reason "error": the exception, type and text
    # speculative decoding, this request's so far: tokens proposed, and of those accepted
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    index: int = 0  # the choice it is of, for a request with n > 1 (its params' `n`)


class Backend(Protocol):
    model_fingerprint: str  # identity of the weights: part of every KV block's key
    max_model_len: int  # prompt plus output tokens one request may hold
    max_num_seqs: int  # sequences it runs at once (a request's choices are one each)
    step_tokens: int  # tokens one step computes at most (prompt chunks and decodes)

    def add(self, req: AddRequest) -> list[str]:
        """Queue a request. Raises RequestError.

        With `n` > 1 in `req.params` the request has n choices, choice i sampled as a request
        of seed `seed` + i (mod 2^63) would be; each step output says its choice
        (`index`), and a choice's `finished` ends that choice only. The request is over
        once every choice has finished.

        `output_ids`: per choice, the output tokens a run of this request cut off
        elsewhere (a crash, a drain) had generated. Each choice then goes on after its
        tokens and gives exactly what the uninterrupted run would have: the rest of its
        tokens, text deltas, logprobs and finish reason (a choice its tokens ended is
        reported finished, with no new token); num_output_tokens and max_tokens count the
        tokens given. A backend that cannot continue this request exactly (or that finds
        the progress wrong: ids out of range, more than max_tokens, tokens after the one
        that ended a choice, every choice ended) raises RequestError with code
        BAD_PROGRESS, and the caller starts it again from no output. Returns, per choice,
        the output text the cut-off run had reported for its tokens (the concatenation of
        its text deltas); "" each without output_ids."""
        ...

    def step(self) -> list[StepOutput]: ...

    def wake(self) -> None:
        """New work arrived (called from another thread): a step() that waits for the
        engine's outputs returns now, with what it has. A backend whose step computes
        rather than waits does nothing."""
        ...

    def abort(self, request_id: str) -> bool: ...

    def can_admit(
        self, prompt_tokens: int, max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        """Whether a request of this size fits beside the ones already added (sequence
        slots and KV blocks, each assumed to run to its max_tokens), with the KV of `spare`
        more tokens left free (what better-priority arrivals are kept). With `priority`:
        beside those of that priority or better only, since the backend preempts the
        others (they keep their output and go on when room frees)."""
        ...

    def preempted(self) -> list[str]:
        """The requests it preempted since the last call (to run better-priority ones) that
        wait to go on; the caller may abort them and hand them to another engine. A
        backend that keeps its preempted requests to itself returns []."""
        ...

    def has_unfinished(self) -> bool: ...

    @property
    def prompt_backlog(self) -> int:
        """Prompt tokens of the requests added and not computed yet."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
