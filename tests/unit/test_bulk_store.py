"""The bulk store without Redis: batch ids, key lifetimes, and the batch record and line
progress as they are parsed from what Redis holds."""

from __future__ import annotations

import json

import fakeredis
import pytest

from plurai.broker_config import keys
from plurai.broker_config.settings import BulkSettings
from plurai.producer.bulk import store
from plurai.producer.bulk.store import BatchRecord, LineProgress
from plurai.results.records import BadRecord


@pytest.mark.parametrize(
    "bad", ["", "..", "../x", "a/b", "/abs", "a\\b", "x:lines", "a b", "é", "x" * 65, "a\n"]
)
def test_batch_ids_that_could_name_other_keys_or_paths_are_refused(bad):
    with pytest.raises(store.InvalidBatchId, match="invalid batch id"):
        store.check_id(bad)


def test_well_formed_batch_ids_pass():
    for good in ("batch_0123456789abcdef01234567", "batch_nosuch", "A-b_9"):
        assert store.check_id(good) == good


def test_running_batches_keep_their_keys_longer_than_the_window():
    bs = BulkSettings()
    assert bs.running_ttl_s > bs.completion_window_s and bs.running_ttl_s >= bs.ttl_s


def test_a_batch_record_round_trips_through_its_hash():
    rec = BatchRecord("b1", store.VALIDATING, total=3, failed=1, created_ms=5, tenant="t")
    h = rec.to_hash()
    # counts are written at creation; fields not set (valid, cancelling_ms) are not
    assert h == {
        "status": "validating",
        "total": 3,
        "completed": 0,
        "failed": 1,
        "gen": 0,
        "created_ms": 5,
        "tenant": "t",
    }
    raw = {k.encode(): str(v).encode() for k, v in h.items()}  # as a raw connection reads it
    assert BatchRecord.from_hash("b1", raw) == rec
    assert BatchRecord.from_hash("b1", {"status": "x", "valid": "0"}).valid == 0


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"total": "3"}, "has no status"),
        ({"status": "in_progress", "total": "two"}, "'total' is not a count: 'two'"),
        ({"status": "in_progress", "next": "-1"}, "'next' is not a count"),
        ({"status": "in_progress", "created_ms": "1e9"}, "'created_ms' is not a count"),
        ({"status": "in_progress", "gen": ""}, "'gen' is not a count"),
    ],
)
def test_a_damaged_batch_record_is_a_bad_record_naming_its_field(raw: dict, says: str):
    with pytest.raises(BadRecord, match=f"^batch b1: .*{says}"):
        BatchRecord.from_hash("b1", raw)


def test_line_progress_keeps_its_stored_format():
    saved = json.dumps({"level": 1, "jobs": ["j1", "j2"], "p": 30, "o": 12})
    st = LineProgress.from_json(saved)
    assert st == LineProgress(1, ["j1", "j2"], 30, 12) and st.usage == (30, 12)
    assert json.loads(st.to_json()) == json.loads(saved)
    assert LineProgress.from_json(saved.encode()) == st


@pytest.mark.parametrize(
    "saved",
    [
        "[1]",
        "{oops",
        "[" * 5000,
        '{"level": 0, "jobs": ["j"], "p": 0}',
        '{"level": true, "jobs": ["j"], "p": 0, "o": 0}',
        '{"level": 0, "jobs": [5], "p": 0, "o": 0}',
        '{"level": 0, "jobs": "j", "p": 0, "o": 0}',
    ],
)
def test_damaged_line_progress_is_a_bad_record(saved: str):
    with pytest.raises(BadRecord):
        LineProgress.from_json(saved)


def test_get_reads_a_record_or_says_why_it_cannot():
    r = fakeredis.FakeRedis(decode_responses=True)
    assert store.get(r, "b1") is None
    r.hset(keys.batch("b1"), mapping={"status": "in_progress", "total": "2"})
    assert store.get(r, "b1") == BatchRecord("b1", "in_progress", total=2)
    r.hset(keys.batch("b1"), "error", b"\xff")
    with pytest.raises(BadRecord, match="not UTF-8"):
        store.get(r, "b1")
    r.delete(keys.batch("b1"))
    r.set(keys.batch("b1"), "not a hash")
    with pytest.raises(BadRecord, match="another type"):
        store.get(r, "b1")
