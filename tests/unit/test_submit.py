"""producer.submit.Plan, the submit shared by the sync and async clients, without Redis:
its commands, and what it makes of the replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from redis.exceptions import NoScriptError, ResponseError

from plurai.broker_config import keys
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.producer.errors import BadIdempotencyKey, NotReplicated, QueueFull
from plurai.producer.request import check, prepare
from plurai.producer.submit import Plan


@dataclass
class Job:
    id: str


def plan(settings: Settings, requests: list[Any], split: bool = False, before=None) -> Plan:
    return Plan(requests, Routes(settings), settings, split, before or [], Job)


def test_commands_list_a_new_model_then_one_call_per_job() -> None:
    s = Settings()
    subs = [prepare(s, prompt="a"), prepare(s, prompt="b")]
    cmds = list(plan(s, subs).commands())
    assert cmds[0][:3] == ["HSETNX", keys.MODELS, s.default_model]
    assert [c[0] for c in cmds[1:]] == ["EVALSHA", "EVALSHA"]
    assert cmds[1:] == [subs[0].commands()[0], subs[1].commands()[0]]


def test_on_a_cluster_each_job_is_two_calls_and_a_refused_one_is_cleaned_up() -> None:
    s = Settings()
    sub = prepare(s, prompt="a")
    p = plan(s, [sub], split=True)
    assert len(list(p.commands())) == 3  # HSETNX, QUEUED, SUBMIT
    assert p.lost([0, 1, ResponseError("QUEUEFULL 9")]) == []
    assert p.settle() == [["DEL", keys.job(sub.job_id)]]
    with pytest.raises(QueueFull):
        p.jobs()


def test_checked_requests_are_built_as_the_commands_are_read() -> None:
    s = Settings()
    p = plan(s, [check(s, prompt="a"), check(s, prompt="b")])
    it = p.commands()
    next(it), next(it)  # HSETNX, the first job
    assert len(p.subs) == 1
    list(it)
    assert len(p.subs) == 2


def test_calls_redis_ran_without_their_script_are_sent_again() -> None:
    s = Settings()
    subs = [prepare(s, prompt="a"), prepare(s, prompt="b")]
    p = plan(s, subs)
    cmds = list(p.commands())
    lost = p.lost([1, subs[0].job_id, NoScriptError("NOSCRIPT")])
    assert lost == [cmds[2]]
    p.rerun([subs[1].job_id])
    assert p.settle() == []
    assert p.jobs() == [Job(subs[0].job_id), Job(subs[1].job_id)]


def test_a_repeated_idempotency_key_gives_the_earlier_job() -> None:
    s = Settings()
    sub = prepare(s, prompt="a", idempotency_key="k")
    p = plan(s, [sub])
    list(p.commands())
    earlier = prepare(s, prompt="a").job_id
    p.lost([1, earlier])
    p.settle()
    assert p.jobs() == [Job(earlier)]


def test_a_full_lane_raises_with_the_jobs_queued_all_the_same() -> None:
    s = Settings()
    subs = [prepare(s, prompt="a"), prepare(s, prompt="b")]
    p = plan(s, subs, before=[Job("x")])
    list(p.commands())
    p.lost([1, subs[0].job_id, ResponseError("QUEUEFULL 7")])
    p.settle()
    with pytest.raises(QueueFull) as e:
        p.jobs()
    assert e.value.queued == 7 and e.value.accepted == [Job("x"), Job(subs[0].job_id)]


def test_an_idempotency_key_holding_no_job_id_is_refused() -> None:
    s = Settings()
    p = plan(s, [prepare(s, prompt="a", idempotency_key="k")])
    list(p.commands())
    p.lost([1, "not a job id!"])
    p.settle()
    with pytest.raises(BadIdempotencyKey):
        p.jobs()


@pytest.mark.parametrize(("acked", "ok"), [(2, True), (1, False), (ResponseError("NOPERM"), False)])
def test_replicas_asked_for_end_the_round_trip_with_a_wait(acked: Any, ok: bool) -> None:
    s = Settings(submit_replicas=2, submit_replicas_timeout_ms=50)
    sub = prepare(s, prompt="a")
    p = plan(s, [sub])
    assert list(p.commands())[-1] == ["WAIT", 2, 50]
    p.lost([1, sub.job_id, acked])
    p.settle()
    if ok:
        assert p.jobs() == [Job(sub.job_id)]
    else:
        with pytest.raises(NotReplicated):
            p.jobs()
