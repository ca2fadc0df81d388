"""One pipelined submit without its I/O, shared by producer.client and producer.aio.

A client runs a Plan so (each `run` one round trip, as the client does it):

    plan = Plan(requests, routes, settings, split, before, job)
    lost = plan.lost(run(plan.commands()))  # the calls Redis ran without their script
    if lost:
        load SCRIPTS; plan.rerun(run(lost))
    cleanup = plan.settle()
    if cleanup:
        run(cleanup)
    return plan.jobs()  # or raises QueueFull, BadIdempotencyKey, NotReplicated, ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from redis.exceptions import NoScriptError

from plurai.broker_config import keys, tracing
from plurai.broker_config.protocol import valid_job_id
from plurai.broker_config.routes import Routes, registry_value
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.producer.errors import check_replicas, queue_full, submitted
from plurai.producer.request import Checked
from plurai.results import jobs, records, webhooks


class _Job(Protocol):
    id: str


J = TypeVar("J", bound=_Job)


class Plan(Generic[J]):
    """The state of one submit of prepared submissions (producer.request.prepare), or of
    checked requests built into submissions (`subs`) as `commands()` is iterated (Redis
    runs the first while the rest are built). `before`: jobs of the same call already
    queued, for the `accepted` of an error; `job` makes a client's job of a job id.

    Its commands: the models' entries in plurai:models for those no worker has served yet
    (so `plurai status` and the metrics show the lanes where their jobs wait), each job's
    submit calls (one, or two with `split` on a Cluster), then, with
    PLURAI_SUBMIT_REPLICAS, a WAIT."""

    def __init__(
        self,
        requests: list[jobs.Submission] | list[Checked],
        routes: Routes,
        settings: Settings,
        split: bool,
        before: list[J],
        job: Callable[[str], J],
    ) -> None:
        new = dict.fromkeys(r.model for r in requests if r.model not in routes.models)
        self.listed = [["HSETNX", keys.MODELS, m, registry_value(1, 0)] for m in new]
        self.requests, self.settings, self.split = requests, settings, split
        self.before, self.job = before, job
        self.subs: list[jobs.Submission] = []
        self.built = False
        self.replies: list[Any] = []
        self.acked: Any = 0  # WAIT's reply
        self.missing: list[int] = []
        self.ids: list[J] = []
        self.error: Exception | None = None
        # whether its commands end with the WAIT: a pipeline of several plans has one, at
        # its end, whose reply the others take as their `acked`
        self.wait = True

    def commands(self) -> Iterator[list[Any]]:
        """Every command of the first round trip, in order; the submissions are built the
        first time they are iterated."""
        yield from self.listed
        if self.built:
            for sub in self.subs:
                yield from sub.commands(self.split)
        else:
            self.built = True
            for r in self.requests:
                sub = r.submission() if isinstance(r, Checked) else r
                self.subs.append(sub)
                yield from sub.commands(self.split)
        s = self.settings
        yield from self.watches
        if s.submit_replicas and self.wait:
            yield ["WAIT", s.submit_replicas, s.submit_replicas_timeout_ms]

    @functools.cached_property
    def watches(self) -> list[list[Any]]:
        """The commands that watch the webhooks of the jobs that have one (after their
        submits: a refused job's watch is dropped by `plurai webhooks`, finding no record)."""
        hooked = [sub for sub in self.subs if sub.webhook]
        if not hooked:  # most submits: nothing to compute
            return []
        return webhooks.watch(
            [sub.job_id for sub in hooked],
            [sub.webhook for sub in hooked],
            records.now_ms(),
            self.settings.webhook_poll_s,
        )

    def lost(self, replies: list[Any]) -> list[list[Any]]:
        """Take the first round trip's replies; returns the commands to send again once the
        scripts are loaded (Redis lost them: a restart, a failover; those calls did
        nothing), none when every call ran."""
        self.replies = replies
        self.missing = [i for i, x in enumerate(replies) if isinstance(x, NoScriptError)]
        if not self.missing:
            return []
        commands = list(self.commands())  # the same submissions again
        return [commands[i] for i in self.missing]

    def rerun(self, replies: list[Any]) -> None:
        """Take the replies of the commands `lost` returned."""
        for i, reply in zip(self.missing, replies, strict=True):
            self.replies[i] = reply

    def settle(self) -> list[list[Any]]:
        """Read the replies; returns the commands that delete the records written for
        nothing, to send before `jobs()` (also when refused: a record QUEUED wrote would
        read "queued" for days)."""
        s, replies = self.settings, self.replies
        if s.submit_replicas and self.wait:
            self.acked = replies.pop()
        replies = replies[len(self.listed) : len(replies) - len(self.watches)]
        self.ids, cleanup, self.error = submitted(
            self.subs, replies, s.queue_full_retry_s, self.before, self.job, self.split
        )
        if tracing.ON:
            _end_spans(self.subs, replies, self.split)
        return cleanup

    def jobs(self) -> list[J]:
        """The jobs queued, in order; raises the error of a refused call, or NotReplicated
        when fewer replicas than PLURAI_SUBMIT_REPLICAS acknowledged them."""
        if self.error is not None:
            raise self.error
        s = self.settings
        job_ids = [j.id for j in self.ids]
        check_replicas(job_ids, self.acked, s.submit_replicas, s.submit_replicas_timeout_ms)
        return self.ids


def _end_spans(subs: list[jobs.Submission], replies: list[Any], split: bool) -> None:
    """End each submit's span by its reply: queued, an idempotency key's earlier job (then
    no job was queued: `plurai.job_of_key` names the one that runs), or refused."""
    per = 2 if split else 1
    for i, sub in enumerate(subs):
        if sub.span is None:
            continue
        reply = replies[per * i + per - 1]
        if isinstance(reply, Exception):
            full = queue_full(reply, sub.lane, 0)
            tracing.end(sub.span, None, full.code if full else type(reply).__name__)
        elif (owner := text(reply)) != sub.job_id and not valid_job_id(owner):
            tracing.end(sub.span, None, "idempotency_key_conflict")
        elif owner != sub.job_id:
            tracing.end(sub.span, None, **{"plurai.job_of_key": owner})
        else:
            tracing.end(sub.span)
