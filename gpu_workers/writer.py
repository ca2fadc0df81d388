"""A worker's writes: each step's token deltas and final results go out in one packed
write, sent before the next step and confirmed after it, so Redis works while the engine
computes; one connection keeps them in order. Final results are kept until Redis has
them, through outages, and sent again (FINALIZE stores a job's result once). A job's
request entry is acked only once its result's reply is back: with the next write, or at
once when the worker is idle (`settle`).

On a Redis Cluster the writes of a step go out as one pipeline (a round trip per node) and
are confirmed at once. Every script call is built by results/jobs.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from plurai.broker_config import fastpipe, keys, tracing
from plurai.broker_config.connection import is_cluster
from plurai.broker_config.memory import is_oom
from plurai.broker_config.settings import Settings
from plurai.results import jobs, records
from plurai.results.records import now_ms

log = logging.getLogger("plurai.worker")

# Refusals that end by themselves (memory freed, failover done, data loaded). redis-py
# raises most as their own classes, their code cut off the message; BUSY stays in it.
PASSING = frozenset({"OOM", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN"})
PASSING_ERRORS = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
)


def passing(e: redis.ResponseError) -> bool:
    """A refusal that ends by itself; a Lua script's write refused for memory is one too
    (Redis 6 answers it as the script's error, its OOM reply inside)."""
    if isinstance(e, PASSING_ERRORS) or is_oom(e):
        return True
    return str(e).split(" ", 1)[0] in PASSING


class Writer:
    def __init__(self, r: redis.Redis, settings: Settings, worker_id: str) -> None:
        self.r, self.settings, self.id = r, settings, worker_id
        # A job's deltas since its last reset are never trimmed away.
        self.out_maxlen = max(settings.output_maxlen, settings.max_tokens_limit + 64)
        self.unsent: list[jobs.Call] = []  # FINALIZE calls not yet known to be stored
        # why Redis refused the kept results for now (OOM, READONLY, ...), None if it did not
        self.refusal: redis.ResponseError | None = None
        self._refused: redis.ResponseError | None = None
        self.acks: list[list[Any]] = []  # commands due once their call's reply came back
        self.cluster = is_cluster(r)
        self.progress_head = b""  # results/progress.header of the worker's model
        self._conn: Any = None  # the packed writes' own connection
        # while traced: each job's result span, open until its FINALIZE's reply (spans.py)
        self.results: dict[str, Any] = {}
        self._in_flight: list[jobs.Call | list[Any]] = []

    # -- calls ----------------------------------------------------------------------
    def deltas(self, items: list[jobs.Delta]) -> list[jobs.Call]:
        """The DELTAS calls of a step: one, or one per delta on a Cluster (one slot each)."""
        groups = [[d] for d in items] if self.cluster else [items]
        ttl, head = self.settings.result_ttl_s, self.progress_head
        return [
            jobs.deltas(worker=self.id, maxlen=self.out_maxlen, ttl_s=ttl, head=head, items=g)
            for g in groups
        ]

    def final(
        self,
        job_id: str,
        lane: str,
        entry: tuple[str, bytes] | None,
        state: str,
        finish_reason: str,
        fields: list[Any],
        resync: jobs.Resync,
    ) -> jobs.Call:
        """The FINALIZE call of one job: its result, the end of its stream; `entry` (stream,
        entry id) is acked once it is stored. `resync`: see jobs.finalize."""
        s = self.settings
        return jobs.finalize(
            job_id=job_id,
            state=state,
            finish_reason=finish_reason,
            fields=fields,
            ttl_s=s.result_ttl_s,
            stream_ttl_s=s.output_ttl_s,
            stream_maxlen=self.out_maxlen,
            resync=resync,
            lane=lane,
            entry=entry,
            ack_inside=not self.cluster,
        )

    def failed(
        self, job_id: str, lane: str, entry: tuple[str, bytes] | None, code: str, message: str
    ) -> jobs.Call:
        """The result of a job that never ran: failed, with its code."""
        fields = records.final_fields(
            worker=self.id, finished_ms=now_ms(), error_code=code, error_message=message
        )
        return self.final(job_id, lane, entry, records.FAILED, "", fields, jobs.RESYNC_AUTO)

    def replied(self, item: jobs.Call | list[Any], reply: Any) -> None:
        """A reply came back: a FINALIZE's ack is due now; a job whose record is not a hash
        (-1: no result can be written) is dead-lettered with it."""
        if not isinstance(item, jobs.Call) or isinstance(reply, Exception):
            return
        if self.results and item.script == "FINALIZE" and item.job_id in self.results:
            error = "bad_record" if reply == -1 else ""
            tracing.end(self.results.pop(item.job_id), None, error, **{"plurai.stored": reply == 1})
        if item.script == "FINALIZE" and reply == -1:
            entry_id = item.entry[1] if item.entry is not None else ""
            error = "bad_record: the job record is not a hash; no result written"
            self.acks.append(self.dead_letter(item.lane, entry_id, error, job_id=item.job_id))
            if item.entry is not None and not item.then:  # FINALIZE did not ack it
                self.acks += jobs.ack(*item.entry)
        self.acks += item.then

    def dead_letter(self, lane: str, entry_id: Any, error: str, **more: Any) -> list[Any]:
        """The XADD of an entry to the dead-letter stream: its lane, id, why, then `more`
        fields."""
        fields = {"lane": lane, "entry_id": entry_id, "error": error, **more}
        flat = [x for kv in fields.items() for x in kv]
        return [
            "XADD",
            keys.DEAD_LETTER,
            "MAXLEN",
            "~",
            self.settings.dead_letter_maxlen,
            "*",
            *flat,
        ]

    # -- sending ------------------------------------------------------------------

    def send(self, calls: list[jobs.Call]) -> None:
        """One step's writes: the previous step's replies are read, then these (after the
        acks due) are sent in one packed write without waiting for their replies."""
        try:
            self.collect()
            items: list[jobs.Call | list[Any]] = [*self.acks, *calls]
            self.acks = []
            if self.cluster:
                self._in_flight = items
                self.collect()
                return
            if items:
                if self._conn is None:
                    self._conn = self.r.connection_pool.get_connection()
                packed = b"".join(fastpipe.pack(jobs.command(c)) for c in items)
                self._conn.send_packed_command([packed])
        except BaseException:
            self.keep(calls)
            self._drop_conn()
            raise
        self._in_flight = items

    def collect(self) -> None:
        """Read the replies of the writes sent after the previous step."""
        if not self._in_flight:
            return
        items, self._in_flight = self._in_flight, []
        if self.cluster:
            self._replies(items, self._pipeline(items))
            return
        replies: list[Any] = []
        try:
            for _ in items:
                try:
                    replies.append(self._conn.read_response())
                except redis.exceptions.NoScriptError as e:
                    replies.append(e)
        except BaseException:
            self._drop_conn()
            self.keep([c for c in items if isinstance(c, jobs.Call)])
            raise
        self._replies(items, replies)

    def _replies(self, items: list[jobs.Call | list[Any]], replies: list[Any]) -> None:
        """Take the replies of a write; a call Redis refused is kept (a result) and the
        first refusal raised once all are taken."""
        refused: redis.ResponseError | None = None
        for item, reply in zip(items, jobs.rerun(self.r, items, replies), strict=True):
            if isinstance(reply, redis.ResponseError) and isinstance(item, jobs.Call):
                self.keep([item])
                refused = refused or reply
            self.replied(item, reply)
        if refused is not None:
            raise refused

    def settle(self) -> None:
        """An idle worker's turn: read the last replies and send the acks they made due."""
        self.collect()
        self._send_acks()

    def _send_acks(self) -> None:
        """The commands due after stored results; one Redis refuses for now (a full Redis
        refuses a dead letter's XADD) waits for the next turn."""
        if self.acks:
            acks, self.acks = self.acks, []
            self.acks += self.execute(acks)

    def _pipeline(self, items: list[jobs.Call | list[Any]]) -> list[Any]:
        try:
            return jobs.pipeline(self.r, items, self.cluster)
        except BaseException:
            self.keep([c for c in items if isinstance(c, jobs.Call)])
            raise

    def store(self, calls: list[jobs.Call]) -> None:
        """Store these results now, after the previous step's writes, with every result
        kept from before; those not stored (Redis away, or refusing for now) are kept."""
        self.unsent += calls
        self.collect()
        self._refused = None
        again = self.execute(self.unsent)  # a lost connection raises here: all are kept
        self.unsent = [c for c in again if isinstance(c, jobs.Call)]
        self.refusal = self._refused if self.unsent else None
        self._send_acks()

    def flush(self) -> None:
        """Send the kept results (and the acks their replies make due)."""
        if self.unsent:
            n = len(self.unsent)
            self.store([])
            if not self.unsent:
                log.info("stored %d kept result(s)", n)

    def kept_entries(self) -> dict[str, list[Any]]:
        """The request entries of the kept results, by stream: still pending here, their
        leases to renew while Redis refuses the results (a full Redis takes renewals)."""
        out: dict[str, list[Any]] = {}
        for call in self.unsent:
            if call.entry is not None:
                out.setdefault(call.entry[0], []).append(call.entry[1])
        return out

    def keep(self, calls: list[jobs.Call]) -> None:
        """Keep the results among writes that may not have reached Redis, to send again (a
        repeat stores nothing new; a fresh one rewrites the stream's text: lost deltas are
        made good the same way)."""
        self.unsent += [jobs.resynced(c) for c in calls if c.script == "FINALIZE"]

    def lost_writes(self) -> None:
        """Redis failed: writes sent since the last reply may be lost, and a Redis restarted
        from its append-only file may have lost the last ones it acknowledged. Each running
        job's next stream write, and each kept result, first resets the stream to the whole
        text so far (Runs.resync), so its deltas after the last reset always spell the result;
        that makes the kept stream writes that went with the kept results needless."""
        self.unsent = [jobs.resynced(c) for c in self.unsent if c.script == "FINALIZE"]

    def execute(self, items: list[jobs.Call] | list[list[Any]]) -> list[Any]:
        """Send script calls or plain commands in one pipeline. Returns those Redis refused
        for a passing reason (OOM, READONLY, ...), to send again later; other refusals are
        logged and dropped, since repeating them would stall the worker."""
        if not items:
            return []
        again = []
        for item, rep in zip(items, jobs.pipeline(self.r, items, self.cluster), strict=True):
            if not isinstance(rep, redis.ResponseError):
                self.replied(item, rep)
                continue
            if passing(rep):
                again.append(item)
                self._refused = rep
            else:
                name = item.script if isinstance(item, jobs.Call) else item[0]
                log.error("redis refused a %s call (%s); dropped", name, rep)
                if isinstance(item, jobs.Call) and item.job_id in self.results:
                    tracing.end(self.results.pop(item.job_id), None, "dropped")
        return again

    def _drop_conn(self) -> None:
        """After a failure: the next write takes a connection from the pool again, which
        connects it anew (to the current primary, with Sentinel; a kept connection would
        reconnect to the address it had)."""
        if self._conn is not None:
            self._conn.disconnect()
            self.r.connection_pool.release(self._conn)
            self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            self.r.connection_pool.release(self._conn)
            self._conn = None


class Outage:
    """The worker loop's answer to Redis failing: exponential backoff (0.1 s doubling to
    5 s), and an exit once it has failed for `budget_s` (0: never)."""

    FULL_LOG_S = 30.0  # a Redis that stays full is logged again after this

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.backoff = 0.1
        self.since: float | None = None
        self._full_logged = -self.FULL_LOG_S

    def over(self) -> None:
        self.backoff, self.since = 0.1, None

    def full(self, e: redis.RedisError, kept: int, idle: bool) -> None:
        """Redis is at its maxmemory and refuses writes. It answers, so this is no outage:
        the worker never exits for it (the results it keeps would go with it), its running
        jobs go on, and it waits the back-off only when `idle` (nothing to step)."""
        now = time.monotonic()
        if now - self._full_logged >= self.FULL_LOG_S:
            self._full_logged = now
            log.error(
                "Redis is out of memory (%s): %d result(s) kept and retried, no new job "
                "starts until it takes writes again; free memory or raise its maxmemory "
                '(docs/operations.md, "Memory")',
                e,
                kept,
            )
        if idle:
            time.sleep(self.backoff)
            self.backoff = min(2 * self.backoff, 5.0)

    def wait(self, e: redis.RedisError, kept: int) -> None:
        if isinstance(e, redis.ResponseError):
            # Not tied to one job (those are answered where they happen): e.g. OOM,
            # READONLY, NOPERM. Wait for the operator, as for an outage.
            log.error("redis refused a command (%s); retrying in %.1fs", e, self.backoff)
        else:
            log.warning(
                "redis unavailable (%s); %d result(s) kept; retrying in %.1fs",
                e,
                kept,
                self.backoff,
            )
        now = time.monotonic()
        self.since = self.since or now
        if self.budget_s and now - self.since > self.budget_s:
            raise SystemExit(
                f"plurai worker: Redis failed for over {self.budget_s:.0f}s "
                "(PLURAI_REDIS_RETRY_S); exiting, other workers reclaim its jobs"
            )
        time.sleep(self.backoff)
        self.backoff = min(2 * self.backoff, 5.0)
