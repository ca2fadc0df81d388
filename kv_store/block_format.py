"""The one binary format of a KV block outside the device cache (host tier, Redis tier).

    header (little-endian, 72 bytes)
      magic       4s   b"PLKV"
      version     H    1
      dtype       B    index into DTYPES
      layout      B    1 = [K/V, layer, kv_head, token, head_dim]
      shape       5I   2, layers, kv_heads, block_size, head_dim
      fingerprint 16s  model fingerprint (first 16 bytes)
      block hash  16s  the block's chained content hash
      checksum    8s   blake2b-8 of the payload
    payload      raw tensor bytes, C order

`decode` checks every field against what the reader expects and raises BadBlock on any
difference, so a corrupt, truncated, foreign-model or wrong-layout entry is recomputed,
never used. No pickle.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

MAGIC = b"PLKV"
VERSION = 1
LAYOUT_HEADS_FIRST = 1
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_HEADER = struct.Struct("<4sHBB5I16s16s8s")


class BadBlock(ValueError):
    """A stored block that must not be used (it is recomputed instead)."""


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


def encode(block: torch.Tensor, block_hash: bytes, fingerprint: bytes) -> bytes:
    """`block` is [2, layers, kv_heads, block_size, head_dim] on any device."""
    t = block.detach().contiguous().cpu()
    payload = t.view(torch.uint8).numpy().tobytes()  # numpy has no bf16: go through bytes
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        DTYPES.index(t.dtype),
        LAYOUT_HEADS_FIRST,
        *t.shape,
        fingerprint[:16],
        block_hash,
        _checksum(payload),
    )
    return header + payload


def decode(
    data: bytes, block_hash: bytes, fingerprint: bytes, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The block's tensor, or BadBlock saying why it cannot be used."""
    if len(data) < _HEADER.size:
        raise BadBlock("truncated header")
    magic, version, dt, layout, *rest = _HEADER.unpack_from(data)
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
    payload = memoryview(data)[_HEADER.size :]
    if len(payload) != torch.empty(0, dtype=dtype).element_size() * math.prod(shape):
        raise BadBlock("truncated payload")
    if _checksum(payload) != checksum:
        raise BadBlock("checksum mismatch")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(dtype).view(shape)
