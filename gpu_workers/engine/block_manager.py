"""Paged KV cache bookkeeping: blocks, ref counts, prefix cache, LRU eviction, and the
prompt blocks the choices of one request share (`match_prefix`).

A block whose ref count drops to zero stays in the prefix cache (its hash still maps
to it) until a new allocation needs it; the free queue hands out the least recently
used block first. Blocks that hold no reusable content (partial, unhashed) are put at
the front of the queue so they go before any cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from plurai.gpu_workers.engine.kv_tiers import KVTiers
from plurai.gpu_workers.engine.sequence import Sequence
from plurai.kv_store.block_hash import chain_hashes


@dataclass(eq=False)
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, fingerprint: bytes, prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.hits = 0  # prefix-cache hits and lookups, in blocks
        self.lookups = 0
        self.tiers: KVTiers | None = None  # host / Redis tiers below the device cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------

    def _hash_full_blocks(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of its tokens."""
        if len(seq.block_hashes) < len(seq.token_ids) // self.block_size:
            seq.block_hashes = chain_hashes(
                seq.token_ids, self.block_size, self.fingerprint, seq.block_hashes, seq.hash_root
            )

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of computed blocks holding the longest prefix of seq's tokens: a choice of a
        request with n > 1 forks its lead's full prompt blocks while the lead holds them
        computed (with or without prefix caching); other sequences get cached blocks.

        At least one token is always left to compute, since the step needs its logits.
        """
        bs = self.block_size
        limit = (len(seq.token_ids) - 1) // bs
        lead = seq.lead
        if lead is not None and lead.num_computed_tokens >= seq.num_prompt_tokens:
            return lead.block_table[: min(limit, seq.num_prompt_tokens // bs)]
        if not self.prefix_caching:
            return []
        self._hash_full_blocks(seq)
        out: list[int] = []
        for i in range(limit):
            bid = self.cached.get(seq.block_hashes[i])
            if bid is None or self.blocks[bid].token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            out.append(bid)
        return out

    def match_tiers(self, seq: Sequence, start: int) -> list[torch.Tensor]:
        """Blocks `start`.. of seq's prefix that a tier below the device holds, looked up
        once per admission attempt and kept on the sequence until it is admitted."""
        if self.tiers is None or not self.prefix_caching:
            return []
        if seq.tier_blocks is None or seq.tier_start != start:
            limit = (len(seq.token_ids) - 1) // self.block_size
            seq.tier_blocks, seq.tier_from_host = (
                self.tiers.lookup(seq.block_hashes[start:limit]) if start < limit else ([], 0)
            )
            seq.tier_start = start
        return seq.tier_blocks

    def can_allocate(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        """Whether seq can hold `num_tokens` slots, reusing the `hit` blocks."""
        hit_in_free = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        need = self.blocks_for(num_tokens) - len(hit)
        return need <= self.num_free - hit_in_free

    def allocate(
        self, seq: Sequence, hit: list[int], loaded: list[torch.Tensor] | None = None
    ) -> None:
        """Give a waiting sequence its cached prefix: the device blocks `hit`, then fresh
        blocks filled with the `loaded` tier blocks. Further blocks come from `grow`."""
        assert not seq.block_table
        for bid in hit:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
        seq.block_table = list(hit)
        bs = self.block_size
        for i, data in enumerate(loaded or [], start=len(hit)):
            block = self._take_free()
            self.tiers.load(block.id, data)  # type: ignore[union-attr]
            block.hash = seq.block_hashes[i]
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached.setdefault(block.hash, block.id)
            seq.block_table.append(block.id)
        seq.tier_blocks = None
        seq.num_committed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * bs
        if seq.num_preemptions == 0:  # the prompt's first admission: what the cache served
            seq.num_cached_tokens = seq.num_computed_tokens
            self.lookups += max(1, (len(seq.token_ids) - 1) // bs)
            self.hits += len(hit)
            if loaded:
                c = self.tiers.counters  # type: ignore[union-attr]
                c.host_hits += min(len(loaded), seq.tier_from_host)
                c.redis_hits += len(loaded) - min(len(loaded), seq.tier_from_host)

    # -- allocation ---------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append blocks until seq's table covers `num_tokens` slots."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free().id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first `num_tokens` slots (grown for proposed
        tokens that were rejected: they hold nothing cached)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.id] = None
                self.free.move_to_end(block.id, last=False)

    def _take_free(self) -> Block:
        """The least recently used free block, its cached content evicted (to a tier
        below, when there is one)."""
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
                if self.tiers is not None:
                    self.tiers.evicted(bid, block.hash)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def commit(self, seq: Sequence) -> None:
        """Publish blocks that became full in the prefix cache (after a step)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        first = seq.num_committed_blocks
        full = seq.num_computed_tokens // bs
        if full <= first:
            return
        self._hash_full_blocks(seq)
        seq.num_committed_blocks = full
        for i in range(first, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = seq.block_hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                if (
                    self.cached.setdefault(block.hash, block.id) == block.id
                    and self.tiers is not None
                ):
                    self.tiers.computed(block.id, block.hash)

    def release(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks are queued for eviction before its prefix."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} ref count went negative"
            if block.ref_count == 0:
                self.free[bid] = None
                if block.hash is None:
                    self.free.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.tier_blocks = None
