"""Completion webhooks: a job submitted with `webhook=URL` is told to that URL once it ends.

The life of one:
1. Submit (producer/submit.py) writes, in the same round trip as the job, its watch: the
   job id -> {"url", "since_ms", "attempts"} in keys.WEBHOOKS, and the job id in
   keys.WEBHOOKS_DUE scored by when to look at it.
2. `plurai webhooks` (a Notifier; run one or more anywhere) hears each job's end on its
   done channel and makes that job due at once; it also looks at every job when its score
   comes (a job whose end it missed, while it was down, say).
3. It claims due jobs (CLAIM moves each a lease ahead, so two notifiers do not send the
   same one and a notifier that dies leaves them to the next), reads each record, and for
   a final one POSTs the job as `plurai get` shows it, signed (results/webhook_http.py).
4. An answer 2xx ends the watch (`webhook_state` delivered on the record); a network
   error, a timeout, 408, 425, 429 or 5xx is tried again later, PLURAI_WEBHOOK_ATTEMPTS
   times in all; any other answer, or a URL or address not allowed, ends it as failed,
   with why in the record's `webhook_error`.

A delivery is at least once: a notifier that dies after the POST and before it records it
sends it again. Receivers tell repeats by the Plurai-Job-Id header.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import is_cluster
from plurai.broker_config.protocol import valid_job_id
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.results import jobs, records
from plurai.results.webhook_http import MAX_URL, SIGNATURE, Answer, post, sign

log = logging.getLogger("plurai.webhooks")

# KEYS: due set; ARGV: now ms, lease ms, most
# The due jobs (score <= now), earliest first, each moved a lease ahead.
CLAIM = """
local due = KEYS[1]
local now, lease, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ids = redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, most)
for _, id in ipairs(ids) do redis.call('ZADD', due, now + lease, id) end
return ids
"""
# KEYS: job record; ARGV: field/value pairs
# Sets them where the record is still a hash (an expired record is not made again).
NOTE = """
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
jobs.register(WEBHOOK_CLAIM=CLAIM, WEBHOOK_NOTE=NOTE)

GRACE_MS = 120_000  # a watched job with no record after this was never queued, or expired
MAX_LOOK_MS = 60_000  # the longest between two looks at an unfinished job
MAX_RETRY_S = 3600.0


def watch(job_ids: list[str], urls: list[str], now_ms: int, poll_s: float) -> list[list[Any]]:
    """The commands that watch these jobs for their webhooks (none when no job has one)."""
    if not job_ids:
        return []
    look = now_ms + int(poll_s * 1000)
    values = [Watch(u, now_ms, 0).value() for u in urls]
    return [
        ["HSET", keys.WEBHOOKS, *[x for pair in zip(job_ids, values, strict=True) for x in pair]],
        ["ZADD", keys.WEBHOOKS_DUE, *[x for j in job_ids for x in (look, j)]],
    ]


@dataclass(slots=True)
class Watch:
    url: str
    since_ms: int
    attempts: int

    def value(self) -> str:
        """Its value in keys.WEBHOOKS."""
        return json.dumps({"url": self.url, "since_ms": self.since_ms, "attempts": self.attempts})

    @classmethod
    def parse(cls, raw: Any) -> Watch | None:
        """A watch as written by `watch`, or None for anything else (bytes from Redis)."""
        try:
            d = json.loads(raw)
            w = cls(d["url"], d["since_ms"], d["attempts"])
        except (TypeError, ValueError, KeyError):
            return None
        ok = isinstance(w.url, str) and len(w.url) <= MAX_URL
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (w.since_ms, w.attempts))
        return w if ok and ints and w.attempts >= 0 else None


def body(rec: records.JobRecord, limit: int) -> bytes:
    """The POST's body: {"type": "job.ended", "job": the record as `plurai get` shows it},
    without the text and token ids (`"truncated": true`) when that would pass `limit`, and
    then without its metadata and timings too if still over."""
    job = rec.to_dict()
    for name in ("hops_us", "raw"):
        job.pop(name, None)
    out = json.dumps({"type": "job.ended", "job": job}, ensure_ascii=False).encode()
    if len(out) <= limit:
        return out
    for name in ("text", "token_ids", "logprobs", "choices"):
        job.pop(name, None)
    job["truncated"] = True
    out = json.dumps({"type": "job.ended", "job": job}, ensure_ascii=False).encode()
    if len(out) > limit:  # large metadata: the job's end alone
        short = ("id", "state", "finish_reason", "error_code", "truncated")
        job = {k: job[k] for k in short if k in job}
        out = json.dumps({"type": "job.ended", "job": job}).encode()
    return out


