"""A request's life inside the engine, and what the engine reports about it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import numpy as np
import torch

from plurai.gpu_workers.engine.detokenizer import Detokenizer, StopMatcher
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.kv_store.block_hash import salt_root


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_arrival = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by every generated token
    params: SamplingParams
    priority: int = 0
    index: int = 0  # which of its request's choices (params n > 1) it is
    # a choice's lead: its request's first choice that runs (the first, unless a resume
    # found it ended), whose computed prompt blocks it shares (BlockManager.match_prefix);
    # None for the lead itself
    lead: Sequence | None = None
    others: list[Sequence] = field(default_factory=list, repr=False)  # on choice 0: the rest
    detok: Detokenizer | None = None
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_scheduled: int = 0  # tokens to compute in the current step
    # speculative decoding (speculator.py): the last num_draft of token_ids are proposed
    # tokens, there only while a step checks them
    num_draft: int = 0
    spec: Any = None  # the speculator's SpecState
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_committed_blocks: int = 0  # leading blocks already published to the prefix cache
    tier_blocks: list[torch.Tensor] | None = None  # prefix blocks found in a KV tier, to load
    tier_start: int = 0  # the block index tier_blocks starts at
    tier_from_host: int = 0  # how many of tier_blocks (the first ones) the host tier held
    arrival: int = field(default_factory=lambda: next(_arrival))
    waited_steps: int = 0
    num_preemptions: int = 0
    output_counts: dict[int, int] = field(default_factory=dict)
    # for the repetition penalty: the distinct token ids held (a set, for membership) and
    # the same ids in a buffer that doubles as it fills ([:seen_count] valid)
    seen: set[int] | None = None
    seen_ids: np.ndarray | None = None
    seen_count: int = 0
    seen_len: int = 0  # tokens already added to `seen_ids`
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    emitted: int = 0  # characters of output text already reported in a text delta
    # structured output: the llguidance matcher of its constraint (grammar.py), advanced
    # with each generated token; kept across preemption, as the generated tokens are
    matcher: Any = None
    steer: Any = None  # and its steering to a completion near max_tokens (grammar.Steer)
    cache_salt: str | None = None  # prefix-cache isolation: only equal salts share blocks
    hash_root: bytes = field(init=False, default=b"")  # the first block's parent, from the salt
    # stop conditions prepared once, so checking a token costs O(1) whatever their sizes
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    stop_matcher: StopMatcher | None = field(init=False, default=None)
    stop_hold: int = field(init=False, default=0)  # characters a stop string may start in

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.hash_root = salt_root(self.cache_salt)
        self.stop_ids = frozenset(self.params.stop_token_ids)
        if self.params.stop:
            self.stop_matcher = StopMatcher(self.params.stop)
            self.stop_hold = self.stop_matcher.longest - 1

    @property
    def choices(self) -> list[Sequence]:
        """Every choice of its request, from its first choice (the others have none)."""
        return [self, *self.others]

    @property
    def key(self) -> tuple[str, int]:
        """Which sequence it is: its request and choice."""
        return self.request_id, self.index

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_draft]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens - self.num_draft

    def drop_draft(self, keep: int = 0) -> None:
        """Take back the proposed tokens after the first `keep`."""
        cut = self.num_draft - keep
        if cut > 0:
            del self.token_ids[-cut:]
            self.num_draft = keep

    @property
    def max_len(self) -> int:
        """Length this sequence can reach: prompt plus max_tokens."""
        return self.num_prompt_tokens + self.params.max_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """Output tokens it may still make: to its max_tokens, within max_model_len."""
        return min(self.params.max_tokens - self.num_output_tokens, max_model_len - len(self))

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1


@dataclass
class Completion:
    """A finished request, as returned by the offline `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int = 0
    logprobs: list[dict] | None = None
    index: int = 0  # which of its request's choices (params n > 1)


def finished_at(reason: str, i: int, token: int) -> RequestError:
    """The refusal of output tokens that ended the request at output token `i`: nothing
    to resume after it (the same message on every backend)."""
    return RequestError(
        ErrorCode.BAD_PROGRESS,
        f"the request finished ({reason}) at output token {i} ({token}): "
        "there is nothing to resume",
    )


def check_progress(
    output_ids: Any, num_prompt: int, max_tokens: int, vocab_size: int, max_model_len: int
) -> list[int]:
    """The checks of a resumed request's output tokens that need no replay, the same on
    every backend: token ids in [0, vocab_size), at most max_tokens of them, within
    max_model_len. Whether the tokens ended the request (a stop, max_tokens reached) is
    the backend's to judge. Raises RequestError(BAD_PROGRESS)."""

    def bad(message: str) -> RequestError:
        return RequestError(ErrorCode.BAD_PROGRESS, message)

    if not isinstance(output_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in output_ids
    ):
        raise bad("output_ids must be a list of token ids (integers)")
    wrong = [t for t in output_ids if not 0 <= t < vocab_size]
    if wrong:
        raise bad(f"output token ids {wrong[:5]} are outside the vocabulary [0, {vocab_size})")
    n = len(output_ids)
    if n > max_tokens:
        raise bad(f"{n} output tokens are more than max_tokens ({max_tokens})")
    if num_prompt + n > max_model_len:
        raise bad(
            f"the prompt's {num_prompt} tokens and {n} output tokens are more than "
            f"max_model_len ({max_model_len})"
        )
    return output_ids
