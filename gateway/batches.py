"""OpenAI's Files and Batches APIs onto the bulk pipeline (producer/bulk).

    POST   /v1/files                    upload a JSONL file (multipart; purpose "batch")
    GET    /v1/files/{id}               the file object
    GET    /v1/files/{id}/content       its bytes
    DELETE /v1/files/{id}               forget it before it expires
    POST   /v1/batches                  a bulk batch of a file's lines (manage.create)
    GET    /v1/batches/{id}             the batch object
    POST   /v1/batches/{id}/cancel      manage.cancel

An upload is stored whole in Redis (keys.file, with its metadata in keys.file_meta) for
the bulk completion window, or the `expires_after` the client asks for: at most
MAX_FILE_BYTES, MAX_FILE_LINES lines, UTF-8. Its lines are judged one by one when a batch
runs (producer/bulk/inputs.py), a bad line becoming a line of the error file. A batch's
output and error files are virtual: `file-<batch id>-output` and `file-<batch id>-errors`
name the JSONL texts the batch's finalize wrote (manage.results), once it has ended.

With an API key, files and batches belong to the key's tenant: another tenant's id is
unknown (404). Without one (an open gateway) every file and batch is visible.
"""

from __future__ import annotations

import codecs
import functools
import io
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis
import redis.asyncio
from kombu.exceptions import OperationalError
from redis.client import NEVER_DECODE
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from broker_config import keys
from broker_config.celery_app import app as celery_app
from broker_config.celery_app import configure
from broker_config.connection import connect
from broker_config.memory import is_oom
from broker_config.settings import BulkSettings
from broker_config.text import text, valid_text
from gateway import auth
from gateway.app import Gateway
from gateway.auth import Key, Unauthorized
from gateway.errors import error, unavailable
from producer.bulk import drive, inputs, manage, store
from producer.client import Client
from producer.openai_body import BadRequest

log = logging.getLogger("plurai.gateway")

MAX_FILE_BYTES = 200 << 20  # OpenAI's own limit for a batch input file
MAX_FILE_LINES = 50_000  # OpenAI's limit of requests in one batch
FORM_SLACK = 64 << 10  # the multipart framing and small fields around the file
CHUNK = 1 << 20  # bytes per Redis read or write of a file
UPLOAD_TTL_S = 3600  # an upload's bytes until its metadata makes it a file
MIN_EXPIRES_S, MAX_EXPIRES_S = 3600, 30 * 86400  # OpenAI's bounds of expires_after
COMPLETION_WINDOW = "24h"
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
FILENAME_CHARS = 255

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
RESULT_FILE_ID = re.compile(r"file-(?P<batch>[A-Za-z0-9_-]{1,64})-(?P<kind>output|errors)")
_DIGITS = re.compile(r"[0-9]{1,15}")

# The bulk store's statuses are OpenAI's, but for a batch that is past its window and
# stopping (cancelling with stop_reason "expired"): OpenAI has no such state, and it is
# writing its files.
_STATUSES = frozenset(
    {
        store.VALIDATING,
        store.IN_PROGRESS,
        store.FINALIZING,
        store.COMPLETED,
        store.FAILED,
        store.CANCELLING,
        store.CANCELLED,
        store.EXPIRED,
    }
)
_ENDED_AT = {
    store.COMPLETED: "completed_at",
    store.FAILED: "failed_at",
    store.CANCELLED: "cancelled_at",
    store.EXPIRED: "expired_at",
}


class FileGone(Exception):
    """The stored file expired or was deleted while it was read."""


SCAN_BATCHES = 5000  # batch ids one list page may look at (other tenants' are skipped)


def _not_found(what: str, ident: str, param: str | None = None) -> BadRequest:
    shown = ident if len(ident) <= 80 and ident.isprintable() else ident[:80] + "..."
    return BadRequest(f"no {what} {shown!r}", code=f"{what}_not_found", param=param, status=404)


def _int(meta: dict[str, str], name: str) -> int:
    """A count or unix-ms field of a record; 0 when it is missing or not one."""
    v = meta.get(name, "")
    return int(v) if _DIGITS.fullmatch(v) else 0


def _seconds(meta: dict[str, str], name: str) -> int | None:
    ms = _int(meta, name)
    return ms // 1000 if ms else None


def _visible(meta: dict[str, str], key: Key | None) -> bool:
    return key is None or meta.get("tenant", "") == key.tenant


# -- the objects ------------------------------------------------------------------------


