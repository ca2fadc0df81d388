"""Uploads of the Files API (gateway/batches.py): a file's bytes copied to Redis and
checked as they come (UTF-8, not blank, at most MAX_FILE_BYTES and MAX_FILE_LINES), its
lifetime and name, and a stored file read back a range at a time."""

from __future__ import annotations

import codecs
import io
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio
from starlette.datastructures import UploadFile

from plurai.broker_config.text import valid_text
from plurai.gateway.batch_objects import DIGITS
from plurai.producer.openai_body import BadRequest

MAX_FILE_BYTES = 200 << 20  # OpenAI's own limit for a batch input file
MAX_FILE_LINES = 50_000  # OpenAI's limit of requests in one batch
FORM_SLACK = 64 << 10  # the multipart framing and small fields around the file
CHUNK = 1 << 20  # bytes per Redis read or write of a file
UPLOAD_TTL_S = 3600  # an upload's bytes until its metadata makes it a file
MIN_EXPIRES_S, MAX_EXPIRES_S = 3600, 30 * 86400  # OpenAI's bounds of expires_after
FILENAME_CHARS = 255


class FileGone(Exception):
    """The stored file expired or was deleted while it was read."""


def expires_after(form: Any, default_s: int) -> int:
    """The file's lifetime: the form's expires_after[seconds] (anchor created_at), else
    `default_s`."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_s
    if (
        anchor != "created_at"
        or not isinstance(seconds, str)
        or DIGITS.fullmatch(seconds) is None
        or not MIN_EXPIRES_S <= int(seconds) <= MAX_EXPIRES_S
    ):
        raise BadRequest(
            f"expires_after: anchor 'created_at' and seconds from {MIN_EXPIRES_S} to "
            f"{MAX_EXPIRES_S}",
            param="expires_after",
        )
    return int(seconds)


def filename_of(upload: UploadFile) -> str:
    name = upload.filename or "upload.jsonl"
    if not valid_text(name):
        name = name.encode("utf-8", "replace").decode()
    return name[:FILENAME_CHARS]


def too_large() -> BadRequest:
    return BadRequest(
        f"the file is over {MAX_FILE_BYTES} bytes", code="file_too_large", param="file", status=413
    )


async def capped(stream: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    got = 0
    async for chunk in stream:
        got += len(chunk)
        if got > limit:
            raise too_large()
        yield chunk


class StoredFile(io.RawIOBase):
    """A stored file's bytes, read from Redis a range at a time (sync)."""

    def __init__(self, r: redis.Redis, key: str, size: int) -> None:
        self.r, self.key, self.size, self.pos = r, key, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.r.getrange(self.key, self.pos, self.pos + n - 1)
        if not data:
            raise FileGone(self.key)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


async def store(r: redis.asyncio.Redis, name: str, upload: UploadFile) -> int:
    """Copy the upload to the key `name`, checking it as it goes: UTF-8, not blank, at
    most MAX_FILE_BYTES and MAX_FILE_LINES; returns its size. Nothing is left on failure."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    size = ends = 0
    blank, last = True, b""
    try:
        while chunk := await upload.read(CHUNK):
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise too_large()
            utf8.decode(chunk)
            # line ends as the batch reads the file (universal newlines): \n, \r\n, \r;
            # a \r that ends a read is counted with the next (it may start a \r\n)
            ends += last == b"\r" and chunk[:1] != b"\n"
            ends += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            ends -= chunk[-1:] == b"\r"
            if ends > MAX_FILE_LINES:
                raise BadRequest(f"the file has over {MAX_FILE_LINES} lines", code="too_many_lines")
            blank = blank and not chunk.strip()
            last = chunk[-1:]
            if size == len(chunk):
                await r.set(name, chunk, ex=UPLOAD_TTL_S)
            else:
                await r.append(name, chunk)
        utf8.decode(b"", final=True)
        if ends + (last not in (b"", b"\n")) > MAX_FILE_LINES:  # a last \r or line
            raise BadRequest(f"the file has over {MAX_FILE_LINES} lines", code="too_many_lines")
        if blank:
            raise BadRequest("the file is empty: send JSONL, one request a line", param="file")
    except UnicodeDecodeError:
        await r.delete(name)
        raise BadRequest("the file is not UTF-8 text", code="invalid_utf8", param="file") from None
    except BaseException:
        await r.delete(name)
        raise
    return size
