"""Token sampling for a batch whose rows each carry their own parameters.

Penalties, then the grammar masks of constrained rows (grammar.py), then temperature,
top-k, top-p and min-p; greedy rows take the argmax. A constrained row's token is then
checked against the tokens left (`Grammars.steer`).
Random rows draw by inverse CDF (one uniform number a row, on the row's cumulative
probabilities). A seeded row's number is a function of its seed and the index of the output
token being sampled only (`seeded_uniform`): a seeded request samples the same tokens
whatever else shares its batch, and a request resumed from its first k output tokens (on
another engine) draws what the uninterrupted run drew. Unseeded rows share the sampler's
generator.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plurai.gpu_workers.engine.grammar import Grammars
from plurai.gpu_workers.engine.sequence import Sequence


class Sampler:
    def __init__(
        self,
        seed: int,
        grammars: Grammars | None = None,
        ops: Any = None,
        max_model_len: int = 1 << 62,
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.grammars = grammars
        self.ops = ops  # the fused CPU kernels (top-p), or None for numpy
        self.max_model_len = max_model_len

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None
    ) -> tuple[list[int], list[dict | None]]:
        """A token (and its logprobs when asked for) per row; `positions`: the index of the
        output token each row draws (default: the sequence's next), for the rows of proposed
        tokens (speculator.py), where a sequence has a row per position."""
        logits = logits.float().cpu()
        raw = logits
        params = [s.params for s in seqs]
        penalized = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        )
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        # both work in place, on a copy while the raw logits are still wanted for logprobs
        if (penalized or constrained) and any(p.logprobs is not None for p in params):
            logits = logits.clone()
        if penalized:
            logits = self._penalize(logits, seqs, positions)
        if constrained:
            logits = self._constrain(logits, seqs, constrained)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            at = [positions[i] if positions else seqs[i].num_output_tokens for i in random_rows]
            picked = self._sample(logits[rows], [seqs[i] for i in random_rows], at)
            tokens[rows] = picked
        token_list = tokens.tolist()
        if constrained:
            assert self.grammars is not None
            for i in constrained:
                s = seqs[i]
                if s.num_draft:
                    continue  # far from its max_tokens: it proposes nothing near it
                token_list[i] = self.grammars.steer(
                    s, token_list[i], s.tokens_left(self.max_model_len)
                )
        return token_list, self._logprobs(raw, seqs, token_list)

    def _penalize(
        self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None
    ) -> torch.Tensor:
        """Repetition, presence and frequency penalties, in place. A row of a proposed
        position counts the proposals before it as generated."""
        logits = logits.contiguous()  # a vocab-padded slice (tensor parallel) is not
        ahead = [_ahead(s, positions[i]) if positions else [] for i, s in enumerate(seqs)]
        rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if rep:  # every token seen so far, prompt included, as transformers does
            vocab = logits.shape[1]
            ids = [_seen(seqs[i], ahead[i]) for i in rep]
            # the seen entries of all those rows as one flat index: only they change
            flat = torch.from_numpy(
                np.concatenate([t + i * vocab for i, t in zip(rep, ids, strict=True)])
            )
            penalty = torch.from_numpy(
                np.repeat(
                    np.array([seqs[i].params.repetition_penalty for i in rep], np.float32),
                    [len(t) for t in ids],
                )
            )
            view = logits.view(-1)
            vals = view[flat]
            # clamped: a tiny penalty would overflow to inf, and inf - inf is NaN further on
            view[flat] = torch.where(vals > 0, vals / penalty, vals * penalty).clamp(-_MAX, _MAX)
        for i, s in enumerate(seqs):
            p = s.params
            if (p.presence_penalty or p.frequency_penalty) and (s.output_counts or ahead[i]):
                seen = s.output_counts
                if ahead[i]:
                    seen = dict(seen)
                    for t in ahead[i]:
                        seen[t] = seen.get(t, 0) + 1
                ids = torch.tensor(list(seen), dtype=torch.long)
                counts = torch.tensor(list(seen.values()), dtype=torch.float32)
                logits[i, ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _constrain(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> torch.Tensor:
        """Only the tokens its grammar allows next keep their logits, per constrained row
        (numpy, in place: a few rows, where torch's indexing costs more than the work)."""
        assert self.grammars is not None
        # a sequence with proposals has a row per position, in order: its masks are
        # computed along its proposals, from its first row
        first = [i for i in rows if i == 0 or seqs[i - 1] is not seqs[i]]
        drafts = [seqs[i].token_ids[len(seqs[i].token_ids) - seqs[i].num_draft :] for i in first]
        allowed = self.grammars.allowed([seqs[i].matcher for i in first], drafts)
        view = logits.numpy()
        width = allowed.shape[1]
        j = 0
        for i in first:
            for r in range(i, i + 1 + seqs[i].num_draft):
                np.copyto(view[r, :width], -np.inf, where=~allowed[j])
                view[r, width:] = -np.inf  # vocab padding beyond the model's vocabulary
                j += 1
        return logits

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int]
    ) -> torch.Tensor:
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
        # shifted so each row's best logit is 0: a tiny temperature (even one that is 0 in
        # float32) then sends the others to -inf, the greedy limit, never to NaN
        temps = torch.tensor([p.temperature for p in params]).clamp(min=_TINY).unsqueeze(1)
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temps
        ks = torch.tensor([min(p.top_k, vocab) for p in params])
        if ks.any():
            kth = logits.topk(int(ks.max()), dim=-1).values.gather(
                1, (ks - 1).clamp(min=0).unsqueeze(1)
            )
            kth[ks == 0] = float("-inf")
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params])
        if (top_p < 1.0).all():
            probs = _nucleus(probs, top_p, self.ops)
        elif (top_p < 1.0).any():
            rows = (top_p < 1.0).nonzero().squeeze(1)
            probs[rows] = _nucleus(probs[rows], top_p[rows], self.ops)
        min_p = torch.tensor([p.min_p for p in params])
        if (min_p > 0).any():
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        # inverse CDF with one uniform draw per row: a seeded row's depends on nothing but
        # its seed and position, so what else is in the batch never changes its tokens
        cdf = probs.cumsum(dim=-1)
        u = torch.empty(len(seqs))
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                u[i] = seeded_uniform(s.params.seed, positions[i])
        picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        return picked.clamp(max=vocab - 1)

    def _logprobs(
        self, raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]
    ) -> list[dict | None]:
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return [None] * len(seqs)
        lp = raw.log_softmax(dim=-1)
        out: list[dict | None] = []
        for i, w in enumerate(wanted):
            if w is None:
                out.append(None)
                continue
            entry: dict = {"token_id": tokens[i], "logprob": lp[i, tokens[i]].item()}
            if w:
                vals, ids = lp[i].topk(w)
                entry["top"] = [
                    [int(t), float(v)] for t, v in zip(ids.tolist(), vals.tolist(), strict=True)
                ]
            out.append(entry)
        return out


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) a seeded row draws for its output token `position`:
    that element of a SplitMix64 stream started from the mixed seed. 24 bits, like
    torch.rand's float32: exact in float32, so the number stays below 1 and
    u * cdf[-1] below the row's total (a float64 draw could round up to 1.0)."""
    z = _mix64((_mix64(seed & _MASK64) + (position + 1) * _GAMMA) & _MASK64)
    return (z >> 40) / (1 << 24)