def file_object(file_id: str, meta: dict[str, str]) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": _int(meta, "bytes"),
        "created_at": _int(meta, "created_at"),
        "expires_at": _int(meta, "expires_at") or None,
        "filename": meta.get("filename", ""),
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }


def result_file_object(batch_id: str, kind: str, meta: dict[str, str], size: int) -> dict:
    return {
        "id": f"file-{batch_id}-{kind}",
        "object": "file",
        "bytes": size,
        "created_at": (_int(meta, "finished_ms") or _int(meta, "created_ms")) // 1000,
        "expires_at": None,
        "filename": f"{batch_id}_{kind}.jsonl",
        "purpose": "batch_output",
        "status": "processed",
        "status_details": None,
    }


def status_of(meta: dict[str, str]) -> str:
    status = meta.get("status", "")
    if status == store.CANCELLING and meta.get("stop_reason") == "expired":
        return store.FINALIZING
    return status if status in _STATUSES else store.FAILED


def metadata_of(meta: dict[str, str]) -> dict[str, str] | None:
    try:
        value = json.loads(meta.get("metadata") or "null")
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return None
    return value


def batch_object(batch_id: str, meta: dict[str, str]) -> dict[str, Any]:
    """The OpenAI batch object of a bulk batch record (store.get); any record, whatever
    its fields hold."""
    status = status_of(meta)
    counts = {k: _int(meta, k) for k in ("total", "completed", "failed")}
    ended = meta.get("status") in store.TERMINAL
    prompt, output = _int(meta, "prompt_tokens"), _int(meta, "output_tokens")
    obj: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": meta.get("endpoint") or None,
        "errors": None,
        "input_file_id": meta.get("input_file_id") or None,
        "completion_window": meta.get("completion_window") or COMPLETION_WINDOW,
        "status": status,
        "output_file_id": f"file-{batch_id}-output" if ended and counts["completed"] else None,
        "error_file_id": f"file-{batch_id}-errors" if ended and counts["failed"] else None,
        "created_at": _int(meta, "created_ms") // 1000,
        "in_progress_at": _seconds(meta, "started_ms") if status != store.VALIDATING else None,
        "expires_at": _seconds(meta, "expires_ms"),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": _seconds(meta, "cancelling_ms"),
        "cancelled_at": None,
        "request_counts": counts,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        },
        "metadata": metadata_of(meta),
    }
    if status in _ENDED_AT:
        obj[_ENDED_AT[status]] = _seconds(meta, "finished_ms")
    if meta.get("error_code"):
        error = {
            "code": meta["error_code"],
            "message": meta.get("error", ""),
            "param": None,
            "line": None,
        }
        obj["errors"] = {"object": "list", "data": [error]}
    return obj


# -- reading what the client sent --------------------------------------------------------


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys to 64 and values to 512 chars."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > METADATA_PAIRS
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= METADATA_KEY_CHARS
            and len(v) <= METADATA_VALUE_CHARS
            for k, v in value.items()
        )
    ):
        raise BadRequest(
            f"metadata: an object of at most {METADATA_PAIRS} string pairs, keys of at most "
            f"{METADATA_KEY_CHARS} characters, values of at most {METADATA_VALUE_CHARS}",
            param="metadata",
        )
    return value


def expires_after(form: Any, default_s: int) -> int:
    """The file's lifetime: the form's expires_after[seconds] (anchor created_at), else
    `default_s`."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_s
    if (
        anchor != "created_at"
        or not isinstance(seconds, str)
        or _DIGITS.fullmatch(seconds) is None
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


def _too_large() -> BadRequest:
    return BadRequest(
        f"the file is over {MAX_FILE_BYTES} bytes", code="file_too_large", param="file", status=413
    )


async def _capped(stream: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    got = 0
    async for chunk in stream:
        got += len(chunk)
        if got > limit:
            raise _too_large()
        yield chunk


class _StoredFile(io.RawIOBase):
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


# -- the endpoints ---------------------------------------------------------------------

Handler = Callable[["Batches", Request], Awaitable[Response]]


def _endpoint(route: str) -> Callable[[Handler], Handler]:
    """Answers BadRequest with its status and code, an unavailable Redis or broker with a
    503; counts the request in the gateway's metrics."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(self: Batches, request: Request) -> Response:
            try:
                response = await fn(self, request)
            except BadRequest as e:
                kind = "authentication_error" if e.status == 401 else None
                response = error(e.status, e.message, e.code, e.param, kind=kind)
            except ClientDisconnect:
                response = Response(status_code=499)  # nobody reads it
            except redis.ResponseError as e:
                if is_oom(e):  # an upload can fill it: 503 redis_oom, Retry-After
                    response = unavailable(e)
                else:
                    log.warning("%s: Redis refused a command: %s", route, e)
                    response = error(500, "the stored record is damaged", "internal")
            except (redis.RedisError, OperationalError):
                response = unavailable()
            return response

        return handler

    return wrap


