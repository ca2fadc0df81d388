"""The dashboard's readers of Redis on what no Plurai process writes (fakeredis): ids
that are no job ids, records of another type, junk in dead letters and the batches index
are shown bounded or skipped, never raised."""

from __future__ import annotations

import json

import fakeredis
import msgpack
import pytest

from plurai.broker_config import keys
from plurai.gateway import dashboard


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def test_recent_jobs_newest_first_once_each(r) -> None:
    for job_id in ("job-aaaaaaaa", "job-bbbbbbbb", "job-aaaaaaaa"):  # a begins twice
        r.xadd(keys.RECENT, {"id": job_id, "model": "m", "lane": "standard"})
    r.hset(
        keys.job("job-aaaaaaaa"),
        mapping={
            "state": "completed",
            "worker": "w1",
            "created_ms": 1000,
            "first_token_ms": 1250,
            "output_tokens": 7,
        },
    )
    rows = dashboard.recent_jobs(r)
    assert [x["id"] for x in rows] == ["job-aaaaaaaa", "job-bbbbbbbb"]
    a, b = rows
    assert a["state"] == "completed" and a["ttft_ms"] == 250 and a["output_tokens"] == 7
    assert b["state"] == "expired" and b["ttft_ms"] is None  # no record (any more)


def test_recent_jobs_skip_or_flag_what_is_not_plurai(r) -> None:
    r.xadd(keys.RECENT, {"id": "short"})  # no job id
    r.xadd(keys.RECENT, {"id": "x" * 200})
    r.xadd(keys.RECENT, {"id": b"\xff\xfe-not-utf8-aaaa"})
    r.xadd(keys.RECENT, {"model": "m"})
    r.xadd(keys.RECENT, {"id": "job-cccccccc", "lane": "l" * 1000})
    r.set(keys.job("job-cccccccc"), "a string, not a hash")
    r.xadd(keys.RECENT, {"id": "job-dddddddd"})
    r.hset(keys.job("job-dddddddd"), mapping={"state": "running", "first_token_ms": "soon"})
    rows = dashboard.recent_jobs(r)
    assert [x["id"] for x in rows] == ["job-dddddddd", "job-cccccccc"]
    assert rows[0]["state"] == "running" and rows[0]["first_token_ms"] is None
    assert rows[1]["state"] == "bad_record" and len(rows[1]["lane"]) == 128


def test_recent_jobs_read_a_bounded_count(r) -> None:
    for i in range(500):
        r.xadd(keys.RECENT, {"id": f"job-{i:08d}"})
    rows = dashboard.recent_jobs(r, n=50)
    assert len(rows) == 50 and rows[0]["id"] == "job-00000499"


def test_dead_letters(r) -> None:
    cut = json.dumps({"v": "2", "id": "job-ffffffff", "body": "x" * 70000})[:65536]
    r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "too many", "fields": cut})
    r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "bad_record", "job_id": "job-gggggggg"})
    r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "e" * 5000, "fields": "not json"})
    r.xadd(
        keys.DEAD_LETTER,
        {"lane": "batch", "error": "too many", "fields": json.dumps({"id": "job-eeeeeeee"})},
    )
    r.xadd(keys.DEAD_LETTER, {"fields": json.dumps({"id": "<script>"})})
    out = dashboard.dead_letters(r)
    assert out["count"] == 5
    newest, second, oldest, result, cut = out["recent"]
    assert cut["job_id"] == "job-ffffffff"  # its fields cut at 64 KiB: no JSON any more
    assert result["job_id"] == "job-gggggggg"  # a result that could not be stored
    assert newest["job_id"] is None  # not a job id: not shown as one
    assert second["job_id"] == "job-eeeeeeee" and second["error"] == "too many"
    assert len(oldest["error"]) == dashboard.SHORT and oldest["at_ms"] > 0


def test_batches(r) -> None:
    r.zadd(keys.BATCHES, {"batch_one": 1, "batch_gone": 2, "bad id!": 3, "batch_str": 4})
    r.hset(keys.batch("batch_one"), mapping={"status": "in_progress", "total": 10, "completed": 4})
    r.set(keys.batch("batch_str"), "x")
    (row,) = dashboard.batches(r)
    assert row == {
        "id": "batch_one",
        "status": "in_progress",
        "total": 10,
        "completed": 4,
        "failed": None,
        "created_ms": None,
        "tenant": None,
    }


