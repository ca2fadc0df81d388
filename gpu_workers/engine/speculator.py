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
Documents that are quoted, copied from or continued give long matches. Or from a draft
model (drafter.py): before the scheduler runs, the sequences that would propose get the
draft's most likely next tokens, all of them in k batched forwards.

How many to propose is a cost model, so that no workload gets slower: a proposed token
costs a row of the step, and pays only if it is accepted. The engine's steps give the
time of one more row (the median slope of step time over rows, on recent steps) and
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

import numpy as np

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.drafter import Drafter
from plurai.gpu_workers.engine.grammar import Grammars
from plurai.gpu_workers.engine.sequence import Sequence

EMA = 0.25  # weight of a step's outcome in a sequence's running acceptance
BLOCK = 8  # decode steps run with proposals on, or off, between two choices
MAX_GAP = 64  # blocks between two tries of the mode that lost, at most
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
    pending: list[int] = field(default_factory=list)  # the draft model's proposals,
    pending_at: int = -1  # made when the sequence had this many tokens
    next_pause: int = PAUSE_STEPS
    proposed: int = 0
    accepted: int = 0


@dataclass
class Modes:
    """At one batch size: seconds per token made with proposals on and off (running
    means over blocks of steps), which is cheaper, and when to try the other again."""

    on: float | None = None
    off: float | None = None
    best: bool = True  # proposals on
    gap: int = 1  # blocks between two tries of the other
    since: int = 0  # blocks since the last try


class Speculator:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        grammars: Grammars | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.drafter = drafter  # None: prompt lookup
        self.k = config.num_speculative_tokens
        self.lo, self.hi = config.ngram_min, config.ngram_max
        self.proposed = 0  # totals over the engine's life
        self.accepted = 0
        # (rows, seconds, tokens made) of recent steps, and the acceptance a proposal needs
        self.steps: deque[tuple[int, float, int]] = deque(maxlen=WINDOW)
        self.observed = 0  # steps observed, for the refits
        self.need = 0.0
        # whether this block of steps proposes, and the blocks' figures per batch size
        # (by its bit length: 1, 2-3, 4-7, ...)
        self.on = True
        self.modes: dict[int, Modes] = {}
        self.block: list[tuple[float, int]] = []

    def prepare(self, running: list[Sequence]) -> None:
        """With a draft model: proposals for the decoding sequences of `running` that will
        propose this step (draft() takes them), as many as the one that wants most."""
        if self.drafter is None or not self.on:
            return
        seqs, k = [], 0
        for seq in running:
            if len(seq) - seq.num_computed_tokens != 1 or not seq.params.speculate:
                continue
            st = seq.spec
            if st is None:
                st = seq.spec = SpecState()
            want = 1 if st.pause == 1 else 0 if st.pause else self._paying(st, self.k)
            want = min(want, seq.tokens_left(self.max_model_len) - 1)
            if want > 0:
                seqs.append(seq)
                k = max(k, want)
        if not seqs:
            return
        by_key = {s.key: s for s in seqs}
        for key, tokens in self.drafter.propose(seqs, k).items():
            seq = by_key[key]
            seq.spec.pending, seq.spec.pending_at = tokens, len(seq)

    def forget(self, seq: Sequence) -> None:
        """seq has finished: the draft model's cache gives its blocks back."""
        if self.drafter is not None:
            self.drafter.forget(seq.key)

    def _paying(self, st: SpecState, n: int) -> int:
        """How many of up to n proposals pay at the sequence's acceptance (see above)."""
        paying = 0
        while paying < n and st.acceptance ** (paying + 1) >= self.need:
            paying += 1
        return paying

    def draft(self, seq: Sequence, room: int) -> None:
        """Append up to `room` proposed tokens to a decoding `seq`, as many as pay (the
        cost model above); seq.num_draft says how many."""
        if room <= 0 or not self.on or not seq.params.speculate:
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
        left = seq.tokens_left(self.max_model_len)
        n = min(self.k, room, left - 1)  # the last token is drawn
        paying = self._paying(st, n)
        if n > 0 and paying == 0:
            if not probe:  # a proposal would not pay: a pause, then one to try
                st.pause, st.next_pause = st.next_pause, min(2 * st.next_pause, MAX_PAUSE_STEPS)
                return
            paying = 1
        if self.drafter is None:
            tokens = self.lookup(st, seq.token_ids, paying) if paying else []
        else:  # prepare()'s, made for this length
            tokens = st.pending[:paying] if st.pending_at == len(seq) else []
            st.pending = []
        if tokens and seq.matcher is not None:
            # the ones the grammar allows; none where the output may be steered to its end
            tokens = tokens[: seq.matcher.validate_tokens(tokens)]
            assert self.grammars is not None
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

    def observe(self, rows: int, seconds: float, made: int, seqs: int) -> None:
        """A decode step's rows (tokens computed), time, tokens made and sequences: the
        cost model's input, and the measure of whether proposing pays at all."""
        self.steps.append((rows, seconds, made))
        self.observed += 1
        # a fit takes ~0.2 ms (every pair of steps): every step, it would cost a small
        # model's decode step a third of its time
        if self.observed % REFIT == 0:
            cost = row_cost(self.steps)
            if cost is not None:
                self.need = cost
        self.block.append((seconds, made))
        if len(self.block) >= BLOCK:
            self._choose(seqs.bit_length())

    def _choose(self, size: int) -> None:
        """End a block: book its seconds per token to its mode at this batch size, then
        run the next block in the cheaper mode, or try the other one: at once while it
        is unknown, then after a gap of blocks that doubles each time it loses again.

        The row cost above shapes how many tokens a sequence proposes, but misses what
        proposing costs a step besides rows (lookups, verification, bookkeeping): on a
        small model a batch can make fewer tokens a second with proposals that seem to
        pay. So whether to propose at all is measured, the two modes side by side."""
        cost = sum(s for s, _ in self.block) / max(1, sum(m for _, m in self.block))
        self.block = []
        m = self.modes.setdefault(size, Modes())
        tried = self.on != m.best
        mine = m.on if self.on else m.off
        # a tried mode's last figure is blocks old: this block's stands alone
        mine = cost if mine is None or tried else mine + 0.5 * (cost - mine)
        if self.on:
            m.on = mine
        else:
            m.off = mine
        other = m.off if self.on else m.on
        if tried:
            if other is None or mine < other:
                m.best, m.gap = self.on, 1
            else:
                m.gap = min(2 * m.gap, MAX_GAP)
            m.since = 0
        else:
            m.since += 1
        unknown = (m.off if m.best else m.on) is None
        self.on = not m.best if unknown or m.since >= m.gap else m.best


def row_cost(steps: deque[tuple[int, float, int]] | list[tuple[int, float, int]]) -> float | None:
    """The time of one more row of a step over the time per token made, on these steps;
    None where their rows never varied (nothing to tell). The slope is Theil-Sen's, the
    median of the slopes between every two steps of different rows: a step's time is
    noisy (a collection, a kernel built for a new row count, another process) and a few
    slow steps would tilt a least-squares line, enough to propose where it does not pay."""
    made = sum(s[2] for s in steps)
    if len(steps) < 2 or made <= 0:
        return None
    a = np.array([(s[0], s[1]) for s in steps], dtype=np.float64)
    i, j = np.triu_indices(len(a), k=1)
    dx = a[j, 0] - a[i, 0]
    varied = dx != 0
    if not varied.any():
        return None
    slope = float(np.median((a[j, 1] - a[i, 1])[varied] / dx[varied]))
    per_token = float(a[:, 1].sum()) / made
    return max(0.0, slope) / per_token if per_token > 0 else 0.0