class Batches:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.bs = BulkSettings()
        configure(celery_app, gw.url)  # manage.create sends the batch's first step
        # raw bytes: batch lines and file bytes are read as they are, whatever they hold
        self.sync = Client(redis=connect(gw.url), settings=gw.settings)

    @property
    def r(self) -> redis.asyncio.Redis:
        assert self.gw.client is not None
        return self.gw.client.redis

    async def caller(self, request: Request) -> Key | None:
        """The request's API key (None: an open gateway); a 401 without a valid one where
        one is needed."""
        try:
            return await self.gw.authorize(request)
        except Unauthorized as e:
            raise BadRequest(str(e), "invalid_api_key", status=401) from None

    async def _hash(self, name: str) -> dict[str, str]:
        """A record as text, {} when it is missing or not a hash."""
        try:
            raw = await self.r.execute_command("HGETALL", name, **{NEVER_DECODE: []})
        except redis.ResponseError as e:
            if not str(e).startswith("WRONGTYPE"):
                raise
            return {}
        return {text(k): text(v) for k, v in (raw or {}).items()}

    async def file_meta(self, file_id: str, key: Key | None) -> dict[str, str]:
        if FILE_ID.fullmatch(file_id):
            meta = await self._hash(keys.file_meta(file_id))
            if meta and _visible(meta, key):
                return meta
        raise _not_found("file", file_id)

    async def batch_meta(self, batch_id: str, key: Key | None) -> dict[str, str]:
        if store.BATCH_ID.fullmatch(batch_id):
            meta = await self._hash(keys.batch(batch_id))
            if meta and _visible(meta, key):
                return meta
        raise _not_found("batch", batch_id)

    async def result_file(self, file_id: str, key: Key | None) -> tuple[str, str, dict]:
        """(batch id, kind, batch record) of a batch's output or error file."""
        m = RESULT_FILE_ID.fullmatch(file_id)
        if m is not None:
            try:
                meta = await self.batch_meta(m["batch"], key)
            except BadRequest:
                meta = {}
            if meta.get("status") in store.TERMINAL:
                return m["batch"], m["kind"], meta
        raise _not_found("file", file_id)

    # -- files ---------------------------------------------------------------------

    @_endpoint("files")
    async def create_file(self, request: Request) -> Response:
        key = await self.caller(request)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise BadRequest("send the file as multipart/form-data", code="bad_body")
        declared = request.headers.get("content-length", "")
        limit = MAX_FILE_BYTES + FORM_SLACK
        if declared.isdigit() and int(declared) > limit:
            raise _too_large()
        parser = MultiPartParser(
            request.headers, _capped(request.stream(), limit), max_files=1, max_fields=8
        )
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise BadRequest(f"the form is not valid multipart data: {e}", code="bad_body") from e
        try:
            purpose = form.get("purpose")
            if purpose != "batch":
                what = "is required" if purpose is None else f"{purpose!r} is not supported"
                raise BadRequest(f"purpose {what}: only 'batch' is", param="purpose")
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise BadRequest("the form has no file", param="file")
            ttl = expires_after(form, self.bs.completion_window_s)
            if upload.size is not None and upload.size > MAX_FILE_BYTES:
                raise _too_large()
            file_id = "file-" + secrets.token_hex(12)
            size = await self._store(file_id, upload)
        finally:
            await form.close()
        now = int(time.time())
        meta = {
            "filename": filename_of(upload),
            "bytes": str(size),
            "created_at": str(now),
            "expires_at": str(now + ttl),
            "purpose": "batch",
            "tenant": key.tenant if key is not None else "",
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.file_meta(file_id), mapping=meta)
        pipe.expire(keys.file_meta(file_id), ttl)
        pipe.expire(keys.file(file_id), ttl)
        await pipe.execute()
        return JSONResponse(file_object(file_id, meta))

    async def _store(self, file_id: str, upload: UploadFile) -> int:
        """Copy the upload to Redis, checking it as it goes: UTF-8, not blank, at most
        MAX_FILE_BYTES and MAX_FILE_LINES; returns its size."""
        name = keys.file(file_id)
        utf8 = codecs.getincrementaldecoder("utf-8")()
        size = ends = 0
        blank, last = True, b""
        try:
            while chunk := await upload.read(CHUNK):
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise _too_large()
                utf8.decode(chunk)
                # line ends as the batch reads the file (universal newlines): \n, \r\n, \r;
                # a \r that ends a read is counted with the next (it may start a \r\n)
                ends += last == b"\r" and chunk[:1] != b"\n"
                ends += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
                ends -= chunk[-1:] == b"\r"
                if ends > MAX_FILE_LINES:
                    raise BadRequest(
                        f"the file has over {MAX_FILE_LINES} lines", code="too_many_lines"
                    )
                blank = blank and not chunk.strip()
                last = chunk[-1:]
                if size == len(chunk):
                    await self.r.set(name, chunk, ex=UPLOAD_TTL_S)
                else:
                    await self.r.append(name, chunk)
            utf8.decode(b"", final=True)
            if ends + (last not in (b"", b"\n")) > MAX_FILE_LINES:  # a last \r or line
                raise BadRequest(f"the file has over {MAX_FILE_LINES} lines", code="too_many_lines")
            if blank:
                raise BadRequest("the file is empty: send JSONL, one request a line", param="file")
        except UnicodeDecodeError:
            await self.r.delete(name)
            raise BadRequest(
                "the file is not UTF-8 text", code="invalid_utf8", param="file"
            ) from None
        except BaseException:
            await self.r.delete(name)
            raise
        return size

    @_endpoint("files")
    async def get_file(self, request: Request) -> Response:
        key = await self.caller(request)
        file_id = request.path_params["file_id"]
        if RESULT_FILE_ID.fullmatch(file_id):
            batch_id, kind, meta = await self.result_file(file_id, key)
            name = keys.batch_output(batch_id) if kind == "output" else keys.batch_errors(batch_id)
            size = await self.r.strlen(name)
            return JSONResponse(result_file_object(batch_id, kind, meta, size))
        return JSONResponse(file_object(file_id, await self.file_meta(file_id, key)))

    @_endpoint("files")
    async def file_content(self, request: Request) -> Response:
        key = await self.caller(request)
        file_id = request.path_params["file_id"]
        if RESULT_FILE_ID.fullmatch(file_id):
            batch_id, kind, _ = await self.result_file(file_id, key)
            name = keys.batch_output(batch_id) if kind == "output" else keys.batch_errors(batch_id)
        else:
            await self.file_meta(file_id, key)
            name = keys.file(file_id)
        size = await self.r.strlen(name)
        if size <= CHUNK:  # most: one read, and a missing file is still a 404
            data = await self.r.execute_command("GET", name, **{NEVER_DECODE: []})
            if data is None:
                raise _not_found("file", file_id)
            return Response(data, media_type="application/octet-stream")
        return StreamingResponse(
            self._ranges(name, size),
            media_type="application/octet-stream",
            headers={"Content-Length": str(size)},
        )

    async def _ranges(self, name: str, size: int) -> AsyncIterator[bytes]:
        for start in range(0, size, CHUNK):
            end = min(size, start + CHUNK) - 1
            data = await self.r.execute_command("GETRANGE", name, start, end, **{NEVER_DECODE: []})
            if not data:  # deleted or expired meanwhile: the response ends short
                return
            yield data

    @_endpoint("files")
    async def delete_file(self, request: Request) -> Response:
        key = await self.caller(request)
        file_id = request.path_params["file_id"]
        if RESULT_FILE_ID.fullmatch(file_id):
            await self.result_file(file_id, key)
            raise BadRequest(
                "a batch's output and error files expire with the batch", param="file_id"
            )
        await self.file_meta(file_id, key)
        deleted = await self.r.delete(keys.file_meta(file_id), keys.file(file_id))
        return JSONResponse({"id": file_id, "object": "file", "deleted": deleted > 0})

    # -- batches ---------------------------------------------------------------------

    @_endpoint("batches")
    async def create_batch(self, request: Request) -> Response:
        key = await self.caller(request)
        body = await self.gw.body(request)
        allowed = {"input_file_id", "endpoint", "completion_window", "metadata"}
        for name in body:
            if name not in allowed:
                raise BadRequest(f"unknown or unsupported field {name!r}", param=name)
        endpoint = body.get("endpoint")
        if endpoint not in inputs.URLS:
            raise BadRequest(
                f"endpoint {endpoint!r} is not supported; use one of {', '.join(inputs.URLS)}",
                param="endpoint",
            )
        window = body.get("completion_window")
        if window != COMPLETION_WINDOW:
            raise BadRequest(
                f"completion_window must be {COMPLETION_WINDOW!r}", param="completion_window"
            )
        metadata = check_metadata(body.get("metadata"))
        if key is not None:  # the batch's requests go to the batch lane
            try:
                auth.lane_for(key, drive.LANE, self.gw.settings)
            except auth.LaneError as e:
                raise BadRequest(str(e), "lane_not_allowed") from None
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise BadRequest("input_file_id must be a file id", param="input_file_id")
        if RESULT_FILE_ID.fullmatch(file_id):
            raise BadRequest(
                "input_file_id: a batch's output is not an input file", param="input_file_id"
            )
        try:
            await self.file_meta(file_id, key)
        except BadRequest:
            raise _not_found("file", file_id, "input_file_id") from None
        fields = {
            "tenant": key.tenant if key is not None else "",
            "input": file_id,
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": window,
        }
        try:
            batch_id = await run_in_threadpool(self._create, file_id, endpoint, metadata, fields)
        except FileGone:
            raise _not_found("file", file_id, "input_file_id") from None
        return JSONResponse(batch_object(batch_id, await self._hash(keys.batch(batch_id))))

    def _create(
        self, file_id: str, endpoint: str, metadata: dict | None, fields: dict[str, str]
    ) -> str:
        """manage.create on the stored file's lines, read as `plurai batch submit` reads a
        file (universal newlines, blank lines skipped). In a worker thread: it reads the
        whole file and sends the Celery task."""
        r = self.sync.redis
        size = r.strlen(keys.file(file_id))
        if not size:
            raise FileGone(file_id)
        raw = io.BufferedReader(_StoredFile(r, keys.file(file_id), size), CHUNK)
        with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=None) as f:
            return manage.create(
                self.sync,
                manage.lines_of(f),
                metadata=metadata,
                endpoint=endpoint,
                fields=fields,
            )

    @_endpoint("batches")
    async def get_batch(self, request: Request) -> Response:
        key = await self.caller(request)
        batch_id = request.path_params["batch_id"]
        return JSONResponse(batch_object(batch_id, await self.batch_meta(batch_id, key)))

    @_endpoint("batches")
    async def list_batches(self, request: Request) -> Response:
        """Newest first, `limit` (1..100, default 20) after the batch `after`; a tenant sees
        its own. At most SCAN_BATCHES ids are looked at per page."""
        key = await self.caller(request)
        q = request.query_params
        limit = q.get("limit", "20")
        if not re.fullmatch(r"[0-9]{1,3}", limit) or not 1 <= int(limit) <= 100:
            raise BadRequest("limit must be an integer in [1, 100]", param="limit")
        start = 0
        after = q.get("after")
        if after:
            try:  # another tenant's batch is unknown here too
                await self.batch_meta(after, key)
            except BadRequest:
                raise _not_found("batch", after, "after") from None
            rank = await self.r.zrevrank(keys.BATCHES, after)
            if rank is None:
                raise _not_found("batch", after, "after")
            start = rank + 1
        found: list[dict[str, Any]] = []
        more = False
        for offset in range(start, start + SCAN_BATCHES, 100):
            ids = [text(i) for i in await self.r.zrevrange(keys.BATCHES, offset, offset + 99)]
            for batch_id in ids:
                meta = await self._hash(keys.batch(batch_id))
                if meta and _visible(meta, key):
                    if len(found) == int(limit):
                        more = True
                        break
                    found.append(batch_object(batch_id, meta))
            if more or len(ids) < 100:
                break
        return JSONResponse(
            {
                "object": "list",
                "data": found,
                "first_id": found[0]["id"] if found else None,
                "last_id": found[-1]["id"] if found else None,
                "has_more": more,
            }
        )

    @_endpoint("batches")
    async def cancel_batch(self, request: Request) -> Response:
        key = await self.caller(request)
        batch_id = request.path_params["batch_id"]
        await self.batch_meta(batch_id, key)
        try:
            await run_in_threadpool(manage.cancel, self.sync, batch_id)
        except manage.UnknownBatch:
            raise _not_found("batch", batch_id) from None
        return JSONResponse(batch_object(batch_id, await self.batch_meta(batch_id, key)))


def routes(gw: Gateway) -> list[Route]:
    api = Batches(gw)
    return [
        Route("/v1/files", api.create_file, methods=["POST"]),
        Route("/v1/files/{file_id}", api.get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", api.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", api.file_content, methods=["GET"]),
        Route("/v1/batches", api.create_batch, methods=["POST"]),
        Route("/v1/batches", api.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", api.get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", api.cancel_batch, methods=["POST"]),
    ]
