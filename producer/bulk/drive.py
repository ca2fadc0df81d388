"""One pass of a batch, by its status: validate (validate.py), drive the requests, or
finalize.

Every action can be repeated after a crash with the same effect: requests are submitted
with idempotency keys `bulk:<batch>:<custom_id hash>:<level>:<chunk>`
(keys.bulk_idempotency; a repeat returns the same job), each line's result is written once
(store.record_line), and the progress of a line (store.LineProgress) is saved after its
requests are submitted, so a pass that died in between submits the same requests again and
gets the same jobs back. The settings come from the caller (the Celery task): the bulk
settings as `bs`, the rest as the client's (its model directory, the wire's limits).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import PurePath
from typing import Any

import redis

from plurai.broker_config import keys, protocol
from plurai.broker_config.settings import BulkSettings
from plurai.broker_config.text import text
from plurai.producer.bulk import finalize, plan, store
from plurai.producer.bulk.store import BatchRecord, LineProgress
from plurai.producer.bulk.validate import configured_model, validate
from plurai.producer.client import Client
from plurai.producer.errors import QueueFull
from plurai.results import records
from plurai.results.records import BadRecord, JobRecord

log = logging.getLogger(__name__)

LANE = "batch"


@functools.lru_cache(maxsize=4)
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def give_up(r: redis.Redis, batch_id: str, message: str, bs: BulkSettings) -> str:
    """End a batch whose steps keep failing: failed (`driver_failed`, with why), its files
    holding the lines recorded so far where they can still be written."""
    store.fail_reason(r, batch_id, ("driver_failed", message[:500]))
    r.hset(
        keys.batch(batch_id), mapping={"end_status": store.FAILED, "finished_ms": store.now_ms()}
    )
    try:
        rec = store.get(r, batch_id)
        finalize.finalize(r, batch_id, rec.total if rec else 0, bs.ttl_s)
    except Exception:  # what failed the steps may fail this too: the lines stay unwritten
        log.warning("batch %s: its files could not be written", batch_id, exc_info=True)
    running = (store.VALIDATING, store.IN_PROGRESS, store.CANCELLING, store.FINALIZING)
    return store.move(r, batch_id, store.FAILED, *running) or store.FAILED


def step(client: Client, batch_id: str, bs: BulkSettings) -> str:
    """Do the work the batch's status calls for (at most bs.pass_s of driving); returns the
    status after it."""
    r = client.redis
    rec = store.get(r, batch_id)
    if rec is None:
        return store.FAILED
    status = rec.status
    if status in store.TERMINAL:
        return status
    if status == store.VALIDATING or (status == store.CANCELLING and rec.valid is None):
        return validate(r, rec, bs, client.settings)  # cancelled lines get error lines too
    if status in (store.IN_PROGRESS, store.CANCELLING):
        return Driver(client, rec, bs).run()
    if status != store.FINALIZING:  # damaged (or by hand): a step would follow step forever
        problem = ("invalid_status", f"the batch's status {status!r} is unknown")
        store.fail_reason(r, batch_id, problem)
        r.hset(keys.batch(batch_id), "end_status", store.FAILED)
        store.move(r, batch_id, store.FINALIZING, status)
        rec = store.get(r, batch_id) or rec
    return finish(r, rec, bs)


def finish(r: redis.Redis, rec: BatchRecord, bs: BulkSettings) -> str:
    batch_id = rec.id
    finalize.finalize(r, batch_id, rec.total, bs.ttl_s)
    end = rec.end_status or store.COMPLETED
    if end not in store.TERMINAL:  # damaged: a status that is not an end would never end
        end = store.FAILED
    r.hset(keys.batch(batch_id), mapping={"finished_ms": store.now_ms()})
    return store.move(r, batch_id, end, store.FINALIZING) or end


def _progress(saved: Any) -> LineProgress | None:
    """A line's saved progress (Driver._submit); None if there is none or it is damaged
    (the line is started again: the same idempotency keys give the same jobs)."""
    try:
        return LineProgress.from_json(saved) if saved is not None else None
    except BadRecord:
        return None


def _request(saved: Any) -> dict[str, Any] | None:
    """A line's validated request (validate); None if it is gone or damaged."""
    try:
        req = json.loads(saved)
    except (TypeError, ValueError):
        return None
    if not isinstance(req, dict) or not isinstance(req.get("custom_id"), str):
        return None
    if req.get("kind") == "doc":
        return req if isinstance(req.get("text"), str) else None
    ok = req.get("kind") in ("chat", "completion") and isinstance(req.get("options"), dict)
    return req if ok else None


