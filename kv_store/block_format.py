"""The one binary format of a KV block outside the device cache (the Redis tier).

    header (little-endian, 100 bytes)
      magic       4s   b"PLKV"
      version     H    2
      dtype       B    index into DTYPES
      layout      B    1 = [K/V, layer, kv_head, token, head_dim]
      shape       5I   2, layers, kv_heads, block_size, head_dim
      fingerprint 16s  model fingerprint (first 16 bytes)
      block hash  16s  the block's chained content hash
      checksum    8s   blake2b-8 of the payload
      mac         32s  HMAC-SHA256 with the writer's secret over the 68 bytes above and the
                       payload; all zero when the writer had no secret
    payload      raw tensor bytes, C order

`decode` checks every field against what the reader expects, and that every value is
finite, and raises BadBlock on any difference, so a corrupt, truncated, foreign-model,
wrong-layout or NaN/Inf entry is recomputed, never used. The checksum only catches
accidents: anyone who can write the store can compute it. `verify` checks the MAC, which
only holders of the secret can compute; a reader with a secret refuses every block whose
MAC is missing or wrong. No pickle.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct

import torch

MAGIC = b"PLKV"
VERSION = 2
LAYOUT_HEADS_FIRST = 1
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_FIELDS = struct.Struct("<4sHBB5I16s16s8s")  # what the MAC covers ahead of the payload
MAC_SIZE = 32
HEADER_SIZE = _FIELDS.size + MAC_SIZE
NO_MAC = bytes(MAC_SIZE)


class BadBlock(ValueError):
    """A stored block that must not be used (it is recomputed instead)."""


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


def _mac(secret: bytes, fields: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    m = hmac.new(secret, fields, hashlib.sha256)
    m.update(payload)
    return m.digest()


def encode(
    block: torch.Tensor, block_hash: bytes, fingerprint: bytes, secret: bytes | None = None
) -> bytes:
    """`block` is [2, layers, kv_heads, block_size, head_dim] on any device; with a
    `secret`, the header carries the MAC that `verify` checks."""
    t = block.detach().contiguous().cpu()
    payload = t.view(torch.uint8).numpy().tobytes()  # numpy has no bf16: go through bytes
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        DTYPES.index(t.dtype),
        LAYOUT_HEADS_FIRST,
        *t.shape,
        fingerprint[:16],
        block_hash,
        _checksum(payload),
    )
    mac = _mac(secret, fields, payload) if secret else NO_MAC
    return fields + mac + payload


def size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The length of an encoded block of this shape and dtype, header included."""
    return HEADER_SIZE + torch.empty(0, dtype=dtype).element_size() * math.prod(shape)


def verify(data: bytes, secret: bytes) -> None:
    """Raise BadBlock unless `data` carries the MAC of `secret` over its header and
    payload (so it was written by a holder of the same secret, and not changed since)."""
    if len(data) < HEADER_SIZE:
        raise BadBlock("truncated header")
    view = memoryview(data)
    mac = bytes(view[_FIELDS.size : HEADER_SIZE])
    if mac == NO_MAC:
        raise BadBlock("no MAC: written without a secret")
    if not hmac.compare_digest(mac, _mac(secret, view[: _FIELDS.size], view[HEADER_SIZE:])):
        raise BadBlock("MAC mismatch: forged, changed, or written with another secret")


def decode(
    data: bytes,
    block_hash: bytes,
    fingerprint: bytes,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    secret: bytes | None = None,
) -> torch.Tensor:
    """The block's tensor, or BadBlock saying why it cannot be used. With a `secret`, the
    MAC is checked too (the Redis tier checks it before handing blocks out)."""
    if len(data) < HEADER_SIZE:
        raise BadBlock("truncated header")
    magic, version, dt, layout, *rest = _FIELDS.unpack_from(data)
    dims, fp, h, checksum = tuple(rest[:5]), rest[5], rest[6], rest[7]
    if magic != MAGIC or version != VERSION:
        raise BadBlock(f"unknown format {magic!r} v{version}")
    if fp != fingerprint[:16]:
        raise BadBlock("written by another model")
    if h != block_hash:
        raise BadBlock("holds another block")
    if layout != LAYOUT_HEADS_FIRST or dims != tuple(shape):
        raise BadBlock(
            f"layout {layout} shape {dims}, expected {LAYOUT_HEADS_FIRST} {tuple(shape)}"
        )
    if dt >= len(DTYPES) or DTYPES[dt] != dtype:
        raise BadBlock(f"dtype index {dt}, expected {dtype}")
    if len(data) != size(shape, dtype):
        word = "truncated" if len(data) < size(shape, dtype) else "oversized"
        raise BadBlock(f"{word} payload: {len(data)} bytes, expected {size(shape, dtype)}")
    payload = memoryview(data)[HEADER_SIZE:]
    if _checksum(payload) != checksum:
        raise BadBlock("checksum mismatch")
    if secret is not None:
        verify(data, secret)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    block = raw.view(dtype).view(shape)
    if not bool(torch.isfinite(block).all()):
        raise BadBlock("holds NaN or Inf")
    return block
