"""Uploads of the Files API (gateway/uploads.py) without a server: lifetimes, stored files
read back as `plurai batch submit` reads a file, line ends counted as the batch reads them
(fakeredis; the endpoints run in tests/integration/test_gateway_batches.py)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import fakeredis
import pytest
from starlette.datastructures import UploadFile

from plurai.gateway import uploads
from plurai.producer.bulk import manage
from plurai.producer.openai_body import BadRequest


def test_expiry_checks():
    assert uploads.expires_after({}, 99) == 99
    form = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}
    assert uploads.expires_after(form, 99) == 7200
    for seconds in ("60", "99999999", "1.5", ""):
        with pytest.raises(BadRequest):
            uploads.expires_after({**form, "expires_after[seconds]": seconds}, 99)
    with pytest.raises(BadRequest):
        uploads.expires_after({**form, "expires_after[anchor]": "now"}, 99)


def test_stored_file_reads_as_the_cli_reads_a_file(tmp_path: Path):
    data = "a\r\n\r\n  \nb\u2028c\nd\re\n" + "é" * 3000 + "\nlast"
    path = tmp_path / "in.jsonl"
    path.write_bytes(data.encode())
    r = fakeredis.FakeRedis()
    r.set("f", data.encode())
    raw = io.BufferedReader(uploads.StoredFile(r, "f", r.strlen("f")), 64)
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=None) as f:
        assert list(manage.lines_of(f)) == manage.read_input(path, documents=False)
    r.delete("f")
    with pytest.raises(uploads.FileGone):  # deleted while it is read
        uploads.StoredFile(r, "f", 10).read(10)


def test_line_ends_are_counted_as_the_batch_reads_them(monkeypatch):
    # a lone \r ends a line too (universal newlines): it may not slip past MAX_FILE_LINES
    monkeypatch.setattr(uploads, "MAX_FILE_LINES", 4)
    monkeypatch.setattr(uploads, "CHUNK", 3)  # so a \r\n is cut between two reads
    r = fakeredis.FakeAsyncRedis()

    def lines(data: bytes) -> str:
        try:
            asyncio.run(uploads.store(r, "f", UploadFile(io.BytesIO(data))))
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
