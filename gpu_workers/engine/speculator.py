"""Speculative decoding: tokens proposed for a decoding sequence, checked in one forward.

A sequence that decodes one token a step reads every weight for it; with proposals, the
step feeds its last token and k proposed ones as one chunk (a prefill row over the paged
KV cache, beside the other rows of the step) and gets logits at every position. Position
j's token is then drawn exactly as plain decoding would draw it there (the sampler, with
the same seeded number per output position), and the proposal for j+1 is kept only if it
equals that token: so every request's output is token for token what it is without
speculation, greedy or seeded, and unseeded ones follow the same distribution. (With a
proposal that is one token rather than a distribution, this is what rejection sampling
accepts, with the same probability p(token).) A step appends the tokens up to the first
proposal that differs, plus the one drawn there; the rejected proposals' KV slots are
simply overwritten by later steps, and their blocks are given back (`BlockManager.trim`).

Proposals come from prompt lookup: the latest earlier place where the sequence's last n
tokens (ngram_max down to ngram_min) occurred, and the tokens that followed it there.
Documents that are quoted, copied from or continued give long matches; anything else gives
few, and a sequence whose proposals keep failing stops proposing for a while (doubling,
so a changed text is found again). Speculation is off for a step that decodes more than
spec_max_seqs sequences (there a step's time grows with its tokens), for a request that
asks `speculate: false`, and for requests with penalties or a grammar (their sampling at
position j depends on the tokens before it; they decode as usual).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.sequence import Sequence

EMA = 0.25  # weight of a step's acceptance in the running figure
MIN_ACCEPT = 0.25  # below this running acceptance a sequence pauses its proposals
PAUSE_STEPS = 8  # the first pause; each failed return doubles it
MAX_PAUSE_STEPS = 256


@dataclass
class SpecState:
    """A sequence's prompt-lookup index and how its proposals fared."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> last end
    indexed: int = 0  # n-grams ending before this position are in `index`
    acceptance: float = 1.0  # running share of proposed tokens accepted
    pause: int = 0  # steps left without proposals
    next_pause: int = PAUSE_STEPS
    proposed: int = 0
    accepted: int = 0


class Speculator:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.k = config.num_speculative_tokens
        self.lo, self.hi = config.ngram_min, config.ngram_max
        self.max_seqs = config.spec_max_seqs
        self.proposed = 0  # totals over the engine's life
        self.accepted = 0

    def eligible(self, seq: Sequence) -> bool:
        p = seq.params
        return (
            p.speculate
            and seq.matcher is None
            and p.repetition_penalty == 1.0
            and not p.presence_penalty
            and not p.frequency_penalty
        )

    def draft(self, seq: Sequence, room: int, decoding: int) -> None:
        """Append up to `room` proposed tokens to a decoding `seq` (seq.num_draft says how
        many); `decoding`: the sequences this step decodes."""
        if decoding > self.max_seqs or room <= 0 or not self.eligible(seq):
            return
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState()
        if st.pause > 0:
            st.pause -= 1
            return
        left = min(
            self.k,
            room,
            seq.params.max_tokens - seq.num_output_tokens - 1,  # the last token is drawn
            self.max_model_len - len(seq) - 1,
        )
        if left <= 0:
            return
        tokens = self.lookup(st, seq.token_ids, left)
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
            st.acceptance += EMA * (m / len(draft) - st.acceptance)
            if st.acceptance < MIN_ACCEPT:
                st.pause, st.next_pause = st.next_pause, min(2 * st.next_pause, MAX_PAUSE_STEPS)
                st.acceptance = MIN_ACCEPT  # one good step after the pause resumes it
            elif m:
                st.next_pause = PAUSE_STEPS
        return m