class Notifier:
    """`plurai webhooks`: sends the webhooks of ended jobs until `stop` is set."""

    def __init__(self, r: redis.Redis, settings: Settings) -> None:
        if settings.webhook_secret is None or not settings.webhook_secret.get_secret_value():
            raise ValueError(
                "set PLURAI_WEBHOOK_SECRET: every webhook is signed with it (receivers check "
                "the Plurai-Signature header)"
            )
        self.r, self.s = r, settings
        self.secret = settings.webhook_secret.get_secret_value().encode()
        self.cluster = is_cluster(r)
        self.wake = threading.Event()
        # a try's lease: its POST's timeout (connect, then answer) and the time to record it
        self.lease_ms = int(settings.webhook_timeout_s * 2000) + 30_000
        self.pool = ThreadPoolExecutor(settings.webhook_concurrency, "plurai-webhook")

    def run(self, stop: threading.Event) -> None:
        threading.Thread(target=self._listen, args=(stop,), daemon=True).start()
        try:
            while not stop.is_set():
                try:
                    busy = self.turn()
                except redis.RedisError as e:  # Redis away: what was claimed comes back
                    log.warning("webhooks: %s; again in 1 s", e)
                    stop.wait(1.0)
                    continue
                if not busy:
                    self.wake.wait(0.5)
                    self.wake.clear()
        finally:
            self.pool.shutdown(wait=True)

    def _listen(self, stop: threading.Event) -> None:
        """Each job's end (its done channel) makes its watch due now, if it has one."""
        prefix = len(keys.done_channel(""))
        while not stop.is_set():
            pubsub = self.r.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.psubscribe(keys.done_channel("*"))
                while not stop.is_set():
                    ended: list[str] = []
                    msg = pubsub.get_message(timeout=0.5)
                    while msg is not None:
                        ended.append(text(msg["channel"])[prefix:])
                        msg = pubsub.get_message(timeout=0) if len(ended) < 1000 else None
                    if ended:
                        self.r.zadd(keys.WEBHOOKS_DUE, dict.fromkeys(ended, 0), xx=True)
                        self.wake.set()
            except redis.RedisError as e:  # a look at its score finds what was missed
                log.warning("done channels: %s; listening again in 1 s", e)
                stop.wait(1.0)
            finally:
                pubsub.close()

    def turn(self) -> int:
        """Claim the due watches and handle each; returns how many were due."""
        now = records.now_ms()
        most = self.s.webhook_concurrency * 4
        claim = jobs.Call("WEBHOOK_CLAIM", [keys.WEBHOOKS_DUE], [now, self.lease_ms, most])
        ids = [text(x) for x in jobs.run(self.r, claim)]
        if not ids:
            return 0
        watches = self.r.hmget(keys.WEBHOOKS, ids)
        list(self.pool.map(self._one, ids, watches))
        return len(ids)

    def _one(self, job_id: str, raw: Any) -> None:
        try:
            self._handle(job_id, raw)
        except redis.RedisError as e:  # the lease brings it back
            log.warning("webhook of job %s: %s; tried again later", job_id[:64], e)

    def _handle(self, job_id: str, raw: Any) -> None:
        w = Watch.parse(raw) if raw is not None and valid_job_id(job_id) else None
        if w is None:  # no watch, or not one Plurai wrote
            log.warning("webhook watch %r is not one Plurai wrote; dropped", job_id[:64])
            self._end(job_id, "dropped")
            return
        now = records.now_ms()
        try:
            rec = records.get(self.r, job_id)
        except records.BadRecord as e:
            self._end(job_id, "failed", 0, Answer(error=str(e)[:200]))
            return
        if rec.state == records.UNKNOWN:
            if now - w.since_ms > GRACE_MS:  # never queued (refused), or expired
                self._end(job_id, "dropped")
            else:
                self._later(job_id, now + int(self.s.webhook_poll_s * 1000))
            return
        if not rec.final:
            wait = max(self.s.webhook_poll_s * 1000, (now - w.since_ms) / 10)
            self._later(job_id, now + int(min(wait, MAX_LOOK_MS)))
            return
        answer = self._send(job_id, w, rec)
        tries = w.attempts + 1
        if answer.ok:
            self._end(job_id, "delivered", tries, answer)
        elif answer.retry and tries < self.s.webhook_attempts:
            wait_s = min(self.s.webhook_retry_s * 4 ** (tries - 1), MAX_RETRY_S)
            self.r.hset(keys.WEBHOOKS, job_id, Watch(w.url, w.since_ms, tries).value())
            self._later(job_id, now + int(wait_s * 1000))
            log.info(
                "webhook of job %s: %s; try %d in %.0f s", job_id, answer.error, tries + 1, wait_s
            )
        else:
            self._end(job_id, "failed", tries, answer)

    def _send(self, job_id: str, w: Watch, rec: records.JobRecord) -> Answer:
        data = body(rec, self.s.webhook_max_bytes)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "plurai-webhooks",
            "Plurai-Job-Id": job_id,
            "Plurai-Attempt": str(w.attempts + 1),
            SIGNATURE: sign(self.secret, int(time.time()), data),
        }
        return post(
            w.url,
            data,
            headers,
            allowed=self.s.webhook_hosts,
            private=self.s.webhook_private,
            timeout=self.s.webhook_timeout_s,
        )

    def _later(self, job_id: str, at_ms: int) -> None:
        self.r.zadd(keys.WEBHOOKS_DUE, {job_id: at_ms}, xx=True)

    def _end(
        self,
        job_id: str,
        how: str,
        tries: int = 0,
        answer: Answer | None = None,
    ) -> None:
        """The watch ends: delivered, failed (with `answer`: said on the record) or dropped."""
        if answer is not None:
            fields = [
                "webhook_state",
                how,
                "webhook_attempts",
                tries,
                "webhook_status",
                answer.status,
            ]
            if answer.error:
                fields += ["webhook_error", answer.error]
                log.warning(
                    "webhook of job %s failed after %d tries: %s", job_id, tries, answer.error
                )
            jobs.run(self.r, jobs.Call("WEBHOOK_NOTE", [keys.job(job_id)], fields))
        pipe = self.r.pipeline(transaction=not self.cluster)
        pipe.hdel(keys.WEBHOOKS, job_id)
        pipe.zrem(keys.WEBHOOKS_DUE, job_id)
        pipe.hincrby(keys.WEBHOOKS_COUNTS, how, 1)
        pipe.execute()