def _ahead(s: Sequence, position: int) -> list[int]:
    """The proposals of `s` before its output position `position` (speculator.py)."""
    done = s.num_output_tokens
    if position <= done:
        return []
    start = len(s.token_ids) - s.num_draft
    return s.token_ids[start : start + position - done]


def _seen(s: Sequence, ahead: list[int] | None = None) -> np.ndarray:
    """The distinct token ids `s` holds, gathered once and then extended as tokens arrive
    (plain Python and numpy: a decode step adds one token, where torch's per-call cost
    would dominate); proposals are not held until drawn, but `ahead` ones are added."""
    if s.seen is None:
        s.seen = set()
        s.seen_ids = np.empty(max(64, 2 * len(s.token_ids)), dtype=np.int64)
    buf, n = s.seen_ids, s.seen_count
    end = len(s.token_ids) - s.num_draft
    for t in s.token_ids[s.seen_len : end]:
        if t not in s.seen:
            s.seen.add(t)
            if n == len(buf):
                buf = s.seen_ids = np.concatenate([buf, np.empty_like(buf)])
            buf[n] = t
            n += 1
    s.seen_len, s.seen_count = end, n
    if ahead:
        extra = [t for t in dict.fromkeys(ahead) if t not in s.seen]
        if extra:
            return np.concatenate([buf[:n], np.array(extra, dtype=np.int64)])
    return buf[:n]


