"""Redis tier: encoded blocks shared by every worker of the same model.

Blocks are stored in kv_store.block_format under keys from broker_config.keys.kv_block (model fingerprint + block hash) and expire
after `ttl_s`; Redis `maxmemory` with an eviction policy such as allkeys-lru may drop any
of them at any time, which is only a miss. Writes go through a background thread in
pipelined batches, so the engine step never waits on them; reads are one pipelined round
trip per lookup; the caller decodes and checks what it reads. Redis being down or full degrades to misses and dropped writes, never
to an error for a request. The writer's queue is bounded in blocks and in bytes
(`max_pending_bytes`): what does not fit is dropped, never waited for. A Redis at its
maxmemory that refuses writes (OOM, policy noeviction) stops the writes for a while,
doubling up to a minute while it stays full; its reads go on meanwhile.

Authentication: with a secret (`PLURAI_KV_SECRET`, Settings.kv_secret, unless given),
every block written carries an HMAC-SHA256 of the secret over its header and payload, and
every block read is checked before it is handed out; one with a missing or wrong MAC is a
miss (counted in `refused`, and recomputed by the engine), never used. Workers share
blocks only with workers that have the same secret. Without a secret, anyone who can
write this Redis can change what the engines read, and so their outputs. The secret is
never logged.
"""

from __future__ import annotations

import enum
import logging
import queue
import re
import threading
import time
from typing import Any

import redis
import torch

from plurai.broker_config import keys
from plurai.broker_config.connection import is_cluster
from plurai.broker_config.memory import is_oom
from plurai.broker_config.settings import Settings
from plurai.kv_store import block_format

log = logging.getLogger(__name__)

SECRET_ENV = "PLURAI_KV_SECRET"  # Settings.kv_secret's variable


class _Default(enum.Enum):
    SECRET = "kv_secret"


FROM_SETTINGS = _Default.SECRET  # RedisTier's default: the secret of Settings
# what a Redis being down, full or gone raises; a Redis Cluster with no node left to reach
# raises RedisClusterException, which is not a RedisError
ERRORS = (redis.RedisError, redis.RedisClusterException)
MAX_PENDING_BYTES = 256 << 20  # blocks queued for the writer, at most
FULL_BACKOFF_MAX_S = 60.0
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


def settings_secret() -> bytes | None:
    """Settings.kv_secret (PLURAI_KV_SECRET) as bytes; None when it is unset or empty."""
    value = Settings().kv_secret
    text = value.get_secret_value() if value is not None else ""
    return text.encode() if text else None


def fingerprint_bytes(fingerprint: Any) -> bytes:
    """The model fingerprint (it names the keys, and the block header keeps 16 bytes of it)
    as bytes. Raises ValueError, before any writer thread starts, for anything but a str
    of an even number of lowercase hex digits, as bytes.hex() writes them: bytes.fromhex
    alone also takes capitals, spaces and newlines, which would name keys no other worker
    of the model reads."""
    if not isinstance(fingerprint, str) or not _HEX.fullmatch(fingerprint):
        shown = fingerprint[:40] if isinstance(fingerprint, str | bytes) else fingerprint
        raise ValueError(
            "the KV tier's model fingerprint must be a str of an even number of lowercase "
            f"hex digits (the engine's model_fingerprint), not {shown!r}"
        )
    return bytes.fromhex(fingerprint)


