"""Every Redis key, stream, consumer group and channel Plurai uses is named here, and
only here. docs/protocol.md documents the same names for clients in other languages.

Hash tags (the part in braces) keep the keys one Lua script touches in one Redis Cluster
slot: a job's record and token stream share the job id's tag; a model's request streams
are split over shards, each shard's lane streams and idempotency keys sharing one tag.
"""

from __future__ import annotations

import hashlib
import zlib

from plurai.broker_config.protocol import valid_job_id

PREFIX = "plurai"
GROUP = "workers"  # the consumer group on every request stream

CANCEL_CHANNEL = f"{PREFIX}:cancel"  # message: job id; workers abort it if they run it
DEAD_LETTER = f"{PREFIX}:dead"  # entries that carry no usable job id
# the consumer that holds preempted jobs' entries until a worker takes them (TAKE)
HANDED_OVER = f"{PREFIX}:handed-over"
WORKERS = f"{PREFIX}:workers"  # set of worker ids that have heartbeated
# hash: model name -> JSON {"shards": n, "beat_ms": ms} of the last worker to serve it
MODELS = f"{PREFIX}:models"
# capped stream: job id, model and lane of each job a worker began, newest last (the
# dashboard's recent jobs; MAXLEN ~ PLURAI_RECENT_JOBS_MAXLEN)
RECENT = f"{PREFIX}:recent"
DEFAULT_MODEL = "default"  # the model of requests that name none, unless configured
# set of "<model>:<lane>": the lanes workers take no new entries from (`plurai lane pause`)
PAUSED = f"{PREFIX}:paused"
# Completion webhooks (results/webhooks.py), one hash tag: hash job id -> JSON {"url",
# "since_ms", "attempts"} of each job whose end is still to be told; sorted set of the same
# job ids scored by when `plurai webhooks` next looks at each (unix ms); hash of counts
# (delivered, failed, dropped)
WEBHOOKS = f"{PREFIX}:{{webhooks}}:jobs"
WEBHOOKS_DUE = f"{PREFIX}:{{webhooks}}:due"
WEBHOOKS_COUNTS = f"{PREFIX}:{{webhooks}}:counts"


def paused_member(model: str, lane: str) -> str:
    """A lane's member of PAUSED (a model name holds no ':')."""
    return f"{model}:{lane}"


def queue_tag(model: str, shard: int = 0) -> str:
    """The hash tag of one shard of a model's queue: `{model}`, or `{model:n}` for n > 0."""
    return f"{{{model}}}" if shard == 0 else f"{{{model}:{shard}}}"


def request_stream(lane: str, model: str = DEFAULT_MODEL, shard: int = 0) -> str:
    """A lane of one shard of a model's queue; consumer group GROUP."""
    return f"{PREFIX}:{queue_tag(model, shard)}:req:{lane}"


def delayed(model: str = DEFAULT_MODEL, shard: int = 0) -> str:
    """Sorted set of one shard of a model's queue: the entries of jobs not to run before a
    time (their score, unix ms), each its lane and fields (msgpack), until a worker moves
    them to their lanes (script DUE)."""
    return f"{PREFIX}:{queue_tag(model, shard)}:delayed"


def arrivals(model: str = DEFAULT_MODEL) -> str:
    """Pub/sub channel: the request stream of each entry submitted for the model, so that
    its busy workers read it at once instead of at their next poll."""
    return f"{PREFIX}:{queue_tag(model)}:arrived"


def loads(model: str = DEFAULT_MODEL, shard: int = 0) -> str:
    """Hash: worker id -> "<jobs it runs>:<unix ms>" of the workers reading one shard of a
    model's queue, each written as it takes (TAKE), so that a busier worker leaves a new
    entry to a less loaded one for a moment (Settings.balance_ms)."""
    return f"{PREFIX}:{queue_tag(model, shard)}:loads"


def idempotency(key: str, model: str = DEFAULT_MODEL, shard: int = 0) -> str:
    """The job id that owns an idempotency key; in the queue shard the key picks."""
    return f"{PREFIX}:{queue_tag(model, shard)}:idem:{key}"


def shard_of(name: str, shards: int) -> int:
    """The shard a job goes to: picked by its idempotency key (so a repeat finds the key)
    or else its id; CRC-32 of the UTF-8 bytes, modulo the model's shard count."""
    return zlib.crc32(name.encode()) % shards if shards > 1 else 0


def job(job_id: str) -> str:
    """The job record (hash)."""
    return f"{PREFIX}:job:{{{job_id}}}"


def job_of(key: bytes | str) -> str | None:
    """The job id a job record's key (`job`'s) names; None for any other text, or an id
    that is no valid job id."""
    if isinstance(key, bytes):
        try:
            key = key.decode("ascii")
        except UnicodeDecodeError:
            return None
    head, tail = f"{PREFIX}:job:{{", "}"
    if not (key.startswith(head) and key.endswith(tail)):
        return None
    job_id = key[len(head) : -len(tail)]
    return job_id if valid_job_id(job_id) else None


def output(job_id: str) -> str:
    """The job's token stream."""
    return f"{PREFIX}:out:{{{job_id}}}"


