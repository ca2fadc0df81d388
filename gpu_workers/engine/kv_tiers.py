"""The bridge between the device KV cache and the kv_store tiers.

Cached blocks evicted from the device are copied into the host tier; blocks pushed out
of the host tier are encoded and written to Redis by a background thread. With write-through, every full block is also
sent to Redis as soon as it is computed, so other workers can use a hot prefix at once.
On admission the block manager asks for the longest run of a sequence's next blocks
that a tier holds (host first, then Redis) and has them copied into fresh device blocks
instead of computing them. A Redis entry that fails any check of kv_store.block_format
ends the run there and is recomputed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from plurai.kv_store import block_format
from plurai.kv_store.host import HostTier
from plurai.kv_store.redis_tier import RedisTier

log = logging.getLogger(__name__)


@dataclass
class TierCounters:
    host_hits: int = 0  # blocks loaded into the device from each tier, at admission
    redis_hits: int = 0
    bad_entries: int = 0  # entries refused by block_format checks
    spilled: int = 0  # device blocks saved to host on eviction
    written_through: int = 0


class KVTiers:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: bytes,
        host_bytes: int,
        redis_tier: RedisTier | None,
        write_through: bool,
    ) -> None:
        self.cache = kv_cache  # [2, layers, kv_heads, num_blocks, block_size, head_dim]
        self.fingerprint = fingerprint
        self.remote = redis_tier
        self.write_through = write_through and redis_tier is not None
        # with write-through, Redis already has every block: the host tier just drops
        spill = redis_tier.put if redis_tier is not None and not self.write_through else None
        self.host = HostTier(host_bytes, on_evict=spill) if host_bytes > 0 else None
        c = kv_cache
        self.shape = (2, c.shape[1], c.shape[2], c.shape[4], c.shape[5])
        self.size = block_format.size(self.shape, c.dtype)  # of an entry, so of a Redis read
        self.counters = TierCounters()

    def _copy(self, block_id: int) -> torch.Tensor:
        return self.cache[:, :, :, block_id].to("cpu", copy=True)

    def evicted(self, block_id: int, h: bytes) -> None:
        """A cached device block is about to be reused: keep its content below."""
        if self.host is None and self.remote is None:
            return
        self.counters.spilled += 1
        if self.host is not None:
            self.host.put(h, self._copy(block_id))
        elif not self.write_through:  # already sent to Redis when it was computed
            self.remote.put(h, self._copy(block_id))  # type: ignore[union-attr]

    def computed(self, block_id: int, h: bytes) -> None:
        """A block just became full: write it through to Redis if asked."""
        if self.write_through:
            self.remote.put(h, self._copy(block_id))  # type: ignore[union-attr]
            self.counters.written_through += 1

    def lookup(self, hashes: list[bytes]) -> tuple[list[torch.Tensor], int]:
        """Blocks for the longest leading run of `hashes` held by a tier, decoded, and how
        many of them (the first ones) came from the host tier; the rest came from Redis."""
        out: list[torch.Tensor] = []
        i = 0
        while i < len(hashes) and self.host is not None:
            block = self.host.get(hashes[i])
            if block is None:
                break
            out.append(block)
            i += 1
        if (
            i < len(hashes)
            and self.remote is not None
            and (self.host is None or hashes[i] not in self.host)
        ):
            for h, data in zip(
                hashes[i:], self.remote.get_many(hashes[i:], self.size), strict=True
            ):
                if data is None or not self._take(h, data, out):
                    break
        return out, i

    def _take(self, h: bytes, data: bytes, out: list[torch.Tensor]) -> bool:
        try:
            out.append(block_format.decode(data, h, self.fingerprint, self.shape, self.cache.dtype))
        except block_format.BadBlock as e:
            self.counters.bad_entries += 1
            log.warning("KV block %s from Redis refused (%s); recomputing it", h.hex(), e)
            return False
        return True

    def load(self, block_id: int, block: torch.Tensor) -> None:
        self.cache[:, :, :, block_id].copy_(block)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.flush()
            self.remote.close()
