"""One pass of a batch, by its status: validate, drive the requests, or finalize.

Every action can be repeated after a crash with the same effect: requests are submitted
with idempotency keys `bulk:<batch>:<custom_id hash>:<level>:<chunk>`
(keys.bulk_idempotency; a repeat returns the same job), each line's result is written once (store.record_line), and the progress of a
line (its level and jobs) is saved after its requests are submitted, so a pass that died
in between submits the same requests again and gets the same jobs back.

Documents are split with the tokenizer of the model directory this process is configured
with (PLURAI_MODEL_DIR), never of a path read from the batch record, which any client can
write: the record's `model_dir` only says which model the client meant, and a batch whose
model is not the configured one (another folder name) fails with `model_mismatch`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import PurePath
from typing import Any

import redis
from redis.client import NEVER_DECODE

from broker_config import keys, protocol
from broker_config.settings import BulkSettings, Settings
from broker_config.text import text
from producer.bulk import finalize, plan, store
from producer.bulk.inputs import LineError, parse_line
from producer.client import Client
from producer.errors import QueueFull
from results import records
from results.records import JobRecord

log = logging.getLogger(__name__)

LANE = "batch"


@functools.lru_cache(maxsize=4)
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def configured_model(meta: dict[str, str]) -> tuple[str, tuple[str, str] | None]:
    """The model directory to split the batch's documents with (PLURAI_MODEL_DIR; "" for a
    batch without a task, which needs none), and the error code and message that fail the
    batch when it cannot run with it, a task that is not valid included (None: it can)."""
    if not meta.get("task"):
        return "", None
    try:  # a record written before a rule it breaks (or by hand) fails the batch cleanly
        plan.Task.from_dict(json.loads(meta["task"]))
    except (ValueError, TypeError, AttributeError) as e:
        return "", ("invalid_task", f"the batch's task is not valid: {e}"[:500])
    mine = Settings().model_dir or ""
    if not mine:
        return "", (
            "model_unavailable",
            "this batch driver has no model directory (set PLURAI_MODEL_DIR): "
            "documents are split with its tokenizer",
        )
    wanted = PurePath(meta.get("model_dir", "")).name
    if wanted != PurePath(mine).name:
        return mine, (
            "model_mismatch",
            f"the batch was submitted for the model {wanted!r}; this batch driver serves "
            f"{PurePath(mine).name!r} (PLURAI_MODEL_DIR)",
        )
    return mine, None


def fail_reason(r: redis.Redis, batch_id: str, problem: tuple[str, str]) -> None:
    """Record why the whole batch failed (manage.info shows it as `errors`)."""
    r.hset(keys.batch(batch_id), mapping={"error_code": problem[0], "error": problem[1]})


def give_up(r: redis.Redis, batch_id: str, message: str, bs: BulkSettings) -> str:
    """End a batch whose steps keep failing: failed (`driver_failed`, with why), its files
    holding the lines recorded so far where they can still be written."""
    fail_reason(r, batch_id, ("driver_failed", message[:500]))
    r.hset(
        keys.batch(batch_id), mapping={"end_status": store.FAILED, "finished_ms": store.now_ms()}
    )
    try:
        finalize.finalize(r, batch_id, store.count(store.get(r, batch_id), "total"), bs.ttl_s)
    except Exception:  # what failed the steps may fail this too: the lines stay unwritten
        log.warning("batch %s: its files could not be written", batch_id, exc_info=True)
    running = (store.VALIDATING, store.IN_PROGRESS, store.CANCELLING, store.FINALIZING)
    return store.move(r, batch_id, store.FAILED, *running) or store.FAILED


def step(client: Client, batch_id: str, bs: BulkSettings) -> str:
    """Do the work the batch's status calls for (at most bs.pass_s of driving); returns the
    status after it."""
    r = client.redis
    meta = store.get(r, batch_id)
    status = meta.get("status")
    if status is None or status in store.TERMINAL:
        return status or store.FAILED
    if status == store.VALIDATING or (status == store.CANCELLING and "valid" not in meta):
        return validate(r, batch_id, meta, bs)  # cancelled lines get error lines too
    if status in (store.IN_PROGRESS, store.CANCELLING):
        return Driver(client, batch_id, meta, bs).run()
    if status != store.FINALIZING:  # damaged (or by hand): a step would follow step forever
        fail_reason(r, batch_id, ("invalid_status", f"the batch's status {status!r} is unknown"))
        r.hset(keys.batch(batch_id), "end_status", store.FAILED)
        store.move(r, batch_id, store.FINALIZING, status)
        meta = store.get(r, batch_id)
    return finish(r, batch_id, meta, bs)


def validate(r: redis.Redis, batch_id: str, meta: dict[str, str], bs: BulkSettings) -> str:
    if "valid" in meta:  # parsed (its input is gone), then the driver died before moving on
        return validated(r, batch_id, meta["valid"] != "0")
    documents = bool(meta.get("task"))
    settings = Settings()  # a body runs as it would through the gateway
    _, problem = configured_model(meta)
    if problem is not None:
        fail_reason(r, batch_id, problem)
    # read as bytes, whatever the connection decodes: bytes that are not UTF-8 become
    # U+FFFD, so such a line is an error line, never a crash of the whole batch
    lines = r.execute_command("LRANGE", keys.batch_input(batch_id), 0, -1, **{NEVER_DECODE: []})
    raw = [text(x) for x in lines]
    seen: dict[str, int] = {}
    valid = 0
    pipe = r.pipeline(transaction=True)
    for i, line in enumerate(raw):
        try:
            try:
                req = parse_line(
                    line,
                    i + 1,
                    documents=documents,
                    max_line_bytes=bs.max_line_bytes,
                    max_tokens_limit=settings.max_tokens_limit,
                    default_max_tokens=settings.gateway_default_max_tokens,
                )
            except LineError as e:
                if e.custom_id is not None:
                    seen.setdefault(e.custom_id, i + 1)
                raise
            first = seen.setdefault(req["custom_id"], i + 1)
            if first != i + 1:
                raise LineError(
                    "duplicate_custom_id",
                    f"line {i + 1}: custom_id {req['custom_id']!r} already used on line {first}",
                    req["custom_id"],
                )
            if problem is not None:
                raise LineError(*problem, req["custom_id"])
        except LineError as e:
            line_out = finalize.error_line(batch_id, i, e.custom_id, e.code, e.message)
            store.record_line(r, batch_id, i, line_out, False, (0, 0), bs.running_ttl_s)
            continue
        pipe.hset(keys.batch_requests(batch_id), str(i), json.dumps(req))
        valid += 1
    pipe.hset(
        keys.batch(batch_id),
        mapping={"total": len(raw), "valid": valid, "started_ms": store.now_ms()},
    )
    pipe.delete(keys.batch_input(batch_id))  # parsed; the requests hash replaces it
    store.expire_pipe(pipe, batch_id, bs.running_ttl_s)
    pipe.execute()
    return validated(r, batch_id, valid > 0)


def validated(r: redis.Redis, batch_id: str, any_valid: bool) -> str:
    """Move a parsed batch on: to in_progress, or (no valid line) to finalizing as failed."""
    if not any_valid:
        r.hset(keys.batch(batch_id), mapping={"end_status": store.FAILED})
        return store.move(r, batch_id, store.FINALIZING, store.VALIDATING) or store.FAILED
    return store.move(r, batch_id, store.IN_PROGRESS, store.VALIDATING) or store.FAILED


def finish(r: redis.Redis, batch_id: str, meta: dict[str, str], bs: BulkSettings) -> str:
    total = int(meta.get("total", 0) or 0)
    finalize.finalize(r, batch_id, total, bs.ttl_s)
    end = meta.get("end_status") or store.COMPLETED
    if end not in store.TERMINAL:  # damaged: a status that is not an end would never end
        end = store.FAILED
    r.hset(keys.batch(batch_id), mapping={"finished_ms": store.now_ms()})
    return store.move(r, batch_id, end, store.FINALIZING) or end


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


def _progress(saved: Any) -> dict[str, Any] | None:
    """A line's saved progress (Driver._submit); None if there is none or it is damaged."""
    try:
        st = json.loads(saved) if saved is not None else None
    except ValueError:
        return None
    ok = (
        isinstance(st, dict)
        and isinstance(st.get("level"), int)
        and isinstance(st.get("jobs"), list)
        and all(isinstance(j, str) for j in st["jobs"])
        and all(isinstance(st.get(k), int) for k in ("p", "o"))
    )
    return st if ok else None


