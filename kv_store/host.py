"""Host-memory tier: encoded blocks in an LRU under a byte budget."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


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

    def get(self, h: bytes) -> bytes | None:
        data = self.blocks.get(h)
        if data is not None:
            self.blocks.move_to_end(h)
        return data

    def put(self, h: bytes, data: bytes) -> None:
        if len(data) > self.budget:  # can never fit: straight to the next tier
            if self.on_evict is not None:
                self.on_evict(h, data)
            return
        old = self.blocks.pop(h, None)
        if old is not None:
            self.bytes -= len(old)
        self.blocks[h] = data
        self.bytes += len(data)
        while self.bytes > self.budget:
            victim, vdata = self.blocks.popitem(last=False)
            self.bytes -= len(vdata)
            if self.on_evict is not None:
                self.on_evict(victim, vdata)

    def discard(self, h: bytes) -> None:
        data = self.blocks.pop(h, None)
        if data is not None:
            self.bytes -= len(data)
