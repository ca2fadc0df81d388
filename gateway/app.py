"""The gateway: OpenAI's HTTP API in front of the queue.

Each request becomes a job (producer.aio), and the answer is read back from Redis: the
job's record for a whole response, its token stream for `stream: true`. The gateway keeps
no state of its own, so any number of them can serve one Redis. What a request cannot get
is raised as a typed error, which errors.py's handlers turn into its response.

A streamed response starts only once the job's first token (or its end) is in Redis, so a
job the worker refuses still gets an HTTP error status with its code rather than a 200
stream that ends in an error. A job that restarts on another worker (its worker died)
continues the same stream: the text the new run repeats is skipped (results.tokens.
TextFollower); if the new run differs (sampling without a seed), the stream ends with an
error event, code `job_restarted`. Logprobs of a stream come on its closing chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plurai.broker_config import keys, tracing
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.gateway import auth, openai
from plurai.gateway.apikeys import Key
from plurai.gateway.dashboard import Dashboard
from plurai.gateway.errors import ApiError, client_status, error, model_not_found, no_workers
from plurai.gateway.lag import LoopWatch
from plurai.gateway.lease import Lease, OpenStreams, StreamSlot, max_output, request_tokens
from plurai.gateway.metrics import GatewayMetrics
from plurai.gateway.sse import (
    BAD_RECORD,
    EXPIRED,
    EventStream,
    Gone,
    SseBody,
    close_reader,
    head,
    unless_gone,
)
from plurai.gateway.streams import Streams
from plurai.producer.aio import AsyncClient
from plurai.producer.openai_body import BadRequest, Job, chat_job, completion_job
from plurai.producer.request import prepare
from plurai.results import records, tokens, wait
from plurai.results.records import JobRecord

log = logging.getLogger("plurai.gateway")


class Gateway:
    """The endpoints. `client` (its `routes`: the model directory) and `streams` are built
    in `lifespan`, on the server's event loop."""

    client: AsyncClient
    streams: Streams
    done: wait.SharedDone
    guard: auth.Guard
    watch: LoopWatch

    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url
        self.metrics = GatewayMetrics()
        self.max_request_bytes = settings.gateway_max_request_bytes
        self.tasks: set[asyncio.Task] = set()  # cancels sent after a client left
        self.open_streams = OpenStreams(settings.gateway_max_streams_per_key)
        self.dashboard: Dashboard | None = None  # set by serve.create_app where enabled
        self.closers: list[Callable[[], None]] = []  # run as it stops (admin.py's client)

    @asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        tracing.setup("plurai-gateway")  # only where OTEL_* variables ask for traces
        self.watch = LoopWatch(self.metrics.loop_lag)
        self.client = AsyncClient(self.url, settings=self.settings)
        self.streams = Streams(self.client.redis)
        self.done = wait.SharedDone(self.client.redis)  # the waits of whole answers
        # without API keys, only a gateway listening on loopback serves (open)
        self.guard = auth.Guard(self.client.redis, self.settings.gateway_host)
        if self.dashboard is not None:
            self.dashboard.start(self.guard)
        self.watch.start()  # here: its thread and task end in the finally below
        try:
            yield
        finally:
            if self.dashboard is not None:
                await self.dashboard.stop()
            for close in self.closers:
                close()
            await self.streams.close()
            await self.done.close()
            await self.client.aclose()
            await self.watch.stop()
            tracing.shutdown()

    # -- plumbing ---------------------------------------------------------------------

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the request, read up to the size cap."""
        if not _json_type(request.headers.get("content-type", "")):
            raise BadRequest(
                "the body must be JSON, sent as Content-Type: application/json", code="bad_body"
            )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise BadRequest(
                f"the request body is over {self.max_request_bytes} bytes",
                code="too_large",
                status=413,
            )
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.max_request_bytes:
                raise BadRequest(
                    f"the request body is over {self.max_request_bytes} bytes",
                    code="too_large",
                    status=413,
                )
        try:  # UTF-8 only: json.loads would also take UTF-16 and UTF-32 bytes
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise BadRequest("the body is not valid UTF-8", code="invalid_utf8") from None
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}", code="bad_body") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", code="bad_body")
        try:  # JSON escapes can spell lone surrogates, which no UTF-8 text holds
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest(
                "the body holds a lone surrogate (\\ud800-\\udfff): send valid UTF-8 text",
                code="invalid_utf8",
            ) from None
        return body

    async def authorize(self, request: Request) -> Key | None:
        """The request's API key, or None on an open gateway; raises Unauthorized."""
        headers = request.headers
        return await self.guard.key(headers.get("authorization"), headers.get("host"))

    async def models(self) -> Routes:
        """The model directory, read at most every routes.REFRESH_S."""
        return await self.client.fresh_routes()

    def _later(self, work: Any) -> None:
        """Run `work` (a coroutine) outside the request's own task, which may be ending."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self._done_later)

    def _done_later(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a cancel or release after a response failed: %r", task.exception())

    def _cancel_later(self, job_id: str) -> None:
        """Cancel a job whose client left."""
        self._later(self.client.job(job_id).cancel())

    # -- endpoints ----------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def generate(self, request: Request, chat: bool) -> Response:
        request.state.received_us = time.time_ns() // 1000  # the queue hop's start
        if not tracing.ON:
            return await self._generate(request, chat)
        # the request's span: a child of the client's traceparent header where it sends
        # one, the parent of its job's submit (whose context the job's entry carries)
        path = request.url.path
        attrs = {"http.request.method": request.method, "http.route": path, "url.path": path}
        parent = tracing.incoming(request.headers)
        span = tracing.span(f"{request.method} {path}", parent, None, attrs, kind="server")
        token = tracing.attach(span)
        try:
            response = await self._generate(request, chat, span)
        except BaseException as e:  # answered by errors.py's handlers
            status = client_status(e)
            if status is None:  # a failure here: the span's status is an error
                tracing.end(span, None, str(getattr(e, "code", "") or type(e).__name__))
            else:  # the client's mistake or a refusal, as OpenTelemetry counts a 4xx
                tracing.end(span, None, **{"http.response.status_code": status})
            raise
        finally:
            tracing.detach(token)
        if not isinstance(response, EventStream):  # a stream's ends when the stream does
            status = response.status_code
            error = str(status) if status >= 500 else ""
            tracing.end(span, None, error, **{"http.response.status_code": status})
        return response

    async def _generate(self, request: Request, chat: bool, span: Any = None) -> Response:
        key = await self.authorize(request)
        body = await self.body(request)
        default_max = self.settings.gateway_default_max_tokens
        job = chat_job(body, default_max) if chat else completion_job(body)
        models = await self.models()
        if not models.served():
            raise no_workers()
        served = models.route(job.model)
        if served is None:
            raise model_not_found(job.model)
        options = {**job.options, "model": served}
        options["lane"] = auth.lane_for(key, options.pop("lane", None), self.settings)
        if key is not None:
            options["cache_salt"] = auth.tenant_salt(key, options.get("cache_salt"))
            options["tenant"] = key.tenant
        idem = request.headers.get("idempotency-key")
        if idem:
            options["idempotency_key"] = auth.scoped_idempotency_key(key, idem)
        try:
            sub = prepare(self.settings, models, **options)
            sub.received(request.state.received_us)
        # what prepare refuses (priority, sizes); msgpack: an integer over 64 bits. Its
        # TypeError (an option it does not know) would be a bug here: the parser gives
        # only known options, so it is left to the 500 handler.
        except (ValueError, OverflowError) as e:
            raise ApiError(400, str(e), "bad_field") from None
        slot = self.open_streams.take(key) if job.stream else None
        if job.stream and slot is None:
            cap = self.settings.gateway_max_streams_per_key
            message = (
                f"this API key has {cap} streams open on this gateway "
                "(PLURAI_GATEWAY_MAX_STREAMS_PER_KEY): wait for one to end"
            )
            raise ApiError(429, message, "too_many_streams", retry_after=1, kind="rate_limit_error")
        lease = Lease(self.client.redis, key, sub.job_id)
        try:
            await lease.admit(request_tokens(options), max_output(options))
            job_id = (await self.client.send([sub]))[0].id
            if job_id != sub.job_id and not await self.client.redis.exists(keys.job(job_id)):
                # an Idempotency-Key's earlier job, whose record has expired: nothing comes
                raise ApiError(404, EXPIRED.format(job_id), "job_expired")
            if span is not None:
                span.set_attribute("plurai.job_id", job_id)
            if slot is not None:
                new = job_id == sub.job_id
                return await self.stream(request, job, job_id, lease, slot, new, span)
            return await self.whole(request, job, job_id, lease)
        finally:
            if slot is not None and not slot.passed:
                slot.release()
            if not lease.passed:
                await lease.close()
                if lease.counted:  # the job has ended, was cancelled, or was never queued
                    self._later(lease.settle())

    async def whole(self, request: Request, job: Job, job_id: str, lease: Lease) -> Response:
        """Wait for the job's result; a client that leaves first cancels it (unless the
        request asked for `background`)."""
        try:
            waiting = wait.wait_many_async(self.client.redis, [job_id], None, self.done)
            (rec,) = await unless_gone(request, waiting)
        except Gone:
            return self._left(job, job_id, lease)
        except records.BadRecord as e:
            return self._damaged(job, job_id, e)
        return self.answer(job, rec)

    def _left(self, job: Job, job_id: str, lease: Lease) -> Response:
        """The client left before its answer: cancel the job, unless it runs in the
        background, when its concurrency slot stays taken until it ends."""
        if job.background:
            lease.passed = True
            self._later(lease.close_when_final())
        else:
            self._cancel_later(job_id)
        return Response(status_code=499)  # nobody reads it

    def _damaged(self, job: Job, job_id: str, e: Exception) -> JSONResponse:
        """The job's token stream or record holds what no worker writes: cancel the job
        (unless it runs in the background), whose answer cannot be read; the answer."""
        log.warning("job %s: a damaged token stream or record (%s)", job_id, e)
        if not job.background:
            self._cancel_later(job_id)
        return error(500, BAD_RECORD, "bad_record")

    def answer(self, job: Job, rec: JobRecord) -> Response:
        if rec.state == records.COMPLETED:
            return JSONResponse(openai.completion(job, rec))
        if rec.state == records.CANCELLED:
            return error(409, f"job {rec.id} was cancelled", "cancelled")
        if rec.state == records.UNKNOWN:  # an idempotency key's earlier job, long gone
            return error(404, EXPIRED.format(rec.id), "job_expired")
        code = rec.error_code or "internal"
        return error(openai.STATUS.get(code, 500), rec.error_message or code, code)

    async def stream(
        self,
        request: Request,
        job: Job,
        job_id: str,
        lease: Lease,
        slot: StreamSlot,
        new: bool = True,
        span: Any = None,
    ) -> Response:
        batches = self.streams.batches(job_id, new)
        follower = tokens.TextFollower()
        try:  # up to the first text, or the end; a client that leaves meanwhile cancels it
            first, ev, rest = await unless_gone(request, head(batches, follower))
            if ev is not None and ev.type == tokens.END:
                rec = await records.get_async(self.client.redis, job_id)
                if rec.state != records.COMPLETED:
                    await batches.aclose()
                    return self.answer(job, rec)
        except Gone:
            await close_reader(batches)
            return self._left(job, job_id, lease)
        except records.BadRecord as e:  # a damaged entry (streams.py) or record
            await close_reader(batches)
            return self._damaged(job, job_id, e)
        except BaseException:
            await close_reader(batches)
            raise
        sse = SseBody(
            self.client.redis,
            job,
            job_id,
            int(time.time()),
            follower,
            self.metrics.open_streams,
            cancel=lambda: self._cancel_later(job_id),
            damaged=lambda e: self._damaged(job, job_id, e),
        )
        body = sse.chunks(first, ev, rest, batches)

        async def close(complete: bool) -> None:
            if span is not None:  # the request's span (generate)
                attrs = {"http.response.status_code": 200, "plurai.client_left": not complete}
                tracing.end(span, None, **attrs)
            slot.release()
            await body.aclose()
            await batches.aclose()  # when the body never started
            if complete:
                self._later(lease.close())
            elif job.background:  # the client left; the job runs on, holding its slot
                self._later(lease.close_when_final())
            else:  # the client left mid-stream
                self._cancel_later(job_id)
                self._later(lease.close())
            if lease.counted:
                self._later(lease.settle())

        lease.passed = slot.passed = True  # the stream closes them when it ends
        return EventStream(body, close, self.settings.gateway_stream_stall_s)

    async def list_models(self, request: Request) -> Response:
        await self.authorize(request)
        data = [
            {
                "id": m.id,
                "object": "model",
                "created": m.beat_ms // 1000,
                "owned_by": "plurai",
                "max_model_len": m.max_model_len,
            }
            for m in (await self.models()).served()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        try:
            await self.client.redis.ping()
            workers = await self.client.redis.scard(keys.WORKERS)
        except redis.RedisError:
            return JSONResponse({"status": "redis unavailable"}, 503)
        return JSONResponse({"status": "ok", "workers": workers})

    async def metrics_page(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


def _json_type(content_type: str) -> bool:
    """Whether a request's Content-Type is JSON's, or absent. A browser sends a page's
    cross-site POST of text/plain or a form without asking first (no CORS preflight): such
    a body is refused, or any web page could queue jobs on an open gateway of this machine."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return (
        not kind
        or kind == "application/json"
        or (kind.startswith("application/") and kind.endswith("+json"))
    )
