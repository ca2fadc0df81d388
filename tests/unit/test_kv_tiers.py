"""KV tiers below the device cache: the block format, the host tier, and the engine
loading blocks from the host tier instead of recomputing them."""

from __future__ import annotations

import random

import pytest
import torch

from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.kv_store import block_format
from plurai.kv_store.block_format import BadBlock
from plurai.kv_store.host import HostTier

FP = bytes(range(16))
H = bytes(range(100, 116))
SHAPE = (2, 3, 2, 4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_format_round_trip(dtype):
    block = torch.randn(SHAPE).to(dtype)
    data = block_format.encode(block, H, FP)
    assert torch.equal(block_format.decode(data, H, FP, SHAPE, dtype), block)


def test_block_format_refuses_anything_off():
    block = torch.randn(SHAPE)
    data = block_format.encode(block, H, FP)
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    cases = {
        "checksum": (bytes(flipped), H, FP, SHAPE, torch.float32),
        "truncated payload": (data[:-4], H, FP, SHAPE, torch.float32),
        "truncated header": (data[:30], H, FP, SHAPE, torch.float32),
        "another model": (data, H, bytes(16), SHAPE, torch.float32),
        "another block": (data, bytes(16), FP, SHAPE, torch.float32),
        "shape": (data, H, FP, (2, 3, 2, 8, 4), torch.float32),
        "dtype": (data, H, FP, SHAPE, torch.float16),
        "format": (b"XXXX" + data[4:], H, FP, SHAPE, torch.float32),
    }
    for why, args in cases.items():
        with pytest.raises(BadBlock):
            block_format.decode(*args)
        assert why


def test_host_tier_evicts_least_recently_used_to_the_next_tier():
    spilled = []
    host = HostTier(300, on_evict=lambda h, d: spilled.append(h))
    for h in (b"a", b"b", b"c"):
        host.put(h, torch.zeros(25))  # 100 bytes each
    assert host.get(b"a") is not None  # now most recently used
    host.put(b"d", torch.zeros(25))
    assert spilled == [b"b"]
    assert b"b" not in host and b"a" in host and host.bytes == 300
    host.put(b"huge", torch.zeros(1000))  # larger than the whole budget: passed straight on
    assert spilled == [b"b", b"huge"] and b"huge" not in host


def long_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 2000) for _ in range(length)] for _ in range(n)]


def test_blocks_evicted_to_host_are_loaded_back_and_give_the_same_tokens(
    model_factory, engine_factory
):
    path = model_factory("llama")
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = long_prompts(1, 200, 1)[0] + [5, 6, 7]
    cold = engine_factory(path, kv_host_bytes=0).generate([prompt], sp)[0]
    engine = engine_factory(path, num_kv_blocks=16, kv_host_bytes=64 << 20)
    assert engine.generate([prompt], sp)[0].token_ids == cold.token_ids
    engine.generate(long_prompts(2, 200, 2), sp)  # pushes the prompt's blocks out of the device
    assert engine.blocks.match_prefix(_seq(prompt)) == []
    warm = engine.generate([prompt], sp)[0]
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == 192  # 12 full blocks from the host tier
    stats = engine.stats()
    assert stats["kv_host_hits"] == 12 and stats["kv_spilled"] > 0


def _seq(prompt: list[int], engine=None):
    from plurai.gpu_workers.engine.sequence import Sequence

    seq = Sequence("probe", list(prompt), SamplingParams())
    if engine is not None:
        engine.blocks._hash_full_blocks(seq)
    return seq