def progress(job_id: str) -> str:
    """The output tokens a running job has made so far (results/progress.py), from which
    another worker resumes it."""
    return f"{PREFIX}:progress:{{{job_id}}}"


def done_channel(job_id: str) -> str:
    """Pub/sub channel that receives the final state when the job ends."""
    return f"{PREFIX}:done:{job_id}"


def worker(worker_id: str) -> str:
    """A worker's heartbeat hash; it expires when the worker stops beating."""
    return f"{PREFIX}:worker:{worker_id}"


def kv_block(fingerprint: str, block_hash: str) -> str:
    """A KV block in the shared Redis tier: model fingerprint + chained block hash (hex)."""
    return f"{PREFIX}:kv:{fingerprint}:{block_hash}"


# -- bulk batches (producer/bulk) -----------------------------------------------------

BATCHES = f"{PREFIX}:batches"  # sorted set: batch id -> created unix ms
CELERY_PREFIX = f"{PREFIX}:celery:"  # every key Celery's broker and result backend write


def batch(batch_id: str) -> str:
    """The batch record (hash): status, counts, options."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_input(batch_id: str) -> str:
    """The uploaded input lines (list), one JSON line each."""
    return f"{PREFIX}:batch:{batch_id}:input"


def batch_requests(batch_id: str) -> str:
    """Validated requests (hash): input line index -> request JSON."""
    return f"{PREFIX}:batch:{batch_id}:req"


def batch_state(batch_id: str) -> str:
    """Progress of each started line (hash): index -> {level, jobs, usage} JSON."""
    return f"{PREFIX}:batch:{batch_id}:state"


def batch_active(batch_id: str) -> str:
    """Indexes of lines with requests in flight (set)."""
    return f"{PREFIX}:batch:{batch_id}:active"


def batch_lines(batch_id: str) -> str:
    """The one final output or error line per input line (hash): index -> JSON line."""
    return f"{PREFIX}:batch:{batch_id}:lines"


def batch_output(batch_id: str) -> str:
    """The finished output JSONL (string)."""
    return f"{PREFIX}:batch:{batch_id}:output"


def batch_errors(batch_id: str) -> str:
    """The finished error JSONL (string)."""
    return f"{PREFIX}:batch:{batch_id}:errors"


def bulk_idempotency(batch_id: str, custom_id: str, level: int, chunk: int) -> str:
    """The idempotency key (the submit option; its Redis key is `idempotency(...)` of it) of
    a batch line's request: chunk `chunk` of reduce level `level` of the line `custom_id`."""
    cid = hashlib.blake2b(custom_id.encode(), digest_size=8).hexdigest()
    return f"bulk:{batch_id}:{cid}:{level}:{chunk}"


def batch_all(batch_id: str) -> list[str]:
    """Every key of one batch, for expiry."""
    return [
        batch(batch_id),
        batch_input(batch_id),
        batch_requests(batch_id),
        batch_state(batch_id),
        batch_active(batch_id),
        batch_lines(batch_id),
        batch_output(batch_id),
        batch_errors(batch_id),
    ]


# -- files of the gateway's Files API (gateway/batches.py) ----------------------------


def file(file_id: str) -> str:
    """An uploaded file's bytes (string); expires with its `file_meta`."""
    return f"{PREFIX}:file:{file_id}"


def file_meta(file_id: str) -> str:
    """An uploaded file's metadata (hash): filename, bytes, created_at, expires_at, purpose,
    tenant ('' without an API key). The file exists while this record does."""
    return f"{PREFIX}:file:{file_id}:meta"


# -- API keys and quotas of the HTTP gateway (gateway/auth.py) ------------------------

API_KEYS = f"{PREFIX}:apikeys"  # hash: public key id -> SHA-256 (hex) of the key's secret


def api_key(key_hash: str) -> str:
    """An API key's record (hash), named by the SHA-256 (hex) of its secret. The secret
    itself is stored nowhere."""
    return f"{PREFIX}:apikey:{key_hash}"


def quota_window(key_id: str) -> str:
    """An API key's admissions of the last minute (sorted set): '<job id>:<tokens>' ->
    admitted unix ms (Redis' clock)."""
    return f"{PREFIX}:quota:{key_id}:window"


def quota_tokens(key_id: str) -> str:
    """The sum of the tokens of the admissions in `quota_window` (string, an integer)."""
    return f"{PREFIX}:quota:{key_id}:tokens"


def quota_running(key_id: str) -> str:
    """An API key's running jobs (sorted set): job id -> lease expiry unix ms."""
    return f"{PREFIX}:quota:{key_id}:running"


def quota_all(key_id: str) -> list[str]:
    """Every quota key of one API key, for revocation."""
    return [quota_window(key_id), quota_tokens(key_id), quota_running(key_id)]


def gateway_wake(gateway_id: str) -> str:
    """A gateway's own wake-up stream (gateway/streams.py): one entry tells its shared
    reader to start reading a newly followed token stream. Capped at one entry; expires
    when the gateway stops touching it."""
    return f"{PREFIX}:gateway:{gateway_id}:wake"
