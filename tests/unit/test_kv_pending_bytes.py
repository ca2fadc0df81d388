"""The Redis KV tier's write queue is bounded in bytes as well as in blocks: blocks beyond
`max_pending_bytes` are dropped at once (counted), never waited for, and the bytes count
down as the writer gets through them. A Redis stub holds the writer inside a write."""

from __future__ import annotations

import threading

import torch

from plurai.kv_store.redis_tier import RedisTier

FP = "ab" * 16
BLOCK = 64 << 10  # bytes of each test block


class HeldRedis:
    """A Redis whose pipeline's execute waits until `release` is set: the writer is stuck
    in its first write, as against a slow Redis."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[str] = []

    def pipeline(self, transaction: bool = False) -> HeldRedis:
        return self

    def set(self, key: str, data: bytes, ex: int) -> None:
        self.written.append(key)

    def execute(self) -> list[bool]:
        self.release.wait(10)
        return []


def block(i: int) -> torch.Tensor:
    """[2, layers, kv_heads, block_size, head_dim] in fp32: BLOCK bytes."""
    return torch.full((2, 4, 2, 16, BLOCK // (2 * 4 * 2 * 16 * 4)), float(i))


def test_queued_blocks_are_bounded_in_bytes():
    r = HeldRedis()
    tier = RedisTier(r, FP, max_pending=1024, max_pending_bytes=3 * BLOCK + 100, secret=None)
    for i in range(10):
        tier.put(bytes([i]) * 32, block(i))
    # three blocks fit in the bytes, whatever the writer has taken: the rest are dropped
    assert tier.dropped == 7
    assert tier.pending_bytes == 3 * BLOCK
    r.release.set()
    tier.flush()
    assert tier.pending_bytes == 0 and len(r.written) == 3
    tier.put(b"\x0b" * 32, block(11))  # room again once written
    tier.flush()
    assert len(r.written) == 4 and tier.dropped == 7
    tier.close()


def test_a_block_over_the_whole_budget_is_dropped():
    r = HeldRedis()
    r.release.set()
    tier = RedisTier(r, FP, max_pending_bytes=BLOCK - 1, secret=None)
    tier.put(b"\x01" * 32, block(1))
    tier.flush()
    assert tier.dropped == 1 and r.written == [] and tier.pending_bytes == 0
    tier.close()
