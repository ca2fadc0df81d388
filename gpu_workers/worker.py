"""The long-lived worker loop: take entries while the backend can admit them (intake.py),
step, send each step's deltas and results in one packed write (writer.py); bad input ends
only its job. On SIGTERM it stops taking work, lets running jobs run on for the grace
period (none by default) and hands the rest back with their progress, from which other
workers resume them (results/progress.py). The life of a job, failures counted per job, leases and
reclaiming: docs/architecture.md ("The worker") and docs/operations.md.

One file, though long: taking work, stepping and ending jobs share the loop's state (the
running jobs, the entries held, the pace) and each reads what the others left; intake,
the job's own state and the writes are already modules of their own.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis

from broker_config import keys, memory, protocol, tracing
from broker_config.groups import ensure_groups
from broker_config.protocol import Code
from broker_config.settings import Settings
from broker_config.text import text
from gpu_workers.backend import Backend, RequestError, StepOutput
from gpu_workers.heartbeat import Heartbeat
from gpu_workers.intake import BAD_RECORD, Entry, Intake
from gpu_workers.job import Running, Stream
from gpu_workers.metrics import Metrics
from gpu_workers.pace import Pace
from gpu_workers.spans import Spans
from gpu_workers.writer import Outage, Writer, now_ms
from results import jobs, progress, records

log = logging.getLogger("plurai.worker")


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    def __init__(
        self,
        engine: Backend,
        r: redis.Redis,
        settings: Settings,
        worker_id: str | None = None,
        model_names: set[str] | None = None,
    ) -> None:
        self.engine = engine
        self.r = r
        self.settings = settings
        self.id = worker_id or settings.worker_id or new_worker_id()
        self.model = settings.model  # the queue it serves (keys.request_stream)
        self.model_names = (model_names or set()) | {self.model}
        self.model_id = Path(settings.model_dir).name if settings.model_dir else ""  # /v1/models
        self.lanes = list(settings.lanes)
        self.running: dict[str, Running] = {}
        # taken, not yet in the backend: at most takes_per_step, or one per lane after a wait
        self.held: list[Entry] = []
        self.stopping = False
        self.stop_deadline = 0.0
        self.metrics = Metrics(self.id, self.lanes)
        self.metrics_port = 0  # where /metrics is served (serve.py sets it), 0: nowhere
        self.writer = Writer(r, settings, self.id)
        self.writer.progress_head = progress.header(engine.model_fingerprint)
        self.spans = Spans(self.id, self.model, self.writer)  # while tracing.ON
        self.stream = Stream(
            tokens=settings.stream_flush_tokens, seconds=settings.stream_flush_ms / 1000
        )
        self.pace = Pace(settings.top_lane_slowdown, target_s=settings.top_lane_tpot_ms / 1000)
        self._lower_open = True  # the pace gate's state, logged when it changes
        self._slow = False  # whether the top lane is over its target, logged when it changes
        self._next_waited = 0.0  # when to look for a top-lane entry waiting too long next
        self._waited_takes = 0  # top-lane entries taken for their wait since a fair turn
        self._fair: Entry | None = None  # the lower-lane entry a fair turn took in a hold
        self._prompt_size = 0.0  # mean prompt tokens of the entries taken (moving)
        self._top_size = 0.0  # mean prompt plus max_tokens of the top lane's (moving)
        self._output_size = 0.0  # mean max_tokens times n of the entries taken (moving)
        self._turn_s = 0.0  # mean length of a turn that stepped the engine (moving)
        self._turn_start, self._stepped = 0.0, False
        limits = settings.limits(engine.max_model_len - 1)
        self.intake = Intake(
            r, settings, self.id, self.metrics, self.writer, limits, self.model_names
        )
        self.intake.load = lambda: len(self.running) + len(self.held)
        self.beat = Heartbeat(r, settings, self.id, self.model_names)
        self.cancels = r.pubsub(ignore_subscribe_messages=True)
        self.jobs_done = 0
        self.lanes_done: dict[str, list[int]] = {}  # lane -> [jobs ended, their tokens]
        self.jobs_resumed = 0  # begun from another run's progress
        self.jobs_handed_over = 0  # preempted here and handed over with their progress
        self._next_beat = 0.0
        self._generated = 0  # tokens generated, for tokens/s between heartbeats
        self._rate_from = (time.monotonic(), 0)
        self._next_stats = 0.0

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Consumer groups, scripts and the cancel channel: what a turn needs."""
        ensure_groups(self.r, self.intake.streams())
        jobs.load(self.r, "BEGIN", "DELTAS", "FINALIZE")  # pipelined, not sent by jobs.run
        self.cancels.subscribe(keys.CANCEL_CHANNEL)
        self.intake.listen(self.engine.wake)

    def request_stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.grace_period_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        self.stop_deadline = min(self.stop_deadline, deadline) if self.stopping else deadline
        self.stopping = True

    def run(self) -> None:
        try:
            self.start()
        except BaseException:
            self._forget()  # the `starting` heartbeat: gone from `plurai status` now
            raise
        self._heartbeat()
        log.info(
            "worker %s ready: model %r, lanes %s, %d shard(s)",
            self.id,
            self.model,
            self.lanes,
            self.settings.shards,
        )
        outage = Outage(self.settings.redis_retry_s)
        crashed = True
        try:
            while not self.stopping or (
                (self.engine.has_unfinished() or self.writer.unsent)
                and time.monotonic() < self.stop_deadline
            ):
                try:
                    self.iterate()
                    outage.over()
                    continue
                except redis.ResponseError as e:
                    if "NOGROUP" in str(e):
                        log.warning("consumer groups are gone (Redis lost its data?); recreating")
                        ensure_groups(self.r, self.intake.streams())
                        continue
                    if memory.is_oom(e):
                        self._redis_full(e, outage)
                        continue
                    failure: redis.RedisError = e
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    failure = e
                self.metrics.redis_errors.inc()
                self._lost_writes()
                # once back: renew this worker's leases at once, and reclaim nothing until
                # the others have had the time to renew theirs (Intake.hold_reclaims)
                self._next_beat = 0.0
                self.intake.hold_reclaims(self.settings.reclaim_idle_ms / 1000)
                outage.wait(failure, len(self.writer.unsent))
            crashed = False
        finally:
            self._shut(crashed)

    def _shut(self, crashed: bool) -> None:
        try:
            self.writer.flush()
        except redis.RedisError:
            log.exception(
                "%d result(s) not stored; their entries stay pending", len(self.writer.unsent)
            )
        else:
            if self.writer.unsent:  # refused for now (a full Redis): rerun elsewhere
                log.error(
                    "%d result(s) not stored (Redis refused them); their entries stay "
                    "pending and are run again",
                    len(self.writer.unsent),
                )
        # After a crash every job it ran is a suspect: its attempt counts.
        self._hand_back(failed="the worker crashed while running it" if crashed else "")
        self.cancels.close()
        self.intake.close()
        self.writer.close()
        self._forget()
        log.info("worker %s stopped after %d jobs", self.id, self.jobs_done)

    def _forget(self) -> None:
        """Remove this worker's heartbeat and its id in the workers set."""
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.delete(keys.worker(self.id))
            pipe.srem(keys.WORKERS, self.id)
            for shard in range(self.settings.shards):
                pipe.hdel(keys.loads(self.model, shard), self.id)
            pipe.execute(raise_on_error=False)
        except redis.RedisError as e:
            log.warning("could not remove this worker's heartbeat (%s); it expires", e)

    def iterate(self) -> None:
        """One turn: kept results, new work, cancels and deadlines, one step, heartbeat."""
        start = time.monotonic()
        if self._stepped:  # the turn's length, from one read to the next: other workers
            # leave a new entry to this one for about that long when it runs fewer jobs
            self._turn_s = moving(self._turn_s, start - self._turn_start)
            self.intake.turn_ms = round(1000 * self._turn_s)
        self._turn_start, self._stepped = start, False
        self.writer.flush()  # results kept through a Redis outage
        idle = not self.engine.has_unfinished()
        if idle and self.writer.unsent and self.writer.refusal is not None:
            raise self.writer.refusal  # nothing to step: back off before sending them again
        if idle:
            self.writer.settle()  # the last step's acks, before waiting for work
        if not self.stopping:
            try:
                self._fill()
            except redis.ResponseError as e:
                # a full Redis refuses to start new jobs, not to step the running ones
                if not (memory.is_oom(e) and self.engine.has_unfinished()):
                    raise
        self._poll_cancels()
        self._expire_deadlines()
        if self.engine.has_unfinished():
            outputs = self.engine.step()
            self._stepped = True
            if not self.engine.has_unfinished():
                # drained: the metrics get the engine's last figures before its jobs' results
                self._refresh_stats()
                self._next_stats = time.monotonic() + 1.0
            self._publish(outputs)
            self._hand_over(self.engine.preempted())
        now = time.monotonic()
        if now >= self._next_stats:
            self._refresh_stats()
            self._next_stats = now + 1.0
        if now >= self._next_beat:
            self._heartbeat()

    # -- taking work ----------------------------------------------------------------

    def _fill(self) -> None:
        """Move entries into the backend while it has room for the next one, at most
        takes_per_step of them between two steps: a wave of finished jobs is refilled over
        a few steps instead of stalling the running ones (and a top-lane arrival). The
        entries of a turn cost two round trips together: one read (Intake.take) and one
        pipeline of BEGINs (`_start`). Entries that end at once (cancelled, expired,
        refused) do not count. Only as many are asked for as the prompt backlog bound
        leaves room for (`_backlog_room`), so that a worker does not hold entries it cannot
        start while another worker could; the top lane has no such bound unless an
        objective is set, and then waits only behind the top lane's own prompts
        (`_top_backlog`), since the engine runs it ahead of lower lanes'."""
        added = 0
        limit = self._takes()
        top = self.lanes[0]
        while added < limit and not self.stopping:
            slow = self._top_lane_slow()
            if slow and not self._lower_running():
                # new work waits in the queue while the top lane's tokens are slow, a
                # top-lane entry no longer than top_lane_wait_ms
                if not self.held or self.held[0].lane != top:
                    self.held[:0] = self._waited()
                if not self.held or self.held[0].lane != top and self.held[0] is not self._fair:
                    return
            else:
                room = self._backlog_room(self.engine.prompt_backlog, False)
                top_room = self._backlog_room(self._top_backlog(), True)
                n = min(limit - added, max(room, top_room))
                if n <= 0:
                    return
                if not self.held:
                    idle = not self.engine.has_unfinished() and not self.running
                    below_top = self._room_below_top() if room > 0 and not slow else 0
                    # a read that may reach the lower lanes asks for no more entries than
                    # they may start (their backlog bound, the top lane's reserve); the
                    # top lane's further entries come in the turn's next reads
                    # (none while room is negative: the prompts held exceed the bound)
                    lower = max(0, min(n, room, below_top))
                    self.held = self.intake.take(idle, lower > 0, count=lower or n)
                    if not self.held:
                        return
                elif self.held[0].lane != top and (slow or not self._startable(self.held[0], room)):
                    # the lower-lane entries held must wait: a top-lane arrival need not
                    arrived = self.intake.take(False, False, count=n)
                    if not arrived:
                        return
                    self.held[:0] = arrived
            batch: list[tuple[Entry, Exception | None]] = []
            while self.held and added + len(batch) < limit:
                entry, req = self.held[0], self.held[0].req
                if self._duplicate(entry, batch):
                    self.held.pop(0)
                    continue
                if entry.lane != top and (
                    slow
                    and entry is not self._fair
                    or not self._room_below_top()
                    or self.settings.top_lane_slowdown
                    and any(e.lane == top for e, _ in batch)  # its prompt not computed
                ):
                    break  # held until the top lane's reserve and pace allow it
                if self.engine.has_unfinished() and not self._fits(req, entry.lane == top):
                    break
                self._prompt_size = moving(self._prompt_size, req.prompt_tokens)
                self._output_size = moving(self._output_size, req.envelope.max_tokens * req.n)
                if entry.lane == top:
                    whole = req.prompt_tokens + req.envelope.max_tokens
                    self._top_size = moving(self._top_size, whole)
                batch.append((self.held.pop(0), self._add(entry)))
            if not batch:
                if self.held:  # the next one does not fit now
                    return
                continue  # every one was a second entry of a running job
            added += self._start(batch)

    def _lower_running(self) -> bool:
        """Whether jobs of lanes below the top one run here. While they do, a top lane over
        its target is slowed by them too: lower lanes wait (they take nothing new), the top
        lane's arrivals do not (holding them would put batch work ahead of interactive)."""
        top = self.lanes[0]
        return any(r.entry.lane != top for r in self.running.values())

    def _top_lane_slow(self) -> bool:
        """Whether the top lane's tokens come slower here than its target (top_lane_tpot_ms)
        while top-lane jobs make tokens: then this worker starts nothing new of the lower
        lanes, nor of the top lane unless lower-lane jobs run here (`_lower_running`)."""
        top = self.lanes[0]
        slow = self.pace.over_target() and any(
            r.entry.lane == top and r.num_tokens for r in self.running.values()
        )
        if slow != self._slow:
            self._slow = slow
            log.info(
                "new work %s: the top lane's time per token %.0f ms, target %.0f ms",
                "held" if slow else "taken again",
                1000 * self.pace.tpot_s,
                1000 * self.pace.target_s,
            )
        return slow

    def _waited(self) -> list[Entry]:
        """The top-lane entry that has waited top_lane_wait_ms in the queue, if one has
        (asked at most once per poll_ms): taken even while this worker is over the target,
        since every worker may be. Such takes say that holding new work does not bring the
        top lane under its target (the fleet is behind on the top lane alone), so the
        lower lanes get their fair turn in the hold too: after fair_every - 1 of them, the
        next take is the oldest lower-lane entry, started over the target."""
        wait, now = self.settings.top_lane_wait_ms, time.monotonic()
        if wait <= 0 or now < self._next_waited:
            return []
        self._next_waited = now + self.settings.poll_ms / 1000
        every = self.settings.fair_every
        if 0 < every <= self._waited_takes + 1 and len(self.lanes) > 1:
            got = self.intake.take_waited(0, self.lanes[1:])
            if got:
                self._waited_takes, self._fair = 0, got[0]
                return got
        got = self.intake.take_waited(round(wait))
        self._waited_takes += len(got)
        return got

    def _startable(self, entry: Entry, room: int) -> bool:
        """Whether a held lower-lane entry may start now (`room`: _backlog_room's)."""
        if room <= 0 or not self._room_below_top():
            return False
        return not self.engine.has_unfinished() or self._fits(entry.req, False)

    def _fits(self, req: protocol.Request, top: bool) -> bool:
        """Whether the engine has room for the request now, and its prompt fits in the
        backlog bound beside the prompts not computed yet (a prompt alone always does):
        all of them, or for a top-lane request the top lane's only. With preemption on, a
        top-lane request needs room beside the top lane's jobs only. A request's n choices
        count as one request of n times its max_tokens."""
        bound = self._bound(top)
        backlog = self._top_backlog() if top else self.engine.prompt_backlog
        if bound is not None and backlog and backlog + req.prompt_tokens > bound:
            return False  # left in the queue, for whichever worker frees up first
        return self._admits(req.prompt_tokens, req.envelope.max_tokens * req.n, top)

    def _admits(self, prompt_tokens: int, output_tokens: int, top: bool) -> bool:
        """Whether the engine has room (KV, a sequence slot) for a request of this size."""
        # a top-lane request may take what lower lanes' jobs hold: the engine preempts them
        preempt = top and self.settings.preempt
        priority = protocol.engine_priority(0, protocol.MAX_PRIORITY) if preempt else None
        spare = 0 if top else self._top_kv_reserve()
        return self.engine.can_admit(prompt_tokens, output_tokens, priority, spare)

    def _top_kv_reserve(self) -> int:
        """Tokens of KV that lower-lane work leaves free for the top lane: room for
        top_lane_reserve of its requests of the recent mean size, while it has run here
        within the pace window. Without it a batch flood fills the cache and a top-lane
        arrival waits for batch jobs to finish: vLLM preempts only to let running
        requests grow, never to admit a waiting one, whatever its priority."""
        if not self._top_size or time.monotonic() - self.pace.top_seen_s > self.pace.window_s:
            return 0
        return self.settings.top_lane_reserve * round(self._top_size)

    def _top_backlog(self) -> int:
        """Prompt tokens of this worker's top-lane jobs that have no token yet."""
        top = self.lanes[0]
        return sum(
            r.entry.req.prompt_tokens
            for r in self.running.values()
            if r.entry.lane == top and not r.num_tokens
        )

    def _bound(self, top: bool) -> int | None:
        """The prompt tokens not computed yet that a new request may join (None: no bound:
        the engine's KV room and sequence slots alone decide, as they would behind a
        router, and its scheduler chunks the prompts over its steps). With no objective set
        that is every lane's case, but for the lanes below the top one while the top lane
        runs here (within the pace window): then prefill_backlog_tokens (or the engine's
        step budget where lower, or without it), which keeps the steps short that the top
        lane's tokens wait for. With an objective (top_lane_tpot_ms), every lane keeps to
        the step budget (the top lane counting its own prompts only), so that the rest of a
        burst waits in Redis for whichever worker frees up first."""
        step, lower = self.engine.step_tokens, self.settings.prefill_backlog_tokens
        objective = bool(self.settings.top_lane_tpot_ms)
        if top:
            return step if objective else None
        if time.monotonic() - self.pace.top_seen_s <= self.pace.window_s:
            return min(step, lower) if lower else step
        return step if objective else None

    def _takes(self) -> int:
        """Most entries moved into the engine between two steps."""
        return self.settings.takes_per_step or max(4, self.engine.max_num_seqs // 16)

    def _backlog_room(self, backlog: int, top: bool) -> int:
        """How many entries to ask for now: as many prompts of the recent mean size as fit
        in the bound (`_bound`) beside `backlog` prompt tokens not computed yet; at least
        one while none is pending (and one at first, with no size to go by), none while the
        next would probably not fit. With no bound, as many as the engine has room for (KV,
        sequence slots), up to a turn's takes: an entry read that cannot start would wait
        here while another worker might start it."""
        bound, size = self._bound(top), round(self._prompt_size)
        if bound is None:
            if not self.engine.has_unfinished() or not size:
                return self._takes()
            output, n = round(self._output_size), 0
            while n < self._takes() and self._admits((n + 1) * size, (n + 1) * output, top):
                n += 1
            return n
        room = (bound - backlog) // size if size else 1
        return room if backlog else max(1, room)

    def _room_below_top(self) -> int:
        """How many entries of lanes below the top one may be taken now: only while the
        backend keeps top_lane_reserve sequence slots free beyond them, so that a top-lane
        arrival is admitted at once rather than after lower-lane work finishes, and none
        while they would slow the top lane's tokens (gpu_workers/pace.py) or while a
        top-lane prompt is not computed yet: the engine would compute a lower-lane prompt
        in the same step, and the top-lane job's first token would wait for both."""
        reserve = self.settings.top_lane_reserve
        if not self.engine.has_unfinished():
            return self.engine.max_num_seqs
        if self.settings.top_lane_slowdown and self._top_backlog():
            return 0
        open_ = self.pace.lower_lanes_open(time.monotonic())
        if open_ != self._lower_open:
            self._lower_open = open_
            log.info(
                "lower lanes %s: the top lane's time per token %.0f ms, unloaded %.0f ms",
                "open" if open_ else "held",
                1000 * self.pace.tpot_s,
                1000 * self.pace.unloaded_s,
            )
        if not open_:
            return 0  # lower-lane work would slow the top lane's tokens further
        if reserve <= 0:
            return self.engine.max_num_seqs
        busy = self.engine.num_running + self.engine.num_waiting
        return max(0, self.engine.max_num_seqs - reserve - busy)

    def _duplicate(self, entry: Entry, batch: list[tuple[Entry, Exception | None]]) -> bool:
        """Whether the entry's job already runs here (or is in `batch`): a second entry of
        the job is acked; this worker's own entry, reclaimed after a stall, runs on."""
        run = self.running.get(entry.job_id)
        if run is None and all(e.job_id != entry.job_id for e, _ in batch):
            return False
        if run is None or run.entry.entry_id != entry.entry_id:
            self.intake.ack(entry)
        return True

    def _add(self, entry: Entry) -> Exception | None:
        """Put the entry's job into the backend ahead of its BEGIN, so that the backend's
        room for the next entry counts it (`_start` takes it out again unless BEGIN says
        run). Returns what the backend raised on it, if anything."""
        try:
            self._engine_add(entry)
        except RequestError as e:
            return e
        except Exception as e:  # a Plurai bug met on this job
            log.exception("engine.add failed", extra={"job_id": entry.job_id})
            return e
        return None

    def _engine_add(self, entry: Entry, output_ids: list[list[int]] | None = None) -> list[str]:
        req, env = entry.req, entry.req.envelope
        texts = self.engine.add(
            entry.job_id,
            prompt=req.prompt,
            token_ids=req.token_ids,
            messages=req.messages,
            params=req.params,
            priority=protocol.engine_priority(self.lanes.index(entry.lane), env.priority),
            cache_salt=req.cache_salt,
            special_tokens=req.special_tokens,
            output_ids=output_ids,
        )
        entry.added_s = time.time()
        return texts

    def _start(self, batch: list[tuple[Entry, Exception | None]]) -> int:
        """BEGIN the jobs of `batch` (entry, what the backend raised on it), in one round
        trip; returns how many run. A job BEGIN does not let run leaves the backend and is
        answered (`_not_run`), one the backend refused fails with its code, one it raised
        on otherwise is handed back as a failed attempt; entries Redis refused for now
        (OOM, ...) are held, taken again once it takes writes."""
        try:
            verdicts = self.intake.begin([entry for entry, _ in batch])
        except BaseException:
            for entry, error in batch:
                if error is None:
                    self.engine.abort(entry.job_id)
            self.held[:0] = [entry for entry, _ in batch]  # begun again later
            raise
        refused: redis.ResponseError | None = None
        again: list[Entry] = []
        answers: list[tuple[Entry, Exception | None, str]] = []
        started = 0
        now = time.time() if tracing.ON else 0.0
        for (entry, error), (verdict, saved) in zip(batch, verdicts, strict=True):
            if error is None and verdict != "run":
                self.engine.abort(entry.job_id)
            if tracing.ON and not isinstance(verdict, redis.ResponseError):
                self.spans.taken(entry, now)
            if isinstance(verdict, redis.ResponseError):
                refused = refused or verdict
                again.append(entry)
            elif verdict != "run" or error is not None:
                answers.append((entry, error, verdict))
            else:
                run = Running(entry)
                if saved is not None:
                    error = self._resume(run, saved)
                    if error is not None:  # not even as a new run now: a failed attempt
                        answers.append((entry, error, verdict))
                        continue
                self.running[entry.job_id] = run
                if tracing.ON:
                    self.spans.started(run, now)
                if entry.lane == self.lanes[0]:
                    self.pace.seen(time.monotonic())
                self.metrics.jobs_started.labels(entry.lane).inc()
                wait = max(0.0, time.time() - entry.entered_s)
                self.metrics.queue_wait.labels(entry.lane).observe(wait)
                log.debug("job started", extra={"job_id": entry.job_id, "lane": entry.lane})
                started += 1
        self.held[:0] = again
        for entry, error, verdict in answers:
            if verdict != "run":
                self._not_run(entry, verdict)
            elif isinstance(error, RequestError):
                log.info(
                    "job refused: %s: %s",
                    error.code,
                    error.message,
                    extra={"job_id": entry.job_id, "lane": entry.lane, "code": error.code},
                )
                self._end_now(Running(entry), records.FAILED, "", error.code, error.message)
            else:  # a Plurai bug met on this job: it counts as a failed attempt
                self._retry(entry, f"{type(error).__name__}: {str(error)[:300]}")
        if refused is not None:
            raise refused
        return started

    def _resume(self, run: Running, blob: bytes) -> Exception | None:
        """Continue the job from the output its previous run made (BEGIN found its
        progress): the backend computes prompt and output so far and goes on from there,
        and the stream goes on without a reset. Where the progress cannot be trusted or
        the backend cannot continue the job exactly, the job starts over: its next write
        resets the stream and rewrites the progress. Returns what the backend raised
        adding it as a new run, if anything (it was added once already)."""
        entry = run.entry
        req = entry.req
        asked = req.params.get("logprobs") is not None
        head, limit = self.writer.progress_head, req.envelope.max_tokens
        saved = progress.parse(blob, head, limit, asked, req.n)
        why = "its progress is damaged"
        if saved is not None and any(c.token_ids for c in saved):
            self.engine.abort(entry.job_id)
            try:
                made = self._engine_add(entry, [c.token_ids for c in saved])
            except RequestError as e:
                why = e.message
            except Exception as e:  # a Plurai bug met on this job: start it over
                log.exception("resuming a job failed", extra={"job_id": entry.job_id})
                why = f"{type(e).__name__}: {str(e)[:300]}"
            else:
                run.resume(saved, made)
                self.jobs_resumed += 1
                self.metrics.jobs_resumed.labels(entry.lane).inc()
                self.metrics.resumed_tokens.inc(run.resumed)
                log.info(
                    "job resumed after %d output tokens",
                    run.resumed,
                    extra={"job_id": entry.job_id, "lane": entry.lane},
                )
                return None
            error = self._add(entry)
            if error is not None:
                return error
        elif saved is not None:
            return None  # no token yet: a run like any other
        log.info("job starts over: %s", why, extra={"job_id": entry.job_id, "lane": entry.lane})
        run.resync = True
        return None

    def _not_run(self, entry: Entry, verdict: str) -> None:
        """BEGIN's answer for a job that must not run."""
        if verdict == "done":  # a result exists: only the entry is left
            self.intake.ack(entry)
        elif verdict == "cancelled":
            self._end_now(Running(entry), records.CANCELLED, "abort")
        elif verdict == "expired":
            message = "the job's deadline passed before a worker could start it"
            self._end_now(Running(entry), records.FAILED, "", Code.DEADLINE_EXCEEDED, message)
        else:  # "badkey"
            self._end_now(Running(entry), records.FAILED, "", Code.BAD_RECORD, BAD_RECORD)

    # -- results --------------------------------------------------------------------

    def _publish(self, outputs: list[StepOutput]) -> None:
        """One round trip per step: every delta in one script call, then every final result
        (with its XACK), in one packed write."""
        if not outputs:
            return
        items: list[jobs.Delta] = []
        finished: list[Running] = []
        errors: list[tuple[Entry, str]] = []
        now, mono, generated = time.time(), time.monotonic(), 0
        # a top-lane job's tokens of this step, for the pace: a backend may give several
        # outputs of one job at once (the vLLM backend collects every engine step since its
        # last call), which are one interval, not several of zero length
        top_made: dict[str, tuple[Running, int]] = {}
        for out in outputs:
            run = self.running.get(out.request_id)
            if run is None:
                continue
            if out.error:  # the backend raised on this job and dropped it
                del self.running[out.request_id]
                self.engine.abort(out.request_id)  # its other choices too
                if run.span is not None:
                    self.spans.stopped(run, "failed", Code.INTERNAL)
                errors.append((run.entry, out.error))
                continue
            if out.new_token_ids and not run.first_token_s:
                run.first_token_s = now
                if run.span is not None:
                    self.spans.first_token(run, out, now)
                if not run.resumed:  # a resumed job's first token came in an earlier run
                    ttft = max(0.0, now - run.entry.entered_s)
                    self.metrics.ttft.labels(run.entry.lane).observe(ttft)
            if out.new_token_ids and run.entry.lane == self.lanes[0]:
                made = top_made.get(out.request_id, (run, 0))[1]
                top_made[out.request_id] = (run, made + len(out.new_token_ids))
            generated += len(out.new_token_ids)
            items += run.absorb(out, mono, self.stream)
            if out.finished and run.done:  # its last choice ended
                finished.append(run)
        for run, made in top_made.values():
            if run.last_token_s:
                self.pace.tokens(mono - run.last_token_s, made, mono)
            run.last_token_s = mono
        for run in self.running.values():  # tokens held too long by jobs that did not step
            if run.held_since is not None and mono - run.held_since >= self.stream.seconds:
                items += run.unsent()
        self._generated += generated
        self.metrics.generation_tokens.inc(generated)
        calls = self.writer.deltas(items) if items else []
        for run in finished:
            del self.running[run.entry.job_id]
            reason = run.choices[0].finish_reason or ""  # the record's is its first choice's
            calls.append(self._end(run, records.COMPLETED, reason))
        # The backend is done with the finished jobs: from here their results live only in
        # `calls` until Redis has them (the writer keeps them through failures).
        self.writer.send(calls)
        for entry, error in errors:
            try:
                self._retry(entry, error)
            except redis.RedisError as e:  # its entry stays pending: reclaimed, counted
                log.warning(
                    "could not hand back a failed job (%s); it is reclaimed later",
                    e,
                    extra={"job_id": entry.job_id},
                )

    def _end(
        self, run: Running, state: str, finish_reason: str, code: str = "", message: str = ""
    ) -> jobs.Call:
        """The FINALIZE call of the job's result (and the ack of its entry); counts it."""
        entry = run.entry
        fields = run.result_fields(self.id, now_ms(), finish_reason, code, message)
        if tracing.ON:
            self.spans.ended(run, state, finish_reason, code)
        call = self.writer.final(
            entry.job_id,
            entry.lane,
            (entry.stream, entry.entry_id),
            state,
            finish_reason,
            fields,
            run.resync_mode,
        )
        self.jobs_done += 1
        m, now, lane = self.metrics, time.time(), entry.lane
        m.jobs_finished.labels(lane, state).inc()
        if code:
            m.errors.labels(code).inc()
        m.prompt_tokens.inc(run.prompt_tokens)
        m.cached_tokens.inc(run.cached_tokens)
        m.e2e.labels(lane).observe(max(0.0, now - entry.entered_s))
        made = run.num_tokens - run.resumed  # the tokens of this run
        done = self.lanes_done.setdefault(lane, [0, 0])
        done[0] += 1
        done[1] += made
        each = made / len(run.choices)  # a choice's: they make their tokens side by side
        if each > 1 and run.first_token_s:
            m.tpot.labels(lane).observe((now - run.first_token_s) / (each - 1))
        log.debug(
            "job finished",
            extra={"job_id": entry.job_id, "lane": lane, "state": state, "code": code},
        )
        return call

    def _end_now(
        self, run: Running, state: str, finish_reason: str, code: str = "", message: str = ""
    ) -> None:
        """End a job outside a step: its result goes out now (after its deltas, the held
        ones included)."""
        deltas = run.unsent() if run.entry.req.stream else []
        held = self.writer.deltas(deltas) if deltas else []
        self.writer.store(held + [self._end(run, state, finish_reason, code, message)])

    def _redis_full(self, e: redis.ResponseError, outage: Outage) -> None:
        """Redis is at its maxmemory: it refused this turn's writes, and made none of them
        (a script's first write refused ends it). The running jobs step on; their streams
        are rewritten from the whole text at their next write that Redis takes, and the
        results of finished ones are kept and sent again every turn, their entries left
        pending until stored. Nothing new starts (BEGIN is refused)."""
        self.metrics.redis_errors.inc()
        self._lost_writes()
        if time.monotonic() >= self._next_beat:  # a turn cut short still renews the leases
            try:
                self._heartbeat()
            except redis.RedisError as beat_failed:
                log.warning("heartbeat failed while Redis is full: %s", beat_failed)
        outage.full(e, len(self.writer.unsent), idle=not self.engine.has_unfinished())

    def _lost_writes(self) -> None:
        """Redis failed: writes sent since the last reply may be lost, and a Redis restarted
        from its append-only file may have lost the last ones it acknowledged. Each running
        job's next stream write, and each kept result, first resets the stream to the whole
        text so far, so its deltas after the last reset always spell the result."""
        for run in self.running.values():
            run.resync = True
        self.writer.lost_writes()

    def _poll_cancels(self) -> None:
        for _ in range(1000):  # a flood of messages waits for the next turn, not the backend
            msg = self.cancels.get_message(timeout=0)
            if msg is None:
                return
            data = msg.get("data")
            if not isinstance(data, bytes) or len(data) > 128:
                continue
            run = self.running.pop(text(data), None)
            if run is not None:  # unknown or malformed ids match nothing
                self.engine.abort(run.entry.job_id)
                self._end_now(run, records.CANCELLED, "abort")

    def _expire_deadlines(self) -> None:
        now = None
        for job_id, run in list(self.running.items()):
            deadline = run.entry.req.envelope.deadline_ms
            if deadline is None:
                continue
            now = now or now_ms()
            if now > deadline:
                del self.running[job_id]
                self.engine.abort(job_id)
                message = "the job's deadline passed while it ran; the text so far is kept"
                self._end_now(run, records.FAILED, "abort", Code.DEADLINE_EXCEEDED, message)

    # -- handing back ---------------------------------------------------------------

    def _retry(self, entry: Entry, error: str) -> None:
        self.writer.collect()  # its deltas go before its stream's next start
        start = time.time()
        self.intake.retry(entry, error)
        if tracing.ON:
            self.spans.handed_back(entry, "failed", start, Code.INTERNAL)

    def _hand_over(self, job_ids: list[str]) -> None:
        """Give up the jobs the engine preempted (to run a better lane's): their tokens so
        far written first (stream and progress), then each entry keeps its place in its
        lane for the first worker with room, this one too, which resumes it; no attempt
        counted (Intake.hand_over). Where Redis refuses the writes, they stay here."""
        runs = [self.running[j] for j in job_ids if j in self.running]
        if not runs:
            return
        self.writer.collect()  # the step's writes first: the progress goes after them
        if self._checkpoint(runs):
            for run in runs:  # not written: they go on here and rewrite their streams
                run.resync = True
            return
        for run in runs:
            self.engine.abort(run.entry.job_id)
            del self.running[run.entry.job_id]
            start = time.time()
            if run.span is not None:
                self.spans.stopped(run, "preempted")
            # should Redis fail here, the entry stays pending here, unrenewed: reclaimed later
            handed = self.intake.hand_over(run.entry)
            if tracing.ON:
                self.spans.handed_back(run.entry, "preempted", start)
            if handed:
                self.jobs_handed_over += 1
                self.metrics.jobs_handed_over.labels(run.entry.lane).inc()
            log.info(
                "job preempted: %s with %d token(s)",
                "handed over" if handed else "dropped (done, or another worker's now)",
                run.num_tokens,
                extra={"job_id": run.entry.job_id, "lane": run.entry.lane},
            )

    def _checkpoint(self, runs: Iterable[Running]) -> list[Any]:
        """Write the jobs' tokens not written yet (stream and progress), so that whichever
        worker takes a job next resumes it where it stopped here. Returns what Redis
        refused for now (Writer.execute)."""
        items = [d for run in runs for d in run.unsent()]
        return self.writer.execute(self.writer.deltas(items)) if items else []

    def _hand_back(self, failed: str = "") -> None:
        """Give every job not finished here back to the queue, its tokens written first:
        each keeps its place in its lane (Intake.hand_back). `failed`: why this worker is
        going down abnormally; each job's attempt counts and it goes to the lane's tail."""
        try:
            self.writer.collect()
            self._checkpoint(self.running.values())
        except redis.RedisError:
            log.warning("the last step's writes are unconfirmed")
        for job_id in list(self.running):
            self.engine.abort(job_id)
        reason, start = "crashed" if failed else "drained", time.time()
        if tracing.ON:
            for run in self.running.values():
                self.spans.stopped(run, reason)
        self.intake.hand_back([run.entry for run in self.running.values()] + self.held, failed)
        if tracing.ON:
            for run in self.running.values():
                self.spans.handed_back(run.entry, reason, start)
        self.running.clear()
        self.held = []

    # -- heartbeat ------------------------------------------------------------------

    def _refresh_stats(self) -> dict[str, Any]:
        """Copy the backend's figures for the metrics endpoint (read by its own thread)."""
        s = self.engine.stats()
        self.metrics.engine.stats = s
        return s

    def _heartbeat(self) -> None:
        """Publish this worker's figures, renew its leases, and end the jobs whose entry is
        another worker's now or whose record asks for a cancel or was replaced."""
        s = self._refresh_stats()
        now = time.monotonic()
        since, count = self._rate_from
        rate = (self._generated - count) / (now - since) if now > since else 0.0
        self._rate_from = (now, self._generated)
        self.metrics.tokens_per_s.set(rate)
        self.beat.publish(
            s,
            running=len(self.running),
            held=len(self.held),
            jobs_done=self.jobs_done,
            lanes_done=json.dumps(self.lanes_done, separators=(",", ":")),
            jobs_resumed=self.jobs_resumed,
            jobs_handed_over=self.jobs_handed_over,
            state="stopping" if self.stopping else "serving",
            generation_tokens=self._generated,
            tokens_per_s=rate,
            metrics_port=self.metrics_port,
            model_id=self.model_id,
            max_model_len=self.engine.max_model_len,
        )
        for entry in self.beat.renew([run.entry for run in self.running.values()] + self.held):
            run = self.running.get(entry.job_id)
            if run is not None and run.entry is entry:  # dropped unwritten: not ours now
                del self.running[entry.job_id]
                self.engine.abort(entry.job_id)
                if run.span is not None:
                    self.spans.stopped(run, "lost")
            self.held = [e for e in self.held if e is not entry]
        for stream, ids in self.writer.kept_entries().items():  # results Redis refused
            jobs.run(self.r, jobs.renew(stream=stream, consumer=self.id, entry_ids=ids))
        for job_id, flag in self.beat.check(list(self.running)):
            run = self.running.pop(job_id)
            self.engine.abort(job_id)
            if flag == 1:
                self._end_now(run, records.CANCELLED, "abort")
            else:
                self._end_now(run, records.FAILED, "", Code.BAD_RECORD, BAD_RECORD)
        self.metrics.heartbeats.inc()
        self.metrics.last_heartbeat.set(time.time())
        self._next_beat = time.monotonic() + self.settings.heartbeat_interval_s


def moving(mean: float, value: float) -> float:
    """A moving mean over about the last 8 values; the first value is its own mean."""
    return mean + (value - mean) / 8 if mean else value