def test_a_list_key_of_another_type_empties_its_section_only(r, caplog) -> None:
    for key in (keys.RECENT, keys.DEAD_LETTER, keys.BATCHES):
        r.set(key, "not a stream or a sorted set")
    assert dashboard._or(dashboard.recent_jobs, r, []) == []
    assert dashboard._or(dashboard.batches, r, []) == []
    assert dashboard._or(dashboard.dead_letters, r, None) is None
    assert "another type" in caplog.text


def test_a_heartbeats_lane_counts_are_read_or_dropped(r) -> None:
    from plurai.broker_config import stats

    good = {"standard": [3, 120], "batch": [1, 16]}
    beats = {
        "w-good": json.dumps(good),
        "w-none": "",  # an older worker writes none
        "w-junk": "{not json",
        "w-list": "[1, 2]",
        "w-odd": json.dumps({"a": [1], "b": ["1", 2], "c": [1.5, 2], "d": [2, 3]}),
    }
    for worker_id, raw in beats.items():
        r.sadd(keys.WORKERS, worker_id)
        r.hset(keys.worker(worker_id), mapping={"state": "serving", "lanes_done": raw})
    live, _ = stats.workers(r, stats.redis_now_ms(r))
    got = {w.id: w.lanes_done for w in live}
    assert got == {"w-good": good, "w-none": {}, "w-junk": {}, "w-list": {}, "w-odd": {"d": [2, 3]}}
    snap = stats.Snapshot(time_s=1.0, lanes=[], workers=live, dead_letters=0)
    snap.lanes = [stats.Lane("standard", model="m", waiting=2)]
    for w in live:
        w.served_model = "m"
    point, counts = dashboard.sample(snap, None)
    assert point["lanes"] == [["m", "standard", 2, 0, 0.0, None, None]]  # no rate yet
    # two seconds on: w-good ended 4 more jobs of 80 tokens; w-none its first 3 of 40 (a
    # lane it had no count of: from 0); a worker seen for the first time adds nothing (its
    # counts since its start are no rate)
    later = [w for w in live if w.id != "w-junk"]
    for w in later:
        if w.id == "w-good":
            w.lanes_done = {"standard": [7, 200], "batch": [1, 16]}
        if w.id == "w-none":
            w.lanes_done = {"standard": [3, 40]}
    newcomer = stats.WorkerInfo("w-new", served_model="m", lanes_done={"standard": [90, 9]})
    snap = stats.Snapshot(time_s=3.0, lanes=snap.lanes, workers=[*later, newcomer], dead_letters=0)
    point, _ = dashboard.sample(snap, counts)
    assert point["lanes"] == [["m", "standard", 2, 0, 0.0, 3.5, 60.0]]
    # a worker whose counts fell (not the same process any more) adds nothing either
    snap.workers = [stats.WorkerInfo("w-good", served_model="m", lanes_done={"standard": [1, 1]})]
    point, _ = dashboard.sample(snap, counts)
    assert point["lanes"] == [["m", "standard", 2, 0, 0.0, 0.0, 0.0]]


def test_heartbeat_figures_that_are_no_numbers_read_as_none_given(r) -> None:
    from plurai.broker_config import stats

    r.sadd(keys.WORKERS, "w1")
    r.hset(
        keys.worker("w1"),
        mapping={
            "state": "serving",
            "running": "three",
            "tokens_per_s": "nan",
            "kv_blocks_used": "inf",
            "jobs_done": "12",
            "beat_ms": "soon",
        },
    )
    (w,), _ = stats.workers(r, stats.redis_now_ms(r))
    assert (w.running, w.tokens_per_s, w.kv_blocks_used, w.jobs_done) == (0, 0.0, 0, 12)
    assert w.beat_age_s == 0.0
    json.dumps(stats.Snapshot(1.0, [], [w], 0).to_dict(), allow_nan=False)


def test_a_dead_letter_that_kept_its_entry_is_shown_requeueable(r) -> None:
    entry = msgpack.packb({b"v": b"2", b"id": b"job-hhhhhhhh"})
    r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "x", "entry": entry, "fields": "{}"})
    r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "y", "fields": "{}"})
    newer, older = dashboard.dead_letters(r)["recent"]
    assert (newer["requeueable"], older["requeueable"]) == (False, True)
