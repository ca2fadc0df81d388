"""Dead letters as an operator handles them (`plurai dead-letters list|requeue|drop`): a job
that failed PLURAI_MAX_DELIVERIES times is listed with its entry, queued again under its own
id once the cause is mended, and then runs to exactly one result, token for token; a dead
letter that cannot run again, or an id that names none, is refused with its code and
changes nothing."""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.producer import dead_letters as dead
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker, plurai, turn_until

from .recorder import Recorder


class Broken(Recorder):
    """An engine with a bug: it raises on every job it is given."""

    def add(self, req: AddRequest) -> list[str]:
        raise RuntimeError("an engine bug")


def dead_lettered(url: str, n: int = 1) -> list[str]:
    """`n` jobs that a broken engine failed PLURAI_MAX_DELIVERIES (1) times: their ids."""
    worker = driven_worker(url, Broken(), "broken", max_deliveries=1)
    with Client(url) as client:
        jobs = [client.submit(f"job {i}", max_tokens=5, temperature=0) for i in range(n)]
        turn_until(worker, lambda: all(j.record().final for j in jobs))
        for job in jobs:
            r = job.record()
            assert (r.state, r.error_code) == (records.FAILED, "too_many_deliveries")
    worker.cancels.close()
    return [j.id for j in jobs]