class Driver:
    """Submits the lines' requests (at most bs.window lines at a time), gathers finished
    jobs, reduces chunk outputs level by level, and records each line's result (a
    document's final output only once plan.Task.check passes it)."""

    def __init__(self, client: Client, rec: BatchRecord, bs: BulkSettings):
        batch_id = rec.id
        self.client, self.r, self.id, self.bs = client, client.redis, batch_id, bs
        self.end = time.monotonic() + bs.pass_s  # when this pass hands over to the next
        self.total = rec.total
        self.next = rec.next or 0
        self.model_dir, self.problem = configured_model(rec, client.settings)
        self.task = (
            plan.Task.from_dict(json.loads(rec.task)) if rec.task and self.problem is None else None
        )
        self.model_name = PurePath(self.model_dir or rec.model_dir or "").name
        self.max_model_len = rec.max_model_len or 0
        self.tenant = rec.tenant or None  # a batch made through the gateway with a key
        active = sorted(int(text(i)) for i in self.r.smembers(keys.batch_active(batch_id)))
        self.state: dict[int, LineProgress] = {}
        self.finished: set[str] = set()
        self.pubsub: Any = None
        self.reqs: dict[int, dict[str, Any]] = {}
        self.unstarted: list[int] = []  # active lines with no jobs (queued by a later pass)
        if active:
            st = self.r.hmget(keys.batch_state(batch_id), active)
            rq = self.r.hmget(keys.batch_requests(batch_id), active)
            for i, s, q in zip(active, st, rq, strict=True):
                if not self._load(i, q):
                    continue
                saved = _progress(s)
                if saved is not None:
                    self.state[i] = saved
                elif self.problem is None:  # died between marking it active and saving its
                    self._start([i])  # jobs (or they are damaged): the same keys, same jobs
                else:
                    self.unstarted.append(i)

    def run(self) -> str:
        end = self.end
        self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        try:
            if self.problem is not None:  # PLURAI_MODEL_DIR changed since it was validated
                store.fail_reason(self.r, self.id, self.problem)
                return self._stop(store.FAILED, *self.problem)
            self._watch([j for st in self.state.values() for j in st.jobs])
            next_look = 0.0
            while True:
                now = time.monotonic()
                if now >= next_look:  # the status, a heartbeat, and any missed message
                    rec = store.get(self.r, self.id)
                    status = rec.status if rec is not None else ""
                    if status == store.CANCELLING and rec is not None:
                        return self._cancel(rec)
                    if status != store.IN_PROGRESS:
                        return status
                    pipe = self.r.pipeline(transaction=False)
                    pipe.hset(keys.batch(self.id), "beat_ms", store.now_ms())
                    store.expire_pipe(pipe, self.id, self.bs.running_ttl_s)  # renewed
                    pipe.execute()
                    self._look(self._in_flight())
                    next_look = now + self.bs.look_s
                busy = self._fill() + self._gather()
                if not self.state and not self.unstarted and self.next >= self.total:
                    return store.move(self.r, self.id, store.FINALIZING, store.IN_PROGRESS) or ""
                if time.monotonic() >= end:
                    return status
                if not busy:
                    self._listen(self.bs.poll_s)
        finally:
            self.pubsub.close()

    def _cancel(self, rec: BatchRecord) -> str:
        if rec.stop_reason == "expired":
            msg = "the batch did not finish within its completion window"
            return self._stop(store.EXPIRED, "batch_expired", msg)
        return self._stop(store.CANCELLED, "batch_cancelled", "the batch was cancelled")

    # -- knowing which jobs finished -------------------------------------------------
    # Each job publishes its final state on its done channel: the driver subscribes to the
    # channels of the jobs in flight and reads the records of finished jobs only. Pub/sub is
    # not durable, so the finals are also looked up after subscribing and every look_s.

    def _in_flight(self) -> list[str]:
        return [j for st in self.state.values() for j in st.jobs if j not in self.finished]

    def _watch(self, job_ids: list[str]) -> None:
        for start in range(0, len(job_ids), 1000):
            self.pubsub.subscribe(*[keys.done_channel(j) for j in job_ids[start : start + 1000]])
        self._look(job_ids)

    def _look(self, job_ids: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for j in job_ids:
            pipe.hmget(keys.job(j), ["final", "state"])
        for j, (final, state) in zip(job_ids, pipe.execute(), strict=True):
            if final is not None or state is None:  # final, or the record is gone
                self.finished.add(j)

    def _listen(self, timeout: float) -> None:
        if not self.pubsub.subscribed:
            time.sleep(timeout)
            return
        msg = self.pubsub.get_message(timeout=timeout)
        prefix = len(keys.done_channel(""))
        while msg is not None:
            self.finished.add(text(msg["channel"])[prefix:])
            msg = self.pubsub.get_message(timeout=0)

    # -- starting lines ------------------------------------------------------------

    def _fill(self) -> int:
        # a few lines at a time, so that the first requests are queued while later lines
        # are still being split
        room = min(self.bs.window - len(self.state), 32)
        if room <= 0 or self.next >= self.total:
            return 0
        idx = list(range(self.next, min(self.total, self.next + room)))
        reqs = self.r.hmget(keys.batch_requests(self.id), idx)
        done = self.r.hmget(keys.batch_lines(self.id), idx)
        start = []
        for i, q, d in zip(idx, reqs, done, strict=True):
            # else invalid (already an error line), done, or started already
            if q is not None and d is None and i not in self.state and self._load(i, q):
                start.append(i)
        self.next = idx[-1] + 1
        self._start(start)
        self.r.hset(keys.batch(self.id), "next", self.next)
        return len(idx)

    def _start(self, lines: list[int]) -> None:
        plans: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        for i in lines:
            req = self.reqs[i]
            if req["kind"] != "doc":
                plans[i] = (0, [req["options"]])
                continue
            try:
                prompts = self._split(req["text"], 0)
            except ValueError as e:
                self._error(i, "context_too_small", str(e), (0, 0))
                continue
            plans[i] = (0, [{"prompt": p, **self._sampling()} for p in prompts])
        self._submit(plans, {i: (0, 0) for i in plans})

    def _split(self, text: str, level: int) -> list[str]:
        assert self.task is not None
        return plan.split(self.task, text, level, tokenizer(self.model_dir), self.max_model_len)

    def _sampling(self) -> dict[str, Any]:
        assert self.task is not None
        return self.task.sampling()

    def _submit(
        self, plans: dict[int, tuple[int, list[dict[str, Any]]]], usage: dict[int, tuple[int, int]]
    ) -> None:
        """Submit each line's requests of its level, then save its progress."""
        if not plans:
            return
        order: list[tuple[int, dict[str, Any]]] = []
        for i, (level, opts) in plans.items():
            for c, o in enumerate(opts):
                key = keys.bulk_idempotency(self.id, self.reqs[i]["custom_id"], level, c)
                o = {**o, "lane": LANE, "stream": False, "idempotency_key": key}
                if self.tenant:  # the tenant's job and cache prefixes, as through the gateway
                    o["cache_salt"] = protocol.tenant_salt(self.tenant, o.get("cache_salt"))
                    o["tenant"] = self.tenant
                order.append((i, o))
        while True:
            try:
                jobs = self.client.submit_many([o for _, o in order])
                break
            except QueueFull as e:  # the lane is full: wait, then submit again (same keys)
                if time.monotonic() + e.retry_after >= self.end:
                    self._defer(plans)  # within this pass, which must end (cancel, heartbeat)
                    return
                time.sleep(e.retry_after)
        by_line: dict[int, list[str]] = {}
        for (i, _), job in zip(order, jobs, strict=True):
            by_line.setdefault(i, []).append(job.id)
        pipe = self.r.pipeline(transaction=True)
        for i, (level, _) in plans.items():
            st = LineProgress(level, by_line[i], *usage[i])
            self.state[i] = st
            pipe.hset(keys.batch_state(self.id), str(i), st.to_json())
            pipe.sadd(keys.batch_active(self.id), i)
        pipe.expire(keys.batch_state(self.id), self.bs.running_ttl_s)
        pipe.expire(keys.batch_active(self.id), self.bs.running_ttl_s)
        pipe.execute()
        if self.pubsub is not None:
            self._watch([job.id for job in jobs])

    def _defer(self, plans: dict[int, tuple[int, list[dict[str, Any]]]]) -> None:
        """Leave these lines' requests to the next pass: a new line is marked active with
        no progress saved (the next pass starts it, as after a driver that died there); a
        line further on keeps the progress of its last level, whose jobs the next pass
        finds final and advances again. The idempotency keys make each submit count once."""
        new = [i for i in plans if i not in self.state]
        if new:
            self.r.sadd(keys.batch_active(self.id), *new)
            self.r.expire(keys.batch_active(self.id), self.bs.running_ttl_s)
            self.unstarted += new  # not ended before they are: a stop gives them error lines

    # -- gathering -----------------------------------------------------------------

    def _gather(self) -> int:
        """Advance every line whose current jobs are all final; returns how many moved."""
        ready = [i for i, st in self.state.items() if all(j in self.finished for j in st.jobs)]
        if not ready:
            return 0
        done = [j for i in ready for j in self.state[i].jobs]
        recs = records.get_many(self.r, done)
        self.finished.difference_update(done)
        if self.pubsub.subscribed:
            self.pubsub.unsubscribe(*[keys.done_channel(j) for j in done])
        at = 0
        nxt: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        usage: dict[int, tuple[int, int]] = {}
        for i in ready:
            n = len(self.state[i].jobs)
            got, at = recs[at : at + n], at + n
            step = self._advance(i, got)
            if step is not None:
                nxt[i], usage[i] = step
        self._submit(nxt, usage)
        return len(ready)

    def _advance(
        self, i: int, recs: list[JobRecord]
    ) -> tuple[tuple[int, list[dict[str, Any]]], tuple[int, int]] | None:
        st = self.state[i]
        use = (
            st.prompt_tokens + sum(x.prompt_tokens or 0 for x in recs),
            st.output_tokens + sum(x.output_tokens or 0 for x in recs),
        )
        bad = next((x for x in recs if x.state != records.COMPLETED), None)
        if bad is not None:
            if bad.state == records.UNKNOWN:
                code, msg = "job_expired", f"job {bad.id} has no record (expired)"
            else:
                code = bad.error_code or bad.state
                msg = bad.error_message or f"job {bad.id} was {bad.state}"
            self._error(i, code, msg, use)
            return None
        if len(recs) == 1:
            last = recs[0]
            output, reason = last.text or "", last.finish_reason or "stop"
            if self.reqs[i]["kind"] == "doc":
                assert self.task is not None
                problem = self.task.check(output, reason)
                if problem is not None:
                    self._error(i, plan.INVALID_OUTPUT, problem, use)
                    return None
            line = finalize.ok_line(
                self.id,
                i,
                {**self.reqs[i], "model": self.reqs[i].get("model") or self.model_name},
                choices=last.choices,
                usage=use,
                request_id=last.id,
                created_s=(last.finished_ms or store.now_ms()) // 1000,
            )
            self._record(i, line, True, use)
            return None
        level = st.level + 1
        if level > plan.MAX_LEVELS:
            self._error(i, "reduce_failed", f"no single result after {plan.MAX_LEVELS} levels", use)
            return None
        try:  # the reduce template may leave less room than the map's
            prompts = self._split(plan.combine([x.text or "" for x in recs]), level)
        except ValueError as e:
            self._error(i, "context_too_small", str(e), use)
            return None
        return (level, [{"prompt": p, **self._sampling()} for p in prompts]), use

    def _load(self, i: int, saved: Any) -> bool:
        """Keep line i's saved request; False, and its error line, if it is gone or damaged
        (rather than a crash of every pass)."""
        req = _request(saved)
        if req is not None:
            self.reqs[i] = req
            return True
        message = f"line {i + 1}: its validated request is missing or damaged in Redis"
        line = finalize.error_line(self.id, i, None, "damaged_record", message)
        self._record(i, line, False, (0, 0))
        return False

    def _error(self, i: int, code: str, message: str, usage: tuple[int, int]) -> None:
        line = finalize.error_line(self.id, i, self.reqs[i]["custom_id"], code, message)
        self._record(i, line, False, usage)

    def _record(self, i: int, line: str, ok: bool, usage: tuple[int, int]) -> None:
        store.record_line(self.r, self.id, i, line, ok, usage, self.bs.running_ttl_s)
        pipe = self.r.pipeline(transaction=True)
        pipe.srem(keys.batch_active(self.id), i)
        pipe.hdel(keys.batch_state(self.id), str(i))
        pipe.execute()
        self.state.pop(i, None)

    # -- cancel and expiry ---------------------------------------------------------

    def _stop(self, end_status: str, code: str, message: str) -> str:
        """Keep lines already finished, cancel the jobs in flight, and give every other
        valid line an error line (on cancel, expiry, or a model that is not this one's)."""
        self._gather()
        for st in self.state.values():
            for j in st.jobs:
                self.client.job(j).cancel()
        for i in list(self.state):
            self._error(i, code, message, self.state[i].usage)
        for i in self.unstarted:
            self._error(i, code, message, (0, 0))
        rest = list(range(self.next, self.total))
        for start in range(0, len(rest), 5000):
            part = rest[start : start + 5000]
            reqs = self.r.hmget(keys.batch_requests(self.id), part)
            for i, q in zip(part, reqs, strict=True):
                if q is not None and self._load(i, q):
                    self._error(i, code, message, (0, 0))
        self.r.hset(keys.batch(self.id), mapping={"end_status": end_status, "next": self.total})
        moved = store.move(self.r, self.id, store.FINALIZING, store.CANCELLING, store.IN_PROGRESS)
        return moved or ""
