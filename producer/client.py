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

from broker_config import fastpipe, keys
from broker_config.connection import connect, resolve_url
from broker_config.settings import Settings
from producer.errors import JobCancelled, JobFailed, QueueFull, queue_full
from producer.request import prepare
from results import records, scripts, tokens, wait
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
        self._submit = self.redis.register_script(scripts.SUBMIT)
        self._cancel = self.redis.register_script(scripts.CANCEL)

    def submit(
        self, prompt: str | None = None, *, queue_timeout: float = 0.0, **options: Any
    ) -> Job:
        """Queue one job; options as in producer.request.prepare (max_tokens, temperature,
        ..., priority, lane, metadata, idempotency_key, deadline). With an idempotency key
        already used, returns the earlier job and queues nothing.

        When the lane is full, raises QueueFull at once, or with `queue_timeout` > 0 keeps
        trying until there is room or that many seconds have passed."""
        job_id, key_list, args = prepare(self.settings, prompt=prompt, **options)
        give_up = time.monotonic() + queue_timeout
        while True:
            try:
                return Job(self, _s(self._submit(keys=key_list, args=args)))
            except redis.ResponseError as e:
                full = queue_full(e, args[5], self.settings.queue_full_retry_s)
                if full is None:
                    raise
                left = give_up - time.monotonic()
                if left <= 0:
                    raise full from None
                time.sleep(min(0.1, left))

    def submit_many(self, requests: Iterable[dict[str, Any]]) -> list[Job]:
        """Queue many jobs, pipelined: each dict holds submit's arguments. If a lane is full,
        raises QueueFull after the chunk in flight; its `accepted` lists the jobs queued."""
        sha = self.redis.script_load(scripts.SUBMIT)
        jobs: list[Job] = []
        chunk: list[bytes] = []
        lanes: list[str] = []
        for req in requests:
            _job_id, key_list, args = prepare(self.settings, **req)
            chunk.append(fastpipe.pack(["EVALSHA", sha, len(key_list), *key_list, *args]))
            lanes.append(args[5])
            if len(chunk) == _CHUNK:
                jobs += self._send(chunk, lanes, jobs)
                chunk, lanes = [], []
        if chunk:
            jobs += self._send(chunk, lanes, jobs)
        return jobs

    def _send(self, chunk: list[bytes], lanes: list[str], before: list[Job]) -> list[Job]:
        replies = fastpipe.run(self.redis, chunk)
        jobs: list[Job] = []
        full: QueueFull | None = None
        for reply, lane in zip(replies, lanes, strict=True):
            if not isinstance(reply, Exception):
                jobs.append(Job(self, _s(reply)))
                continue
            full = queue_full(reply, lane, self.settings.queue_full_retry_s)
            if full is None:
                raise reply
        if full is not None:
            full.accepted = before + jobs
            raise full
        return jobs

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
        return wait.wait_many(self.redis, ids, timeout)

    def close(self) -> None:
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
        rec = wait.wait(self.client.redis, self.id, timeout)
        return _final(rec, timeout)

    def stream(self, block_ms: int = 1000) -> Iterator[str]:
        """Text deltas as the worker produces them; raises JobFailed / JobCancelled at the end
        of a job that did not complete."""
        follower = tokens.TextFollower()
        for ev in tokens.events(self.client.redis, self.id, block_ms=block_ms):
            text = follower.feed(ev)
            if text:
                yield text
        _final(self.record(), None)

    def cancel(self) -> str:
        """Cancel; returns 'cancelled', 'cancelling' (its worker is told), or the final state
        the job already had."""
        return _s(
            self.client._cancel(
                keys=[keys.job(self.id), keys.output(self.id)],
                args=[
                    self.client.settings.result_ttl_s,
                    keys.done_channel(self.id),
                    keys.CANCEL_CHANNEL,
                    self.id,
                    int(time.time() * 1000),
                ],
            )
        )


def _final(rec: JobRecord, timeout: float | None) -> JobRecord:
    if not rec.final:
        raise TimeoutError(f"job {rec.id} is {rec.state} after {timeout}s")
    if rec.state == records.FAILED:
        raise JobFailed(rec)
    if rec.state == records.CANCELLED:
        raise JobCancelled(rec)
    return rec


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
