"""Token sampling for a batch whose rows each carry their own parameters.

Penalties, then temperature, top-k, top-p and min-p; greedy rows take the argmax.
Random rows draw with the exponential race (argmax of p / Exp(1) noise), one noise
vector per row from the row's own generator when it has a seed, so a seeded request
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_workers.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[dict | None]]:
        logits = logits.float().cpu()
        raw = logits
        params = [s.params for s in seqs]
        if any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        ):
            logits = self._penalize(logits.clone(), seqs)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            picked = self._sample(logits[rows], [seqs[i] for i in random_rows])
            tokens[rows] = picked
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, seqs, token_list)

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if rep:  # every token seen so far, prompt included, as transformers does
            vocab = logits.shape[1]
            ids = [_seen(seqs[i]) for i in rep]
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
            view[flat] = torch.where(vals > 0, vals / penalty, vals * penalty)
        for i, s in enumerate(seqs):
            p = s.params
            if (p.presence_penalty or p.frequency_penalty) and s.output_counts:
                ids = torch.tensor(list(s.output_counts), dtype=torch.long)
                counts = torch.tensor(list(s.output_counts.values()), dtype=torch.float32)
                logits[i, ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
        logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
        ks = torch.tensor([min(p.top_k, vocab) for p in params])
        if ks.any():
            kth = logits.topk(int(ks.max()), dim=-1).values.gather(
                1, (ks - 1).clamp(min=0).unsqueeze(1)
            )
            kth[ks == 0] = float("-inf")
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params])
        if (top_p < 1.0).any():
            rows = (top_p < 1.0).nonzero().squeeze(1)
            probs[rows] = _nucleus(probs[rows], top_p[rows])
        min_p = torch.tensor([p.min_p for p in params])
        if (min_p > 0).any():
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        # inverse CDF with one uniform draw per row: a seeded row draws from its own
        # generator, so what else is in the batch never changes its tokens
        cdf = probs.cumsum(dim=-1)
        u = torch.empty(len(seqs))
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator)
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


def _seen(s: Sequence) -> np.ndarray:
    """The distinct token ids `s` holds, gathered once and then extended as tokens arrive
    (plain Python and numpy: a decode step adds one token, where torch's per-call cost
    would dominate)."""
    if s.seen is None:
        s.seen = set()
        s.seen_ids = np.empty(max(64, 2 * len(s.token_ids)), dtype=np.int64)
    buf, n = s.seen_ids, s.seen_count
    for t in s.token_ids[s.seen_len :]:
        if t not in s.seen:
            s.seen.add(t)
            if n == len(buf):
                buf = s.seen_ids = np.concatenate([buf, np.empty_like(buf)])
            buf[n] = t
            n += 1
    s.seen_len, s.seen_count = len(s.token_ids), n
    return buf[:n]


# top-p looks for its cutoff among this many most probable tokens first, and sorts the
# whole vocabulary when some row's nucleus is wider
NUCLEUS_CANDIDATES = 2048


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but the most probable tokens whose mass first reaches top_p, per row
    (tokens tied with the last one kept are kept too)."""
    p = probs.numpy()
    want = top_p.numpy().astype(np.float64)[:, None]
    vocab = p.shape[1]
    # selecting the top candidates is O(vocab), sorting is not; but when even that many
    # tokens at the row's highest probability could not reach top_p (a flat row), the
    # selection cannot suffice, and is skipped
    if (
        vocab > NUCLEUS_CANDIDATES
        and (p.max(axis=-1, keepdims=True) * NUCLEUS_CANDIDATES >= want).all()
    ):
        top = np.partition(p, vocab - NUCLEUS_CANDIDATES, axis=-1)[:, -NUCLEUS_CANDIDATES:]
        if (top.sum(axis=-1, keepdims=True) >= want).all():
            p = top
    # numpy's value-only sort is about twice as fast as torch.sort on CPU; ascending, so
    # the mass ranked above a token is the total minus the running sum up to it (summed in
    # float64: over a 150k vocabulary float32 sums move the cutoff by a token or two)
    p = np.sort(p, axis=-1)
    csum = np.cumsum(p, axis=-1, dtype=np.float64)
    kept = np.maximum((csum[:, -1:] - csum < want).sum(axis=-1), 1)  # the top token at least
    cutoff = np.take_along_axis(p, (p.shape[1] - kept)[:, None], axis=-1)
    return probs.masked_fill(probs < torch.from_numpy(cutoff), 0.0)
