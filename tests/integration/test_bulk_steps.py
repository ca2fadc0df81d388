"""A batch's steps (drive.step, what the Celery task runs) under hostile input and faults:
keys that expire, the model directory taken from the driver's own settings (never from the
batch record), input lines that cannot be encoded, batch ids, damaged records and saved
state, a full lane, steps that keep failing. Every step ends, and every line gets one
result line.

Steps run in this process against a real redis-server, mostly with no GPU worker: jobs stay
queued, so a batch is stopped by a cancel; the last test runs a whole batch through a
Celery worker and a GPU worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.settings import BulkSettings
from plurai.producer.bulk import drive, manage, plan, store
from plurai.producer.client import Client
from plurai.results.records import BadRecord

from .test_bulk import Celery

TASK = plan.Task("summarize", max_tokens=4)
BS = BulkSettings(pass_s=0.5, look_s=0.1, ttl_s=1000, running_ttl_s=50_000)


@pytest.fixture
def client(redis_url: str, monkeypatch) -> Iterator[Client]:
    from plurai.broker_config.celery_app import app, configure

    configure(app, redis_url)  # kick() sends the first step; no Celery worker takes it here
    monkeypatch.delenv("PLURAI_MODEL_DIR", raising=False)
    with Client(redis_url) as c:
        yield c


def write_docs(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(r + "\n" for r in rows))
    return path


def docs(n: int) -> list[str]:
    return [json.dumps({"id": f"doc-{i}", "text": f"the river stone {i}"}) for i in range(n)]


def run_steps(client: Client, batch_id: str, until: frozenset[str], bs=BS, n: int = 20) -> str:
    status = ""
    for _ in range(n):
        status = drive.step(client, batch_id, bs)
        if status in until:
            return status
    raise AssertionError(f"batch {batch_id} is {status}")


def batch_keys(r: redis.Redis, batch_id: str) -> list[str]:
    """Every key of the batch, found by pattern (so a key not in keys.batch_all counts)."""
    found = list(r.scan_iter(match=f"{keys.batch(batch_id)}*", count=1000))
    assert set(found) <= set(keys.batch_all(batch_id))
    return found


def ttls(r: redis.Redis, batch_id: str) -> dict[str, int]:
    return {k.rsplit(":", 1)[-1]: r.ttl(k) for k in batch_keys(r, batch_id)}


def test_every_key_expires_while_running_and_after(client, tmp_path):
    r = client.redis
    rows = [
        json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": "x"}})
        for i in range(5)
    ] + ["{not json"]
    batch_id = manage.create(client, BS, write_docs(tmp_path, rows))
    t = ttls(r, batch_id)
    assert set(t) == {batch_id, "input"} and all(40_000 < v <= 14 * 24 * 3600 for v in t.values())

    assert run_steps(client, batch_id, frozenset({store.IN_PROGRESS})) == store.IN_PROGRESS
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS  # jobs queued, no worker
    t = ttls(r, batch_id)
    assert {batch_id, "req", "lines", "state", "active"} <= set(t)
    assert all(49_000 < v <= 50_000 for v in t.values()), t  # the running TTL, renewed

    r.expire(keys.batch(batch_id), 100)
    drive.step(client, batch_id, BS)  # a pass renews the keys
    assert r.ttl(keys.batch(batch_id)) > 49_000

    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    t = ttls(r, batch_id)
    assert {batch_id, "req", "lines", "output", "errors"} <= set(t)
    assert all(0 < v <= 1000 for v in t.values()), t  # BulkSettings.ttl_s once it ended


def test_kicking_a_batch_that_is_gone_writes_nothing(client):
    from plurai.producer.bulk.tasks import kick

    assert kick(client, "batch_gone") is None
    assert client.redis.exists(keys.batch("batch_gone")) == 0


@pytest.mark.parametrize("bad", ["../x", "a/b", "/tmp/x", "batch:1:lines", ".."])
def test_malformed_batch_ids_are_refused(client, bad):
    for call in (manage.info, manage.cancel, manage.results):
        with pytest.raises(store.InvalidBatchId):
            call(client, bad)
    from plurai.producer.bulk.tasks import step

    assert step.run(bad, 1) == "invalid"


def test_the_driver_uses_its_own_model_dir_never_the_records(
    client, tmp_path, tiny_model, monkeypatch
):
    loaded: list[str] = []
    real = drive.tokenizer

    def spy(model_dir: str):
        loaded.append(model_dir)
        return real(model_dir)

    monkeypatch.setattr(drive, "tokenizer", spy)
    settings = client.settings  # the driver's own (the Celery task's client reads them)
    monkeypatch.setattr(settings, "model_dir", str(tiny_model))
    path = write_docs(tmp_path, docs(3))
    # the record names a folder of the same name somewhere else: the driver's own is used
    elsewhere = str(tmp_path / "nowhere" / tiny_model.name)
    same = manage.create(client, BS, path, task=TASK, model_dir=elsewhere, max_model_len=128)
    assert client.redis.hget(keys.batch(same), "model_dir") == elsewhere
    assert run_steps(client, same, frozenset({store.IN_PROGRESS})) == store.IN_PROGRESS
    drive.step(client, same, BS)
    assert loaded and set(loaded) == {str(tiny_model)}
    assert client.redis.hlen(keys.batch_state(same)) == 3  # its documents were queued

    # another model: every line fails, the batch fails, and says why
    other = tmp_path / "evil-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    bad = manage.create(client, BS, path, task=TASK, model_dir=str(other), max_model_len=128)
    assert run_steps(client, bad, store.TERMINAL) == store.FAILED
    info = manage.info(client, bad)
    (error,) = info["errors"]["data"]
    assert error["code"] == "model_mismatch" and "'evil-model'" in error["message"]
    assert info["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    out, err = manage.results(client, bad)
    assert out == "" and {json.loads(x)["error"]["code"] for x in err.splitlines()} == {
        "model_mismatch"
    }
    assert set(loaded) == {str(tiny_model)}  # nothing was read from the record's folder

    # a running batch whose driver is reconfigured with another model fails the same way,
    # every line with its error line: one whose driver died between marking it active and
    # saving its jobs included
    client.redis.hdel(keys.batch_state(same), "0")
    assert client.redis.sismember(keys.batch_active(same), "0")
    monkeypatch.setattr(settings, "model_dir", str(other))
    assert run_steps(client, same, store.TERMINAL) == store.FAILED
    info = manage.info(client, same)
    assert info["errors"]["data"][0]["code"] == "model_mismatch"
    assert info["request_counts"] == {"total": 3, "completed": 0, "failed": 3}

    # no model configured at all
    monkeypatch.setattr(settings, "model_dir", None)
    none = manage.create(client, BS, path, task=TASK, model_dir=str(tiny_model), max_model_len=128)
    assert run_steps(client, none, store.TERMINAL) == store.FAILED
    assert manage.info(client, none)["errors"]["data"][0]["code"] == "model_unavailable"
    assert set(loaded) == {str(tiny_model)}


def test_lines_that_cannot_be_encoded_get_error_lines(client, tmp_path):
    body = {"prompt": "the river"}
    ok = {"url": "/v1/completions", "body": body}
    rows = [
        json.dumps({"custom_id": "good", **ok}),
        '{"custom_id": "\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}',
        json.dumps({"custom_id": 17, **ok}),
        json.dumps({"custom_id": ["a"], **ok}),
        '{"custom_id": "bad-prompt", "url": "/v1/completions", "body": {"prompt": "\\udfff"}}',
        json.dumps({"custom_id": "good2", **ok}),
    ]
    batch_id = manage.create(client, BS, write_docs(tmp_path, rows))
    client.redis.rpush(keys.batch_input(batch_id), b'{"custom_id": "\xff\xfe"}')  # not UTF-8
    client.redis.hincrby(keys.batch(batch_id), "total", 1)
    assert run_steps(client, batch_id, frozenset({store.IN_PROGRESS})) == store.IN_PROGRESS
    assert drive.step(client, batch_id, BS) == store.IN_PROGRESS  # submits without a crash
    assert client.redis.hlen(keys.batch_state(batch_id)) == 2  # the two good lines
    manage.cancel(client, batch_id)
    assert run_steps(client, batch_id, store.TERMINAL) == store.CANCELLED
    _, err = manage.results(client, batch_id)
    got = {(x["custom_id"], x["error"]["code"]) for x in map(json.loads, err.splitlines())}
    assert (
        got
        == {
            ("good", "batch_cancelled"),
            ("good2", "batch_cancelled"),
            (None, "invalid_custom_id"),
            ("bad-prompt", "invalid_request"),
            ("\ufffd\ufffd", "invalid_url"),  # decoded with U+FFFD, then checked as usual
        }
        and len(err.splitlines()) == 7
    )


def test_results_refuse_ids_that_would_write_outside_the_folder(client, tmp_path, capsys):
    from plurai.cli import main as cli

    url = client.redis.connection_pool.connection_kwargs
    dest = tmp_path / "out"
    for bad in ("../escape", "/tmp/escape", "a/../../b", ".."):
        code = cli.main(["batch", "results", bad, "--dir", str(dest), "--url", "redis://x:1/0"])
        assert code == 2 and "invalid batch id" in capsys.readouterr().err
    assert not dest.exists() and not (tmp_path / "escape_output.jsonl").exists()
    assert url  # the client fixture's Redis was never needed


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
    from plurai.producer.bulk import tasks

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
    from plurai.producer.bulk import tasks

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


def test_end_to_end_with_celery(client, redis_url, workers, tiny_model, tmp_path):
    workers.start(1, "--engine", "max_model_len=128")
    celery = Celery(redis_url, tmp_path, tiny_model, {"PLURAI_BATCH_TTL_S": "600"})
    celery.start()
    try:
        rows = docs(4) + ['{"id": "\\ud800", "text": "x"}']
        elsewhere = str(tmp_path / "client-side" / tiny_model.name)
        path = write_docs(tmp_path, rows)
        batch_id = manage.create(
            client, BS, path, task=TASK, model_dir=elsewhere, max_model_len=128
        )
        end = time.monotonic() + 180
        while manage.info(client, batch_id)["status"] not in store.TERMINAL:
            assert time.monotonic() < end, (tmp_path / "celery-0.log").read_text()[-3000:]
            time.sleep(0.2)
        info = manage.info(client, batch_id)
        assert info["status"] == "completed" and info["errors"] is None
        assert info["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
        out, err = manage.results(client, batch_id)
        assert [json.loads(x)["custom_id"] for x in out.splitlines()] == [
            f"doc-{i}" for i in range(4)
        ]
        assert json.loads(err)["error"]["code"] == "invalid_custom_id"
        t = ttls(client.redis, batch_id)
        assert t and all(0 < v <= 600 for v in t.values()), t
    finally:
        celery.stop()
