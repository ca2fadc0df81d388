"""The Redis KV tier (kv_store/redis_tier.py) on fakeredis: it refuses blocks another
secret (or none) wrote, takes its secret from the environment, refuses a fingerprint that
is not plain hex, and drops a block it cannot encode without its writer dying."""

from __future__ import annotations

import logging
import threading

import fakeredis
import pytest
import torch

from plurai.kv_store import block_format
from plurai.kv_store.redis_tier import SECRET_ENV, RedisTier

from .test_block_format import FP, SECRET, SHAPE, H, forged


def tier(r, secret=None, **kw) -> RedisTier:
    return RedisTier(r, FP.hex(), secret=secret, **kw)


def test_the_tier_refuses_what_another_secret_or_none_wrote(caplog):
    r = fakeredis.FakeRedis()
    blocks = {bytes([i]) * 16: torch.randn(SHAPE) for i in range(3)}
    writers = [tier(r, SECRET), tier(r, b"other"), tier(r, None)]
    for w, (h, b) in zip(writers, blocks.items(), strict=True):
        w.put(h, b)
        w.flush()
        w.close()
    hashes = list(blocks)
    reader = tier(r, SECRET)
    with caplog.at_level(logging.WARNING):
        got = reader.get_many(hashes)
        assert got[0] is not None and got[1:] == [None, None] and reader.refused == 1
        assert reader.get_many([hashes[2]]) == [None] and reader.refused == 2
        assert reader.get_many([b"?" * 16, hashes[0]]) == [None, None]  # a miss ends the run
    assert "refused" in caplog.text and SECRET.decode() not in caplog.text
    block = block_format.decode(got[0], hashes[0], FP, SHAPE, torch.float32, SECRET)
    assert torch.equal(block, blocks[hashes[0]])
    r.set(reader.key(hashes[0]), forged(got[0]))
    assert reader.get_many(hashes[:1]) == [None] and reader.refused == 3
    # a reader without a secret cannot tell; it gets every entry (decode still checks them)
    plain = tier(r, None)
    assert all(x is not None for x in plain.get_many(hashes)) and plain.refused == 0
    for t in (reader, plain):
        t.close()


def test_the_secret_defaults_to_the_environment(monkeypatch):
    r = fakeredis.FakeRedis()
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    t = RedisTier(r, FP.hex())  # as the engine constructs it
    assert t.secret == SECRET
    t.put(H, torch.randn(SHAPE))
    t.flush()
    block_format.verify(r.get(t.key(H)), SECRET)
    t.close()
    monkeypatch.setenv(SECRET_ENV, "")
    t = RedisTier(r, FP.hex())
    assert t.secret is None
    assert t.get_many([H]) != [None]  # no secret: no MAC check
    t.close()
    monkeypatch.delenv(SECRET_ENV)
    t = RedisTier(r, FP.hex())
    assert t.secret is None
    t.close()


def test_a_fingerprint_that_is_not_hex_is_refused_at_once():
    r = fakeredis.FakeRedis()
    before = threading.active_count()
    # bytes.fromhex takes the spaced, newlined and capital ones: keys no other worker reads
    bad = ("not-hex", "", "abc", "zz" * 16, "ab cd", "abcd\n", " abcd", "ABCD", "é1", None)
    for fp in (*bad, FP, FP.hex().encode(), 1234):
        with pytest.raises(ValueError, match="fingerprint must be a str of an even number"):
            RedisTier(r, fp)
    assert threading.active_count() == before  # no writer thread was started
    t = RedisTier(r, "ab12", secret=None)  # any length of hex digits names the keys
    t.put(H, torch.randn(SHAPE))
    t.flush()
    assert t.get_many([H]) != [None] and t.writer.is_alive()
    t.close()


def test_a_block_the_writer_cannot_encode_is_dropped_and_the_writer_goes_on(caplog):
    r = fakeredis.FakeRedis()
    t = tier(r)
    t.put(H, torch.zeros(SHAPE, dtype=torch.int64))  # no such dtype in the block format
    t.flush()  # returns: the writer thread did not die on it
    assert t.dropped == 1 and t.errors == 1
    assert "could not be written" in caplog.text
    t.put(H, torch.randn(SHAPE))
    t.flush()
    assert t.get_many([H]) != [None]
    t.close()


def test_the_secret_of_the_config_file(monkeypatch, tmp_path):
    """kv_secret in the PLURAI_CONFIG file reaches the tier (the environment still wins)."""
    config = tmp_path / "plurai.toml"
    config.write_text('kv_secret = "from-file"\n')
    monkeypatch.setenv("PLURAI_CONFIG", str(config))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    r = fakeredis.FakeRedis()
    t = RedisTier(r, FP.hex())
    assert t.secret == b"from-file"
    t.close()
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    t = RedisTier(r, FP.hex())
    assert t.secret == SECRET
    t.close()
