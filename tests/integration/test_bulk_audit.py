"""Bulk batches under hostile input and faults: every step ends, and every line gets one
result line.

Steps run in this process (drive.step, what the Celery task runs) against a real
redis-server, with no GPU worker: jobs stay queued, so a batch is stopped by a cancel."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from broker_config import keys
from broker_config.settings import BulkSettings
from producer.bulk import drive, manage, plan, store
from producer.client import Client
from results.records import BadRecord

from .test_security_bulk import BS, run_steps


@pytest.fixture
def client(redis_url: str, monkeypatch) -> Iterator[Client]:
    from broker_config.celery_app import app, configure

    configure(app, redis_url)  # kick() sends the first step; no Celery worker takes it here
    monkeypatch.delenv("PLURAI_MODEL_DIR", raising=False)
    with Client(redis_url) as c:
        yield c


def line(cid: str) -> str:
    return json.dumps({"custom_id": cid, "url": "/v1/completions", "body": {"prompt": "x"}})


def errors(client: Client, batch_id: str) -> list[tuple[str | None, str]]:
    _, err = manage.results(client, batch_id)
    return [(x["custom_id"], x["error"]["code"]) for x in map(json.loads, err.splitlines())]


def test_deeply_nested_lines_are_error_lines(client):
    rows = [line("a"), "[" * 5000, '{"custom_id": "b", "x": ' + "[" * 5000, line("c")]
    batch_id = manage.create(client, BS, rows)
    assert run_steps(client, batch_id, frozenset({store.IN_PROGRESS})) == store.IN_PROGRESS
    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    assert errors(client, batch_id) == [
        ("a", "batch_cancelled"),
        (None, "invalid_json"),
        (None, "invalid_json"),
        ("c", "batch_cancelled"),
    ]


def test_a_value_msgpack_cannot_hold_is_an_error_line(client):
    big = {"custom_id": "big", "url": "/v1/completions", "body": {"prompt": "x", "seed": 10**30}}
    batch_id = manage.create(client, BS, [line("a"), json.dumps(big), line("c")])
    assert run_steps(client, batch_id, frozenset({store.IN_PROGRESS})) == store.IN_PROGRESS
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS  # the others are queued
    assert client.redis.hlen(keys.batch_state(batch_id)) == 2
    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    assert errors(client, batch_id) == [
        ("a", "batch_cancelled"),
        ("big", "invalid_body"),
        ("c", "batch_cancelled"),
    ]


def test_validation_repeated_after_its_driver_died_keeps_the_lines(client):
    batch_id = manage.create(client, BS, [line("a"), "{oops", line("c")])
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS
    # the driver died after the validation's transaction, before it moved the status on
    client.redis.hset(keys.batch(batch_id), "status", store.VALIDATING)
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS
    assert manage.info(client, batch_id)["request_counts"] == {
        "total": 3,
        "completed": 0,
        "failed": 1,
    }
    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    assert errors(client, batch_id) == [
        ("a", "batch_cancelled"),
        (None, "invalid_json"),
        ("c", "batch_cancelled"),
    ]


@pytest.mark.parametrize(
    "damage",
    [{"status": "bogus"}, {"status": store.FINALIZING, "end_status": "bogus"}],
    ids=["status", "end_status"],
)
def test_a_record_with_an_unknown_status_ends(client, damage):
    batch_id = manage.create(client, BS, [line("a"), "{oops"])
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS
    client.redis.hset(keys.batch(batch_id), mapping=damage)
    # the Celery task queues the next step until the batch is terminal
    assert drive.step(client, batch_id, BS) == store.FAILED
    info = manage.info(client, batch_id)
    assert info["status"] == store.FAILED
    if damage["status"] == "bogus":
        assert info["errors"]["data"][0]["code"] == "invalid_status"
    assert errors(client, batch_id)[0] == (None, "invalid_json")


def test_a_reduce_template_too_long_for_the_context_is_an_error_line(
    client, workers, tiny_model, monkeypatch
):
    # the map prompts fit, the reduce template alone leaves no room: level 1 cannot be split
    monkeypatch.setattr(client.settings, "model_dir", str(tiny_model))  # the driver's
    workers.start(1, "--engine", "max_model_len=128")
    task = plan.Task(
        "custom", max_tokens=4, template="{text}", reduce_template="merge " * 110 + "{text}"
    )
    rows = [
        json.dumps({"id": "long", "text": "the river stone light " * 60}),
        json.dumps({"id": "short", "text": "the river"}),
    ]
    batch_id = manage.create(
        client, BS, rows, task=task, model_dir=str(tiny_model), max_model_len=128
    )
    assert run_steps(client, batch_id, store.TERMINAL, n=400) == store.COMPLETED
    assert errors(client, batch_id) == [("long", "context_too_small")]
    out, _ = manage.results(client, batch_id)
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["short"]


@pytest.mark.parametrize("damage", ["created_ms", "beat_ms", "gen", "wrong_type"], ids=lambda d: d)
def test_a_damaged_batch_record_does_not_stop_maintenance(client, damage):
    from producer.bulk import tasks

    r = client.redis
    bad = manage.create(client, BS, [line("a")])
    good = manage.create(client, BS, [line("b")])
    for b in (bad, good):
        r.hset(keys.batch(b), "created_ms", 1)  # long past its completion window
    if damage == "wrong_type":
        r.delete(keys.batch(bad))
        r.set(keys.batch(bad), "not a hash")
    else:
        r.hset(keys.batch(bad), damage, "x")
    out = tasks.maintain.run()
    assert good in out["expired"] and good in out["kicked"]
    assert r.hget(keys.batch(good), "status") == store.CANCELLING
    gen = int(r.hget(keys.batch(good), "gen"))
    tasks._resume()  # a Celery worker's start kicks every unfinished batch
    assert int(r.hget(keys.batch(good), "gen")) == gen + 1


def test_damaged_saved_requests_and_progress_are_error_lines_not_crashes(client):
    r = client.redis
    bs = BulkSettings(pass_s=0.5, look_s=0.1, window=3)
    batch_id = manage.create(client, BS, [line(c) for c in "abcde"])
    assert run_steps(client, batch_id, frozenset({store.IN_PROGRESS})) == store.IN_PROGRESS
    assert drive.step(client, batch_id, bs) == store.IN_PROGRESS
    assert r.smembers(keys.batch_active(batch_id)) == {"0", "1", "2"}  # the window
    r.hdel(keys.batch_requests(batch_id), "0")  # an active line's request is gone
    r.hset(keys.batch_requests(batch_id), "3", "{damaged")  # a line not started yet
    r.hset(keys.batch_state(batch_id), "1", "[1]")  # progress that is not a line's
    assert drive.step(client, batch_id, bs) == store.IN_PROGRESS
    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    assert errors(client, batch_id) == [
        (None, "damaged_record"),
        ("b", "batch_cancelled"),
        ("c", "batch_cancelled"),
        (None, "damaged_record"),
        ("e", "batch_cancelled"),
    ]
    assert manage.info(client, batch_id)["request_counts"] == {
        "total": 5,
        "completed": 0,
        "failed": 5,
    }


@pytest.mark.timeout(60)
def test_a_full_lane_ends_the_pass_and_no_line_is_lost(redis_url, client, monkeypatch):
    """The batch lane is full and nothing drains it: a pass waits for room only until its
    time is up (it once waited forever, with no heartbeat and deaf to a cancel), leaves the
    lines to the next pass, and a cancel then gives every line its error line."""
    monkeypatch.setenv("PLURAI_MAX_QUEUED_PER_LANE", "2")
    with Client(redis_url) as small:
        batch_id = manage.create(small, BS, [line(c) for c in "abcde"])
        for _ in range(3):  # validation, then passes that find the lane full
            assert drive.step(small, batch_id, BS) == store.IN_PROGRESS
        active = {int(x) for x in small.redis.smembers(keys.batch_active(batch_id))}
        assert active == set(range(5))  # every line waits for a pass, none is dropped
    monkeypatch.delenv("PLURAI_MAX_QUEUED_PER_LANE")
    with Client(redis_url) as roomy:  # room again: the next pass queues every line, once
        assert drive.step(roomy, batch_id, BS) == store.IN_PROGRESS
        assert roomy.redis.hlen(keys.batch_state(batch_id)) == 5
        assert roomy.redis.xlen(keys.request_stream(drive.LANE)) == 5
    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    assert sorted(errors(client, batch_id)) == [(c, "batch_cancelled") for c in "abcde"]


def test_a_batch_whose_steps_keep_failing_fails_with_driver_failed(client):
    """A record damaged (here `total`): each step raises BadRecord, and after
    max_step_failures in a row the batch fails with the reason, instead of maintenance
    kicking a step that fails every minute for ever. A step that passes resets the count."""
    from producer.bulk import tasks

    batch_id = manage.create(client, BS, [line("a"), line("b")])
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS
    r = client.redis
    gen = int(r.hget(keys.batch(batch_id), "gen"))
    good = r.hget(keys.batch(batch_id), "total")
    r.hset(keys.batch(batch_id), "total", "two")
    with pytest.raises(ValueError):
        tasks.step(batch_id, gen)
    r.hset(keys.batch(batch_id), "total", good)
    assert tasks.step(batch_id, gen) == store.IN_PROGRESS  # and the count starts again
    assert not r.hexists(keys.batch(batch_id), "step_failures")
    r.hset(keys.batch(batch_id), "total", "two")
    for _ in range(4):
        with pytest.raises(ValueError):
            tasks.step(batch_id, gen)
    assert tasks.step(batch_id, gen) == store.FAILED
    rec = r.hgetall(keys.batch(batch_id))
    assert rec["status"] == store.FAILED and rec["error_code"] == "driver_failed"
    assert "failed 5 times: BadRecord: " in rec["error"] and "'total'" in rec["error"]
    with pytest.raises(BadRecord, match="field 'total' is not a count: 'two'"):
        manage.info(client, batch_id)  # the record is still damaged: said, not guessed
