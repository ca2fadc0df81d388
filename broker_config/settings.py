"""Runtime settings: environment variables `PLURAI_*`, then an optional TOML file.

Precedence, highest first: arguments to `Settings(...)`, environment variables, the TOML
file named by `PLURAI_CONFIG`, the defaults below.

    PLURAI_REDIS_URL=rediss://worker:secret@redis.internal:6380/0 plurai worker --model m/

Bulk batches have their own, `BulkSettings`: environment variables `PLURAI_BATCH_*`, then
the table `[batch]` of the same TOML file (`[batch]` `window = 512` is
`PLURAI_BATCH_WINDOW=512`).

One file, though long: every setting with its default, bounds and description, from which
docs/settings.md is generated; one place to read what can be set.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from plurai.broker_config.protocol import Limits, model_name

CONFIG_ENV = "PLURAI_CONFIG"
DEFAULT_METRICS_PORT = 9400
# The longest any blocking Redis command of Plurai's may wait (a worker's XREADGROUP, WAIT
# for replicas): well under the connections' read timeout (connection.SOCKET_TIMEOUT_S).
BLOCK_LIMIT_MS = 30_000


def config_file() -> str | None:
    """The TOML file named by PLURAI_CONFIG (None: none named); FileNotFoundError if it is
    not a file."""
    path = os.environ.get(CONFIG_ENV)
    if path and not os.path.isfile(path):
        raise FileNotFoundError(f"{CONFIG_ENV}={path}: no such file")
    return path or None


def explain(e: ValidationError) -> str:
    """A settings error in one line, each bad setting named as its environment variable
    (the PLURAI_CONFIG file's key is the part after the prefix, in lower case)."""
    prefix = "PLURAI_BATCH_" if e.title == BulkSettings.__name__ else "PLURAI_"
    parts = []
    for err in e.errors():
        name = prefix + "_".join(str(x) for x in err["loc"]).upper()
        parts.append(f"{name}: {err['msg']}, got {str(err.get('input'))[:60]!r}")
    return "bad setting: " + "; ".join(parts)


def _toml_table(path: str, table: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pydantic-settings reads TOML with tomli too
        import tomli as tomllib  # type: ignore[no-redef]
    with open(path, "rb") as f:
        found = tomllib.load(f).get(table, {})
    if not isinstance(found, dict):
        raise ValueError(f"{CONFIG_ENV}={path}: {table} must be a table ([{table}])")
    return found


class _Sourced(BaseSettings):
    """Arguments, then the environment, then the PLURAI_CONFIG file (its top level, or the
    table named `toml_table`), then the defaults."""

    toml_table: ClassVar[str | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = config_file()
        if path and cls.toml_table is None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        elif path:
            sources.append(InitSettingsSource(settings_cls, _toml_table(path, cls.toml_table)))
        return tuple(sources)


class Settings(_Sourced):
    model_config = SettingsConfigDict(
        env_prefix="PLURAI_", extra="ignore", use_attribute_docstrings=True
    )

    redis_url: str | None = None
    """The queue's Redis; password, ACL user and TLS go in the URL (redis://user:pass@host:6379/0,
    rediss://...; docs/protocol.md, "Connections"). None: workers and `plurai demo` start an
    embedded redis-server under data_dir, and clients find it there."""
    data_dir: str = "data"
    """The embedded Redis (`redis/`: its files and URL) and the fingerprint cache of
    read-only model folders (`fingerprints/`)."""

    lanes: list[str] = Field(default_factory=lambda: ["interactive", "standard", "batch"])
    """Priority lanes, highest first; one stream each."""
    default_lane: str = "standard"
    """The lane of a request that names none."""
    stream_maxlen: int = Field(default=1_000_000, ge=1)
    """Approximate MAXLEN of each request stream. Must exceed the largest backlog you
    expect: trimming drops the oldest entries whether or not a worker has read them."""

    # TTLs: 0 would delete a key as it is written (a queued job would read as unknown)
    result_ttl_s: int = Field(default=24 * 3600, ge=1)
    """How long a job's record is kept, counted from its completion."""
    output_ttl_s: int = Field(default=3600, ge=1)
    """How long a job's token stream is kept after the job ends (the record keeps the
    text)."""
    output_maxlen: int = Field(default=8192, ge=16)
    """About the most entries a job's token stream keeps (deltas after the last reset are
    never trimmed while the job has fewer tokens than this)."""
    submit_replicas: int = Field(default=0, ge=0)
    """With replicas (Sentinel): a submit returns only once this many replicas acknowledge
    the job (WAIT), else the SDK raises NotReplicated. 0: the primary's word is enough (a
    failover can then lose a job submitted just before it: docs/operations.md)."""
    submit_replicas_timeout_ms: int = Field(default=1000, ge=1, le=BLOCK_LIMIT_MS)
    """How long a submit waits for submit_replicas acknowledgements."""
    stream_flush_tokens: int = Field(default=16, ge=1)
    """A running job's tokens are held back and written to its stream together: its first
    ones at once, then whenever this many are held or the oldest held is stream_flush_ms
    old, the rest with its result (1: every step's tokens as they come). Redis writes per
    generated token fall from about three to a few per job (docs/protocol.md)."""
    stream_flush_ms: int = Field(default=100, ge=0)
    """The longest a held token waits before it is written (see stream_flush_tokens)."""
    dead_letter_maxlen: int = Field(default=10_000, ge=1)
    """Approximate cap of plurai:dead, the dead letters."""
    recent_jobs_maxlen: int = Field(default=1000, ge=0)
    """Approximate cap of plurai:recent, the dashboard's recent jobs (0: not written)."""
    queued_ttl_s: int = Field(default=7 * 24 * 3600, ge=1)
    """How long a job's record is kept while it waits."""
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=1)
    """The window in which a second submit with the same idempotency key returns the first
    job."""

    # Sizes on the wire (docs/protocol.md, "Limits"): larger is refused.
    max_tokens_limit: int = Limits.max_tokens
    """Largest max_tokens; more is refused with max_tokens_over_limit."""
    max_body_bytes: int = Field(default=Limits.body_bytes, ge=1)
    """Largest request entry, in bytes; more is refused with too_large."""
    max_prompt_chars: int = Field(default=Limits.prompt_chars, ge=1)
    """Longest prompt, in characters (too_large)."""
    max_messages: int = Field(default=Limits.messages, ge=1)
    """Most chat messages in a request (too_large)."""
    max_stop: int = Field(default=Limits.stop, ge=0)
    """Most stop strings in a request (too_large)."""
    max_stop_chars: int = Field(default=Limits.stop_chars, ge=1)
    """Longest stop string, in characters (too_large)."""
    max_stop_token_ids: int = Field(default=Limits.stop_token_ids, ge=0)
    """Most stop token ids in a request (too_large)."""
    max_metadata_bytes: int = Field(default=Limits.metadata_bytes, ge=2)
    """Largest metadata object, in bytes of JSON (too_large)."""
    max_logprobs: int = Field(default=Limits.logprobs, ge=0, le=20)
    """Most log-probabilities a token may ask for."""
    max_grammar_bytes: int = Field(default=Limits.grammar_bytes, ge=2)
    """Largest grammar or JSON schema of a structured request, in bytes (too_large)."""
    max_n: int = Field(default=Limits.n, ge=1)
    """Most choices (`n`) a request may ask for; more is refused with n_over_limit."""

    block_ms: int = Field(default=200, ge=1, le=BLOCK_LIMIT_MS)
    """How long an idle worker's read of the lanes (XREADGROUP) blocks; at most 30,000, as
    every Redis connection times a reply out after 60 s (the bound for a connection that
    died unseen)."""
    poll_ms: int = 20
    """A busy worker that found the lanes empty reads them again after this, or as soon as
    a submit announces an entry (gpu_workers/arrivals.py)."""
    balance_ms: int = Field(default=1000, ge=0, le=10_000)
    """Load balance between the workers of a queue: a worker that runs more jobs than
    another one (as each last recorded on taking) leaves a new entry to it until that one's
    next read (while it is due to read: it may be dead, full or in a long step), for at
    most this long; a worker alone, or the least loaded, takes at once. 0: whoever reads
    first takes."""
    grace_period_s: float = Field(default=0.0, ge=0)
    """On SIGTERM, how long running jobs run on before they are handed back with their
    progress (other workers resume them where they stopped)."""
    heartbeat_interval_s: float = 5.0
    """How often a worker writes its heartbeat and renews the entries it holds."""

    # Reliability (docs/operations.md).
    reclaim_idle_ms: int = 60_000
    """A worker renews the idle time of the entries it holds every heartbeat (XCLAIM to
    itself, JUSTID), so an entry idle longer than this belongs to a dead worker and is
    taken over (XPENDING IDLE, XCLAIM). Keep it well above heartbeat_interval_s plus the
    longest engine step."""
    reclaim_interval_s: float = 5.0
    """How often an idle worker scans for entries dead workers stranded."""
    max_deliveries: int = Field(default=5, ge=1)
    """A job whose processing failed this many times (its worker died, stalled or raised on
    it) is dead-lettered with too_many_deliveries."""
    redis_retry_s: float = Field(default=600.0, ge=0)
    """A worker that cannot reach Redis for this long exits (non-zero), as its jobs are
    reclaimed by other workers anyway. 0: retry forever."""
    redis_wait_s: float = Field(default=60.0, ge=0)
    """A starting worker waits this long for Redis to answer (saying so in its log every
    5 s), then exits with code 6 (docs/operations.md, "Starting workers")."""
    max_queued_per_lane: int = 500_000
    """Backpressure: most entries waiting (not yet taken by a worker) per lane; more is
    refused (QueueFull). 0: no limit. Keep it below stream_maxlen so that trimming
    never drops a waiting entry."""
    queue_full_retry_s: float = 1.0
    """The retry-after hint of QueueFull (and of RedisFull: docs/operations.md, "Memory")."""
    fair_every: int = 8
    """Fairness across lanes: every fair_every-th take starts at the next lower lane in
    turn instead of the highest, so lower lanes progress under sustained high-lane load.
    0: strict priority."""
    top_lane_reserve: int = 4
    """Top-lane requests a worker's engine keeps room for beside lower lanes' work: sequence
    slots, and KV for that many of the top lane's recent mean size (while it runs here)."""
    preempt: bool = True
    """A worker whose engine is full of lower-lane work still takes a top-lane entry when it
    fits beside the top lane's own jobs: the native engine preempts lower-lane jobs and the
    worker hands them over with their output so far, keeping their place in the lane, to
    the first worker with room (no attempt counted); vLLM keeps the requests it preempts
    and goes on with them itself. False: a top-lane entry waits for room like any other."""
    top_lane_slowdown: float = Field(default=3.0, ge=0)
    """Lower lanes yield to the top lane's speed (gpu_workers/pace.py): while a top-lane job
    ran on a worker within the last 10 s, it takes lower-lane entries only while the top
    lane's time per output token stays within this many times its unloaded time, and none
    while one of its top-lane prompts has no token yet. 0: both off. With a top-lane target
    (top_lane_tpot_ms) the target bounds the lower lanes instead."""
    top_lane_tpot_ms: float = Field(default=0.0, ge=0)
    """The top lane's target time per output token (ms), your latency objective less a
    margin: while a worker's top-lane tokens come slower than this, it starts no new job of
    the lower lanes, nor of the top lane unless lower-lane jobs run on it; they wait in the
    queue for a faster worker or for running jobs to end, rather than slowing every running
    one further. 0: no target."""
    top_lane_wait_ms: float = Field(default=500.0, ge=0, allow_inf_nan=False)
    """The longest a top-lane request waits in the queue for top_lane_tpot_ms: while no
    worker takes new work, one whose lane's oldest entry has waited this long takes that
    entry all the same (at most one per poll_ms), so holding work back never costs a
    request more than this of its time to first token. Set it under your TTFT objective,
    less a prompt's compute under load. 0: no bound."""
    prefill_backlog_tokens: int = Field(default=512, ge=0)
    """With no objective set, a worker takes every request its engine has room for (KV,
    sequence slots), as a router would hand it over, and the engine's scheduler chunks the
    prompts over its steps; but while top-lane jobs run on it (within the last 10 s), lower
    lanes' requests only while the prompt tokens its engine holds not yet computed, plus the
    new prompt, stay within this (or the engine's step budget, its max_num_batched_tokens,
    where lower; a prompt alone always may). With an objective (top_lane_tpot_ms), every
    lane keeps to the step budget (a top-lane request counting the top lane's prompts
    only), so that the rest of a burst waits in Redis for whichever worker frees up first.
    0: the step budget instead of this."""
    takes_per_step: int | None = Field(default=None, ge=1)
    """Most entries a worker moves into its engine between two engine steps. None: one per
    16 of the engine's sequence slots, at least 4."""

    model_dir: str | None = None
    """The model a worker loads, a folder or a hub id (`--model` sets it); also the model of
    a `plurai batch` task given no --model, and the only tokenizer the bulk Celery worker
    loads."""
    default_model: str = "default"
    """Model routing: each model has its own request streams; this is the model of a
    request that names none."""
    served_model: str | None = None
    """The model a worker serves, whose streams it reads (`--served-model`). None:
    default_model."""
    shards: int = Field(default=1, ge=1, le=256)
    """Request streams per lane of the served model (a worker's setting; clients read it
    from plurai:models): on a Redis Cluster, shards spread one model's intake over masters.
    Raise it freely; to lower it, drain the shards above the new count first (`--shards`)."""
    unserved: Literal["wait", "refuse"] = "wait"
    """A request for a model no live worker serves: "wait" in its queue until one starts,
    or "refuse" at submit (producer.errors.UnknownModel; the gateway's 404)."""
    kv_redis_url: str | None = None
    """The shared KV tier's Redis, when `--engine kv_redis_url=` names none (a password
    here stays out of `ps`). None: no Redis tier."""
    kv_secret: SecretStr | None = None
    """The HMAC key of the KV tier's blocks (kv_store/redis_tier.py): workers share blocks
    only with workers that hold the same key (docs/operations.md, "Security"). None: blocks
    are not authenticated."""
    kernels: Literal["auto", "native", "torch"] = "auto"
    """The fused CPU kernels (gpu_workers/kernels) where `--engine kernels=` names no mode:
    auto (when they build), native (else the start fails) or torch (the pure-torch
    path)."""
    kernel_isa: str | None = None
    """Build the kernels for a narrower ISA than the CPU's (baseline, avx2, avx512,
    avx512_bf16), e.g. to test an AVX2 build on an AVX-512 host. None: the CPU's."""
    kernels_dir: str | None = None
    """Where the kernels' builds live. None: <venv>/lib/plurai-kernels."""
    kernels_build_timeout_s: float = Field(default=900.0, gt=0)
    """A kernel build at start (none for this CPU yet) that takes longer fails the start
    (one on 2 busy cores takes a minute or two)."""
    vllm_kv_share: float = Field(default=0.2, gt=0, le=0.9)
    """The vLLM backend on CPU: the share of the host's memory (or its container's limit)
    its KV cache takes, unless --vllm kv_cache_memory_bytes / gpu_memory_utilization or
    VLLM_CPU_KVCACHE_SPACE give one (vLLM's own default takes nearly all of it, so a second
    worker on the host cannot start); split between the ranks of --tp/--pp."""
    vllm_engine_process: bool = True
    """The vLLM backend's engine core (scheduler and model runner) in a process of its own,
    as `vllm serve` runs it: it steps while the worker loop talks to Redis and turns
    outputs into deltas; a worker killed by any signal takes that process (and its ranks)
    with it, through a small reaper process (Linux). False: in the worker's process,
    stepped by the worker loop."""
    worker_id: str | None = None
    """A worker's consumer name in the lanes' groups and its heartbeat (`--worker-id`); give
    each worker its own. None: <hostname>-<pid>-<random>."""

    metrics_port: int = DEFAULT_METRICS_PORT
    """Each worker serves Prometheus metrics on http://<metrics_host>:<metrics_port>/metrics.
    -1: no endpoint; 0: any free port. If the default port is taken (several workers on one
    host) a free one is used and logged; a port set explicitly must be free."""
    metrics_host: str = "0.0.0.0"
    """The address of a worker's metrics endpoint."""
    gateway_host: str = "127.0.0.1"
    """The address the OpenAI-compatible gateway (`plurai gateway`) listens on. Without API
    keys it serves loopback clients only."""
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    """The gateway's port."""
    gateway_max_request_bytes: int = Field(default=4 << 20, ge=1024)
    """Largest HTTP request body; larger gets 413."""
    gateway_default_max_tokens: int = Field(default=256, ge=1)
    """max_tokens of a chat request (live or a batch line) that gives neither max_tokens nor
    max_completion_tokens (a completion's is OpenAI's 16)."""
    # Floods (gateway/server.py).
    gateway_max_connections: int = Field(default=4096, ge=1)
    """Open connections beyond this get 503."""
    gateway_header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's headers must arrive within this (else 408)."""
    gateway_body_timeout_s: float = Field(default=30.0, gt=0)
    """A request's body must arrive within this after its headers (else 408)."""
    gateway_keepalive_s: float = Field(default=65.0, gt=0)
    """An idle kept-alive connection closes after this: above the idle time after which
    clients drop a pooled connection (5 s for httpx and Go's net/http clients, 60 s for many
    load balancers), since a server that closes first races the client's next request on
    that connection, which then fails mid-send."""
    gateway_max_header_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest request head; larger gets 431."""
    gateway_stream_stall_s: float = Field(default=30.0, gt=0)
    """A stream whose client takes nothing for this long is ended."""
    gateway_max_streams_per_key: int = Field(default=1024, ge=0)
    """Open streams per API key on each gateway (0: no cap): a quarter of max_connections,
    so one client's batch of streamed requests waits in the queue rather than being
    refused, and still leaves room for the others."""
    dashboard: bool = True
    """The dashboard (gateway/dashboard.py) at /dashboard of the gateway: read-only, behind
    an admin API key once keys exist (`plurai dashboard` serves it whatever this). False:
    no page, no sampling."""
    dashboard_port: int = Field(default=8001, ge=0, le=65535)
    """The port of `plurai dashboard`."""
    dashboard_history_s: int = Field(default=900, ge=60, le=86400)
    """How much history the dashboard's charts keep."""
    dashboard_sample_s: float = Field(default=5.0, ge=1.0, le=300.0)
    """How often the dashboard takes a sample for its charts."""
    dashboard_refresh_s: float = Field(default=2.0, ge=0.5, le=60.0)
    """How often an open dashboard page reads the queue."""
    # Completion webhooks (results/webhooks.py, `plurai webhooks`).
    webhook_hosts: list[str] = Field(default_factory=list)
    """The hosts a job's webhook may name: exact names or IP addresses, `*.example.com` for
    every subdomain of example.com, or `*` for any host. Empty (the default): a submit with
    a webhook is refused, so no client can make the deployment call an address the operator
    did not allow."""
    webhook_secret: SecretStr | None = None
    """The HMAC-SHA256 key that signs every webhook (its Plurai-Signature header: receivers
    check it with results.webhooks.verify); `plurai webhooks` does not start without one."""
    webhook_private: bool = False
    """Webhooks to hosts that resolve to private, loopback, link-local or reserved addresses
    (a receiver inside your network). False: such an address is refused at delivery whatever
    the allow-list says, so a name in it cannot be pointed at internal services."""
    webhook_attempts: int = Field(default=6, ge=1, le=20)
    """Deliveries of one webhook before it is given up: a network error, a timeout, HTTP 408,
    425, 429 or 5xx is tried again; another answer (a 3xx or a 4xx) is final."""
    webhook_retry_s: float = Field(default=10.0, gt=0, le=3600)
    """The wait before a webhook's second try; each further try waits four times longer
    (10 s, 40 s, 160 s, ... at most an hour between two)."""
    webhook_timeout_s: float = Field(default=5.0, gt=0, le=60)
    """A receiver must connect and answer within this, else the try failed."""
    webhook_max_bytes: int = Field(default=256 << 10, ge=1024, le=16 << 20)
    """Largest webhook body: a job whose result is larger is told without its text and
    token ids (`"truncated": true`); the receiver reads the rest from Redis or the API."""
    webhook_concurrency: int = Field(default=8, ge=1, le=256)
    """Webhooks one `plurai webhooks` process sends at once."""
    webhook_poll_s: float = Field(default=5.0, gt=0, le=600)
    """How often `plurai webhooks` looks at an unfinished job it heard nothing of (it learns
    of most ends at once, from the jobs' done channels); a job that has waited long is
    looked at less often, at most every minute."""
    log_level: str = "INFO"
    """DEBUG, INFO, WARNING or ERROR."""
    log_format: Literal["text", "json"] = "text"
    """json: one object per line (broker_config/logs.py)."""

    @field_validator("lanes")
    @classmethod
    def _lanes_valid(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError("lanes must be a non-empty list of distinct names")
        for lane in v:
            if not lane or not lane.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"lane name {lane!r}: use letters, digits, '-' or '_'")
        return v

    @field_validator("default_model", "served_model")
    @classmethod
    def _model_valid(cls, v: str | None) -> str | None:
        return None if v is None else model_name(v)

    @field_validator("log_level")
    @classmethod
    def _level_known(cls, v: str) -> str:
        if v.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log level {v!r}: use DEBUG, INFO, WARNING or ERROR")
        return v.upper()

    def limits(self, prompt_tokens: int | None = None) -> Limits:
        """The wire limits; `prompt_tokens`: the most prompt tokens the engine serves."""
        return Limits(
            max_tokens=self.max_tokens_limit,
            body_bytes=self.max_body_bytes,
            prompt_chars=self.max_prompt_chars,
            messages=self.max_messages,
            stop=self.max_stop,
            stop_chars=self.max_stop_chars,
            stop_token_ids=self.max_stop_token_ids,
            metadata_bytes=self.max_metadata_bytes,
            logprobs=self.max_logprobs,
            grammar_bytes=self.max_grammar_bytes,
            n=self.max_n,
            prompt_tokens=prompt_tokens,
        )

    @property
    def model(self) -> str:
        """The model this worker serves."""
        return self.served_model or self.default_model

    def lane_or_default(self, lane: str | None) -> str:
        lane = lane or self.default_lane
        if lane not in self.lanes:
            raise ValueError(f"unknown lane {lane!r}; configured lanes: {self.lanes}")
        return lane


class BulkSettings(_Sourced):
    """Settings of bulk batches (producer/bulk): environment variables PLURAI_BATCH_*, then
    the table [batch] of the PLURAI_CONFIG file, then the defaults below."""

    model_config = SettingsConfigDict(
        env_prefix="PLURAI_BATCH_", extra="ignore", use_attribute_docstrings=True
    )
    toml_table: ClassVar[str | None] = "batch"

    window: int = 256
    """Input lines with requests in flight at once, per batch."""
    max_line_bytes: int = 1 << 20
    """A longer input line is refused."""
    pass_s: float = 5.0
    """One step task drives its batch this long, then re-queues itself."""
    poll_s: float = 0.2
    """Longest wait for a job's done message before looking again."""
    look_s: float = 1.0
    """How often a pass reads the status and every in-flight job's state."""
    completion_window_s: int = 24 * 3600
    """An unfinished batch expires after this (and an uploaded file that asks for no
    expiry)."""
    ttl_s: int = 7 * 24 * 3600
    """A finished batch's keys expire after this."""
    running_ttl_s: int = 14 * 24 * 3600
    """An unfinished batch's keys expire this long after they were last written or renewed
    (every pass of its driver renews them): a safety net for a batch nobody drives any
    more. Keep it above completion_window_s."""
    max_step_failures: int = Field(default=5, ge=1)
    """Steps of one batch that may fail in a row (a damaged record, a bug) before the batch
    fails with driver_failed, instead of being re-kicked and failing for ever."""
    stale_s: float = 60.0
    """Maintenance re-kicks a running batch silent for this long."""
    maintain_interval_s: float = 30.0
    """The Celery beat period of the maintenance task."""
    visibility_timeout_s: int = 3600
    """Celery's redelivery time for unacknowledged tasks; far longer than any task
    (pass_s)."""
