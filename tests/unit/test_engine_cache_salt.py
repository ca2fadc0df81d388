"""Cache salts: salted block-hash chains, and an engine's prefix cache and host tier shared
only between requests of the same salt."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.kv_store.block_hash import EMPTY, chain_hashes, salt_root
from tests.helpers import drain, greedy, prompt, tokens

FP = bytes.fromhex("cd" * 16)


def test_salted_chains_differ_from_each_other_and_from_no_salt():
    toks = list(range(64))
    plain = chain_hashes(toks, 16, FP)
    a = chain_hashes(toks, 16, FP, root=salt_root("tenant-a"))
    b = chain_hashes(toks, 16, FP, root=salt_root("tenant-b"))
    assert salt_root(None) == EMPTY and chain_hashes(toks, 16, FP, root=EMPTY) == plain
    for x, y in ((plain, a), (plain, b), (a, b)):
        assert all(h1 != h2 for h1, h2 in zip(x, y, strict=True))
    assert chain_hashes(toks, 16, FP, root=salt_root("tenant-a")) == a
    # the same in another process, whatever its hash seed
    code = (
        "from plurai.kv_store.block_hash import chain_hashes, salt_root;"
        f"print(chain_hashes(list(range(64)), 16, bytes.fromhex('{FP.hex()}'),"
        " root=salt_root('tenant-a'))[-1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "7", "PATH": ""},
    )
    assert out.stdout.strip() == a[-1].hex()


def test_cache_salt_isolates_the_device_prefix_cache(tiny_model, engine_factory):
    engine = engine_factory(tiny_model)
    p = prompt(50, 1)

    def run(rid: str, salt: str | None):
        engine.add(AddRequest(rid, token_ids=p, params=greedy(), cache_salt=salt))
        outs = drain(engine)[rid]
        return outs[-1].num_cached_tokens, tokens(outs)

    cached_a, first = run("a1", "A")
    assert cached_a == 0
    assert run("b1", "B") == (0, first)  # another salt: nothing of A's
    assert run("none1", None) == (0, first)  # no salt is not A or B either
    assert run("a2", "A") == (48, first)  # the same salt shares: 3 full blocks
    assert run("b2", "B") == (48, first)
    assert run("none2", None) == (48, first)


def test_cache_salt_isolates_the_host_tier(tiny_model, engine_factory):
    # 12 blocks: a second 100-token prompt evicts the first one's blocks to the host tier
    engine = engine_factory(tiny_model, num_kv_blocks=12)
    p = prompt(100, 2)
    engine.add(AddRequest("a", token_ids=p, params=greedy(4), cache_salt="A"))
    expected = tokens(drain(engine)["a"])
    engine.add(AddRequest("evict", token_ids=prompt(100, 3), params=greedy(4)))
    drain(engine)
    assert engine.stats()["kv_spilled"] > 0
    engine.add(AddRequest("b", token_ids=p, params=greedy(4), cache_salt="B"))
    b = drain(engine)["b"]
    assert b[-1].num_cached_tokens == 0 and engine.stats()["kv_host_hits"] == 0
    engine.add(AddRequest("evict2", token_ids=prompt(100, 4), params=greedy(4)))
    drain(engine)
    engine.add(AddRequest("a2", token_ids=p, params=greedy(4), cache_salt="A"))
    a2 = drain(engine)["a2"]
    assert a2[-1].num_cached_tokens == 96 and engine.stats()["kv_host_hits"] > 0
    assert tokens(b) == tokens(a2) == expected


@pytest.mark.parametrize("salt", ["", 5, b"A"])
def test_a_bad_cache_salt_is_refused(tiny_engine, salt):
    with pytest.raises(RequestError) as e:
        tiny_engine.add(AddRequest("x", token_ids=[20, 21], cache_salt=salt))
    assert e.value.code == ErrorCode.INVALID_PARAMS and "cache_salt" in e.value.message
    assert "x" not in tiny_engine.seqs
