"""The long-lived worker: Redis lane streams in, engine steps, results out.

    plurai worker --model models/tiny-llama [--url redis://...]

Loop: take an entry (highest lane first) only while the engine can admit it, judged
from the entry's length metadata; step the engine; write each step's token deltas to the
jobs' streams in one pipeline; store each final result and XACK its entry in one script.
Bad input never stops the loop: the job gets a terminal error result and is acked.

At most one entry is held outside the engine (taken, waiting for room), so a dead worker
strands little. SIGTERM (or Ctrl-C): stop taking entries, let running jobs finish within
the grace period, then hand the rest back by re-adding their entries at the tail of their
lanes (and acking the old ones), so any worker can take them at once. A second Ctrl-C
skips the grace period.

Reliability (docs/operations.md): every heartbeat the worker renews the entries it holds
(XCLAIM to itself, JUSTID: resets their idle time, not their delivery count), so only a
dead worker's entries grow idle; those are taken over with XAUTOCLAIM once idle longer than
reclaim_idle_ms, and one delivered more than max_deliveries times is dead-lettered with a
`too_many_deliveries` result. Final results not yet stored when Redis goes away are kept
and sent again once it is back (FINALIZE is idempotent).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from broker_config import fastpipe, keys, protocol
from broker_config.groups import ensure_groups
from broker_config.protocol import Code, WireError
from broker_config.settings import Settings
from gpu_workers.engine.errors import RequestError
from gpu_workers.metrics import Metrics
from results import records, scripts, tokens

log = logging.getLogger("plurai.worker")


@dataclass
class Entry:
    lane: str
    entry_id: bytes
    fields: dict[bytes, bytes]
    req: protocol.Request
    params: Any  # SamplingParams


@dataclass
class Running:
    entry: Entry
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token_s: float = 0.0  # wall clock, for the time-per-output-token histogram
    # The job's token stream may lack deltas (Redis failed while they were sent): its next
    # write is a reset followed by the whole text so far.
    resync: bool = False


# Refusals that end by themselves (memory freed, failover done, data loaded).
_PASSING = frozenset({"OOM", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN"})

_BAD_RECORD = (
    "the job's record (plurai:job:<id>) or token stream (plurai:out:<id>) was written by "
    "something other than Plurai with the wrong Redis type; submit the job again"
)


def _ms() -> int:
    return int(time.time() * 1000)


def _entry_s(entry_id: bytes) -> float:
    """When the entry entered its lane: stream ids carry Redis's clock in milliseconds."""
    return int(entry_id.split(b"-", 1)[0]) / 1000


