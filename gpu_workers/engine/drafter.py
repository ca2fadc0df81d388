"""Draft-model proposals: a smaller model with the same tokenizer guesses each decoding
sequence's next tokens, and the engine's step checks them (speculator.py).

The draft model runs in the engine's process on a model runner of its own, with its own
paged KV cache (as many blocks as the engine's, each smaller). Each sequence it drafts for
has a shadow here: the tokens the draft model has seen and the KV it holds for them. A
round of proposals for a batch is one forward that feeds each shadow what it has not
computed yet (the tokens the engine accepted since the last round: usually one or two, the
whole prompt the first time) and draws the first proposal, then k - 1 one-token forwards,
all sequences batched together. Proposals are the draft model's most likely tokens; the
engine keeps only those its own draw agrees with, so they never change an output.

After a round the shadow's KV holds the proposals it was fed; the next round keeps what
still agrees with the sequence (the accepted proposals) and recomputes from the first
token that differs. A shadow gives its blocks back when its sequence ends, or when the
draft's cache is short of blocks for the sequences drafting now (those of sequences not
drafting, preempted ones say, go first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import AutoTokenizer

from plurai.gpu_workers.engine.block_manager import BlockManager
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.model_runner import ModelRunner
from plurai.gpu_workers.engine.sequence import Sequence


@dataclass
class Shadow:
    seq: Sequence  # the draft model's view: the tokens it has seen, its blocks, its KV
    known: int = 0  # its leading tokens known to be the sequence's (never proposals)


class Drafter:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        """`config`: the engine's, whose draft_model is the draft's directory; the draft's
        cache gets `num_blocks` blocks (the engine's count) for sequences of up to
        `max_model_len` tokens."""
        path = config.draft_model
        assert path is not None
        mine = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        try:
            theirs = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"draft model {path!r}: no tokenizer there ({e})") from e
        if mine.get_vocab() != theirs.get_vocab():
            raise ValueError(
                f"draft model {path!r}: its tokenizer is not the model's, so its tokens "
                "would mean other text; give a draft trained with the same tokenizer"
            )
        cfg = dataclasses.replace(
            config,
            model=path,
            speculative="off",
            num_kv_blocks=num_blocks,
            max_model_len=max_model_len,
            tensor_parallel=1,
            pipeline_parallel=1,
            pipeline_layers=None,
            fault_token_id=None,
        )
        self.runner = ModelRunner(cfg)
        self.vocab = len(mine)  # the draft's logits may be wider (padding): never past this
        self.blocks = BlockManager(
            self.runner.num_blocks, cfg.block_size, b"draft", prefix_caching=False
        )
        self.shadows: dict[tuple[str, int], Shadow] = {}  # by Sequence.key
        self.forwards = 0  # draft-model forwards run (a round of k proposals is k)

    def propose(self, seqs: list[Sequence], k: int) -> dict[tuple[str, int], list[int]]:
        """Up to k tokens for each of `seqs` (decoding: one token not computed), by
        sequence key; fewer where the draft's cache has no room, or the sequence's room
        ends."""
        batch: list[Sequence] = []
        base: dict[tuple[str, int], int] = {}
        evicted = False
        for s in seqs:
            sh = self._sync(s)
            need = len(s) + k - 1  # the k - 1 proposals fed back take slots too
            if need > self.runner.max_model_len:
                continue
            if not self.blocks.can_grow(sh, need) and not evicted:
                evicted = True
                drafting = {x.key for x in seqs}
                for key in [k for k in self.shadows if k not in drafting]:
                    self.forget(key)
            if not self.blocks.can_grow(sh, need):
                continue
            self.blocks.grow(sh, need)
            sh.num_scheduled = len(sh) - sh.num_computed_tokens
            batch.append(sh)
            base[sh.key] = len(s)
        for _ in range(k):
            if not batch:
                break
            logits, sampling = self.runner.run(batch)
            self.forwards += 1
            picks = logits[:, : self.vocab].argmax(dim=-1).tolist()
            for sh, tok in zip(sampling, picks, strict=True):
                sh.num_computed_tokens += sh.num_scheduled
                sh.token_ids.append(tok)
                sh.num_scheduled = 1
        return {key: self.shadows[key].seq.token_ids[n:] for key, n in base.items()}

    def forget(self, key: tuple[str, int]) -> None:
        """The sequence (Sequence.key) ended: its shadow's blocks go back."""
        sh = self.shadows.pop(key, None)
        if sh is not None:
            self.blocks.release(sh.seq)

    def _sync(self, seq: Sequence) -> Sequence:
        """seq's shadow, holding seq's tokens, its KV kept for the leading tokens that still
        agree with them (the accepted proposals of the last round) and at least the last
        token left to compute (the round's first proposal is drawn from it)."""
        sh = self.shadows.get(seq.key)
        if sh is None:
            draft = Sequence(seq.request_id, [], seq.params, index=seq.index)
            sh = self.shadows[seq.key] = Shadow(draft)
        d, ids = sh.seq, seq.token_ids
        done = min(d.num_computed_tokens, len(ids) - 1)
        same = min(done, sh.known)
        while same < done and d.token_ids[same] == ids[same]:
            same += 1
        d.num_computed_tokens = same
        d.token_ids = list(ids)
        sh.known = len(ids)
        self.blocks.trim(d, len(ids))
        return d