class Driver:
    """Submits the lines' requests (at most bs.window lines at a time), gathers finished
    jobs, reduces chunk outputs level by level, and records each line's result (a
    document's final output only once plan.Task.check passes it)."""

    def __init__(self, client: Client, batch_id: str, meta: dict[str, str], bs: BulkSettings):
        self.client, self.r, self.id, self.bs = client, client.redis, batch_id, bs
        self.end = time.monotonic() + bs.pass_s  # when this pass hands over to the next
        self.total = int(meta.get("total", 0) or 0)
        self.next = int(meta.get("next", 0) or 0)
        self.model_dir, self.problem = configured_model(meta)
        self.task = (
            plan.Task.from_dict(json.loads(meta["task"]))
            if meta.get("task") and self.problem is None
            else None
        )
        self.model_name = PurePath(self.model_dir or meta.get("model_dir", "")).name
        self.max_model_len = int(meta.get("max_model_len", 0) or 0)
        self.tenant = meta.get("tenant") or None  # a batch made through the gateway with a key
        active = sorted(int(text(i)) for i in self.r.smembers(keys.batch_active(batch_id)))
        self.state: dict[int, dict[str, Any]] = {}
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
                fail_reason(self.r, self.id, self.problem)
                return self._stop(store.FAILED, *self.problem)
            self._watch([j for st in self.state.values() for j in st["jobs"]])
            next_look = 0.0
            while True:
                now = time.monotonic()
                if now >= next_look:  # the status, a heartbeat, and any missed message
                    status = text(self.r.hget(keys.batch(self.id), "status") or b"")
                    if status == store.CANCELLING:
                        return self._cancel()
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

    def _cancel(self) -> str:
        if self.r.hget(keys.batch(self.id), "stop_reason") in (b"expired", "expired"):
            msg = "the batch did not finish within its completion window"
            return self._stop(store.EXPIRED, "batch_expired", msg)
        return self._stop(store.CANCELLED, "batch_cancelled", "the batch was cancelled")

    # -- knowing which jobs finished -------------------------------------------------
    # Each job publishes its final state on its done channel: the driver subscribes to the
    # channels of the jobs in flight and reads the records of finished jobs only. Pub/sub is
    # not durable, so the finals are also looked up after subscribing and every look_s.

    def _in_flight(self) -> list[str]:
        return [j for st in self.state.values() for j in st["jobs"] if j not in self.finished]

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
                if self.tenant:  # the tenant's cache prefixes only, as through the gateway
                    o["cache_salt"] = protocol.tenant_salt(self.tenant, o.get("cache_salt"))
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
            st = {"level": level, "jobs": by_line[i], "p": usage[i][0], "o": usage[i][1]}
            self.state[i] = st
            pipe.hset(keys.batch_state(self.id), str(i), json.dumps(st))
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
        ready = [i for i, st in self.state.items() if all(j in self.finished for j in st["jobs"])]
        if not ready:
            return 0
        done = [j for i in ready for j in self.state[i]["jobs"]]
        recs = records.get_many(self.r, done)
        self.finished.difference_update(done)
        if self.pubsub.subscribed:
            self.pubsub.unsubscribe(*[keys.done_channel(j) for j in done])
        at = 0
        nxt: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        usage: dict[int, tuple[int, int]] = {}
        for i in ready:
            n = len(self.state[i]["jobs"])
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
            st["p"] + sum(x.prompt_tokens or 0 for x in recs),
            st["o"] + sum(x.output_tokens or 0 for x in recs),
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
                text=output,
                finish_reason=reason,
                usage=use,
                request_id=last.id,
                created_s=(last.finished_ms or store.now_ms()) // 1000,
            )
            self._record(i, line, True, use)
            return None
        level = st["level"] + 1
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
            for j in st["jobs"]:
                self.client.job(j).cancel()
        for i in list(self.state):
            self._error(i, code, message, (self.state[i]["p"], self.state[i]["o"]))
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
