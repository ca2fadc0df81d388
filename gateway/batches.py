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
unknown (404). Without one (an open gateway) every file and batch is visible. The objects
are built in gateway/batch_objects.py, uploads stored by gateway/uploads.py.
"""

from __future__ import annotations

import io
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio
from redis.client import NEVER_DECODE
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plurai.broker_config import keys
from plurai.broker_config.celery_app import app as celery_app
from plurai.broker_config.celery_app import configure
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import BulkSettings
from plurai.broker_config.text import text
from plurai.gateway import auth
from plurai.gateway.app import Gateway
from plurai.gateway.auth import Key, Unauthorized
from plurai.gateway.batch_objects import (
    COMPLETION_WINDOW,
    FILE_ID,
    RESULT_FILE_ID,
    batch_object,
    check_metadata,
    file_object,
    result_file_object,
)
from plurai.gateway.uploads import (
    CHUNK,
    FORM_SLACK,
    MAX_FILE_BYTES,
    FileGone,
    StoredFile,
    capped,
    expires_after,
    filename_of,
    too_large,
)
from plurai.gateway.uploads import store as store_upload
from plurai.producer.bulk import drive, inputs, manage, store
from plurai.producer.bulk.store import BatchRecord
from plurai.producer.client import Client
from plurai.producer.openai_body import BadRequest
from plurai.results.records import BadRecord

log = logging.getLogger("plurai.gateway")

SCAN_BATCHES = 5000  # batch ids one list page may look at (other tenants' are skipped)


def _not_found(what: str, ident: str, param: str | None = None) -> BadRequest:
    shown = ident if len(ident) <= 80 and ident.isprintable() else ident[:80] + "..."
    return BadRequest(f"no {what} {shown!r}", code=f"{what}_not_found", param=param, status=404)


def _visible(tenant: str | None, key: Key | None) -> bool:
    return key is None or (tenant or "") == key.tenant


# -- the endpoints ---------------------------------------------------------------------


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

    async def record(self, batch_id: str) -> BatchRecord | None:
        """The batch's record (None: there is none); BadRecord when it is damaged."""
        meta = await self._hash(keys.batch(batch_id))
        return BatchRecord.from_hash(batch_id, meta) if meta else None

    async def file_meta(self, file_id: str, key: Key | None) -> dict[str, str]:
        if FILE_ID.fullmatch(file_id):
            meta = await self._hash(keys.file_meta(file_id))
            if meta and _visible(meta.get("tenant"), key):
                return meta
        raise _not_found("file", file_id)

    async def batch_meta(self, batch_id: str, key: Key | None) -> BatchRecord:
        if store.BATCH_ID.fullmatch(batch_id):
            rec = await self.record(batch_id)
            if rec is not None and _visible(rec.tenant, key):
                return rec
        raise _not_found("batch", batch_id)

    async def result_file(self, file_id: str, key: Key | None) -> tuple[BatchRecord, str]:
        """(batch record, kind) of a batch's output or error file."""
        m = RESULT_FILE_ID.fullmatch(file_id)
        if m is not None:
            try:
                rec: BatchRecord | None = await self.batch_meta(m["batch"], key)
            except BadRequest:
                rec = None
            if rec is not None and rec.status in store.TERMINAL:
                return rec, m["kind"]
        raise _not_found("file", file_id)

    # -- files ---------------------------------------------------------------------

    async def create_file(self, request: Request) -> Response:
        key = await self.caller(request)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise BadRequest("send the file as multipart/form-data", code="bad_body")
        declared = request.headers.get("content-length", "")
        limit = MAX_FILE_BYTES + FORM_SLACK
        if declared.isdigit() and int(declared) > limit:
            raise too_large()
        parser = MultiPartParser(
            request.headers, capped(request.stream(), limit), max_files=1, max_fields=8
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
                raise too_large()
            file_id = "file-" + secrets.token_hex(12)
            size = await store_upload(self.r, keys.file(file_id), upload)
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

    async def get_file(self, request: Request) -> Response:
        key = await self.caller(request)
        file_id = request.path_params["file_id"]
        if RESULT_FILE_ID.fullmatch(file_id):
            rec, kind = await self.result_file(file_id, key)
            name = keys.batch_output(rec.id) if kind == "output" else keys.batch_errors(rec.id)
            size = await self.r.strlen(name)
            return JSONResponse(result_file_object(rec, kind, size))
        return JSONResponse(file_object(file_id, await self.file_meta(file_id, key)))

    async def file_content(self, request: Request) -> Response:
        key = await self.caller(request)
        file_id = request.path_params["file_id"]
        if RESULT_FILE_ID.fullmatch(file_id):
            rec, kind = await self.result_file(file_id, key)
            name = keys.batch_output(rec.id) if kind == "output" else keys.batch_errors(rec.id)
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
        rec = await self.record(batch_id)
        assert rec is not None  # written before create returned, and it expires in days
        return JSONResponse(batch_object(rec))

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
        raw = io.BufferedReader(StoredFile(r, keys.file(file_id), size), CHUNK)
        with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=None) as f:
            return manage.create(
                self.sync,
                self.bs,
                manage.lines_of(f),
                metadata=metadata,
                endpoint=endpoint,
                fields=fields,
            )

    async def get_batch(self, request: Request) -> Response:
        key = await self.caller(request)
        batch_id = request.path_params["batch_id"]
        return JSONResponse(batch_object(await self.batch_meta(batch_id, key)))

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
                try:
                    rec = await self.record(batch_id)
                except BadRecord as e:  # one damaged record hides no other batch
                    log.warning("batches: %s", e)
                    continue
                if rec is not None and _visible(rec.tenant, key):
                    if len(found) == int(limit):
                        more = True
                        break
                    found.append(batch_object(rec))
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

    async def cancel_batch(self, request: Request) -> Response:
        key = await self.caller(request)
        batch_id = request.path_params["batch_id"]
        await self.batch_meta(batch_id, key)
        try:
            await run_in_threadpool(manage.cancel, self.sync, batch_id)
        except manage.UnknownBatch:
            raise _not_found("batch", batch_id) from None
        return JSONResponse(batch_object(await self.batch_meta(batch_id, key)))


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
