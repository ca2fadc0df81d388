"""The OpenAI objects of the Files and Batches APIs (gateway/batch_objects.py), from the
stored records, and the batch fields a client sends."""

from __future__ import annotations

import json

import pytest

from plurai.gateway import batch_objects
from plurai.gateway.batch_objects import batch_object
from plurai.producer.bulk.store import BatchRecord
from plurai.producer.openai_body import BadRequest

CHAT = "/v1/chat/completions"


def test_batch_object_of_a_finished_record():
    meta = {
        "status": "completed",
        "endpoint": CHAT,
        "input_file_id": "file-" + "a" * 24,
        "completion_window": "24h",
        "created_ms": "1700000000123",
        "started_ms": "1700000001000",
        "finished_ms": "1700000009000",
        "expires_ms": "1700086400123",
        "total": "3",
        "completed": "2",
        "failed": "1",
        "prompt_tokens": "30",
        "output_tokens": "12",
        "metadata": json.dumps({"run": "a"}),
    }
    b = batch_object(BatchRecord.from_hash("batch_1", meta))
    assert b["status"] == "completed" and b["object"] == "batch"
    assert b["output_file_id"] == "file-batch_1-output"
    assert b["error_file_id"] == "file-batch_1-errors"
    assert (b["created_at"], b["in_progress_at"], b["completed_at"]) == (
        1700000000,
        1700000001,
        1700000009,
    )
    assert b["failed_at"] is b["cancelled_at"] is None
    assert b["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert b["usage"]["total_tokens"] == 42 and b["metadata"] == {"run": "a"}


def obj(**fields: str) -> dict:
    return batch_object(BatchRecord.from_hash("b", fields))


def test_batch_object_while_running_and_of_odd_records():
    running = obj(status="in_progress", total="5", completed="5")
    assert running["output_file_id"] is None and running["error_file_id"] is None
    assert obj(status="cancelling", stop_reason="expired")["status"] == "finalizing"
    odd = obj(status="\ufffd", metadata="[1, 2]", error_code="model_mismatch")
    assert odd["status"] == "failed" and odd["created_at"] == 0 and odd["metadata"] is None
    assert odd["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert odd["errors"]["data"][0]["code"] == "model_mismatch"
    assert obj(status="completed", metadata="[[[" * 10_000)["metadata"] is None


def test_file_object_and_ids():
    f = batch_objects.file_object(
        "file-x", {"bytes": "12", "created_at": "5", "filename": "a.jsonl"}
    )
    assert f == {
        "id": "file-x",
        "object": "file",
        "bytes": 12,
        "created_at": 5,
        "expires_at": None,
        "filename": "a.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }
    m = batch_objects.RESULT_FILE_ID.fullmatch("file-batch_a-b-errors")
    assert m and (m["batch"], m["kind"]) == ("batch_a-b", "errors")
    assert batch_objects.FILE_ID.fullmatch("file-" + "0" * 24)
    assert not batch_objects.RESULT_FILE_ID.fullmatch("file-" + "0" * 24)
    assert not batch_objects.FILE_ID.fullmatch("file-../x")


def test_metadata_checks():
    assert batch_objects.check_metadata(None) is None
    assert batch_objects.check_metadata({"a": "b"}) == {"a": "b"}
    for bad in ([], {"a": 1}, {"k" * 65: "v"}, {"a": "v" * 513}, {f"{i}": "" for i in range(17)}):
        with pytest.raises(BadRequest):
            batch_objects.check_metadata(bad)
