"""A worker's writes: each step's token deltas and final results go out in one packed
write, sent before the next step and confirmed after it, so Redis works while the engine
computes; one connection keeps them in order. Final results are kept until Redis has
them, through outages, and sent again (FINALIZE stores a job's result once).

Every write is a script call built by results/jobs.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from broker_config import fastpipe
from broker_config.settings import Settings
from results import jobs, records
from results.records import now_ms

log = logging.getLogger("plurai.worker")

# Refusals that end by themselves (memory freed, failover done, data loaded).
PASSING = frozenset({"OOM", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN"})


def passing(e: redis.ResponseError) -> bool:
    return str(e).split(" ", 1)[0] in PASSING


class Writer:
    def __init__(self, r: redis.Redis, settings: Settings, worker_id: str) -> None:
        self.r, self.settings, self.id = r, settings, worker_id
        # A job's deltas since its last reset are never trimmed away.
        self.out_maxlen = max(settings.output_maxlen, settings.max_tokens_limit + 64)
        self.unsent: list[jobs.Call] = []  # FINALIZE calls not yet known to be stored
        self._conn: Any = None  # the packed writes' own connection
        self._in_flight: list[jobs.Call] = []

    # -- calls ----------------------------------------------------------------------
    def deltas(self, items: list[jobs.Delta]) -> jobs.Call:
        return jobs.deltas(worker=self.id, maxlen=self.out_maxlen, items=items)

    def final(
        self,
        job_id: str,
        lane: str,
        entry_id: bytes,
        state: str,
        finish_reason: str,
        fields: list[Any],
        resync: jobs.Resync,
    ) -> jobs.Call:
        """The FINALIZE call of one job: its result, the end of its stream, the ack of its
        entry. `resync`: see jobs.finalize."""
        s = self.settings
        return jobs.finalize(
            job_id=job_id,
            lane=lane,
            entry_id=entry_id,
            state=state,
            finish_reason=finish_reason,
            fields=fields,
            ttl_s=s.result_ttl_s,
            stream_ttl_s=s.output_ttl_s,
            stream_maxlen=self.out_maxlen,
            resync=resync,
            dead_letter_maxlen=s.dead_letter_maxlen,
        )

    def failed(self, job_id: str, lane: str, entry_id: bytes, code: str, message: str) -> jobs.Call:
        """The result of a job that never ran: failed, with its code."""
        fields = records.final_fields(
            worker=self.id, finished_ms=now_ms(), error_code=code, error_message=message
        )
        return self.final(job_id, lane, entry_id, records.FAILED, "", fields, jobs.RESYNC_AUTO)

    # -- sending ------------------------------------------------------------------

    def send(self, calls: list[jobs.Call]) -> None:
        """One step's writes: the previous step's replies are read, then these are sent in
        one packed write without waiting for their replies."""
        try:
            self.collect()
            if calls:
                if self._conn is None:
                    self._conn = self.r.connection_pool.get_connection()
                packed = b"".join(fastpipe.pack(c.command()) for c in calls)
                self._conn.send_packed_command([packed])
        except BaseException:
            self.keep(calls)
            self._drop_conn()
            raise
        if calls:
            self._in_flight = calls

    def collect(self) -> None:
        """Read the replies of the writes sent after the previous step."""
        if not self._in_flight:
            return
        calls, self._in_flight = self._in_flight, []
        failed = []
        try:
            for call in calls:
                try:
                    self._conn.read_response()
                except redis.exceptions.NoScriptError:
                    failed.append(call)
        except BaseException:
            self._drop_conn()
            self.keep(calls)
            raise
        for call in failed:  # Redis lost its script cache: these did nothing; run them again
            jobs.run(self.r, call)

    def store(self, calls: list[jobs.Call]) -> None:
        """Store these results now, after the previous step's writes, with every result
        kept from before; those not stored (Redis away, or refusing for now) are kept."""
        self.unsent += calls
        self.collect()
        again = self.execute(self.unsent)  # a lost connection raises here: all are kept
        self.unsent = [c for c in again if isinstance(c, jobs.Call)]

    def flush(self) -> None:
        """Send the kept results."""
        if self.unsent:
            n = len(self.unsent)
            self.store([])
            if not self.unsent:
                log.info("stored %d kept result(s)", n)

    def keep(self, calls: list[jobs.Call]) -> None:
        """Keep the results among writes that may not have reached Redis, to send again (a
        repeat stores nothing new; a fresh one rewrites the stream's text: lost deltas are
        made good the same way)."""
        self.unsent += [jobs.resynced(c) for c in calls if c.script == "FINALIZE"]

    def lost_writes(self) -> None:
        """Redis failed: the kept results rewrite their streams (see keep), which makes the
        kept stream writes that went with them (a job's held tokens) needless."""
        self.unsent = [jobs.resynced(c) for c in self.unsent if c.script == "FINALIZE"]

    def execute(self, items: list[jobs.Call] | list[list[Any]]) -> list[Any]:
        """Send script calls or plain commands in one pipeline. Returns those Redis refused
        for a passing reason (OOM, READONLY, ...), to send again later; other refusals are
        logged and dropped, since repeating them would stall the worker."""
        if not items:
            return []
        pipe = self.r.pipeline(transaction=False)
        for item in items:
            pipe.execute_command(*(item.command() if isinstance(item, jobs.Call) else item))
        replies = pipe.execute(raise_on_error=False)
        again = []
        for item, rep in zip(items, replies, strict=True):
            if isinstance(rep, redis.exceptions.NoScriptError):  # nothing of it ran
                try:
                    jobs.run(self.r, item)  # type: ignore[arg-type]
                    continue
                except redis.ResponseError as e:
                    rep = e
            if not isinstance(rep, redis.ResponseError):
                continue
            if passing(rep):
                again.append(item)
            else:
                name = item.script if isinstance(item, jobs.Call) else item[0]
                log.error("redis refused a %s call (%s); dropped", name, rep)
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

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.backoff = 0.1
        self.since: float | None = None

    def over(self) -> None:
        self.backoff, self.since = 0.1, None

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
