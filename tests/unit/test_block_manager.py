"""Block accounting: hashes, prefix cache, LRU eviction, and a property test of the
engine under random add / abort / step sequences."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.block_manager import BlockManager
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.sequence import Sequence
from plurai.kv_store.block_hash import chain_hashes

FP = bytes.fromhex("ab" * 16)


def seq(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Allocate like the scheduler: cached prefix, then fresh blocks; mark it computed."""
    hit = bm.match_prefix(s)
    bm.allocate(s, hit)
    bm.grow(s, len(s))
    s.num_computed_tokens = len(s)
    bm.commit(s)
    return hit


def test_block_hashes_are_the_same_in_every_process():
    tokens = list(range(100))
    here = [h.hex() for h in chain_hashes(tokens, 16, FP)]
    code = (
        "from plurai.kv_store.block_hash import chain_hashes;"
        f"print(','.join(h.hex() for h in chain_hashes(list(range(100)), 16, bytes.fromhex('{FP.hex()}'))))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=".",
        )
        assert out.stdout.strip().split(",") == here
    assert len(here) == 6  # full blocks only
    # the chain: a different first block changes every later hash
    other = chain_hashes([1] + tokens[1:], 16, FP)
    assert all(a != b for a, b in zip(chain_hashes(tokens, 16, FP), other, strict=True))
    assert chain_hashes(tokens, 16, bytes(16)) != chain_hashes(tokens, 16, FP)  # model fingerprint


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(16, 4, FP)
    a = seq(list(range(10)), "a")
    admit(bm, a)
    b = seq(list(range(8)) + [99, 98, 97], "b")
    hit = admit(bm, b)
    assert hit == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in hit] == [2, 2]
    assert b.num_cached_tokens == 8
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 16
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_a_hash_hit_with_other_tokens_is_not_used():
    bm = BlockManager(8, 4, FP)
    a = seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    first = bm.blocks[a.block_table[0]]
    bm.release(a)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "b")) == [first.id]
    first.token_ids = (9, 9, 9, 9)  # as if another block's content had collided on the hash
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "c")) == []


def test_eviction_order():
    bm = BlockManager(6, 4, FP)
    old, new = seq(list(range(8)), "old"), seq(list(range(100, 108)), "new")
    admit(bm, old)  # blocks 0, 1
    admit(bm, new)  # blocks 2, 3
    bm.release(old)
    bm.release(new)
    partial = seq([7, 7], "p")  # block 4, never full, so never cached
    admit(bm, partial)
    bm.release(partial)
    assert list(bm.free) == [4, 5, 1, 0, 3, 2]  # no-content blocks first, then LRU, tail first
    taker = seq(list(range(200, 212)), "t")
    bm.allocate(taker, [])
    bm.grow(taker, 8)
    assert taker.block_table == [4, 5] and len(bm.cached) == 4
    bm.grow(taker, 12)  # evicts the least recently used cached block: old's tail
    assert taker.block_table == [4, 5, 1] and len(bm.cached) == 3
    assert bm.match_prefix(seq(list(range(8)) + [1], "q")) == [0]
    assert bm.match_prefix(seq(list(range(100, 108)) + [1], "q")) == [2, 3]


def check_invariants(engine) -> None:
    bm = engine.blocks
    tables = [s.block_table for s in engine.seqs.values()]
    for blk in bm.blocks:
        assert blk.ref_count >= 0
        assert blk.ref_count == sum(t.count(blk.id) for t in tables), blk
        assert (blk.id in bm.free) == (blk.ref_count == 0)
    for h, bid in bm.cached.items():
        assert bm.blocks[bid].hash == h
    for s in engine.seqs.values():
        assert len(s.block_table) == len(set(s.block_table))
        assert s.num_computed_tokens <= len(s.block_table) * bm.block_size


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 70), st.integers(1, 40), st.integers(0, 3), st.booleans()
        ),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module")
def prop_engine_factory(model_factory):
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig

    path = model_factory("llama")

    def make():
        return Engine(
            EngineConfig(
                model=str(path),
                dtype="fp32",
                block_size=8,
                num_kv_blocks=24,
                max_num_batched_tokens=32,
                max_num_seqs=6,
            )
        )

    return make


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_random_add_abort_step_never_leaks_blocks(prop_engine_factory, ops):
    engine = prop_engine_factory()
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prio, shared = op
            # shared prefixes exercise the prefix cache and shared ref counts
            tokens = ([5] * 16 if shared else []) + [
                (len(added) * 7 + i) % 2000 + 16 for i in range(n)
            ]
            rid = f"r{len(added)}"
            engine.add(
                AddRequest(
                    rid,
                    token_ids=tokens[:150],
                    priority=prio,
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                ),
            )
            added.append(rid)
        elif op[0] == "abort" and added:
            engine.abort(added[op[1] % len(added)])
        else:
            for _ in range(op[1]):
                engine.step()
        check_invariants(engine)
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)
    assert not engine.seqs
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(b.ref_count == 0 for b in engine.blocks.blocks)
