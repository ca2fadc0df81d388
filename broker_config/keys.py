"""Every Redis key, stream, consumer group and channel Plurai uses is named here, and
only here. docs/protocol.md documents the same names for clients in other languages.
"""

from __future__ import annotations

PREFIX = "plurai"
GROUP = "workers"  # the consumer group on every request stream

CANCEL_CHANNEL = f"{PREFIX}:cancel"  # message: job id; workers abort it if they run it
DEAD_LETTER = f"{PREFIX}:dead"  # entries that carry no usable job id
WORKERS = f"{PREFIX}:workers"  # set of worker ids that have heartbeated


def request_stream(lane: str) -> str:
    return f"{PREFIX}:req:{lane}"


def job(job_id: str) -> str:
    """The job record (hash)."""
    return f"{PREFIX}:job:{job_id}"


def output(job_id: str) -> str:
    """The job's token stream."""
    return f"{PREFIX}:out:{job_id}"


def done_channel(job_id: str) -> str:
    """Pub/sub channel that receives the final state when the job ends."""
    return f"{PREFIX}:done:{job_id}"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idem:{key}"


def worker(worker_id: str) -> str:
    """A worker's heartbeat hash; it expires when the worker stops beating."""
    return f"{PREFIX}:worker:{worker_id}"


def kv_block(fingerprint: str, block_hash: str) -> str:
    """A KV block in the shared Redis tier: model fingerprint + chained block hash (hex)."""
    return f"{PREFIX}:kv:{fingerprint}:{block_hash}"
