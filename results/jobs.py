"""Typed calls of the Lua scripts in results/scripts.py: the one place that knows each
script's KEYS and ARGV order.

Each function below builds a `Call` from named parameters; `run` (or `run_async`) sends it
with EVALSHA, loading the script when Redis does not have it. Pipelines and packed writes
take `call.command()`. Nothing else builds a script's positional arguments.

    jobs.run(r, jobs.cancel(job_id=job_id, ttl_s=86400, stream_ttl_s=3600, now_ms=now))

One file, though long: one short typed function per script, beside the `Call` they build
and the one send path (`pipeline`, `rerun`) every caller's round trips go through.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import redis
import redis.asyncio

from plurai.broker_config import fastpipe, keys, protocol
from plurai.results import records, scripts

# FINALIZE's resync: when to rewrite the token stream's text before its end entry.
RESYNC_ALWAYS = "1"  # a reset and the whole text, whatever the stream holds
RESYNC_AUTO = ""  # only when deltas may be missing or stale (see scripts.FINALIZE)
RESYNC_NEVER = "n"  # a job that streamed no deltas
Resync = Literal["1", "", "n"]

_FINALIZE_RESYNC = 6  # the index of FINALIZE's resync in its ARGV (ARGV[7])


@dataclass(slots=True)  # not frozen: a frozen init costs a job ~1 us in submit_many
class Call:
    """One call of the script `script` (a name in results/scripts.py, e.g. "FINALIZE").

    `job_id`, `lane` and `entry` say which job, lane and request entry the call is about,
    when it is about one (for the caller's errors and logs); they are not sent, nor is
    `then` with it."""

    script: str
    keys: list[str]
    args: list[Any]
    job_id: str = field(default="", compare=False)
    lane: str = field(default="", compare=False)
    # commands to send once this call's reply is back (a FINALIZE's ack of its entry)
    then: list[list[Any]] = field(default_factory=list, compare=False)
    # the request entry (stream, entry id) the call is about, when it is about one
    entry: tuple[str, Any] | None = field(default=None, compare=False)

    def command(self, sha: str | None = None) -> list[Any]:
        """["EVALSHA", sha, number of keys, *keys, *args], for a pipeline or a packed write;
        `sha` defaults to the script's own (the SHA1 of its text)."""
        return ["EVALSHA", sha or _digest(self.script), len(self.keys), *self.keys, *self.args]


@dataclass(slots=True)
class Delta:
    """One job's write in a DELTAS call, of one choice: `text` and `token_ids` are new, or,
    with `reset`, the whole text so far (the stream gets a reset entry first); `progress`
    is the chunk of the same tokens for the job's progress (results/progress.py), written
    as its start (header first) when `whole`, else appended. A job that does not stream
    (`stream` False) writes its progress only. `index`: the choice, for a job of n > 1
    (its deltas carry it); one write of such a job is a Delta per choice, only the first
    resetting or starting the progress."""

    job_id: str
    text: str
    token_ids: list[int]
    reset: bool = False
    stream: bool = True
    progress: bytes = b""
    whole: bool = False
    index: int | None = None


def sha(name: str) -> str:
    """The SHA1 (hex) of the script `name` in results/scripts.py, as SCRIPT LOAD returns it."""
    return _digest(name)


@functools.cache
def _digest(name: str) -> str:
    return hashlib.sha1(_text(name).encode()).hexdigest()


# scripts kept beside their callers (the gateway's quota scripts), by name: see `register`
_KEPT: dict[str, str] = {}


def register(**named: str) -> None:
    """Make scripts kept beside their callers callable by name through `run`, `run_async`
    and `Call.command`, like those of results/scripts.py. A name is taken once."""
    for name, body in named.items():
        if not name.isupper() or hasattr(scripts, name) or _KEPT.get(name, body) != body:
            raise ValueError(f"script name {name!r} is taken, or not upper case")
        _KEPT[name] = body


def _text(name: str) -> str:
    body = _KEPT.get(name) or getattr(scripts, name, None)
    if not isinstance(body, str) or not name.isupper():
        raise KeyError(f"no script {name!r} in results/scripts.py, nor registered")
    return body


def run(r: redis.Redis, call: Call) -> Any:
    """Run `call` (EVALSHA); on NOSCRIPT, load the script and run it again."""
    try:
        return r.evalsha(_digest(call.script), len(call.keys), *call.keys, *call.args)
    except redis.exceptions.NoScriptError:
        r.script_load(_text(call.script))
        return r.evalsha(_digest(call.script), len(call.keys), *call.keys, *call.args)


async def run_async(r: redis.asyncio.Redis, call: Call) -> Any:
    """`run`, awaited."""
    try:
        return await r.evalsha(_digest(call.script), len(call.keys), *call.keys, *call.args)
    except redis.exceptions.NoScriptError:
        await r.script_load(_text(call.script))
        return await r.evalsha(_digest(call.script), len(call.keys), *call.keys, *call.args)


def load(r: redis.Redis, *names: str) -> None:
    """Load scripts into Redis' cache, before pipelining their `command()`s."""
    for name in names:
        r.script_load(_text(name))


async def load_async(r: redis.asyncio.Redis, *names: str) -> None:
    for name in names:
        await r.script_load(_text(name))


def command(item: Call | list[Any]) -> list[Any]:
    """A call's EVALSHA, or a plain command as it is."""
    return item.command() if isinstance(item, Call) else item


def pipeline(r: redis.Redis, items: Sequence[Call | list[Any]], cluster: bool) -> list[Any]:
    """Calls and plain commands in one round trip (one a node on a Cluster, where the
    packed write cannot go), each reply in its place, an error reply as its exception;
    `rerun`'s second try for the calls whose script Redis had lost."""
    commands = [command(item) for item in items]
    if cluster:
        pipe = r.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        replies = pipe.execute(raise_on_error=False)
    else:
        replies = fastpipe.run(r, commands)
    return rerun(r, items, replies)


def rerun(r: redis.Redis, items: Sequence[Call | list[Any]], replies: list[Any]) -> list[Any]:
    """The replies, with each call Redis answered NOSCRIPT (its script cache was lost, as
    after a restart: nothing of the call ran) run again by `run`, its reply or error in
    its place."""
    out = list(replies)
    for i, (item, reply) in enumerate(zip(items, replies, strict=True)):
        if isinstance(reply, redis.exceptions.NoScriptError) and isinstance(item, Call):
            try:
                out[i] = run(r, item)
            except redis.ResponseError as e:
                out[i] = e
    return out


# -- the calls of a job's life ---------------------------------------------------------


@dataclass(slots=True)
class Submission:
    """A job's submit. On a single Redis it is one call, ENQUEUE (its record and its entry);
    on a Redis Cluster two, QUEUED (its record) and SUBMIT (its entry), sent in this order
    (`commands(split=True)`). The reply of ENQUEUE or SUBMIT is the job id in the queue;
    when it is not `job_id` (an earlier job with the same idempotency key, or an error
    reply such as QUEUEFULL), ENQUEUE wrote nothing, and `cleanup()` deletes the record
    QUEUED wrote."""

    job_id: str
    lane: str
    model: str
    keys: list[str]  # the job record, the request stream[, the idempotency key]
    record_args: list[Any]  # QUEUED's ARGV
    queue_args: list[Any]  # SUBMIT's ARGV
    # a job not to run before this unix ms: its entry goes to the shard's delayed set
    # (keys[1]), by DEFER and ENQUEUE_LATER in place of SUBMIT and ENQUEUE; 0: at once
    not_before_ms: int = 0
    # the URL told of the job's end: the submit also watches it (results/webhooks.py)
    webhook: str = ""
    # the submit's trace span while tracing is on (broker_config/tracing.py), ended once
    # the submit's reply is read (producer/submit.py)
    span: Any = field(default=None, compare=False)

    def received(self, us: int) -> None:
        """When a front (the gateway) received the request, unix µs: kept in the record."""
        self.record_args[_RECEIVED] = us

    @property
    def record(self) -> Call:
        """The QUEUED call."""
        return Call("QUEUED", self.keys[:1], self.record_args, job_id=self.job_id, lane=self.lane)

    @property
    def queue(self) -> Call:
        """The SUBMIT call (DEFER for a delayed job)."""
        script = "DEFER" if self.not_before_ms else "SUBMIT"
        return Call(script, self.keys[1:], self.queue_args, job_id=self.job_id, lane=self.lane)

    @property
    def whole(self) -> Call:
        """The ENQUEUE call (ENQUEUE_LATER for a delayed job): QUEUED and SUBMIT in one,
        where all their keys share a server."""
        script = "ENQUEUE_LATER" if self.not_before_ms else "ENQUEUE"
        args = self.record_args + self.queue_args
        return Call(script, self.keys, args, job_id=self.job_id, lane=self.lane)

    def commands(self, split: bool = False) -> list[list[Any]]:
        """ENQUEUE's command; with `split` (a Cluster), QUEUED's then SUBMIT's."""
        if split:
            return [self.record.command(), self.queue.command()]
        return [self.whole.command()]

    def cleanup(self, record_reply: Any, queue_reply: Any) -> list[Any] | None:
        """After QUEUED and SUBMIT: the command that deletes a record written for nothing,
        or None."""
        ours = not isinstance(queue_reply, Exception) and _str(queue_reply) == self.job_id
        if ours or record_reply != 1:
            return None
        return ["DEL", self.keys[0]]


def _str(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


_RECEIVED = 7  # received_us's place in QUEUED's ARGV


def submit(
    *,
    lane: str,
    model: str,
    shard: int,
    job_id: str,
    fields: list[Any],
    created_ms: int,
    priority: int,
    metadata_json: str | None,
    idempotency_key: str | None = None,
    stream_maxlen: int,
    queued_ttl_s: int,
    idempotency_ttl_s: int,
    max_queued: int,
    not_before_ms: int = 0,
) -> Submission:
    """Queue a job: write its record and add its request entry (`fields`: flat field/value
    pairs) to shard `shard` of `model`'s `lane` stream. With `idempotency_key` already
    used, the earlier job's id is returned and nothing is added. `max_queued` 0: no limit;
    else an error reply 'QUEUEFULL <queued>' when the lane holds that many waiting
    entries. The record keeps when this was called (`queued_us`, unix µs), for the queue
    hop's figures (Submission.received). With `not_before_ms` (unix ms) the entry waits in
    the shard's delayed set until then (no lane limit applies there), and the record,
    which says when (`not_before_ms`), lives that much longer."""
    second = (
        keys.delayed(model, shard) if not_before_ms else keys.request_stream(lane, model, shard)
    )
    k = [keys.job(job_id), second]
    if idempotency_key is not None:
        k.append(keys.idempotency(idempotency_key, model, shard))
    queued_us = time.time_ns() // 1000
    ttl = queued_ttl_s + max(0, not_before_ms - created_ms) // 1000
    record = [ttl, lane, priority, created_ms, metadata_json or "", model, queued_us, ""]
    if not_before_ms:
        # every value as bytes (as redis-py sends them), in msgpack Lua's cmsgpack reads
        flat = [x if isinstance(x, bytes) else str(x).encode() for x in [lane, *fields]]
        entry = msgpack.packb(flat, use_bin_type=False)
        return Submission(
            job_id=job_id,
            lane=lane,
            model=model,
            keys=k,
            record_args=[*record, not_before_ms],
            queue_args=[idempotency_ttl_s, job_id, not_before_ms, entry],
            not_before_ms=not_before_ms,
        )
    channel = keys.arrivals(model)
    queue = [stream_maxlen, idempotency_ttl_s, job_id, max_queued, keys.GROUP, channel, *fields]
    return Submission(
        job_id=job_id, lane=lane, model=model, keys=k, record_args=record, queue_args=queue
    )


def due(*, model: str, shard: int, lanes: list[str], now_ms: int, most: int, maxlen: int) -> Call:
    """Move the delayed entries of one shard of `model` whose time has come (<= now_ms), at
    most `most`, to the tail of their lanes; returns the next one's time (unix ms, '' when
    none waits), then the entries it could not move (DUE)."""
    k = [keys.delayed(model, shard), *(keys.request_stream(lane, model, shard) for lane in lanes)]
    return Call("DUE", k, [now_ms, most, maxlen, keys.arrivals(model), *lanes])


def take(
    *,
    streams: list[str],
    consumer: str,
    count: int,
    wait_ms: int = 0,
    balance: tuple[str, int, int, int, int] | None = None,
) -> Call:
    """Take up to `count` entries for `consumer` from `streams` (one shard's lanes, in the
    order to read them: each while it has entries, then the next; in each, preempted jobs'
    entries handed over (keys.HANDED_OVER) before new ones). Returns [stream index
    (1-based), entry id, fields] for each, and for a handed-over entry its failed
    deliveries before as a fourth item. With `wait_ms`, only entries that have waited that
    long are taken. `balance`: (the shard's loads hash (keys.loads), the consumer's load,
    balance ms, fresh ms, its turn ms): the load is recorded there, and an entry is left
    for at most balance ms to a consumer that runs fewer jobs and has not read since the
    entry was added, while it is due to read (scripts.TAKE)."""
    args: list[Any] = [keys.GROUP, consumer, count, keys.HANDED_OVER, wait_ms]
    if balance is None:
        return Call("TAKE", streams, args)
    loads, load, balance_ms, fresh_ms, turn_ms = balance
    return Call("TAKE", [*streams, loads], [*args, load, balance_ms, fresh_ms, turn_ms])


def begin(
    *,
    job_id: str,
    worker: str,
    now_ms: int,
    ttl_s: int,
    deadline_ms: int | None,
    lane: str,
    priority: int,
    metadata_json: str | None,
    progress_head: bytes = b"",
    progress_limit: int = 0,
    tenant: str = protocol.DEFAULT_TENANT,
) -> Call:
    """Mark a job running on `worker` and start its token stream. Returns 'run' (or
    ['run', progress] where the job resumes: `progress_head` is the worker's model's,
    results/progress.header, and the progress at most `progress_limit` bytes), 'done',
    'cancelled', 'expired' or 'badkey' (see scripts.BEGIN). With no `progress_head` the
    job never resumes."""
    args = [
        worker,
        now_ms,
        ttl_s,
        deadline_ms if deadline_ms is not None else "",
        lane,
        priority,
        metadata_json or "",
        progress_head,
        progress_limit,
        tenant,
    ]
    k = [keys.job(job_id), keys.output(job_id), keys.progress(job_id)]
    return Call("BEGIN", k, args, job_id=job_id, lane=lane)


def deltas(
    *, worker: str, maxlen: int, items: Iterable[Delta], ttl_s: int = 86400, head: bytes = b""
) -> Call:
    """Write the token deltas of one engine step, each to its job's stream, and each job's
    progress (`head` first where written whole, expiring after `ttl_s`), while the job's
    record names `worker`. Returns how many deltas were written."""
    k: list[str] = []
    args: list[Any] = [worker, maxlen, ttl_s]
    for d in items:
        k += [keys.job(d.job_id), keys.output(d.job_id), keys.progress(d.job_id)]
        mode = ("r" if d.reset else "d") if d.stream else "n"
        args += [mode, d.text, records.json_ids(d.token_ids), "" if d.index is None else d.index]
        args += ["s", head + d.progress] if d.whole else ["a", d.progress]
    return Call("DELTAS", k, args)


def finalize(
    *,
    job_id: str,
    state: str,
    finish_reason: str,
    fields: list[Any],
    ttl_s: int,
    stream_ttl_s: int,
    stream_maxlen: int,
    resync: Resync = RESYNC_AUTO,
    lane: str = "",
    entry: tuple[str, bytes | str] | None = None,
    ack_inside: bool = False,
) -> Call:
    """Store a job's one final result (`fields`: flat record field/value pairs, e.g.
    records.final_fields), end its token stream and publish its state on its done channel.
    Returns 1 (stored), 0 (a result existed) or -1 (the record is not a hash). `entry`
    (stream, entry id): the job's request entry on `lane`, never acked before its result
    is stored: by the script itself with `ack_inside` (a single Redis), else once the
    reply is back (the call's `then`; on a Cluster the entry is in another slot)."""
    inside = ack_inside and entry is not None
    args = [
        ttl_s,
        keys.done_channel(job_id),
        state,
        finish_reason,
        stream_ttl_s,
        stream_maxlen,
        resync,
        keys.GROUP if inside else "",
        entry[1] if inside and entry is not None else "",
        *fields,
    ]
    k = [keys.job(job_id), keys.output(job_id), keys.progress(job_id)]
    if inside and entry is not None:
        k.append(entry[0])
    then = ack(*entry) if entry is not None and not inside else []
    return Call("FINALIZE", k, args, job_id=job_id, lane=lane, then=then, entry=entry)


def ack(stream: str, entry_id: bytes | str) -> list[list[Any]]:
    """Ack and delete a request entry (workers delete what they ack, so a lane's length
    minus its pending count is its backlog)."""
    return [["XACK", stream, keys.GROUP, entry_id], ["XDEL", stream, entry_id]]


def resynced(call: Call) -> Call:
    """The same FINALIZE call, rewriting the stream's text before its end entry (unless the
    job streamed no deltas): for a result whose deltas may not have reached Redis."""
    if call.script != "FINALIZE":
        raise ValueError(f"resynced takes a FINALIZE call, not {call.script}")
    if call.args[_FINALIZE_RESYNC] == RESYNC_NEVER:
        return call
    args = list(call.args)
    args[_FINALIZE_RESYNC] = RESYNC_ALWAYS
    return dataclasses.replace(call, args=args)


def cancel(*, job_id: str, ttl_s: int, stream_ttl_s: int, now_ms: int) -> Call:
    """Cancel a job: at once if queued (or unknown), else flag it and tell its worker.
    Returns 'cancelled', 'cancelling', or the final state the job already had. `ttl_s`:
    the record's TTL once cancelled here; `stream_ttl_s`: its token stream's."""
    args = [ttl_s, keys.done_channel(job_id), keys.CANCEL_CHANNEL, job_id, now_ms, stream_ttl_s]
    k = [keys.job(job_id), keys.output(job_id), keys.progress(job_id)]
    return Call("CANCEL", k, args, job_id=job_id)


def release(*, job_id: str) -> Call:
    """Mark a job handed back as queued again; returns 1 when its entry is to be re-added,
    0 when it has a result already. Then `requeue`."""
    return Call("RELEASE", [keys.job(job_id)], [], job_id=job_id)


def requeue(
    *,
    stream: str,
    entry_id: bytes | str,
    maxlen: int,
    again: bool,
    fields: Mapping[Any, Any],
    later: tuple[str, str, int] | None = None,
) -> Call:
    """Re-add a job's entry (`fields`) at the tail of `stream` when `again` (RELEASE's
    answer), and ack and delete the old one `entry_id`; returns 1 when re-added. Safe to
    send twice: a repeat finds the old entry acked and does nothing. `later`: (the shard's
    delayed set, the lane, a unix ms): re-added to the delayed set, to run no sooner."""
    flat = [x for kv in fields.items() for x in kv]
    k, lane, not_before = [stream], "", ""
    if later is not None:
        delayed, lane, ms = later
        k, not_before = [stream, delayed], str(ms)
    args = [keys.GROUP, entry_id, maxlen, "1" if again else "", lane, not_before, *flat]
    return Call("REQUEUE", k, args)


def revive(
    *,
    dead_id: str,
    job_id: str,
    lane: str,
    model: str,
    shard: int,
    fields: Mapping[Any, Any],
    priority: int,
    metadata_json: str | None,
    stream_maxlen: int,
    queued_ttl_s: int,
    max_queued: int,
) -> Call:
    """Queue a dead-lettered job again (its entry `fields` at the tail of shard `shard` of
    `model`'s `lane`), its record, token stream and progress started over, and delete the
    dead letter `dead_id`: 1, or 'GONE' / 'ACTIVE', or the error QUEUEFULL (REVIVE)."""
    k = [
        keys.DEAD_LETTER,
        keys.job(job_id),
        keys.output(job_id),
        keys.progress(job_id),
        keys.request_stream(lane, model, shard),
    ]
    now_ms = int(time.time() * 1000)
    record = [queued_ttl_s, lane, priority, now_ms, metadata_json or "", model, now_ms * 1000, ""]
    flat = [x for kv in fields.items() for x in kv]
    args = [dead_id, *record, stream_maxlen, max_queued, keys.GROUP, keys.arrivals(model), *flat]
    return Call("REVIVE", k, args, job_id=job_id, lane=lane)


def unqueue(*, stream: str, entry_ids: Iterable[bytes | str]) -> Call:
    """Delete those of `entry_ids` no worker has read yet (their jobs cancelled first: a
    purge); returns how many."""
    return Call("UNQUEUE", [stream], [keys.GROUP, *entry_ids])


def hand_over(*, stream: str, consumer: str, entry_id: bytes | str, again: bool) -> Call:
    """Pass a preempted job's entry from `consumer` to keys.HANDED_OVER, where the next
    worker to take from its lane takes it (TAKE) before the newer entries, no attempt
    counted; ack and delete it instead unless `again` (RELEASE's answer). Returns 1 when
    handed over."""
    args = [keys.GROUP, consumer, entry_id, keys.HANDED_OVER, "1" if again else ""]
    return Call("HAND_OVER", [stream], args)


def renew(*, stream: str, consumer: str, entry_ids: Iterable[bytes | str]) -> Call:
    """Renew `consumer`'s lease on its entries of `stream`; returns the ids another consumer
    owns now."""
    return Call("RENEW", [stream], [keys.GROUP, consumer, *entry_ids])


def advanced(*, job_id: str) -> Call:
    """1 when the job's progress grew during its last run (noted, so counted once), else 0."""
    return Call("ADVANCED", [keys.job(job_id), keys.progress(job_id)], [], job_id=job_id)


def check(*, job_ids: Iterable[str]) -> Call:
    """One number per job: 0 run on, 1 a cancel was asked, 2 the record is not a hash."""
    return Call("CHECK", [keys.job(j) for j in job_ids], [])


# -- bulk batches ----------------------------------------------------------------------


def batch_line(
    *,
    batch_id: str,
    index: int,
    line: str,
    ok: bool,
    prompt_tokens: int,
    output_tokens: int,
    now_ms: int,
    ttl_s: int,
) -> Call:
    """Store input line `index`'s one result line and move the batch's counts; returns 0
    when it had one already."""
    k = [keys.batch_lines(batch_id), keys.batch(batch_id)]
    return Call(
        "BATCH_LINE", k, [index, line, int(ok), prompt_tokens, output_tokens, now_ms, ttl_s]
    )


def batch_gen(*, batch_id: str) -> Call:
    """Bump the batch's generation; returns it, or None when the batch has no record."""
    return Call("BATCH_GEN", [keys.batch(batch_id)], [])


def batch_move(*, batch_id: str, status: str, allowed: Iterable[str]) -> Call:
    """Set the batch's status if the current one is in `allowed`; returns the status after
    the call, or None when the batch has no record."""
    return Call("BATCH_MOVE", [keys.batch(batch_id)], [status, *allowed])
