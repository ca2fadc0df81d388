"""The Batches API's pieces without a server: batch and file objects from any record,
the client's metadata and expiry, stored files read back as `plurai batch submit` reads a
file, lines naming the other endpoint (fakeredis; the endpoints run in
tests/integration/test_gateway_batches.py)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from types import SimpleNamespace

import fakeredis
import pytest
from starlette.datastructures import UploadFile

from gateway import batches
from producer.bulk import manage
from producer.openai_body import BadRequest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


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
    b = batches.batch_object("batch_1", meta)
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


def test_batch_object_while_running_and_of_a_damaged_record():
    running = batches.batch_object("b", {"status": "in_progress", "total": "5", "completed": "5"})
    assert running["output_file_id"] is None and running["error_file_id"] is None
    expiring = batches.batch_object("b", {"status": "cancelling", "stop_reason": "expired"})
    assert expiring["status"] == "finalizing"
    damaged = {
        "status": "\ufffd",
        "total": "-1",
        "completed": "x" * 40,
        "created_ms": "1e9",
        "metadata": "[1, 2]",
        "error_code": "model_mismatch",
    }
    b = batches.batch_object("b", damaged)
    assert b["status"] == "failed" and b["created_at"] == 0 and b["metadata"] is None
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert b["errors"]["data"][0]["code"] == "model_mismatch"
    assert batches.batch_object("b", {"metadata": "[[[" * 10_000})["metadata"] is None


def test_file_object_and_ids():
    f = batches.file_object("file-x", {"bytes": "12", "created_at": "5", "filename": "a.jsonl"})
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
    m = batches.RESULT_FILE_ID.fullmatch("file-batch_a-b-errors")
    assert m and (m["batch"], m["kind"]) == ("batch_a-b", "errors")
    assert batches.FILE_ID.fullmatch("file-" + "0" * 24)
    assert not batches.RESULT_FILE_ID.fullmatch("file-" + "0" * 24)
    assert not batches.FILE_ID.fullmatch("file-../x")


def test_metadata_and_expiry_checks():
    assert batches.check_metadata(None) is None
    assert batches.check_metadata({"a": "b"}) == {"a": "b"}
    for bad in ([], {"a": 1}, {"k" * 65: "v"}, {"a": "v" * 513}, {f"{i}": "" for i in range(17)}):
        with pytest.raises(BadRequest):
            batches.check_metadata(bad)
    assert batches.expires_after({}, 99) == 99
    form = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}
    assert batches.expires_after(form, 99) == 7200
    for seconds in ("60", "99999999", "1.5", ""):
        with pytest.raises(BadRequest):
            batches.expires_after({**form, "expires_after[seconds]": seconds}, 99)
    with pytest.raises(BadRequest):
        batches.expires_after({**form, "expires_after[anchor]": "now"}, 99)


def test_stored_file_reads_as_the_cli_reads_a_file(tmp_path: Path):
    data = "a\r\n\r\n  \nb\u2028c\nd\re\n" + "é" * 3000 + "\nlast"
    path = tmp_path / "in.jsonl"
    path.write_bytes(data.encode())
    r = fakeredis.FakeRedis()
    r.set("f", data.encode())
    raw = io.BufferedReader(batches._StoredFile(r, "f", r.strlen("f")), 64)
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=None) as f:
        assert list(manage.lines_of(f)) == manage.read_input(path, documents=False)
    r.delete("f")
    with pytest.raises(batches.FileGone):  # deleted while it is read
        batches._StoredFile(r, "f", 10).read(10)


def test_lines_naming_the_other_endpoint():
    def line(url, cid="x"):
        return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {}})

    check = manage._other_endpoint
    assert check(line(CHAT), 1, CHAT, 4096) is None
    cid, code, message = check(line(COMPLETIONS), 7, CHAT, 4096)
    assert (cid, code) == ("x", "invalid_url") and message.startswith("line 7: ")
    # what parse_line refuses for another reason is left to it
    for other in (
        line("/v1/embeddings"),
        line(COMPLETIONS, cid=""),
        line(COMPLETIONS, cid=5),
        "{not json",
        "[" * 4000,  # nested past the parser's recursion limit
        "[]",
        line(COMPLETIONS, cid="y" * 5000),
    ):
        assert check(other, 1, CHAT, 4096) is None


def test_line_ends_are_counted_as_the_batch_reads_them(monkeypatch):
    # a lone \r ends a line too (universal newlines): it may not slip past MAX_FILE_LINES
    monkeypatch.setattr(batches, "MAX_FILE_LINES", 4)
    monkeypatch.setattr(batches, "CHUNK", 3)  # so a \r\n is cut between two reads
    api = batches.Batches.__new__(batches.Batches)
    api.gw = SimpleNamespace(client=SimpleNamespace(redis=fakeredis.FakeAsyncRedis()))

    def lines(data: bytes) -> str:
        try:
            asyncio.run(api._store("file-x", UploadFile(io.BytesIO(data))))
        except BadRequest as e:
            return e.code
        return "ok"

    for sep in (b"\n", b"\r", b"\r\n"):
        assert lines(b"{}" + sep + b"{}" + sep + b"{}" + sep + b"{}") == "ok"
        assert lines(b"{}" + sep + b"{}" + sep + b"{}" + sep + b"{}" + sep) == "ok"
        assert lines(b"{}" + sep + b"{}" + sep + b"{}" + sep + b"{}" + sep + b"{}") == (
            "too_many_lines"
        )
    assert lines(b"{}\r" * 5) == "too_many_lines"
    assert lines(b"{}\r\r\n\r" * 2) == "too_many_lines"  # 6 line ends, 4 of them blank
