"""Content identity of a KV block, the same in every process.

hash(block i) = blake2b(hash(block i-1) || token ids of block i || model fingerprint).
Python's salted `hash()` would differ between workers, so it is never used here.
"""

from __future__ import annotations

import hashlib

import numpy as np

EMPTY = b""  # parent hash of a sequence's first block


def block_hash(parent: bytes, token_ids: list[int], fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(fingerprint)
    return h.digest()


def chain_hashes(
    token_ids: list[int], block_size: int, fingerprint: bytes, known: list[bytes] | None = None
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order; `known` holds the leading ones
    already computed, which are kept rather than hashed again."""
    out = list(known or [])
    parent = out[-1] if out else EMPTY
    for i in range(len(out), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], fingerprint)
        out.append(parent)
    return out
