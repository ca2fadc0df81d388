"""Speculative decoding: tokens proposed for a decoding sequence, checked in one forward.

A sequence that decodes one token a step reads every weight for it; with proposals, the
step feeds its last token and k proposed ones, each a decode row over the paged KV cache
beside the other rows of the step, and gets logits at every position. Position j's token
is then drawn exactly as plain decoding would draw it there (the sampler, with the same
seeded number per output position), and the proposal for j+1 is kept only if it equals
that token: so every request's output is token for token what it is without speculation,
greedy or seeded, and unseeded ones follow the same distribution. (With a proposal that is
one token rather than a distribution, this is what rejection sampling accepts, with the
same probability p(token).) A step appends the tokens up to the first proposal that
differs, plus the one drawn there; the rejected proposals' KV slots are simply
overwritten by later steps, and their blocks are given back (`BlockManager.trim`).

Proposals come from prompt lookup: the latest earlier place where the sequence's last n
tokens (ngram_max down to ngram_min) occurred, and the tokens that followed it there.
Documents that are quoted, copied from or continued give long matches.

How many to propose is a cost model, so that no workload gets slower: a proposed token
costs a row of the step, and pays only if it is accepted. The engine's steps give the
time of one more row (a least-squares line of step time over rows, on recent steps) and
the time per token made; their ratio is the acceptance a proposal needs. Where a step's
time hardly grows with its rows (the memory-bandwidth floor: one sequence, or a few) that
is near 0 and every match is proposed; where it grows in proportion (a large batch on a
CPU) it nears 1 and only near-certain proposals are. A sequence proposes its j-th token
while its acceptance (the running share of proposals kept, each position given the ones
before it) to the power j reaches that ratio; one that proposes nothing retries after a
pause that doubles while it keeps failing. A request can opt out (`speculate: false`).

Penalties and grammars hold: the logits at position j are penalized with the proposals
before j counted as generated (sampler.py), and masked with the grammar's state after them
(llguidance computes a row's masks along its proposals); proposals are cut where the
grammar refuses one. A constrained sequence proposes nothing near its max_tokens, where it
may be steered to a completion (grammar.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.grammar import Grammars
from gpu_workers.engine.sequence import Sequence

EMA = 0.25  # weight of a step's outcome in a sequence's running acceptance
PAUSE_STEPS = 8  # the first pause of a sequence whose proposals do not pay; then doubled
MAX_PAUSE_STEPS = 256
WINDOW = 64  # recent steps the row cost is fitted on
REFIT = 8  # steps between two fits


@dataclass
class SpecState:
    """A sequence's prompt-lookup index and how its proposals fared."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> last end
    indexed: int = 0  # n-grams ending before this position are in `index`
    acceptance: float = 0.8  # running share of proposed positions kept
    pause: int = 0  # steps left without proposals
    next_pause: int = PAUSE_STEPS
    proposed: int = 0
    accepted: int = 0


class Speculator:
    def __init__(
        self, config: EngineConfig, max_model_len: int, grammars: Grammars | None = None
    ) -> None:
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.k = config.num_speculative_tokens
        self.lo, self.hi = config.ngram_min, config.ngram_max
        self.proposed = 0  # totals over the engine's life
        self.accepted = 0
        # (rows, seconds, tokens made) of recent steps, and the acceptance a proposal needs
        self.steps: deque[tuple[int, float, int]] = deque(maxlen=WINDOW)
        self.need = 0.0

    def draft(self, seq: Sequence, room: int) -> None:
        """Append up to `room` proposed tokens to a decoding `seq`, as many as pay (the
        cost model above); seq.num_draft says how many."""
        if room <= 0 or not seq.params.speculate:
            return
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState()
        probe = False
        if st.pause > 0:
            st.pause -= 1
            if st.pause:
                return
            probe = True  # the pause is over: one token, to learn whether proposals pay now
        n = min(
            self.k,
            room,
            seq.params.max_tokens - seq.num_output_tokens - 1,  # the last token is drawn
            self.max_model_len - len(seq) - 1,
        )
        paying = 0
        while paying < n and st.acceptance ** (paying + 1) >= self.need:
            paying += 1
        if n > 0 and paying == 0:
            if not probe:  # a proposal would not pay: a pause, then one to try
                st.pause, st.next_pause = st.next_pause, min(2 * st.next_pause, MAX_PAUSE_STEPS)
                return
            paying = 1
        tokens = self.lookup(st, seq.token_ids, paying) if paying else []
        if tokens and seq.matcher is not None:
            # the ones the grammar allows; none where the output may be steered to its end
            tokens = tokens[: seq.matcher.validate_tokens(tokens)]
            assert self.grammars is not None
            left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
            if self.grammars.slack(seq, left) <= len(tokens):
                tokens = []
        if tokens:
            seq.token_ids.extend(tokens)
            seq.num_draft = len(tokens)

    def lookup(self, st: SpecState, ids: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of ids' longest matching suffix
        (ngram_max down to ngram_min tokens); [] when none occurred."""
        n = len(ids)
        index, lo, hi = st.index, self.lo, self.hi
        # index the n-grams that end before the last token: an earlier occurrence of the
        # suffix is what the lookup wants, never the suffix itself
        for end in range(max(st.indexed, lo - 1), n - 1):
            for size in range(lo, min(hi, end + 1) + 1):
                index[tuple(ids[end - size + 1 : end + 1])] = end
        st.indexed = max(st.indexed, n - 1)
        for size in range(min(hi, n), lo - 1, -1):
            end = index.get(tuple(ids[n - size :]))
            if end is not None:
                return ids[end + 1 : end + 1 + k]
        return []

    def verify(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of seq's proposals the drawn `tokens` (one per fed position) accept:
        the leading proposals equal to the token drawn before them."""
        draft = seq.token_ids[len(seq.token_ids) - seq.num_draft :]
        m = 0
        while m < len(draft) and draft[m] == tokens[m]:
            m += 1
        st = seq.spec
        if st is not None and draft:
            st.proposed += len(draft)
            st.accepted += m
            self.proposed += len(draft)
            self.accepted += m
            # positions decided: the m kept, and the first refused (if one was)
            tried = m + (m < len(draft))
            st.acceptance += EMA * (m / tried - st.acceptance)
            if m:
                st.next_pause = PAUSE_STEPS
        return m

    def observe(self, rows: int, seconds: float, made: int) -> None:
        """A step's rows (tokens computed), time and tokens made: the cost model's input."""
        self.steps.append((rows, seconds, made))
        if len(self.steps) % REFIT == 0 or len(self.steps) == WINDOW:
            self.need = row_cost(self.steps)


def row_cost(steps: deque[tuple[int, float, int]] | list[tuple[int, float, int]]) -> float:
    """The time of one more row of a step over the time per token made, on these steps:
    the slope of a least-squares line of seconds over rows (0 where rows never varied, or
    where the time fell as rows grew), divided by seconds per token."""
    n = len(steps)
    made = sum(s[2] for s in steps)
    if n < 2 or made <= 0:
        return 0.0
    mx = sum(s[0] for s in steps) / n
    my = sum(s[1] for s in steps) / n
    var = sum((s[0] - mx) ** 2 for s in steps)
    if var <= 0:
        return 0.0
    slope = sum((s[0] - mx) * (s[1] - my) for s in steps) / var
    per_token = sum(s[1] for s in steps) / made
    return max(0.0, slope) / per_token if per_token > 0 else 0.0
