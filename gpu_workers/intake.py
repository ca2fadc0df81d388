"""Taking work: the next valid entry from the lanes, an entry stranded by a dead worker
first, lower lanes given their turn; entries that cannot run are answered on the way
(an error result, or the dead-letter stream when no result can be written).

A job's life, top to bottom: take.py asks for as many entries as admission.py lets in,
intake (here) reads and checks them, starter.py puts them in the engine and intake BEGINs
them, worker.py steps them, publish.py and writer.py send the deltas and store the one final
result, give_back.py hands back what a worker lets go.

One file, though long: reading, reclaiming, checking and answering entries, beginning
them and handing them back share the lanes' streams, the consumer group and the
dead-letter path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from plurai.broker_config import keys, protocol, tracing
from plurai.broker_config.protocol import Code, WireError
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.gpu_workers.arrivals import Arrivals
from plurai.gpu_workers.metrics import Metrics
from plurai.gpu_workers.writer import Writer, now_ms, passing
from plurai.results import jobs, progress, tokens

DUE_S = 1.0  # the longest between two moves of due delayed entries (a new one's lateness)
DUE_MOST = 100  # delayed entries one move takes at most
log = logging.getLogger("plurai.worker")

BAD_RECORD = (
    "the job's record (plurai:job:<id>) or token stream (plurai:out:<id>) was written by "
    "something other than Plurai with the wrong Redis type; submit the job again"
)


@dataclass
class Entry:
    lane: str
    stream: str  # the request stream it was read from: its model's, one shard's
    entry_id: bytes
    fields: dict[bytes, bytes]
    req: protocol.Request
    # unix seconds since when it waits, if not since it entered its lane: when its last
    # worker let it go (handed over, or last renewed before it died)
    since_s: float = 0.0
    # while traced (gpu_workers/spans.py): its job's trace context
    trace: Any = None
    # unix seconds: when this worker read it, and put its job into the engine (the queue
    # hop's figures, in the job's record)
    taken_s: float = 0.0
    added_s: float = 0.0

    @property
    def job_id(self) -> str:
        return self.req.envelope.job_id

    @property
    def entered_s(self) -> float:
        """When the entry entered its lane: stream ids carry Redis's clock in ms."""
        return int(self.entry_id.split(b"-", 1)[0]) / 1000

    @property
    def waited_from_s(self) -> float:
        return self.since_s or self.entered_s


# lane, stream, entry id, fields, since when it waits (0.0: since it entered its lane)
Raw = tuple[str, str, bytes, dict[bytes, bytes], float]


