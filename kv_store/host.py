"""Host-memory tier: copies of device blocks in an LRU under a byte budget.

Blocks stay tensors here: they never leave the process, so they need no encoding; the
Redis tier encodes what the host tier pushes out to it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


class HostTier:
    def __init__(
        self, budget_bytes: int, on_evict: Callable[[bytes, bytes], None] | None = None
    ) -> None:
        self.budget = budget_bytes
        self.on_evict = on_evict  # receives (hash, data) of each block pushed out
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.bytes = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self.blocks

    def get(self, h: bytes) -> torch.Tensor | None:
        data = self.blocks.get(h)
        if data is not None:
            self.blocks.move_to_end(h)
        return data

    def put(self, h: bytes, block: torch.Tensor) -> None:
        size = _nbytes(block)
        if size > self.budget:  # can never fit: straight to the next tier
            if self.on_evict is not None:
                self.on_evict(h, block)
            return
        old = self.blocks.pop(h, None)
        if old is not None:
            self.bytes -= _nbytes(old)
        self.blocks[h] = block
        self.bytes += size
        while self.bytes > self.budget:
            victim, vblock = self.blocks.popitem(last=False)
            self.bytes -= _nbytes(vblock)
            if self.on_evict is not None:
                self.on_evict(victim, vblock)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