_MAX = torch.finfo(torch.float32).max
_TINY = torch.finfo(torch.float32).tiny

# top-p buckets probabilities by their top float bits: exponent and 4 mantissa bits, so
# 16 buckets per octave (the bits of a non-negative float order like its value); all below
# 2^-40 share the lowest bucket (together they hold no mass a top_p < 1 can reach)
_SHIFT = 19
_LOW = (127 - 40) << 4  # the key of 2^-40
_BUCKETS = (128 << 4) - _LOW  # up to 1.0


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor, ops: Any = None) -> torch.Tensor:
    """Zero (in place) all but the most probable tokens whose mass first reaches top_p,
    per row (tokens tied with the last one kept are kept too).

    No sort of the vocabulary: one pass buckets each row's probabilities by value and sums
    each bucket's mass (float64); the bucket where the mass counted from the top first
    reaches top_p holds the cutoff, and only that bucket's tokens are sorted. The fused
    CPU kernel (`ops.top_p_`) does the same per row in three passes, without numpy's
    row-sized temporaries (about a tenth of the time)."""
    # a top_p of 0 (or one that rounds to it) still keeps the most probable token
    want = np.maximum(top_p.numpy().astype(np.float64), np.finfo(np.float64).tiny)
    if ops is not None and probs.dtype == torch.float32 and probs.is_contiguous():
        ops.top_p_(probs, torch.from_numpy(want))
        return probs
    p = probs.numpy()
    rows = len(p)
    key = np.maximum(((p.view(np.int32) & 0x7FFFFFFF) >> _SHIFT) - _LOW, 0)  # -0.0 is 0
    offsets = np.arange(rows)[:, None] * _BUCKETS
    mass = np.bincount(
        (key + offsets).ravel(), weights=p.ravel(), minlength=rows * _BUCKETS
    ).reshape(rows, _BUCKETS)
    below = np.cumsum(mass, axis=1)  # per bucket: its mass and all below it
    total = below[:, -1]
    # the bucket holding the cutoff: the highest one whose mass with all above it reaches
    # top_p (when rounding leaves none, the whole row is kept)
    reach = (total[:, None] - below + mass) >= want[:, None]
    bucket = reach.sum(axis=1) - 1
    reached = bucket >= 0
    bucket = np.maximum(bucket, 0)
    before = total - below[np.arange(rows), bucket]  # the mass of the buckets above it
    # that bucket's tokens, per row in descending order; each is kept while the mass ranked
    # above it (the higher buckets, then the larger tokens of its own) is under top_p; the
    # kept ones are a prefix, so the cutoff is the last of them
    r, c = np.nonzero(key == bucket[:, None])
    vals = p[r, c]
    order = np.lexsort((-vals, r))
    r, vals = r[order], vals[order]
    cutoff = np.zeros(rows, dtype=p.dtype)
    if len(vals):
        run = np.cumsum(vals, dtype=np.float64)
        first = np.searchsorted(r, np.arange(rows))  # where each row's tokens start
        at = np.minimum(first, len(run) - 1)
        start = run[at] - vals[at]  # the running sum before each row's tokens
        kept = before[r] + (run - vals - start[r]) < want[r]
        count = np.maximum(np.bincount(r[kept], minlength=rows), 1)  # its top one at least
        has = reached & (np.bincount(r, minlength=rows) > 0)
        cutoff[has] = vals[(first + count - 1)[has]]
    cut = torch.from_numpy(cutoff)[:, None]
    return probs.masked_fill_(probs < cut, 0.0)
