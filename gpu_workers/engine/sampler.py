"""Token sampling for a batch whose rows each carry their own parameters.

Penalties, then temperature, top-k, top-p and min-p; greedy rows take the argmax.
Random rows draw with the exponential race (argmax of p / Exp(1) noise), one noise
vector per row from the row's own generator when it has a seed, so a seeded request
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from gpu_workers.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        logits = logits.float().cpu()
        raw = logits
        params = [s.params for s in seqs]
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
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
        for i, s in enumerate(seqs):
            p = s.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and s.output_counts:
                ids = torch.tensor(list(s.output_counts), dtype=torch.long)
                counts = torch.tensor(list(s.output_counts.values()), dtype=torch.float32)
                logits[i, ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        temp = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temp
        top_k = [p.top_k for p in params]
        if any(top_k):
            k = torch.tensor([k if k else logits.shape[1] for k in top_k]).clamp(max=logits.shape[1])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params])
        if (top_p < 1.0).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token when the tokens ranked above it already reach top_p
            drop = (cum - sorted_logits.softmax(dim=-1)) >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params])
        if (min_p > 0).any():
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(self, raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[dict | None]:
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
                entry["top"] = [[int(t), float(v)] for t, v in zip(ids.tolist(), vals.tolist(), strict=True)]
            out.append(entry)
        return out