@pytest.fixture
def engine(tiny_model):
    e = Engine(EngineConfig(model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32"))
    yield e
    e.close()


def test_a_requeued_job_runs_again_to_one_result(redis_url, engine) -> None:
    (job_id,) = dead_lettered(redis_url)
    r = connect(redis_url)
    (letter,) = dead.list_dead(r)
    assert letter.job_id == job_id and letter.requeueable and letter.lane == "standard"
    assert "an engine bug" in letter.error  # why, as the worker said it

    assert dead.requeue(r, letter.id) == job_id
    assert dead.list_dead(r) == []
    record = Client(redis_url).job(job_id).record()
    assert record.state == records.QUEUED and not record.final and record.error_code is None
    with pytest.raises(dead.DeadLetterError) as again:  # once only
        dead.requeue(r, letter.id)
    assert again.value.code == dead.DeadCode.UNKNOWN

    # the cause mended: a working engine runs it, from its first token, to one result
    worker = driven_worker(redis_url, engine, "mended")
    job = Client(redis_url).job(job_id)
    turn_until(worker, lambda: job.record().final)
    worker.cancels.close()
    done = job.record()
    assert done.state == records.COMPLETED
    (want,) = engine.generate(["job 0"], SamplingParams(max_tokens=5, temperature=0))
    assert done.token_ids == want.token_ids and done.text == want.text


def test_what_cannot_run_again_is_refused_and_left_as_it_was(redis_url) -> None:
    r = connect(redis_url)
    s = Settings(redis_url=redis_url)

    def letter(**fields: object) -> str:
        base = {"lane": "standard", "entry_id": "1-1", "error": "test", "worker": "w"}
        return r.xadd(keys.DEAD_LETTER, {**base, **fields}).decode()  # type: ignore[union-attr]

    def refused(dead_id: str) -> str:
        with pytest.raises(dead.DeadLetterError) as e:
            dead.requeue(r, dead_id, s)
        assert e.value.message
        return e.value.code

    good = {b"v": b"2", b"id": b"job-aaaaaaaa", b"max_tokens": b"4", b"body": b'{"prompt":"x"}'}
    cases = {
        letter(fields="{}"): dead.DeadCode.NOT_REQUEUEABLE,  # no entry kept
        letter(entry=b"\xc1 not msgpack"): dead.DeadCode.NOT_REQUEUEABLE,
        letter(entry=msgpack.packb([1, 2])): dead.DeadCode.NOT_REQUEUEABLE,  # not a map
        letter(entry=msgpack.packb({b"v": b"2"})): dead.DeadCode.NOT_REQUEUEABLE,  # no job id
        letter(
            entry=msgpack.packb({**good, b"max_tokens": b"many"})
        ): dead.DeadCode.NOT_REQUEUEABLE,
        letter(lane="nowhere", entry=msgpack.packb(good)): dead.DeadCode.NOT_REQUEUEABLE,
    }
    for dead_id, code in cases.items():
        assert refused(dead_id) == code, dead_id
    for bad in ("", "x", "1-x", "-1", "1" * 50, "0-0"):
        assert refused(bad) == dead.DeadCode.UNKNOWN, bad
    assert r.xlen(keys.DEAD_LETTER) == len(cases)  # nothing requeued, nothing deleted
    assert not r.keys("plurai:{*}:req:*")  # no entry queued

    # a job that is queued again already: nothing to do
    active = letter(entry=msgpack.packb(good))
    r.hset(keys.job("job-aaaaaaaa"), mapping={"state": "queued"})
    assert refused(active) == dead.DeadCode.JOB_ACTIVE
    # a full lane: refused as a submit would be
    r.delete(keys.job("job-aaaaaaaa"))
    full = Settings(redis_url=redis_url, max_queued_per_lane=1)
    Client(redis_url).submit("fills the lane", lane="standard")
    with pytest.raises(dead.DeadLetterError) as e:
        dead.requeue(r, active, full)
    assert e.value.code == "queue_full"
    assert not r.exists(keys.job("job-aaaaaaaa"))

    with pytest.raises(dead.DeadLetterError):
        dead.drop(r, [active, "not an id"])  # refused before any is deleted
    assert dead.drop(r, [active, "1-0"]) == 1
    assert r.xlen(keys.DEAD_LETTER) == len(cases)


def test_the_cli_lists_requeues_and_drops(redis_url) -> None:
    ids = dead_lettered(redis_url, n=3)
    r = connect(redis_url)

    listed = plurai(redis_url, "dead-letters", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    letters = [json.loads(x) for x in listed.stdout.splitlines()]
    assert sorted(x["job_id"] for x in letters) == sorted(ids)
    assert all(x["requeueable"] for x in letters)

    one = plurai(redis_url, "dead-letters", "requeue", letters[0]["id"])
    assert one.returncode == 0 and letters[0]["job_id"] in one.stdout, one.stderr
    missing = plurai(redis_url, "dead-letters", "requeue", letters[0]["id"])  # requeued already
    assert missing.returncode == 1 and "unknown_dead_letter" in missing.stderr
    bad = plurai(redis_url, "dead-letters", "drop", "not-an-id")
    assert bad.returncode == 2 and "unknown_dead_letter" in bad.stderr
    nothing = plurai(redis_url, "dead-letters", "requeue")
    assert nothing.returncode == 2 and "--all" in nothing.stderr
    dropped = plurai(redis_url, "dead-letters", "drop", "--all")
    assert dropped.returncode == 0 and "dropped 2" in dropped.stdout
    assert r.xlen(keys.DEAD_LETTER) == 0
    states = {Client(redis_url).job(i).record().state for i in ids}
    assert states == {records.QUEUED, records.FAILED}  # the requeued one waits for a worker


def test_a_cluster_is_refused_before_anything_is_read(cluster_url) -> None:
    r = connect(cluster_url)
    with pytest.raises(dead.DeadLetterError) as e:
        dead.requeue(r, "1-0")
    assert e.value.code == dead.DeadCode.CLUSTER
    assert isinstance(r, redis.RedisCluster)


def test_a_job_asks_for_fewer_retries_than_the_deployment_allows(redis_url) -> None:
    """max_retries: the failures after which a job runs no more, within the deployment's
    PLURAI_MAX_DELIVERIES (5 here); a value that is no count is refused at submit, and a
    raw entry that sends one fails with bad_field."""
    worker = driven_worker(redis_url, Broken(), "broken")
    r = connect(redis_url)
    with Client(redis_url) as client:
        once = client.submit("fails once", max_tokens=4, max_retries=0)
        thrice = client.submit("fails three times", max_tokens=4, max_retries=2)
        greedy = client.submit("asks more than allowed", max_tokens=4, max_retries=50)
        turn_until(worker, lambda: all(j.record().final for j in (once, thrice, greedy)))
        for job in (once, thrice, greedy):
            assert job.record().error_code == "too_many_deliveries"
        errors = {d.job_id: d.error for d in dead.list_dead(r)}
        assert "failed 1 times (its max_retries=0)" in errors[once.id]
        assert "failed 3 times (its max_retries=2)" in errors[thrice.id]
        assert "failed 5 times (PLURAI_MAX_DELIVERIES=5)" in errors[greedy.id]

        for bad in (-1, 101, 1.5, "2", True):
            with pytest.raises(ValueError, match="max_retries"):
                client.submit("x", max_retries=bad)
    raw = {"v": "2", "id": "job-bbbbbbbb", "max_tokens": "4", "body": '{"prompt": "x"}'}
    r.xadd("plurai:{default}:req:standard", {**raw, "max_retries": "many"})
    job = Client(redis_url).job("job-bbbbbbbb")
    turn_until(worker, lambda: job.record().final)
    assert job.record().error_code == "bad_field" and "max_retries" in job.record().error_message
    worker.cancels.close()


class Timed(Broken):
    """The broken engine, noting when each run of a job began."""

    def __init__(self) -> None:
        super().__init__()
        self.tries: list[float] = []

    def add(self, req: AddRequest) -> list[str]:
        self.tries.append(time.monotonic())
        return super().add(req)


def test_a_failed_job_waits_its_backoff_before_each_run_again(redis_url) -> None:
    """retry_backoff: after each failure the job waits in its shard's delayed set, that
    long and then twice as long, before a worker runs it again; never sooner."""
    engine = Timed()
    worker = driven_worker(redis_url, engine, "broken")
    r = connect(redis_url)
    with Client(redis_url) as client:
        job = client.submit("backs off", max_tokens=4, max_retries=2, retry_backoff=0.3)
        turn_until(worker, lambda: len(engine.tries) == 1)
        turn_until(worker, lambda: r.zcard(keys.delayed()) == 1)  # waits out its backoff
        assert job.record().state == records.QUEUED
        turn_until(worker, lambda: job.record().final, timeout=30)
        for bad in (-1, 3601, "1", float("nan"), True):
            with pytest.raises(ValueError, match="retry_backoff"):
                client.submit("x", retry_backoff=bad)
    assert job.record().error_code == "too_many_deliveries"
    first, second, third = engine.tries
    assert second - first >= 0.3 and third - second >= 0.6  # 0.3 s, then doubled
    worker.cancels.close()