class Intake:
    def __init__(
        self,
        r: redis.Redis,
        settings: Settings,
        worker_id: str,
        metrics: Metrics,
        writer: Writer,
        limits: protocol.Limits,
        model_names: set[str],
    ) -> None:
        self.r, self.settings, self.id = r, settings, worker_id
        self.metrics, self.writer, self.limits = metrics, writer, limits
        self.model_names = model_names
        self.lanes = list(settings.lanes)
        # lanes an operator paused (`plurai lane pause`): read again at each heartbeat
        self.paused: set[str] = set()
        self.model, self.shards = settings.model, settings.shards
        self._lane_of = {
            self.stream(lane, shard).encode(): lane
            for lane in self.lanes
            for shard in range(self.shards)
        }
        self._shard_of = {
            self.stream(lane, shard): shard for lane in self.lanes for shard in range(self.shards)
        }
        # balance ms, and how long a worker's recorded load counts: an idle worker records
        # its own every block_ms
        self._balance = (settings.balance_ms, 1000 + 2 * settings.block_ms)
        self._next_scan = 0.0  # when the lanes may be read again after they were all empty
        self.arrivals: Arrivals | None = None  # listen() starts it
        self._next_reclaim = 0.0
        self._next_due = 0.0  # when to move delayed entries whose time has come (DUE)
        self._pulls = 0  # entries taken from the lanes, for the fair_every turn
        self._turn = 0  # which shard goes first, in turn
        # the jobs this worker runs, for the balance between workers (Settings.balance_ms);
        # None: not balanced
        self.load: Callable[[], int] | None = None
        self.turn_ms = 0  # the time between two reads while the engine steps (the worker's)

    def stream(self, lane: str, shard: int = 0) -> str:
        return keys.request_stream(lane, self.model, shard)

    def listen(self, wake: Callable[[], None]) -> None:
        """Hear of each entry submitted for the model as it arrives (arrivals.py), and call
        `wake` then."""
        self.arrivals = Arrivals(self.r, keys.arrivals(self.model), wake)
        self.arrivals.start()

    def close(self) -> None:
        if self.arrivals is not None:
            self.arrivals.close()

    def streams(self) -> list[str]:
        """Every request stream this worker reads: its model's lanes, of every shard."""
        return [self.stream(lane, shard) for lane in self.lanes for shard in range(self.shards)]

    def _shard_order(self) -> list[int]:
        """The shards, starting at the next one in turn: every shard is read first as
        often as any other."""
        self._turn += 1
        k = self._turn % self.shards
        return [*range(k, self.shards), *range(k)]

    def take(self, block: bool, below_top: bool = True, count: int = 1) -> list[Entry]:
        """The next valid entries, at most `count` (more after a blocking read: one per lane):
        an entry stranded by a dead worker if there is one, else entries from the highest
        lanes that have work (see lane_order); `below_top`: whether lanes below the top one
        may be read now. Invalid entries met on the way get their error result here and are
        skipped.

        While the engine is busy and the lanes were all empty, the lanes below the top one
        are read again when an entry arrives (arrivals.py), or after poll_ms, so an empty
        queue costs one round trip a step (the top lane's)."""
        self._move_due()
        while True:
            got = self._reclaim()
            if not got:
                # the next scan waits only after every lane was read and found empty
                scan_all = below_top and (
                    block or self._arrived() or time.monotonic() >= self._next_scan
                )
                lanes, n = self.lanes[:1], count
                if scan_all:
                    lanes, n = self._turn_order(count)
                got = self._read(block, lanes, n)
                if not got:
                    if scan_all:
                        self._next_scan = time.monotonic() + self.settings.poll_ms / 1000
                    return []
            valid = [e for e in (self._check(*g) for g in got) if e is not None]
            if valid:
                return valid
            block = False  # invalid entries were handled: look again without waiting

    def _move_due(self) -> None:
        """Move the delayed entries whose time has come to their lanes (DUE): when the next
        one is due, and at least every DUE_S (a delayed job submitted since). One that
        cannot be moved is dead-lettered."""
        now = time.monotonic()
        if now < self._next_due:
            return
        wait_s = DUE_S
        for shard in range(self.shards):
            call = jobs.due(
                model=self.model,
                shard=shard,
                lanes=self.lanes,
                now_ms=now_ms(),
                most=DUE_MOST,
                maxlen=self.settings.stream_maxlen,
            )
            nxt, *bad = jobs.run(self.r, call)
            if nxt:
                wait_s = min(wait_s, max(0.0, (float(nxt) - now_ms()) / 1000))
            for entry in bad:
                self._dead_letter_delayed(shard, entry)
        self._next_due = now + wait_s

    def _dead_letter_delayed(self, shard: int, entry: bytes) -> None:
        """A delayed entry DUE could not move (no lane of this worker's, or bytes that do not
        decode): to the dead letters, kept as it was; a job it names gets its failed result
        (bad_field), so that no client waits on a job that will never run."""
        log.warning("a delayed entry on shard %d could not be moved to a lane", shard)
        self.metrics.dead_lettered.labels("bad_delayed_entry").inc()
        decoded = _delayed_entry(entry)
        if decoded is None:
            error = (
                "a delayed entry that does not decode (msgpack: its lane, then field/value pairs)"
            )
            dead = self.writer.dead_letter(
                "", "", error, worker=self.id, fields=text(entry)[:65536], delayed=entry
            )
            self.writer.execute([dead])
            return
        lane, fields = decoded
        error = f"a delayed entry of lane {lane[:64]!r}, not one of this worker's {self.lanes}"
        self.writer.execute([self._dead_letter_command(lane, "", fields, error)])
        try:
            job_id = protocol.job_id_of(fields)
        except protocol.NoJobId:
            return
        self.writer.store([self.writer.failed(job_id, "", None, Code.BAD_FIELD, error)])

    def _arrived(self) -> bool:
        return self.arrivals is not None and self.arrivals.take()

    def take_waited(self, wait_ms: int, lanes: list[str] | None = None) -> list[Entry]:
        """At most one entry of `lanes` (the top lane by default), and only from a lane
        whose oldest waiting entry has waited `wait_ms` or longer: what a worker that holds
        new work (the top lane's target) still takes, so that no top-lane request waits
        unboundedly for one, and the lower lanes keep their fair turn."""
        got = self._read(False, lanes or self.lanes[:1], 1, wait_ms)
        return [e for e in (self._check(*g) for g in got) if e is not None]

    def _turn_order(self, count: int) -> tuple[list[str], int]:
        """The lane order of the next pull and how many entries may be taken in it: never
        past a fair turn, which is a pull of its own, so every fair_every-th entry taken
        starts at a lower lane whatever the number taken at once."""
        every = self.settings.fair_every
        if len(self.lanes) < 2 or every <= 0:
            return self.lanes, count
        to_fair = every - self._pulls % every  # the fair turn is the to_fair-th pull from now
        return self.lane_order(), 1 if to_fair == 1 else min(count, to_fair - 1)

    def lane_order(self) -> list[str]:
        """Highest lane first, except every fair_every-th pull, which starts at the next
        lower lane in turn (standard, batch, standard, ... with the default lanes) and wraps
        round to the top: a lower lane gets at least one pull in fair_every * (lanes - 1)
        while it has work, however busy the lanes above it are."""
        n, every = len(self.lanes), self.settings.fair_every
        if n < 2 or every <= 0 or (self._pulls + 1) % every:
            return self.lanes
        k = 1 + ((self._pulls + 1) // every - 1) % (n - 1)
        return self.lanes[k:] + self.lanes[:k]

    def _read(self, block: bool, lanes: list[str], count: int = 1, wait_ms: int = 0) -> list[Raw]:
        """Up to `count` new entries, lane by lane in `lanes`' order, every shard of a lane
        before the next lane: one call (TAKE) for a model of one shard, whose lanes share a
        hash tag. Each entry taken counts as a pull (lane_order). `wait_ms`: only from a
        stream whose oldest waiting entry waited that long (jobs.take)."""
        got: list[Raw] = []
        if self.paused:
            lanes = [lane for lane in lanes if lane not in self.paused]
            if not lanes:
                return got
        shards = self._shard_order()
        if self.shards == 1:
            groups = [[self.stream(lane) for lane in lanes]]
        else:
            groups = [[self.stream(lane, shard)] for lane in lanes for shard in shards]
        load = self.load() if self.load is not None and self.settings.balance_ms else None
        for streams in groups:
            balance = None
            if load is not None:
                shard = self._shard_of[streams[0]]
                balance = (
                    keys.loads(self.model, shard),
                    load + len(got),
                    *self._balance,
                    self.turn_ms,
                )
            call = jobs.take(
                streams=streams,
                consumer=self.id,
                count=count - len(got),
                wait_ms=wait_ms,
                balance=balance,
            )
            reply = jobs.run(self.r, call)
            for i, entry_id, flat, *handed in reply:
                stream = streams[i - 1]
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                if handed and int(handed[0]) > 0:  # a handed-over entry's earlier failures
                    failures = protocol.attempts_of(fields) + int(handed[0])
                    fields[b"attempts"] = str(failures).encode()
                since = time.time() - int(handed[1]) / 1000 if handed[1:] else 0.0
                got.append((self._lane_of[stream.encode()], stream, entry_id, fields, since))
            if len(got) >= count:
                break
        if not got and block:
            # one shard's lanes share a hash tag, so one read can wait on all of them; with
            # several shards each wait is shorter, and the next goes to the next shard
            streams = {self.stream(lane, shards[0]): ">" for lane in lanes}
            wait_ms = max(1, self.settings.block_ms // self.shards)
            reply = self.r.xreadgroup(keys.GROUP, self.id, streams, count=1, block=wait_ms)
            got = sorted(self._entries(reply), key=lambda e: self.lanes.index(e[0]))
        self._pulls += len(got)
        return got

    def _entries(self, reply: Any) -> list[Raw]:
        return [
            (self._lane_of[stream], text(stream), entry_id, fields or {}, 0.0)
            for stream, entries in tokens.stream_items(reply)
            for entry_id, fields in entries
        ]

    def hold_reclaims(self, seconds: float) -> None:
        """Reclaim nothing for `seconds`. After a Redis outage (or failover) every worker's
        entries look idle, their leases unrenewed: each worker must get the time to renew
        its own before any takes another's, or live workers would take each other's jobs
        back and forth until their delivery counts ran out."""
        self._next_reclaim = max(self._next_reclaim, time.monotonic() + seconds)

    def _reclaim(self) -> list[Raw]:
        """One entry left idle by a dead worker, highest lane first, claimed to this worker;
        entries whose job failed max_deliveries times are dead-lettered on the way. When a
        whole pass finds none, the next pass waits reclaim_interval_s. (Entries handed over
        are taken by TAKE; one no worker took for reclaim_idle_ms is reclaimed here.)

        Each stream costs one XPENDING with IDLE (the oldest idle entry, found by Redis) and
        an XCLAIM when there is one: a pass costs the same whatever the fleet holds, where
        an XAUTOCLAIM scan would read every pending entry, ten a call."""
        if time.monotonic() < self._next_reclaim:
            return []
        idle = self.settings.reclaim_idle_ms
        for stream in self.streams():  # lane by lane, highest first
            lane = self._lane_of[stream.encode()]
            while True:
                found = self.r.xpending_range(stream, keys.GROUP, "-", "+", 1, idle=idle)
                if not found:
                    break
                entry_id, before = found[0]["message_id"], found[0]["times_delivered"]
                since = time.time() - found[0]["time_since_delivered"] / 1000
                handed = text(found[0]["consumer"]) == keys.HANDED_OVER
                claimed = self.r.xclaim(stream, keys.GROUP, self.id, idle, [entry_id])
                if not claimed or claimed[0][1] is None:  # taken by another, or deleted
                    self._ack_deleted(stream, entry_id)
                    continue
                fields = claimed[0][1]
                times = before + 1
                if self._advanced(fields):  # not a failure: see _advanced
                    self.r.xclaim(
                        stream, keys.GROUP, self.id, 0, [entry_id], retrycount=before, justid=True
                    )
                    times = before
                # Each delivery before this one ended without a result: a failure.
                # (a handed-over entry forgiven its run comes with no delivery counted)
                failures = protocol.attempts_of(fields) + max(0, times - 1)
                if failures >= protocol.max_deliveries_of(fields, self.settings.max_deliveries):
                    self.too_many_failures(
                        lane,
                        stream,
                        entry_id,
                        fields,
                        f"delivered {times} times",
                        "its workers kept dying or stalling on it",
                    )
                    continue
                log.info(
                    "%s entry %s on %s (delivery %d)",
                    "took over preempted" if handed else "reclaimed",
                    entry_id,
                    lane,
                    times,
                    extra={"lane": lane, "delivery": times},
                )
                self.metrics.reclaimed.labels(lane).inc()
                # The count travels with the job if it is handed back after this.
                fields = {**fields, b"attempts": str(failures).encode()}
                return [(lane, stream, entry_id, fields, since)]
        self._next_reclaim = time.monotonic() + self.settings.reclaim_interval_s
        return []

    def _advanced(self, fields: dict[bytes, bytes]) -> bool:
        """Whether the job's run that just ended without a result (its worker died or
        stalled) had made its progress grow. Then the job was not what stopped that worker:
        a worker that dies on a poison job dies before the job's progress grows (at most
        up to the point where it dies, once), so its deliveries still count, and one killed
        at random, or stalled, while it ran the job does not charge the job for it. A run
        that never began counts, as before."""
        try:
            job_id = protocol.job_id_of(fields)
        except protocol.NoJobId:
            return False
        return jobs.run(self.r, jobs.advanced(job_id=job_id)) == 1

    def _ack_deleted(self, stream: str, entry_id: bytes) -> None:
        """Ack a pending entry that no longer exists (trimmed or deleted by hand); one that
        exists was claimed by another worker first and is left alone."""
        if not self.r.xrange(stream, entry_id, entry_id):
            self.r.xack(stream, keys.GROUP, entry_id)

    def _check(
        self, lane: str, stream: str, entry_id: bytes, fields: dict[bytes, bytes], since: float
    ) -> Entry | None:
        """Validate an entry; None when it was answered with an error result instead.
        Sampling fields are checked by the backend when the job is added."""
        try:
            req = protocol.parse_request(fields, self.limits)
            if req.model is not None and req.model not in self.model_names:
                raise WireError(
                    Code.UNKNOWN_MODEL,
                    f"model {req.model!r} is not served here; this queue serves "
                    f"{sorted(self.model_names)} (or leave 'model' out)",
                )
            entry = Entry(lane, stream, entry_id, fields, req, since, taken_s=time.time())
            if tracing.ON and req.envelope.traceparent is not None:
                entry.trace = tracing.parent(req.envelope.traceparent)
            return entry
        except protocol.NoJobId as e:
            self._dead_letter(lane, stream, entry_id, fields, str(e), "no_job_id")
        except WireError as e:
            job_id = protocol.job_id_of(fields)
            if tracing.ON:
                self._traced_refusal(fields, lane, job_id, e.code)
            self.refuse(lane, stream, entry_id, job_id, e.code, e.message)
        return None

    def _traced_refusal(
        self, fields: dict[bytes, bytes], lane: str, job_id: str, code: str
    ) -> None:
        """The result span of a job answered with an error before it ran, where its entry
        carries a valid traceparent (gpu_workers/spans.py); sent before the result, it
        ends with the result's reply (Writer.replied)."""
        parent = tracing.parent(tracing.valid(fields.get(b"traceparent")))
        if parent is None or job_id in self.writer.results:  # none, or a result on its way
            return
        attempts = protocol.attempts_of(fields)
        attrs = tracing.job_attributes(job_id, lane, None, self.model, attempts, self.id)
        span = tracing.span("result", parent, attributes={**attrs, "plurai.state": "failed"})
        tracing.failed(span, code)
        self.writer.results[job_id] = span

    def refuse(
        self, lane: str, stream: str, entry_id: bytes, job_id: str, code: str, message: str
    ) -> None:
        """A terminal error result for a job that never ran, and the ack of its entry."""
        log.info(
            "job refused: %s: %s",
            code,
            message,
            extra={"job_id": job_id, "lane": lane, "code": code},
        )
        self.writer.store([self.writer.failed(job_id, lane, (stream, entry_id), code, message)])

    def too_many_failures(
        self,
        lane: str,
        stream: str,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        what: str,
        why: str,
    ) -> None:
        """Dead-letter a job that failed max_deliveries times (its own max_retries + 1
        where it asks fewer), with its error result."""
        bound = protocol.max_deliveries_of(fields, self.settings.max_deliveries)
        if bound < self.settings.max_deliveries:
            error = f"{what} (its max_retries={bound - 1}); {why}"
        else:
            error = f"{what} (PLURAI_MAX_DELIVERIES={self.settings.max_deliveries}); {why}"
        try:
            job_id = protocol.job_id_of(fields)
        except protocol.NoJobId:
            self._dead_letter(lane, stream, entry_id, fields, error, "too_many_deliveries")
            return
        log.warning(
            "job dead-lettered: %s; moved to %s",
            error,
            keys.DEAD_LETTER,
            extra={"job_id": job_id, "lane": lane, "code": Code.TOO_MANY_DELIVERIES},
        )
        self.metrics.dead_lettered.labels("too_many_deliveries").inc()
        dead = self._dead_letter_command(lane, entry_id, fields, error)
        self.writer.acks += self.writer.execute([dead])  # refused for now: sent again later
        code = Code.TOO_MANY_DELIVERIES
        if tracing.ON:
            self._traced_refusal(fields, lane, job_id, code)
        self.writer.store([self.writer.failed(job_id, lane, (stream, entry_id), code, error)])

    def _dead_letter(
        self,
        lane: str,
        stream: str,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        error: str,
        reason: str,
    ) -> None:
        """Move an entry that carries no usable job id (so no result can be written)."""
        log.warning("entry %s on %s has no job id; moved to %s", entry_id, lane, keys.DEAD_LETTER)
        self.metrics.dead_lettered.labels(reason).inc()
        dead = self._dead_letter_command(lane, entry_id, fields, error)
        if self.writer.execute([dead]):  # refused for now (Redis is full): left pending,
            return  # to be dead-lettered by whoever reclaims it
        self.writer.execute(jobs.ack(stream, entry_id))

    def _dead_letter_command(
        self, lane: str, entry_id: bytes, fields: dict[bytes, bytes], error: str
    ) -> list[Any]:
        """`fields` shown as JSON (a reader's view, cut at 64 KiB), and kept as they were
        (msgpack, binary-safe) where their size is an entry's, so that `plurai dead-letters
        requeue` can queue the job again (producer/dead_letters.py)."""
        shown = json.dumps({text(k): text(v) for k, v in fields.items()})[:65536]
        more = {"worker": self.id, "fields": shown}
        packed = msgpack.packb(fields)
        if len(packed) <= self.settings.max_body_bytes + (64 << 10):
            more["entry"] = packed
        return self.writer.dead_letter(lane, entry_id, error, **more)

    def hand_back(self, entries: list[Entry], failed: str = "") -> None:
        """Give these jobs back to the queue: each entry keeps its place in its lane for
        the next worker, no attempt counted (hand_over), or with `failed` (why they were
        not finished: the worker crashed) each job's attempt counts and its entry goes to
        the tail of its lane (retry)."""
        for entry in entries:
            try:
                if failed:
                    self.retry(entry, failed)
                else:
                    self.hand_over(entry)
            except redis.RedisError:
                log.exception(
                    "could not hand back a job; it stays pending", extra={"job_id": entry.job_id}
                )
        if entries:
            log.info("handed %d unfinished job(s) back to the queue", len(entries))

    def hand_over(self, entry: Entry) -> bool:
        """Give up a job preempted or drained here, its progress written: its entry keeps
        its place in the lane (jobs.hand_over): the next worker to take from the lane takes
        it, ahead of newer entries, with no attempt counted. False when the job had a
        result already or another worker owns the entry now."""
        again = jobs.run(self.r, jobs.release(job_id=entry.job_id)) == 1
        call = jobs.hand_over(
            stream=entry.stream, consumer=self.id, entry_id=entry.entry_id, again=again
        )
        return jobs.run(self.r, call) == 1

    def retry(self, entry: Entry, error: str) -> None:
        """A job whose processing failed: hand it back with one more failed attempt, or at
        max_deliveries attempts dead-letter it with too_many_deliveries."""
        env, attempts = entry.req.envelope, entry.req.envelope.attempts + 1
        bound = min(
            self.settings.max_deliveries, env.max_deliveries or self.settings.max_deliveries
        )
        if attempts >= bound:
            what = f"its processing failed {attempts} times"
            self.too_many_failures(
                entry.lane, entry.stream, entry.entry_id, entry.fields, what, f"last error: {error}"
            )
            return
        log.warning(
            "job failed on this worker (%s); handed back, attempt %d of %d",
            error,
            attempts,
            bound,
            extra={"job_id": entry.job_id, "lane": entry.lane},
        )
        self.requeue(entry, attempts)

    def requeue(self, entry: Entry, attempts: int) -> None:
        """Re-add the job's entry at the tail of its lane (with its count of failed
        attempts) and ack the old one, unless the job has a result already."""
        fields = {k: v for k, v in entry.fields.items() if k != b"attempts"}
        if attempts:
            fields[b"attempts"] = str(attempts).encode()
        again = jobs.run(self.r, jobs.release(job_id=entry.job_id)) == 1
        later = None
        backoff = entry.req.envelope.retry_backoff_ms
        if attempts and backoff:  # its own backoff: base x 2^(failures - 1), at most an hour
            wait_ms = min(protocol.MAX_BACKOFF_MS, backoff << min(attempts - 1, 30))
            delayed = keys.delayed(self.model, self._shard_of[entry.stream])
            later = (delayed, entry.lane, now_ms() + wait_ms)
        call = jobs.requeue(
            stream=entry.stream,
            entry_id=entry.entry_id,
            maxlen=self.settings.stream_maxlen,
            again=again,
            fields=fields,
            later=later,
        )
        jobs.run(self.r, call)

    def begin(self, entries: list[Entry]) -> list[tuple[str | redis.ResponseError, bytes | None]]:
        """Mark the entries' jobs running here and start their streams (script BEGIN, one
        round trip for all). For each: 'run' with the progress to resume from (or None),
        or why not ('done', 'cancelled', 'expired', 'badkey'), or Redis's refusal when it
        refused for a reason that passes (OOM, ...); a refusal tied to the job's keys is
        'badkey'."""
        calls = [self._begin_call(entry) for entry in entries]
        out: list[tuple[str | redis.ResponseError, bytes | None]] = []
        for reply in self._begin(calls, entries):
            if isinstance(reply, redis.ResponseError):
                out.append((reply if passing(reply) else "badkey", None))
            elif isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], bytes):
                out.append((text(reply[0]), reply[1]))
            else:
                out.append((text(reply), None))
        return out

    def _begin(self, calls: list[jobs.Call], entries: list[Entry]) -> list[Any]:
        """BEGIN's replies; the entries also go to the dashboard's index of recent jobs, in
        the same round trip on one server. On a Cluster that index lives on a node of its
        own: it is written after, and a failure there never stops a job."""
        maxlen = self.settings.recent_jobs_maxlen
        recent = [
            ["XADD", keys.RECENT, "MAXLEN", "~", maxlen, "*", "id", entry.job_id,
             "model", self.model, "lane", entry.lane]
            for entry in (entries if maxlen else [])
        ]  # fmt: skip
        cluster = self.writer.cluster
        if not cluster:
            return jobs.pipeline(self.r, [*calls, *recent], cluster)[: len(calls)]
        replies = jobs.pipeline(self.r, calls, cluster)
        if recent:
            try:
                jobs.pipeline(self.r, recent, cluster)
            except redis.RedisError as e:
                log.debug("the recent jobs index was not written (%s)", e)
        return replies

    def _begin_call(self, entry: Entry) -> jobs.Call:
        env = entry.req.envelope
        metadata = entry.req.metadata
        head = self.writer.progress_head
        asked = entry.req.params.get("logprobs") is not None
        return jobs.begin(
            job_id=entry.job_id,
            worker=self.id,
            now_ms=now_ms(),
            ttl_s=self.settings.result_ttl_s,
            deadline_ms=env.deadline_ms,
            lane=entry.lane,
            priority=env.priority,
            metadata_json=json.dumps(metadata) if metadata is not None else None,
            progress_head=head,
            progress_limit=progress.limit(head, env.max_tokens, asked, entry.req.n),
            tenant=env.tenant,
        )

    def ack(self, entry: Entry) -> None:
        """Ack and delete an entry that needs no result from here (workers delete acked
        entries, so a lane's length minus its pending count is its backlog)."""
        pipe = self.r.pipeline(transaction=False)
        for command in jobs.ack(entry.stream, entry.entry_id):
            pipe.execute_command(*command)
        pipe.execute()


def _delayed_entry(entry: bytes) -> tuple[str, dict[bytes, bytes]] | None:
    """A delayed set's member as DEFER wrote it (msgpack of its lane, then the entry's
    field/value pairs, every one a string), or None."""
    try:
        items = msgpack.unpackb(entry, raw=True)
    except ValueError:  # msgpack's errors: not msgpack, extra bytes, nested too deep
        return None
    if not isinstance(items, list) or len(items) % 2 != 1:
        return None
    if not all(isinstance(x, bytes) for x in items):
        return None
    return text(items[0]), dict(zip(items[1::2], items[2::2], strict=True))
