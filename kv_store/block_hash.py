"""Content identity of a KV block, the same in every process.

hash(block i) = blake2b(hash(block i-1) || token ids of block i || model fingerprint).
The parent of a sequence's first block is its root: empty, or for a request with a
`cache_salt` a digest of the salt, so requests of different salts (or salt and none) never
name the same block on the device, in the host tier or in Redis.
Python's salted `hash()` would differ between workers, so it is never used here.
"""

from __future__ import annotations

import hashlib

import numpy as np

EMPTY = b""  # parent hash of the first block of a sequence without a cache salt


def salt_root(cache_salt: str | None) -> bytes:
    """The root parent hash of a chain: EMPTY without a salt, else a digest of the salt
    (16 bytes, so it can never equal EMPTY)."""
    if cache_salt is None:
        return EMPTY
    h = hashlib.blake2b(digest_size=16, person=b"plurai-salt")
    h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def block_hash(parent: bytes, token_ids: list[int], fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(fingerprint)
    return h.digest()


def chain_hashes(
    token_ids: list[int],
    block_size: int,
    fingerprint: bytes,
    known: list[bytes] | None = None,
    root: bytes = EMPTY,
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order; `known` holds the leading ones
    already computed, which are kept rather than hashed again. `root` is the first block's
    parent (see salt_root)."""
    out = list(known or [])
    parent = out[-1] if out else root
    for i in range(len(out), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], fingerprint)
        out.append(parent)
    return out
