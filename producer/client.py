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

from plurai.broker_config import fastpipe
from plurai.broker_config.connection import connect, is_cluster, resolve_url
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.producer.errors import QueueFull, accepting, final
from plurai.producer.request import SCRIPTS, Checked, check, prepare
from plurai.producer.submit import Plan
from plurai.results import jobs, records, tokens, wait
from plurai.results.records import JobRecord

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
        self.routes = Routes(self.settings)
        if self.settings.submit_replicas and is_cluster(self.redis):
            raise ValueError("PLURAI_SUBMIT_REPLICAS (WAIT) is not available on a Redis Cluster")

    def submit(
        self, prompt: str | None = None, *, queue_timeout: float = 0.0, **options: Any
    ) -> Job:
        """Queue one job; options as in producer.request.prepare (max_tokens, temperature,
        ..., priority, lane, model, metadata, idempotency_key, deadline, not_before,
        max_retries, retry_backoff, webhook). With an idempotency key already used, returns
        the earlier job and queues nothing.

        When the lane is full, raises QueueFull at once, or with `queue_timeout` > 0 keeps
        trying until there is room or that many seconds have passed; when Redis is out of
        memory, the same with RedisFull (a QueueFull)."""
        sub = prepare(self.settings, self.fresh_routes(), prompt=prompt, **options)
        give_up = time.monotonic() + queue_timeout
        while True:
            try:
                return self.send([sub])[0]
            except QueueFull:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(0.1, left))

    def submit_many(self, requests: Iterable[dict[str, Any]]) -> list[Job]:
        """Queue many jobs, pipelined: each dict holds submit's arguments. Every request is
        checked before any is queued. If a job is refused (QueueFull: its lane is full,
        RedisFull: Redis is out of memory, BadIdempotencyKey, an error reply), raises after
        the chunk in flight; if Redis fails, at once. Either way the exception's `accepted`
        lists the jobs of the call that were queued (after a connection error, the chunk in
        flight may have been queued too: submit with idempotency keys to make a retry
        safe)."""
        routes = self.fresh_routes()
        checked = [check(self.settings, routes, **req) for req in requests]
        jobs.load(self.redis, *SCRIPTS)
        out: list[Job] = []
        for i in range(0, len(checked), _CHUNK):
            with accepting(out):
                out += self.send(checked[i : i + _CHUNK], out)
        return out

    def fresh_routes(self) -> Routes:
        if self.routes.stale():
            self.routes.load(self.routes.read(self.redis))
        return self.routes

    def send(
        self, requests: list[jobs.Submission] | list[Checked], before: list[Job] | None = None
    ) -> list[Job]:
        """Queue prepared submissions, or checked requests, in one pipeline round trip
        (producer.submit.Plan); with PLURAI_SUBMIT_REPLICAS, followed on the same connection
        by a WAIT for that many replicas to have them. `before`: jobs of the same call
        already queued, for QueueFull."""
        split = is_cluster(self.redis)
        plan = Plan(requests, self.routes, self.settings, split, before or [], self.job)
        lost = plan.lost(self._run(plan.commands()))
        if lost:
            jobs.load(self.redis, *SCRIPTS)
            plan.rerun(self._run(lost))
        cleanup = plan.settle()
        if cleanup:
            self._run(cleanup)
        return plan.jobs()

    def _run(self, commands: Iterable[list[Any]]) -> list[Any]:
        """Commands in one round trip (one per node on a Cluster); error replies in place."""
        if is_cluster(self.redis):
            pipe = self.redis.pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*c)
            return pipe.execute(raise_on_error=False)
        return fastpipe.run(self.redis, commands)

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
        """Wait for the final result. Raises TimeoutError, JobFailed or JobCancelled. A job
        with no record (never submitted here, expired, or queued by a raw-protocol client
        that writes none) is waited for like any other: give a timeout where that matters."""
        return final(wait.wait(self.client.redis, self.id, timeout, self.client.listeners), timeout)

    def stream(self, block_ms: int = 1000) -> Iterator[str]:
        """Text deltas as the worker produces them (the first choice's, of a job of n > 1:
        see stream_choices); raises JobFailed / JobCancelled at the end of a job that did
        not complete."""
        for index, delta in self.stream_choices(block_ms):
            if index == 0:
                yield delta

    def stream_choices(self, block_ms: int = 1000) -> Iterator[tuple[int, str]]:
        """(choice index, text delta) of every choice of the job as the worker produces
        them; raises as `stream`."""
        follower = tokens.TextFollower()
        for ev in tokens.events(self.client.redis, self.id, block_ms=block_ms):
            delta = follower.feed(ev)
            if delta:
                yield ev.index, delta
        final(self.record(), None)

    def cancel(self) -> str:
        """Cancel; returns 'cancelled', 'cancelling' (its worker is told), or the final state
        the job already had."""
        return text(jobs.run(self.client.redis, cancel_call(self.client.settings, self.id)))


def cancel_call(settings: Settings, job_id: str) -> jobs.Call:
    """The CANCEL call of a job (shared with producer.aio): a job cancelled while queued
    keeps its record and token stream as long as a finished job's."""
    return jobs.cancel(
        job_id=job_id,
        ttl_s=settings.result_ttl_s,
        stream_ttl_s=settings.output_ttl_s,
        now_ms=int(time.time() * 1000),
    )
