"""KV blocks of the Redis tier: the MAC of PLURAI_KV_SECRET, and NaN/Inf refused."""

from __future__ import annotations

import logging
import threading

import fakeredis
import pytest
import torch

from kv_store import block_format
from kv_store.block_format import BadBlock
from kv_store.redis_tier import SECRET_ENV, RedisTier

FP = bytes(range(16))
H = bytes(range(100, 116))
SHAPE = (2, 3, 2, 4, 8)
SECRET = b"correct horse battery staple"


def forged(data: bytes) -> bytes:
    """`data` with other payload values and a checksum that matches them: what anyone who
    can write the store can make without the secret (the MAC is left as it was)."""
    header, payload = (
        bytearray(data[: block_format.HEADER_SIZE]),
        bytearray(data[block_format.HEADER_SIZE :]),
    )
    payload[:4] = torch.tensor([42.0]).view(torch.uint8).numpy().tobytes()
    at = block_format._FIELDS.size - 8
    header[at : at + 8] = block_format._checksum(bytes(payload))
    return bytes(header + payload)


def test_a_block_with_the_right_mac_is_accepted():
    block = torch.randn(SHAPE)
    data = block_format.encode(block, H, FP, SECRET)
    block_format.verify(data, SECRET)
    assert torch.equal(block_format.decode(data, H, FP, SHAPE, torch.float32, SECRET), block)


def test_forged_wrong_or_missing_mac_is_refused_with_a_secret():
    data = block_format.encode(torch.randn(SHAPE), H, FP, SECRET)
    fake = forged(data)
    # the checksum is valid: without a secret the forgery passes every other check
    assert block_format.decode(fake, H, FP, SHAPE, torch.float32)[0, 0, 0, 0, 0] == 42.0
    unsigned = block_format.encode(torch.randn(SHAPE), H, FP)
    other = block_format.encode(torch.randn(SHAPE), H, FP, b"another secret")
    for bad, why in ((fake, "mismatch"), (unsigned, "no MAC"), (other, "mismatch")):
        with pytest.raises(BadBlock, match=why):
            block_format.verify(bad, SECRET)
        with pytest.raises(BadBlock, match=why):
            block_format.decode(bad, H, FP, SHAPE, torch.float32, SECRET)
    # the MAC covers the header too: the same payload filed under another block hash
    moved = bytearray(data)
    moved[block_format._FIELDS.size - 24] ^= 1  # a byte of the block hash
    with pytest.raises(BadBlock, match="mismatch"):
        block_format.verify(bytes(moved), SECRET)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_or_inf_blocks_are_refused_with_or_without_a_secret(value, dtype):
    block = torch.randn(SHAPE).to(dtype)
    block[1, 2, 1, 3, 7] = value
    for secret in (None, SECRET):
        data = block_format.encode(block, H, FP, secret)
        with pytest.raises(BadBlock, match="NaN or Inf"):
            block_format.decode(data, H, FP, SHAPE, dtype, secret)


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
