"""KV blocks (kv_store/block_format.py): the MAC of PLURAI_KV_SECRET over header and
payload, and NaN/Inf payloads refused."""

from __future__ import annotations

import pytest
import torch

from plurai.kv_store import block_format
from plurai.kv_store.block_format import BadBlock

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
