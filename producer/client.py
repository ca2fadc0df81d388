"""The synchronous client.

client = Client("redis://localhost:6379/0")
job = client.submit("Summarize: ...", max_tokens=64, lane="interactive")
for text in job.stream():
    print(text, end="")
print(job.result(timeout=30).finish_reason)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from redis.exceptions import NoScriptError

from broker_config import fastpipe
from broker_config.connection import connect, resolve_url
from broker_config.settings import Settings
from broker_config.text import text
from producer.errors import NotReplicated, QueueFull, final, retry_pause, submitted
from producer.request import prepare
from results import jobs, records, tokens, wait
from results.records import JobRecord

_CHUNK = 5000  # jobs per pipeline round trip in submit_many


class Client:
    """A producer. `url` falls back to PLURAI_REDIS_URL, then to an embedded redis-server
    already running from the data folder; the client never starts one itself."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        redis: redis.Redis | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.redis = (
            redis if redis is not None else connect(resolve_url(url, self.settings), decode=True)
        )
        self.listeners = wait.Listeners(self.redis)  # pub/sub connections kept for waits

    def submit(
        self, prompt: str | None = None, *, queue_timeout: float = 0.0, **options: Any
    ) -> Job:
        """Queue one job; options as in producer.request.prepare (max_tokens, temperature,
        ..., priority, lane, metadata, idempotency_key, deadline). With an idempotency key
        already used, returns the earlier job and queues nothing.

        When the lane is full, raises QueueFull at once, or with `queue_timeout` > 0 keeps
        trying until there is room or that many seconds have passed."""
        call = prepare(self.settings, prompt=prompt, **options)
        give_up = time.monotonic() + queue_timeout
        while True:
            try:
                if self.settings.submit_replicas:
                    return self._send([fastpipe.pack(call.command())], [call.lane], [])[0]
                return Job(self, text(jobs.run(self.redis, call)))
            except QueueFull:  # from the path that waits for replicas
                left = give_up - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(self.settings.queue_full_retry_s, left))
            except redis.ResponseError as e:
                retry = self.settings.queue_full_retry_s
                time.sleep(retry_pause(e, call.lane, retry, give_up))

    def submit_many(self, requests: Iterable[dict[str, Any]]) -> list[Job]:
        """Queue many jobs, pipelined: each dict holds submit's arguments. If a lane is full,
        raises QueueFull after the chunk in flight; its `accepted` lists the jobs queued."""
        jobs.load(self.redis, "SUBMIT")
        out: list[Job] = []
        chunk: list[bytes] = []  # packed at once: thousands of live calls would cost GC time
        lanes: list[str] = []
        for req in requests:
            call = prepare(self.settings, **req)
            chunk.append(fastpipe.pack(call.command()))
            lanes.append(call.lane)
            if len(chunk) == _CHUNK:
                out += self._send(chunk, lanes, out)
                chunk, lanes = [], []
        if chunk:
            out += self._send(chunk, lanes, out)
        return out

    def _send(self, chunk: list[bytes], lanes: list[str], before: list[Job]) -> list[Job]:
        """One chunk of packed SUBMIT calls; with PLURAI_SUBMIT_REPLICAS, followed on the
        same connection by a WAIT for that many replicas to have them."""
        s = self.settings
        wait = []
        if s.submit_replicas:
            wait = [fastpipe.pack(["WAIT", s.submit_replicas, s.submit_replicas_timeout_ms])]
        replies = fastpipe.run(self.redis, chunk + wait)
        missing = [i for i, x in enumerate(replies[: len(chunk)]) if isinstance(x, NoScriptError)]
        if missing:  # Redis lost its scripts (a restart, a failover): those calls did nothing
            jobs.load(self.redis, "SUBMIT")
            again = fastpipe.run(self.redis, [chunk[i] for i in missing] + wait)
            for i, reply in zip(missing, again, strict=False):
                replies[i] = reply
            if wait:
                replies[-1] = again[-1]
        acked = replies.pop() if wait else 0
        try:
            ids = submitted(replies, lanes, s.queue_full_retry_s)
        except QueueFull as full:
            full.accepted = before + [Job(self, i) for i in full.accepted]
            raise
        if s.submit_replicas and acked < s.submit_replicas:
            raise NotReplicated(ids, acked, s.submit_replicas, s.submit_replicas_timeout_ms)
        return [Job(self, i) for i in ids]

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def records(self, job_ids: list[str]) -> list[JobRecord]:
        """Current records of many jobs, in one round trip."""
        return records.get_many(self.redis, job_ids)

    def wait_all(
        self, jobs: list[Job] | list[str], timeout: float | None = None
    ) -> list[JobRecord]:
        """Block until every job is final (or timeout); returns their records in order."""
        ids = [j.id if isinstance(j, Job) else j for j in jobs]
        return wait.wait_many(self.redis, ids, timeout, self.listeners)

    def close(self) -> None:
        self.listeners.close()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Job:
    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def record(self) -> JobRecord:
        return records.get(self.client.redis, self.id)

    def status(self) -> str:
        """queued, running, completed, failed, cancelled; unknown if no record (expired)."""
        return self.record().state

    def result(self, timeout: float | None = None) -> JobRecord:
        """Wait for the final result. Raises TimeoutError, JobFailed or JobCancelled."""
        return final(wait.wait(self.client.redis, self.id, timeout, self.client.listeners), timeout)

    def stream(self, block_ms: int = 1000) -> Iterator[str]:
        """Text deltas as the worker produces them; raises JobFailed / JobCancelled at the end
        of a job that did not complete."""
        follower = tokens.TextFollower()
        for ev in tokens.events(self.client.redis, self.id, block_ms=block_ms):
            delta = follower.feed(ev)
            if delta:
                yield delta
        final(self.record(), None)

    def cancel(self) -> str:
        """Cancel; returns 'cancelled', 'cancelling' (its worker is told), or the final state
        the job already had."""
        return text(jobs.run(self.client.redis, cancel_call(self.client.settings, self.id)))


def cancel_call(settings: Settings, job_id: str) -> jobs.Call:
    """The CANCEL call of a job (shared with producer.aio)."""
    return jobs.cancel(job_id=job_id, ttl_s=settings.result_ttl_s, now_ms=int(time.time() * 1000))