class RedisTier:
    def __init__(
        self,
        r: redis.Redis,
        fingerprint: str,
        ttl_s: int = 3600,
        max_pending: int = 1024,
        retry_after_s: float = 5.0,
        secret: bytes | None | _Default = FROM_SETTINGS,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        self.r = r
        self.fp = fingerprint_bytes(fingerprint)
        self.secret = (settings_secret() if isinstance(secret, _Default) else secret) or None
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.pending: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(max_pending)
        # the queue's blocks, bounded in bytes too: a block of a large model is megabytes
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0  # queued and being written
        self._bytes_lock = threading.Lock()
        self.down_until = 0.0  # after an error, skip Redis for a while instead of stalling
        # after an OOM reply (Redis at maxmemory, noeviction): writes are dropped for a
        # while, doubling from 1 s to a minute while Redis stays full; reads go on
        self.writes_paused_until = 0.0
        self.full_backoff_s = 0.0
        self.dropped = 0  # writes not made: queue full, or Redis down or full
        self.errors = 0
        self.refused = 0  # entries read whose MAC was missing or wrong (with a secret)
        self.writer = threading.Thread(target=self._write_loop, name="kv-redis-writer", daemon=True)
        self.writer.start()

    def key(self, h: bytes) -> str:
        return keys.kv_block(self.fingerprint, h.hex())

    def _full(self, e: Exception) -> None:
        """Redis refused writes for memory: its blocks stay readable, so only writes stop,
        and a refused batch is not sent again and again (Redis reads the whole of each)."""
        self.errors += 1
        self.full_backoff_s = min(max(1.0, 2 * self.full_backoff_s), FULL_BACKOFF_MAX_S)
        self.writes_paused_until = time.monotonic() + self.full_backoff_s
        log.warning(
            "Redis KV tier is out of memory (%s); KV blocks are not written for %.0fs, "
            "reads go on (give the tier a Redis with an eviction policy: "
            'docs/operations.md, "Memory")',
            e,
            self.full_backoff_s,
        )

    def _failed(self, e: Exception) -> None:
        self.errors += 1
        if time.monotonic() >= self.down_until:
            log.warning(
                "Redis KV tier unavailable (%s); treating it as empty for %.0fs",
                e,
                self.retry_after_s,
            )
        self.down_until = time.monotonic() + self.retry_after_s

    def get_many(self, hashes: list[bytes], size: int | None = None) -> list[bytes | None]:
        """The stored entries of `hashes` (None: missing). With a secret, only the leading
        run of authentic entries: from the first missing or refused one on, all None.
        `size`: what a valid entry measures; no more than one byte beyond it is read of
        each entry, so a longer one comes back longer than `size` and never whole."""
        if not hashes or time.monotonic() < self.down_until:
            return [None] * len(hashes)
        try:
            found = self._read([self.key(h) for h in hashes], size)
        except ERRORS as e:
            self._failed(e)
            return [None] * len(hashes)
        if self.secret is None:
            return found
        # the caller uses only the leading run: stop at the first miss or refused entry
        for i, (h, data) in enumerate(zip(hashes, found, strict=True)):
            if data is None or not self._authentic(h, data):
                return found[:i] + [None] * (len(found) - i)
        return found

    def _read(self, names: list[str], size: int | None) -> list[bytes | None]:
        if size is None:
            # on a Redis Cluster the blocks spread over the slots by their hash: one MGET
            # per slot (redis-py groups them by node)
            get = self.r.mget_nonatomic if is_cluster(self.r) else self.r.mget
            return list(get(names))
        # anyone who can write this Redis can store 512 MB under a block's key: read at
        # most size + 1 bytes of each, in one round trip
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, size)
        found: list[bytes | None] = []
        for value in pipe.execute(raise_on_error=False):
            if isinstance(value, Exception) and not str(value).startswith("WRONGTYPE"):
                raise value
            # missing: b""; another Redis type: WRONGTYPE (MGET's nil for both)
            found.append(value if isinstance(value, bytes) and value else None)
        return found

    def _authentic(self, h: bytes, data: bytes) -> bool:
        assert self.secret is not None
        try:
            block_format.verify(data, self.secret)
        except block_format.BadBlock as e:
            self.refused += 1
            log.warning("KV block %s from Redis refused (%s); recomputing it", h.hex(), e)
            return False
        return True

    def put(self, h: bytes, block: torch.Tensor) -> None:
        """Queue a write of a block (a CPU tensor the caller no longer changes); dropped
        and counted when the writer is behind (max_pending blocks or max_pending_bytes
        queued) or Redis is full. Encoding happens on the writer thread."""
        if time.monotonic() < self.writes_paused_until:
            self.dropped += 1
            return
        size = _nbytes(block)
        with self._bytes_lock:
            if self.pending_bytes + size > self.max_pending_bytes:
                self.dropped += 1
                return
            self.pending_bytes += size
        try:
            self.pending.put_nowait((h, block))
        except queue.Full:
            self._written(size)
            self.dropped += 1

    def _written(self, size: int) -> None:
        with self._bytes_lock:
            self.pending_bytes -= size

    def _write_loop(self) -> None:
        while True:
            item = self.pending.get()
            batch: list[Any] = [item]
            while len(batch) < 64:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not None]
            now = time.monotonic()
            if items and now >= self.down_until and now >= self.writes_paused_until:
                try:
                    pipe = self.r.pipeline(transaction=False)
                    for h, block in items:
                        data = block_format.encode(block, h, self.fp, self.secret)
                        pipe.set(self.key(h), data, ex=self.ttl_s)
                    pipe.execute()
                    self.full_backoff_s = 0.0
                except ERRORS as e:  # down, or full (OOM with noeviction)
                    if is_oom(e):
                        self._full(e)
                    else:
                        self._failed(e)
                    self.dropped += len(items)
                except Exception:  # a bug must not end the thread: flush() would hang
                    log.exception("%d KV blocks could not be written", len(items))
                    self.errors += 1
                    self.dropped += len(items)
            elif items:
                self.dropped += len(items)
            self._written(sum(_nbytes(block) for _, block in items))
            for _ in batch:
                self.pending.task_done()
            if None in batch:
                return

    def flush(self) -> None:
        """Wait until every queued write has been made or dropped."""
        self.pending.join()

    def close(self) -> None:
        self.pending.put(None)
        self.writer.join(timeout=10)


def _nbytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()