class Worker:
    def __init__(
        self,
        engine: Any,
        r: redis.Redis,
        settings: Settings,
        worker_id: str | None = None,
        model_names: set[str] | None = None,
    ) -> None:
        from gpu_workers.engine.sampling_params import SamplingParams

        self._params_cls = SamplingParams
        self.engine = engine
        self.r = r
        self.settings = settings
        self.id = worker_id or settings.worker_id or new_worker_id()
        self.model_names = model_names or set()
        self.lanes = list(settings.lanes)
        self.running: dict[str, Running] = {}
        self.held: list[Entry] = []  # taken, not yet in the engine (bounded by len(lanes))
        self.stopping = False
        self.stop_deadline = 0.0
        self._begin = r.register_script(scripts.BEGIN)
        self._requeue = r.register_script(scripts.REQUEUE)
        self._renew = r.register_script(scripts.RENEW)
        self._check_jobs = r.register_script(scripts.CHECK)
        max_len = getattr(engine, "max_model_len", None)
        self.limits = settings.limits(max_len - 1 if max_len else None)
        # A job's deltas since its last reset are never trimmed away.
        self.out_maxlen = max(settings.output_maxlen, settings.max_tokens_limit + 64)
        self._sha = {name: "" for name in ("DELTAS", "FINALIZE")}  # used inside pipelines
        self._next_scan = 0.0  # when the lanes may be read again after they were all empty
        # A step's writes are sent before the next step and their replies read after it, so
        # Redis works while the engine computes. One connection keeps them in order.
        self._pub_conn: Any = None
        self._in_flight: list[list[Any]] = []
        self._cancels = r.pubsub(ignore_subscribe_messages=True)
        self._next_beat = 0.0
        self._next_reclaim = 0.0
        self._reclaim_from = {lane: "0-0" for lane in self.lanes}  # XAUTOCLAIM cursors
        self._pulls = 0  # entries taken from the lanes, for the fair_every turn
        self._unsent: list[list[Any]] = []  # FINALIZE calls not yet known to be stored
        self.jobs_done = 0
        self.metrics = Metrics(self.id, self.lanes)
        self.metrics_port = 0  # where /metrics is served (main() sets it), 0: nowhere
        self._generated = 0  # tokens generated, for tokens/s between heartbeats
        self._rate_from = (time.monotonic(), 0)
        self._next_stats = 0.0

    # -- lifecycle ------------------------------------------------------------------

    def request_stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.grace_period_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        self.stop_deadline = min(self.stop_deadline, deadline) if self.stopping else deadline
        self.stopping = True

    def run(self) -> None:
        ensure_groups(self.r, self.lanes)
        self._load_scripts()
        self._cancels.subscribe(keys.CANCEL_CHANNEL)
        self._heartbeat()
        log.info("worker %s ready on lanes %s", self.id, self.lanes)
        backoff = 0.1
        failing_since: float | None = None
        crashed = True
        try:
            while True:
                if self.stopping and (
                    not (self.engine.has_unfinished() or self._unsent)
                    or time.monotonic() >= self.stop_deadline
                ):
                    break
                try:
                    self._iterate()
                    backoff, failing_since = 0.1, None
                    continue
                except redis.ResponseError as e:
                    if "NOGROUP" in str(e):
                        log.warning("consumer groups are gone (Redis lost its data?); recreating")
                        ensure_groups(self.r, self.lanes)
                        continue
                    # Not tied to one job (those are answered where they happen): e.g. OOM,
                    # READONLY, NOPERM. Wait for the operator, as for an outage.
                    log.error("redis refused a command (%s); retrying in %.1fs", e, backoff)
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    log.warning(
                        "redis unavailable (%s); %d result(s) kept; retrying in %.1fs",
                        e,
                        len(self._unsent),
                        backoff,
                    )
                self.metrics.redis_errors.inc()
                self._lost_writes()
                now = time.monotonic()
                failing_since = failing_since or now
                budget = self.settings.redis_retry_s
                if budget and now - failing_since > budget:
                    raise SystemExit(
                        f"plurai worker: Redis failed for over {budget:.0f}s "
                        "(PLURAI_REDIS_RETRY_S); exiting, other workers reclaim its jobs"
                    )
                time.sleep(backoff)
                backoff = min(2 * backoff, 5.0)
            crashed = False
        finally:
            if self._unsent:
                try:
                    self._flush_unsent()
                except redis.RedisError:
                    log.exception("%d result(s) not stored; their entries stay pending")
            # After a crash every job it ran is a suspect: its attempt counts.
            self._hand_back(failed="the worker crashed while running it" if crashed else "")
            self._cancels.close()
            if self._pub_conn is not None:
                self.r.connection_pool.release(self._pub_conn)
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.delete(keys.worker(self.id))
                pipe.srem(keys.WORKERS, self.id)
                pipe.execute(raise_on_error=False)
            except redis.RedisError as e:
                log.warning("could not remove this worker's heartbeat (%s); it expires", e)
            log.info("worker %s stopped after %d jobs", self.id, self.jobs_done)

    def _load_scripts(self) -> None:
        for name in self._sha:
            self._sha[name] = self.r.script_load(getattr(scripts, name))

    def _execute(self, pipe: Any) -> list[list[Any]]:
        """Run a pipeline; re-run the calls refused with NOSCRIPT (Redis lost its script
        cache: nothing of theirs ran) after loading the scripts again. Returns the commands
        Redis refused for a passing reason (OOM, READONLY, ...), to send again later; other
        refusals are logged and dropped, since repeating them would stall the worker."""
        commands = [args for args, _options in pipe.command_stack]
        replies = pipe.execute(raise_on_error=False)
        redo = [
            i for i, rep in enumerate(replies) if isinstance(rep, redis.exceptions.NoScriptError)
        ]
        if redo:
            self._load_scripts()
            retry = self.r.pipeline(transaction=False)
            for i in redo:
                retry.execute_command(*commands[i])
            for i, rep in zip(redo, retry.execute(raise_on_error=False), strict=True):
                replies[i] = rep
        again = []
        for args, rep in zip(commands, replies, strict=True):
            if not isinstance(rep, redis.ResponseError):
                continue
            if str(rep).split(" ", 1)[0] in _PASSING:
                again.append(args)
            else:
                log.error("redis refused a %s call (%s); dropped", args[0], rep)
        return again

    def _iterate(self) -> None:
        if self._unsent:  # results kept through a Redis outage
            n = len(self._unsent)
            self._flush_unsent()
            log.info("stored %d kept result(s)", n)
        if not self.stopping:
            self._fill()
        self._poll_cancels()
        self._expire_deadlines()
        if self.engine.has_unfinished():
            self._publish(self.engine.step())
        now = time.monotonic()
        if now >= self._next_stats:
            self._refresh_stats()
            self._next_stats = now + 1.0
        if now >= self._next_beat:
            self._heartbeat()

    def _refresh_stats(self) -> dict[str, Any]:
        """Copy the engine's figures for the metrics endpoint (read by its own thread)."""
        s = self.engine.stats() if self.engine is not None else {}
        self.metrics.engine.stats = s
        return s

    def _heartbeat(self) -> None:
        interval = self.settings.heartbeat_interval_s
        s = self._refresh_stats()
        now = time.monotonic()
        since, count = self._rate_from
        rate = (self._generated - count) / (now - since) if now > since else 0.0
        self._rate_from = (now, self._generated)
        self.metrics.tokens_per_s.set(rate)
        hits = s.get("prefix_hit_blocks", 0) + s.get("kv_host_hits", 0) + s.get("kv_redis_hits", 0)
        lookups = s.get("prefix_lookup_blocks", 0)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(
            keys.worker(self.id),
            mapping={
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "beat_ms": _ms(),
                "model": ",".join(sorted(self.model_names)),
                "running": len(self.running),
                "waiting": s.get("waiting", 0),
                "held": len(self.held),
                "jobs_done": self.jobs_done,
                "state": "stopping" if self.stopping else "serving",
                "kv_blocks_total": s.get("blocks_total", 0),
                "kv_blocks_used": s.get("blocks_used", 0),
                "kv_blocks_free": s.get("blocks_free", 0),
                "kv_blocks_cached": s.get("blocks_cached", 0),
                "generation_tokens": self._generated,
                "tokens_per_s": round(rate, 2),
                "prefix_hit_rate": round(hits / lookups, 4) if lookups else 0.0,
                "metrics_port": self.metrics_port,
            },
        )
        pipe.expire(keys.worker(self.id), max(1, int(3 * interval)))
        pipe.sadd(keys.WORKERS, self.id)
        commands = [args for args, _options in pipe.command_stack]
        replies = pipe.execute(raise_on_error=False)
        bad = {
            k
            for k, rep in zip((keys.worker(self.id), "", keys.WORKERS), replies, strict=True)
            if k and isinstance(rep, redis.ResponseError) and "WRONGTYPE" in str(rep)
        }
        if bad:  # Plurai's own keys, overwritten by something else: take them back
            log.error("heartbeat keys %s held another type; replaced", sorted(bad))
            self.r.delete(*bad)
            pipe = self.r.pipeline(transaction=False)
            for args in commands:
                pipe.execute_command(*args)
            pipe.execute(raise_on_error=False)
        self._renew_leases()
        self._check_running()
        self.metrics.heartbeats.inc()
        self.metrics.last_heartbeat.set(time.time())
        self._next_beat = time.monotonic() + interval

    def _renew_leases(self) -> None:
        """Renew the lease on every entry held here, so only a dead (or stalled) worker's
        entries pass reclaim_idle_ms. An entry this worker no longer owns was reclaimed by
        another worker while this one stalled: its job is dropped here, unwritten."""
        held: dict[str, list[Entry]] = {}
        for entry in [run.entry for run in self.running.values()] + self.held:
            held.setdefault(entry.lane, []).append(entry)
        for lane, entries in held.items():
            lost = set(
                self._renew(
                    keys=[keys.request_stream(lane)],
                    args=[keys.GROUP, self.id, *(e.entry_id for e in entries)],
                )
            )
            for entry in entries:
                if entry.entry_id not in lost:
                    continue
                job_id = entry.req.envelope.job_id
                log.warning(
                    "job's entry is no longer this worker's (reclaimed after a stall?); "
                    "dropped here",
                    extra={"job_id": job_id, "lane": lane},
                )
                if self.running.get(job_id) is not None and self.running[job_id].entry is entry:
                    del self.running[job_id]
                    self.engine.abort(job_id)
                self.held = [e for e in self.held if e is not entry]

    def _check_running(self) -> None:
        """Honour cancels whose message was lost, and end jobs whose record was replaced."""
        ids = list(self.running)
        if not ids:
            return
        flags = self._check_jobs(keys=[keys.job(job_id) for job_id in ids])
        for job_id, flag in zip(ids, flags, strict=True):
            run = self.running.pop(job_id, None) if flag else None
            if run is None:
                continue
            self.engine.abort(job_id)
            if flag == 1:
                self._end_now(run, records.CANCELLED, "abort")
            else:
                self._end_now(run, records.FAILED, "", Code.BAD_RECORD, _BAD_RECORD)

    # -- taking work ----------------------------------------------------------------

    def _fill(self) -> None:
        """Move entries into the engine while it has room for the next one, at most
        takes_per_step of them between two steps: a wave of finished jobs is refilled over
        a few steps instead of stalling the running ones (and a top-lane arrival) for a
        round trip per entry. Entries that end at once (cancelled, expired, refused) do not
        count."""
        added = 0
        limit = self.settings.takes_per_step or max(4, self.engine.config.max_num_seqs // 16)
        while added < limit and not self.stopping:
            if not self.held:
                self.held = self._take(block=not self.engine.has_unfinished() and not self.running)
                if not self.held:
                    return
            entry = self.held[0]
            req = entry.req
            if self.engine.has_unfinished() and not self.engine.can_admit(
                req.prompt_tokens, req.envelope.max_tokens
            ):
                return
            self.held.pop(0)
            added += self._start(entry)

    def _take(self, block: bool) -> list[Entry]:
        """The next valid entries: an entry stranded by a dead worker if there is one, else
        one from the highest lane that has work (see _lane_order). Invalid entries met on
        the way get their error result here and are skipped.

        While the engine is busy and the lanes were all empty, the lanes below the top one
        are read again only after poll_ms, so an empty queue costs one round trip a step
        (the top lane's, which keeps interactive arrivals from waiting for the poll)."""
        while True:
            got = self._reclaim()
            if not got:
                scan_all = block or time.monotonic() >= self._next_scan
                got = self._read(block, None if scan_all else self.lanes[:1])
                if not got:
                    if scan_all:
                        self._next_scan = time.monotonic() + self.settings.poll_ms / 1000
                    return []
            valid = [e for e in (self._check(*g) for g in got) if e is not None]
            if valid:
                return valid
            block = False  # invalid entries were handled: look again without waiting

    def _lane_order(self) -> list[str]:
        """Highest lane first, except every fair_every-th pull, which starts at the next
        lower lane in turn (standard, batch, standard, ... with the default lanes) and wraps
        round to the top: a lower lane gets at least one pull in fair_every * (lanes - 1)
        while it has work, however busy the lanes above it are."""
        n, every = len(self.lanes), self.settings.fair_every
        if n < 2 or every <= 0 or (self._pulls + 1) % every:
            return self.lanes
        k = 1 + ((self._pulls + 1) // every - 1) % (n - 1)
        return self.lanes[k:] + self.lanes[:k]

    def _room_below_top(self) -> bool:
        """Whether entries of lanes below the top one may be taken now: only while the
        engine keeps top_lane_reserve sequence slots free beyond them, so that a top-lane
        arrival is admitted at once rather than after lower-lane work finishes."""
        reserve = self.settings.top_lane_reserve
        if reserve <= 0 or not self.engine.has_unfinished():
            return True
        busy = self.engine.num_running + self.engine.num_waiting
        return busy + reserve < self.engine.config.max_num_seqs

    def _read(
        self, block: bool, lanes: list[str] | None = None
    ) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        got: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        order = lanes or self._lane_order()
        if not self._room_below_top():
            order = self.lanes[:1]
        for lane in order:
            reply = self.r.xreadgroup(
                keys.GROUP, self.id, {keys.request_stream(lane): ">"}, count=1
            )
            got = self._entries(reply)
            if got:
                break
        if not got and block:
            streams = {keys.request_stream(lane): ">" for lane in self.lanes}
            reply = self.r.xreadgroup(
                keys.GROUP, self.id, streams, count=1, block=self.settings.block_ms
            )
            got = sorted(self._entries(reply), key=lambda e: self.lanes.index(e[0]))
        if got:
            self._pulls += 1
        return got

    def _reclaim(self) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        """One entry left idle by a dead worker, highest lane first, claimed to this worker;
        entries delivered more than max_deliveries times are dead-lettered on the way. When a
        whole pass finds none, the next pass waits reclaim_interval_s."""
        if time.monotonic() < self._next_reclaim:
            return []
        for lane in self.lanes:
            stream = keys.request_stream(lane)
            while True:
                cursor, claimed = self.r.xautoclaim(
                    stream,
                    keys.GROUP,
                    self.id,
                    self.settings.reclaim_idle_ms,
                    start_id=self._reclaim_from[lane],
                    count=1,
                )[:2]
                self._reclaim_from[lane] = cursor
                for entry_id, fields in claimed:
                    if entry_id is None or fields is None:
                        self._ack_deleted(stream)
                        continue
                    pending = self.r.xpending_range(stream, keys.GROUP, entry_id, entry_id, 1)
                    times = pending[0]["times_delivered"] if pending else 1
                    # Each delivery before this one ended without a result: a failure.
                    failures = protocol.attempts_of(fields) + times - 1
                    if failures >= self.settings.max_deliveries:
                        self._too_many_deliveries(
                            lane,
                            entry_id,
                            fields,
                            f"delivered {times} times",
                            "its workers kept dying or stalling on it",
                        )
                        continue
                    log.info(
                        "reclaimed entry %s on %s (delivery %d)",
                        entry_id,
                        lane,
                        times,
                        extra={"lane": lane, "delivery": times},
                    )
                    self.metrics.reclaimed.labels(lane).inc()
                    # The count travels with the job if it is handed back after this.
                    return [(lane, entry_id, {**fields, b"attempts": str(failures).encode()})]
                if cursor in (b"0-0", "0-0"):
                    break
        self._next_reclaim = time.monotonic() + self.settings.reclaim_interval_s
        return []

    def _ack_deleted(self, stream: str) -> None:
        """Ack pending entries of this worker that no longer exist (trimmed or deleted by
        hand): Redis 6.2's XAUTOCLAIM hands them over without their ids."""
        for p in self.r.xpending_range(stream, keys.GROUP, "-", "+", 1000, self.id):
            if not self.r.xrange(stream, p["message_id"], p["message_id"]):
                self.r.xack(stream, keys.GROUP, p["message_id"])

    def _too_many_deliveries(
        self, lane: str, entry_id: bytes, fields: dict[bytes, bytes], what: str, why: str
    ) -> None:
        error = f"{what} (PLURAI_MAX_DELIVERIES={self.settings.max_deliveries}); {why}"
        try:
            job_id = protocol.job_id_of(fields)
        except protocol.NoJobId:
            self._dead_letter(lane, entry_id, fields, ValueError(error), "too_many_deliveries")
            return
        log.warning(
            "job dead-lettered: %s; moved to %s",
            error,
            keys.DEAD_LETTER,
            extra={"job_id": job_id, "lane": lane, "code": Code.TOO_MANY_DELIVERIES},
        )
        self.metrics.dead_lettered.labels("too_many_deliveries").inc()
        pipe = self.r.pipeline(transaction=False)
        self._dead_letter_entry(pipe, lane, entry_id, fields, error)
        self._failed(pipe, lane, entry_id, job_id, Code.TOO_MANY_DELIVERIES, error)
        self._keep(self._execute(pipe))

    def _entries(self, reply: Any) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        by_stream = {keys.request_stream(lane).encode(): lane for lane in self.lanes}
        out = []
        for stream, entries in tokens.stream_items(reply):
            for entry_id, fields in entries:
                out.append((by_stream[stream], entry_id, fields or {}))
        return out

    def _check(self, lane: str, entry_id: bytes, fields: dict[bytes, bytes]) -> Entry | None:
        """Validate an entry; None when it was answered with an error result instead."""
        try:
            req = protocol.parse_request(fields, self.limits)
            if req.model is not None and req.model not in self.model_names:
                raise WireError(
                    Code.UNKNOWN_MODEL,
                    f"model {req.model!r} is not served here; this queue serves "
                    f"{sorted(self.model_names)} (or leave 'model' out)",
                )
            params = self._params_cls.from_dict(req.params)
            return Entry(lane, entry_id, fields, req, params)
        except protocol.NoJobId as e:
            self._dead_letter(lane, entry_id, fields, e)
        except WireError as e:
            self._fail_entry(lane, entry_id, protocol.job_id_of(fields), e.code, e.message)
        except Exception as e:  # RequestError from SamplingParams, or anything unexpected
            code = getattr(e, "code", Code.INTERNAL)
            message = getattr(e, "message", f"{type(e).__name__}: {e}")
            if code == Code.INTERNAL:
                log.exception("entry %s on %s", entry_id, lane)
            self._fail_entry(lane, entry_id, protocol.job_id_of(fields), code, message)
        return None

    def _dead_letter(
        self,
        lane: str,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        e: Exception,
        reason: str = "no_job_id",
    ) -> None:
        """Move an entry that carries no usable job id (so no result can be written)."""
        log.warning("entry %s on %s has no job id; moved to %s", entry_id, lane, keys.DEAD_LETTER)
        self.metrics.dead_lettered.labels(reason).inc()
        pipe = self.r.pipeline(transaction=False)
        self._dead_letter_entry(pipe, lane, entry_id, fields, str(e))
        pipe.xack(keys.request_stream(lane), keys.GROUP, entry_id)
        pipe.xdel(keys.request_stream(lane), entry_id)
        self._execute(pipe)  # a dead-letter stream gone wrong must not keep the entry

    def _dead_letter_entry(
        self, pipe: Any, lane: str, entry_id: bytes, fields: dict[bytes, bytes], error: str
    ) -> None:
        pipe.xadd(
            keys.DEAD_LETTER,
            {
                "lane": lane,
                "entry_id": entry_id,
                "error": error,
                "worker": self.id,
                "fields": json.dumps(
                    {
                        k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
                        for k, v in fields.items()
                    }
                )[:65536],
            },
            maxlen=self.settings.dead_letter_maxlen,
            approximate=True,
        )

    def _fail_entry(self, lane: str, entry_id: bytes, job_id: str, code: str, message: str) -> None:
        log.info(
            "job refused: %s: %s",
            code,
            message,
            extra={"job_id": job_id, "lane": lane, "code": code},
        )
        pipe = self.r.pipeline(transaction=False)
        self._failed(pipe, lane, entry_id, job_id, code, message)
        self._keep(self._execute(pipe))

    def _failed(
        self, pipe: Any, lane: str, entry_id: bytes, job_id: str, code: str, message: str
    ) -> None:
        """Queue on `pipe` a terminal error result for a job that never ran."""
        fields = records.final_fields(
            worker=self.id, finished_ms=_ms(), error_code=code, error_message=message
        )
        self._final(pipe, job_id, lane, entry_id, records.FAILED, "", fields)
        self.metrics.jobs_finished.labels(lane, records.FAILED).inc()
        self.metrics.errors.labels(code).inc()

    def _start(self, entry: Entry) -> bool:
        """Begin the entry's job; True when it went into the engine."""
        req, env = entry.req, entry.req.envelope
        job_id = env.job_id
        if job_id in self.running:
            if self.running[job_id].entry.entry_id != entry.entry_id:
                self._ack(entry)  # a second entry for a job already running here
            return False  # else this worker's own entry, reclaimed after a stall: it runs
        try:
            verdict = self._begin(
                keys=[keys.job(job_id), keys.output(job_id)],
                args=[
                    self.id,
                    _ms(),
                    self.settings.result_ttl_s,
                    env.deadline_ms if env.deadline_ms is not None else "",
                    entry.lane,
                    env.priority,
                    json.dumps(req.metadata) if req.metadata is not None else "",
                ],
            )
        except redis.ResponseError as e:
            if str(e).split(" ", 1)[0] in _PASSING:
                self.held.insert(0, entry)  # taken again once Redis takes writes
                raise
            verdict = "badkey"  # refused for this job's keys
        verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
        if verdict == "badkey":
            self._end_now(Running(entry), records.FAILED, "", Code.BAD_RECORD, _BAD_RECORD)
            return False
        if verdict == "done":
            self._ack(entry)
            return False
        if verdict == "cancelled":
            self._end_now(Running(entry), records.CANCELLED, "abort")
            return False
        if verdict == "expired":
            self._end_now(
                Running(entry),
                records.FAILED,
                "",
                Code.DEADLINE_EXCEEDED,
                "the job's deadline passed before a worker could start it",
            )
            return False
        try:
            self.engine.add(
                job_id,
                prompt=req.prompt,
                token_ids=req.token_ids,
                messages=req.messages,
                params=entry.params,
                priority=protocol.engine_priority(self.lanes.index(entry.lane), env.priority),
                cache_salt=req.cache_salt,
                special_tokens=req.special_tokens,
            )
        except RequestError as e:
            log.info(
                "job refused: %s: %s",
                e.code,
                e.message,
                extra={"job_id": job_id, "lane": entry.lane, "code": e.code},
            )
            self._end_now(Running(entry), records.FAILED, "", e.code, e.message)
            return False
        except Exception as e:  # a Plurai bug met on this job: it counts as a failed attempt
            log.exception("engine.add failed", extra={"job_id": job_id})
            self._retry(entry, f"{type(e).__name__}: {str(e)[:300]}")
            return False
        now = time.time()
        self.running[job_id] = Running(entry)
        self.metrics.jobs_started.labels(entry.lane).inc()
        self.metrics.queue_wait.labels(entry.lane).observe(max(0.0, now - _entry_s(entry.entry_id)))
        log.debug("job started", extra={"job_id": job_id, "lane": entry.lane})
        return True

    def _ack(self, entry: Entry) -> None:
        """Ack and delete an entry that needs no result from here (workers delete acked
        entries, so a lane's length minus its pending count is its backlog)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(keys.request_stream(entry.lane), keys.GROUP, entry.entry_id)
        pipe.xdel(keys.request_stream(entry.lane), entry.entry_id)
        pipe.execute()

    # -- results --------------------------------------------------------------------

    def _publish(self, outputs: list[Any]) -> None:
        """One round trip per step: every delta in one script call, then every final result
        (with its XACK), in one pipeline."""
        if not outputs:
            return
        delta_keys: list[str] = []
        delta_args: list[str] = []
        finished: list[tuple[Running, str]] = []
        errors: list[tuple[Entry, str]] = []
        now = time.time()
        generated = 0
        for out in outputs:
            run = self.running.get(out.request_id)
            if run is None:
                continue
            if out.error:  # the engine raised on this job and dropped it
                del self.running[out.request_id]
                errors.append((run.entry, out.error))
                continue
            if out.new_token_ids and not run.token_ids:
                run.first_token_s = now
                ttft = max(0.0, now - _entry_s(run.entry.entry_id))
                self.metrics.ttft.labels(run.entry.lane).observe(ttft)
            generated += len(out.new_token_ids)
            run.token_ids += out.new_token_ids
            run.prompt_tokens = out.num_prompt_tokens
            run.cached_tokens = out.num_cached_tokens
            if out.logprobs:
                run.logprobs += out.logprobs
            if out.text_delta:
                run.text.append(out.text_delta)
            if run.entry.req.stream and (run.resync or out.text_delta or out.new_token_ids):
                if not (out.finished and run.resync):  # else FINALIZE rewrites the text
                    # A resync resets the stream to the whole text so far.
                    mode, text, ids = (
                        ("r", "".join(run.text), run.token_ids)
                        if run.resync
                        else ("d", out.text_delta, out.new_token_ids)
                    )
                    delta_keys += [keys.job(out.request_id), keys.output(out.request_id)]
                    delta_args += [mode, text, _json(ids)]
                    run.resync = False
            if out.finished:
                finished.append((run, out.finish_reason or ""))
        commands: list[list[Any]] = []
        if delta_keys:
            commands.append(
                [
                    "EVALSHA",
                    self._sha["DELTAS"],
                    len(delta_keys),
                    *delta_keys,
                    self.id,
                    self.out_maxlen,
                    *delta_args,
                ]
            )
        self._generated += generated
        self.metrics.generation_tokens.inc(generated)
        for run, reason in finished:
            del self.running[run.entry.req.envelope.job_id]
            self._end(_Collector(commands), run, records.COMPLETED, reason)
        # The engine is done with the finished jobs: from here their results live only in
        # `commands` until Redis has them.
        try:
            self._collect()  # the previous step's replies come first on the connection
            if commands:
                if self._pub_conn is None:
                    self._pub_conn = self.r.connection_pool.get_connection()
                self._pub_conn.send_packed_command([b"".join(fastpipe.pack(c) for c in commands)])
        except BaseException:
            self._keep_finals(commands)
            raise
        if commands:
            self._in_flight = commands
        for entry, error in errors:
            try:
                self._retry(entry, error)
            except redis.RedisError as e:  # its entry stays pending: reclaimed, counted
                log.warning(
                    "could not hand back a failed job (%s); it is reclaimed later",
                    e,
                    extra={"job_id": entry.req.envelope.job_id},
                )

    def _lost_writes(self) -> None:
        """Redis failed: writes sent since the last reply may be lost, and a Redis restarted
        from its append-only file may have lost the last ones it acknowledged. Each running
        job's next stream write, and each kept result, first resets the stream to the whole
        text so far, so its deltas after the last reset always spell the result."""
        for run in self.running.values():
            run.resync = True
        self._unsent = [_resynced(c) for c in self._unsent]  # FINALIZE calls only

    def _keep_finals(self, commands: list[list[Any]]) -> None:
        """Keep the FINALIZE calls of writes that may not have reached Redis, to send again
        (a repeat stores nothing new; a fresh one rewrites the stream's text, see
        _lost_writes). Lost deltas are made good the same way."""
        self._unsent += [_resynced(c) for c in commands if c[1] == self._sha["FINALIZE"]]

    def _keep(self, commands: list[list[Any]]) -> None:
        """Keep the results among commands Redis refused for now, to send again."""
        self._unsent += [c for c in commands if c[1] == self._sha["FINALIZE"]]

    def _flush_unsent(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for command in self._unsent:
            pipe.execute_command(*command)
        again = self._execute(pipe)  # a connection error raises here: all are kept
        self._unsent = []
        self._keep(again)

    def _collect(self) -> None:
        """Read the replies of the writes sent after the previous step."""
        if not self._in_flight:
            return
        commands, self._in_flight = self._in_flight, []
        failed = []
        try:
            for command in commands:
                try:
                    self._pub_conn.read_response()
                except redis.exceptions.NoScriptError:
                    failed.append(command)
        except BaseException:
            self._pub_conn.disconnect()
            self._keep_finals(commands)
            raise
        if failed:  # Redis lost its script cache: these did nothing; run them again
            self._load_scripts()
            for command in failed:
                self.r.execute_command(*command)

    def _end(
        self,
        pipe: Any,
        run: Running,
        state: str,
        finish_reason: str,
        code: str = "",
        message: str = "",
    ) -> None:
        """Queue on `pipe` the job's final result and the ack of its entry."""
        env = run.entry.req.envelope
        lp = run.logprobs if run.entry.params.logprobs is not None else None
        fields = records.final_fields(
            text="".join(run.text),
            token_ids=run.token_ids,
            prompt_tokens=run.prompt_tokens,
            cached_tokens=run.cached_tokens,
            worker=self.id,
            finished_ms=_ms(),
            error_code=code,
            error_message=message,
            logprobs=lp,
        )
        lane = run.entry.lane
        resync = "" if not run.entry.req.stream else "1" if run.resync else "auto"
        self._final(
            pipe, env.job_id, lane, run.entry.entry_id, state, finish_reason, fields, resync
        )
        m, now = self.metrics, time.time()
        m.jobs_finished.labels(lane, state).inc()
        if code:
            m.errors.labels(code).inc()
        m.prompt_tokens.inc(run.prompt_tokens)
        m.cached_tokens.inc(run.cached_tokens)
        m.e2e.labels(lane).observe(max(0.0, now - _entry_s(run.entry.entry_id)))
        n = len(run.token_ids)
        if n > 1:
            m.tpot.labels(lane).observe((now - run.first_token_s) / (n - 1))
        log.debug(
            "job finished",
            extra={
                "job_id": env.job_id,
                "lane": lane,
                "state": state,
                "finish_reason": finish_reason,
                "code": code,
                "output_tokens": n,
            },
        )

    def _end_now(
        self, run: Running, state: str, finish_reason: str, code: str = "", message: str = ""
    ) -> None:
        commands: list[list[Any]] = []
        self._end(_Collector(commands), run, state, finish_reason, code, message)
        self._unsent += commands  # kept until stored, whatever happens to the connection
        self._collect()  # this job's deltas go before its end entry
        self._flush_unsent()

    def _final(
        self,
        pipe: Any,
        job_id: str,
        lane: str,
        entry_id: bytes,
        state: str,
        finish_reason: str,
        fields: list[Any],
        resync: str = "auto",
    ) -> None:
        """Queue on `pipe` a FINALIZE call; `resync`: "1" rewrite the stream's text before
        its end entry, "auto" when the record shows deltas may be missing, "" never."""
        k = [keys.job(job_id), keys.output(job_id), keys.DEAD_LETTER, keys.request_stream(lane)]
        s = self.settings
        pipe.evalsha(
            self._sha["FINALIZE"],
            len(k),
            *k,
            keys.GROUP,
            entry_id,
            s.result_ttl_s,
            keys.done_channel(job_id),
            state,
            finish_reason,
            s.output_ttl_s,
            self.out_maxlen,
            {"1": "1", "auto": ""}.get(resync, "n"),
            s.dead_letter_maxlen,
            lane,
            job_id,
            *fields,
        )
        self.jobs_done += 1

    def _poll_cancels(self) -> None:
        for _ in range(1000):  # a flood of messages waits for the next turn, not the engine
            msg = self._cancels.get_message(timeout=0)
            if msg is None:
                return
            data = msg.get("data")
            if not isinstance(data, bytes) or len(data) > 128:
                continue
            run = self.running.pop(data.decode("ascii", "replace"), None)
            if run is not None:  # unknown or malformed ids match nothing
                self.engine.abort(run.entry.req.envelope.job_id)
                self._end_now(run, records.CANCELLED, "abort")

    def _expire_deadlines(self) -> None:
        now = None
        for job_id, run in list(self.running.items()):
            deadline = run.entry.req.envelope.deadline_ms
            if deadline is None:
                continue
            now = now or _ms()
            if now > deadline:
                del self.running[job_id]
                self.engine.abort(job_id)
                self._end_now(
                    run,
                    records.FAILED,
                    "abort",
                    Code.DEADLINE_EXCEEDED,
                    "the job's deadline passed while it ran; the text so far is kept",
                )

    def _retry(self, entry: Entry, error: str) -> None:
        """A job whose processing raised: hand it back with one more failed attempt, or at
        max_deliveries attempts dead-letter it with too_many_deliveries."""
        attempts = entry.req.envelope.attempts + 1
        job_id = entry.req.envelope.job_id
        if attempts >= self.settings.max_deliveries:
            self._too_many_deliveries(
                entry.lane,
                entry.entry_id,
                entry.fields,
                f"its processing failed {attempts} times",
                f"last error: {error}",
            )
            return
        log.warning(
            "job failed on this worker (%s); handed back, attempt %d of %d",
            error,
            attempts,
            self.settings.max_deliveries,
            extra={"job_id": job_id, "lane": entry.lane},
        )
        self._collect()  # its deltas go before its stream's next start
        self._requeue_entry(entry, attempts)

    def _requeue_entry(self, entry: Entry, attempts: int) -> None:
        fields = {k: v for k, v in entry.fields.items() if k != b"attempts"}
        if attempts:
            fields[b"attempts"] = str(attempts).encode()
        flat = [x for kv in fields.items() for x in kv]
        self._requeue(
            keys=[keys.request_stream(entry.lane), keys.job(entry.req.envelope.job_id)],
            args=[keys.GROUP, entry.entry_id, self.settings.stream_maxlen, *flat],
        )

    def _hand_back(self, failed: str = "") -> None:
        """Re-add every job not finished here to the tail of its lane, ack the old entry.
        `failed`: why this worker is going down abnormally; each job's attempt counts."""
        try:
            self._collect()
        except redis.RedisError:
            log.warning("the last step's writes are unconfirmed")
        entries = [run.entry for run in self.running.values()] + self.held
        for run_id in list(self.running):
            self.engine.abort(run_id)
        for entry in entries:
            try:
                if failed and entry.req.envelope.attempts + 1 >= self.settings.max_deliveries:
                    self._retry(entry, failed)
                else:
                    self._requeue_entry(entry, entry.req.envelope.attempts + bool(failed))
            except redis.RedisError:
                log.exception(
                    "could not hand back a job; it stays pending",
                    extra={"job_id": entry.req.envelope.job_id},
                )
        if entries:
            log.info("handed %d unfinished job(s) back to the queue", len(entries))
        self.running.clear()
        self.held = []


def _json(ids: list[int]) -> str:
    return json.dumps(ids, separators=(",", ":"))


def _resynced(command: list[Any]) -> list[Any]:
    """The same FINALIZE call, rewriting the stream's text before its end entry; see
    Worker._lost_writes."""
    out = list(command)
    if out[3 + 4 + 8] != "n":  # ARGV[9], resync; "n": a job without deltas
        out[3 + 4 + 8] = "1"
    return out


class _Collector:
    """Stands in for a pipeline: keeps evalsha calls as plain command lists."""

    def __init__(self, commands: list[list[Any]]) -> None:
        self.commands = commands

    def evalsha(self, *args: Any) -> None:
        self.commands.append(["EVALSHA", *args])


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
