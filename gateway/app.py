"""The gateway: OpenAI's HTTP API in front of the queue.

Each request becomes a job (producer.aio), and the answer is read back from Redis: the
job's record for a whole response, its token stream for `stream: true`. The gateway keeps
no state of its own, so any number of them can serve one Redis.

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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import redis
import redis.asyncio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from broker_config import keys, protocol
from broker_config.memory import is_oom
from broker_config.settings import Settings
from gateway import auth, openai
from gateway.auth import Key, Unauthorized
from gateway.metrics import GatewayMetrics
from gateway.models import Models
from gateway.openai import error_body
from gateway.server import CLOSE_EXTENSION
from gateway.streams import DAMAGED, Streams
from producer.aio import AsyncClient
from producer.errors import BadIdempotencyKey, NotReplicated, QueueFull, RedisFull, UnknownModel
from producer.openai_body import BadRequest, Job, chat_job, completion_job
from producer.request import prepare
from results import records, tokens, wait
from results.records import JobRecord

log = logging.getLogger("plurai.gateway")

SSE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
BAD_RECORD = "the job's token stream or record in Redis is damaged"
EXPIRED = "job {} has no record: its result expired (PLURAI_RESULT_TTL_S after it ended)"
FINAL_POLL_S = 1.0  # how often a background job's record is read for its end
# the most text in one SSE chunk: a send waits for its client only between chunks, so
# this bounds what a slow reader holds in the gateway's send buffer beyond its high mark
CHUNK_CHARS = 8192
T = TypeVar("T")


def error(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    retry_after: float | None = None,
    kind: str | None = None,
) -> JSONResponse:
    """An OpenAI error response (its type by default: the client's fault below 500)."""
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, code, param, kind), status, headers=headers)


def unavailable(e: Exception | None = None) -> JSONResponse:
    """503: Redis cannot be reached, or (`e` an OOM refusal) is out of memory."""
    if e is not None and is_oom(e):
        return redis_full(RedisFull("", 1.0))
    return error(503, "the queue's Redis is unavailable", "unavailable", retry_after=1)


def redis_full(e: RedisFull) -> JSONResponse:
    """503: Redis is at its maxmemory and queues nothing until memory frees."""
    return error(503, str(e), e.code, retry_after=e.retry_after)


class Gateway:
    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url
        self.client: AsyncClient | None = None
        self.models: Models | None = None
        self.streams: Streams | None = None
        self.metrics = GatewayMetrics()
        self.max_request_bytes = settings.gateway_max_request_bytes
        self.tasks: set[asyncio.Task] = set()  # cancels sent after a client left
        self.open_streams = OpenStreams(settings.gateway_max_streams_per_key)
        # without API keys, only a gateway listening on loopback serves (open)
        self.loopback = auth.loopback(settings.gateway_host)
        self.keyed = (False, -1.0)  # whether keys exist, and when that was read

    @asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.client = AsyncClient(self.url, settings=self.settings)
        self.models = Models(self.client.redis)
        self.streams = Streams(self.client.redis)
        try:
            yield
        finally:
            await self.streams.close()
            await self.client.aclose()

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
        """The request's API key, or None on an open gateway (no keys exist, and it listens
        on loopback only). Raises Unauthorized. Whether keys exist is read at most once a
        second; the key itself on every request, so a revoked key fails at once."""
        assert self.client is not None
        r = self.client.redis
        exist, at = self.keyed
        if time.monotonic() - at > 1.0:
            exist = await auth.any_keys_async(r)
            self.keyed = (exist, time.monotonic())
        if not exist:
            if self.loopback:
                return None
            raise Unauthorized(
                "this gateway listens beyond localhost and has no API keys yet: "
                "create one with `plurai keys create --tenant NAME`"
            )
        secret = auth.bearer(request.headers.get("authorization"))
        if secret is None:
            raise Unauthorized("an API key is required: Authorization: Bearer <key>")
        key = await auth.authenticate(r, secret)
        if key is None:
            raise Unauthorized("the API key is not valid (unknown or revoked)")
        return key

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
        assert self.client is not None
        self._later(self.client.job(job_id).cancel())

    # -- endpoints ----------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def generate(self, request: Request, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        start = time.perf_counter()
        response = await self._generate(request, chat)
        self.metrics.done(route, response.status_code, time.perf_counter() - start)
        return response

    async def _generate(self, request: Request, chat: bool) -> Response:
        assert self.client is not None and self.models is not None
        try:
            key = await self.authorize(request)
        except Unauthorized as e:
            return error(401, str(e), "invalid_api_key", kind="authentication_error")
        except redis.RedisError:
            return unavailable()
        try:
            body = await self.body(request)
            default_max = self.settings.gateway_default_max_tokens
            job = chat_job(body, default_max) if chat else completion_job(body)
        except BadRequest as e:
            return error(e.status, e.message, e.code, e.param)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it
        try:
            names = await self.models.names()
            served = await self.models.route(job.model)  # may read them again
        except redis.RedisError:
            return unavailable()
        if not names:
            return error(
                503,
                "no worker is serving any model now",
                "no_workers",
                retry_after=5,
                kind="server_error",
            )
        if served is None:
            return error(
                404,
                f"the model {job.model!r} is not served; see GET /v1/models",
                "model_not_found",
                "model",
            )
        options = {**job.options, "model": served}
        try:
            options["lane"] = auth.lane_for(key, options.pop("lane", None), self.settings)
        except auth.LaneError as e:
            return error(400, str(e), "lane_not_allowed", "lane")
        if key is not None:
            options["cache_salt"] = auth.tenant_salt(key, options.get("cache_salt"))
        idem = request.headers.get("idempotency-key")
        if idem:
            options["idempotency_key"] = auth.scoped_idempotency_key(key, idem)
        try:
            sub = prepare(self.settings, await self.client.fresh_routes(), **options)
        # what prepare refuses (priority, sizes); msgpack: an integer over 64 bits
        except (TypeError, ValueError, OverflowError) as e:
            return error(400, str(e), "bad_field")
        except UnknownModel as e:  # plurai:models has no live beat of it (yet)
            return error(404, str(e), "model_not_found", "model")
        except redis.RedisError:
            return unavailable()
        slot = self.open_streams.take(key) if job.stream else None
        if job.stream and slot is None:
            cap = self.settings.gateway_max_streams_per_key
            message = (
                f"this API key has {cap} streams open on this gateway "
                "(PLURAI_GATEWAY_MAX_STREAMS_PER_KEY): wait for one to end"
            )
            return error(429, message, "too_many_streams", retry_after=1, kind="rate_limit_error")
        lease = Lease(self.client.redis, key, sub.job_id)
        try:
            refused = await lease.admit(_tokens(options), options["max_tokens"])
            if refused is not None:
                return refused
            try:
                job_id = (await self.client.send([sub]))[0].id
            except RedisFull as full:  # before QueueFull, of which it is one
                return redis_full(full)
            except QueueFull as full:
                return error(429, str(full), "queue_full", retry_after=full.retry_after)
            except BadIdempotencyKey:
                message = "the Idempotency-Key is held by something other than a job; use another"
                return error(409, message, "idempotency_key_conflict")
            except NotReplicated as e:  # queued on the primary only (a failover loses
                # it); a retry with the same Idempotency-Key queues nothing twice
                return error(503, str(e), "not_replicated", retry_after=1)
            if job_id != sub.job_id and not await self.client.redis.exists(keys.job(job_id)):
                # an Idempotency-Key's earlier job, whose record has expired: nothing comes
                return error(404, EXPIRED.format(job_id), "job_expired")
            if slot is not None:
                return await self.stream(request, job, job_id, lease, slot, job_id == sub.job_id)
            return await self.whole(request, job, job_id, lease)
        except redis.RedisError as e:  # an OOM here: the key's limits could not be counted
            return unavailable(e)
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
        assert self.client is not None
        try:
            (rec,) = await _unless_gone(
                request, wait.wait_many_async(self.client.redis, [job_id], None)
            )
        except _Gone:
            return self._left(job, job_id, lease)
        except DAMAGED as e:  # a damaged record
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
    ) -> Response:
        assert self.client is not None
        assert self.streams is not None
        batches = self.streams.batches(job_id, new)
        follower = tokens.TextFollower()
        try:  # up to the first text, or the end; a client that leaves meanwhile cancels it
            first, ev, rest = await _unless_gone(request, _head(batches, follower))
            if ev is not None and ev.type == tokens.END:
                rec = await records.get_async(self.client.redis, job_id)
                if rec.state != records.COMPLETED:
                    await batches.aclose()
                    return self.answer(job, rec)
        except _Gone:
            await _close(batches)
            return self._left(job, job_id, lease)
        except DAMAGED as e:  # a damaged entry (streams.py) or record
            await _close(batches)
            return self._damaged(job, job_id, e)
        except BaseException:
            await _close(batches)
            raise
        created = int(time.time())
        body = self._sse(job, job_id, created, first, ev, rest, batches, follower)

        async def close(complete: bool) -> None:
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
        return _EventStream(body, close, self.settings.gateway_stream_stall_s)

    async def _sse(
        self,
        job: Job,
        job_id: str,
        created: int,
        first: str,
        ev: tokens.Event | None,
        rest: list[tokens.Event],
        batches: AsyncIterator[list[tokens.Event]],
        follower: tokens.TextFollower,
    ) -> AsyncGenerator[bytes, None]:
        """The SSE chunks of a stream whose first text (or end) is read: one chunk per
        batch of events read together, the end's chunk (finish_reason, and logprobs or
        usage when asked) carrying the text that came with it, and `[DONE]` in the same
        write."""
        assert self.client is not None
        text, head = first, True  # text not yet sent; whether the first chunk is still due
        end = ev if ev is not None and ev.type == tokens.END else None

        def take(batch: list[tokens.Event]) -> tokens.Event | None:
            nonlocal text
            for e in batch:
                text += follower.feed(e)
                if e.type == tokens.END:
                    return e
            return None

        def failed(message: str, code: str) -> bytes:
            """The end of a stream that cannot finish: the text not yet sent, the error
            event, [DONE]."""
            unsent = _event(openai.chunk(job, job_id, created, text, first=head)) if text else b""
            return unsent + _event(error_body(message, code, kind="server_error")) + DONE

        self.metrics.open_streams.inc()
        try:
            async with aclosing(batches):  # type: ignore[type-var]
                try:
                    if end is None:
                        end = take(rest)
                    while end is None:
                        while text:
                            piece, text = text[:CHUNK_CHARS], text[CHUNK_CHARS:]
                            yield _event(openai.chunk(job, job_id, created, piece, first=head))
                            head = False
                        batch = await anext(batches, None)
                        if batch is None:
                            break
                        end = take(batch)
                except tokens.JobRestarted as e:
                    if not job.background:  # nobody will read what it writes
                        self._cancel_later(job_id)
                    yield failed(str(e), "job_restarted")
                    return
            while len(text) > CHUNK_CHARS:  # all but the closing chunk's text
                piece, text = text[:CHUNK_CHARS], text[CHUNK_CHARS:]
                yield _event(openai.chunk(job, job_id, created, piece, first=head))
                head = False
            if (
                end is not None
                and end.state == records.COMPLETED
                and not job.include_usage
                and job.logprobs is None
            ):
                # the end entry says all the closing chunk needs: no record to read
                reason = end.finish_reason or "stop"
                last = openai.chunk(job, job_id, created, text or None, reason, first=head)
                yield _event(last) + DONE
                return
            rec = await records.get_async(self.client.redis, job_id)
        except redis.RedisError:
            # the client learns why its stream ends; the job goes on (Redis cannot take a
            # cancel now), its record readable once Redis is back
            yield failed("the queue's Redis is unavailable", "unavailable")
            return
        except DAMAGED as e:  # a damaged entry (streams.py) or record
            self._damaged(job, job_id, e)
            yield failed(BAD_RECORD, "bad_record")
            return
        finally:
            self.metrics.open_streams.dec()
        if rec.state == records.UNKNOWN:
            yield failed(EXPIRED.format(job_id), "job_expired")
            return
        if rec.state != records.COMPLETED:
            message = rec.error_message or f"the job ended {rec.state}"
            yield failed(message, rec.error_code or rec.state)
            return
        last = openai.chunk(
            job, job_id, created, text or None, rec.finish_reason or "stop", first=head
        )
        # the token stream carries no logprobs: they come whole, on the last chunk
        last["choices"][0]["logprobs"] = openai.logprobs_body(job, rec.logprobs)
        closing = _event(last)
        if job.include_usage:
            closing += _event(openai.usage_chunk(job, rec, created))
        yield closing + DONE

    async def list_models(self, request: Request) -> Response:
        assert self.models is not None
        try:
            await self.authorize(request)
            live = await self.models.live()
        except Unauthorized as e:
            return error(401, str(e), "invalid_api_key", kind="authentication_error")
        except redis.RedisError:
            return unavailable()
        data = [
            {
                "id": m.id,
                "object": "model",
                "created": m.created,
                "owned_by": "plurai",
                "max_model_len": m.max_model_len,
                "workers": m.workers,
            }
            for m in live
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        assert self.client is not None
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


def _tokens(options: dict[str, Any]) -> int:
    """What a request counts against a tokens/min quota: its prompt estimate (the same as
    the queue's length metadata) plus its max_tokens."""
    if "token_ids" in options:
        prompt = len(options["token_ids"])
    else:
        prompt = protocol.estimate_prompt_tokens(
            {k: options[k] for k in ("prompt", "messages") if k in options}
        )
    return prompt + options["max_tokens"]


class StreamSlot:
    """One open stream of a key, counted until `release` (once)."""

    def __init__(self, owner: OpenStreams, name: str) -> None:
        self.owner, self.name = owner, name
        self.passed = False  # its release is up to the stream's close
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.release(self.name)


class OpenStreams:
    """The streams each API key has open on this gateway process, up to `cap` (0: no cap);
    an open gateway's requests (no key) share one count."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.count: dict[str, int] = {}

    def take(self, key: Key | None) -> StreamSlot | None:
        name = key.id if key is not None else ""
        n = self.count.get(name, 0)
        if self.cap and n >= self.cap:
            return None
        self.count[name] = n + 1
        return StreamSlot(self, name)

    def release(self, name: str) -> None:
        n = self.count.get(name, 0) - 1
        if n > 0:
            self.count[name] = n
        else:
            self.count.pop(name, None)


class Lease:
    """A request's quota: admitted (counted) before its job is queued, its concurrency slot
    renewed while the response is open and released when it ends, and the tokens its job
    did not generate given back to the key's tokens per minute once it has ended."""

    def __init__(self, r: redis.asyncio.Redis, key: Key | None, job_id: str) -> None:
        self.r, self.key, self.job_id = r, key, job_id
        self.passed = False  # its close is up to a stream or a background task
        self.held = False  # whether it may hold a concurrency slot, for `close` to release
        self.renewing: asyncio.Task | None = None
        self.counted = 0  # tokens counted against tpm at admission (0: none)
        self.max_tokens = 0
        self.admitted_at = 0.0

    async def admit(self, tokens_: int, max_tokens: int = 0) -> Response | None:
        """None when admitted; else the 429 to answer. `max_tokens`: of `tokens_`, what
        `settle` may give back (0: nothing)."""
        if self.key is None or not self.key.limited:
            return None
        # from the call on: an error may come after the script took the slot
        self.held = bool(self.key.concurrent)
        verdict = await auth.admit(self.r, self.key, tokens_, self.job_id)
        if verdict.admitted and self.key.tpm and max_tokens > 0:
            self.counted, self.max_tokens = tokens_, max_tokens
            self.admitted_at = time.monotonic()
        if not verdict.admitted:
            self.held = False
            return error(
                429,
                verdict.message or f"over the key's {verdict.limit} limit",
                "rate_limit_exceeded",
                verdict.limit,
                retry_after=verdict.retry_after,
                kind="rate_limit_error",
            )
        if self.key.concurrent:
            self.renewing = asyncio.ensure_future(self._renew())
        return None

    async def _renew(self) -> None:
        assert self.key is not None
        while True:
            await asyncio.sleep(auth.LEASE_S / 3)
            try:
                await auth.renew(self.r, self.key, self.job_id)
            except redis.RedisError:  # a blip: the lease outlasts two more tries
                log.warning("could not renew a concurrency slot; trying again")

    async def close_when_final(self) -> None:
        """Close once the job has ended: for a `background` job whose client left, so that
        running jobs count against the key's limit whether anyone reads them or not."""
        try:
            while self.held:
                state, final = await self.r.hmget(keys.job(self.job_id), "state", "final")
                if state is None or final is not None:  # ended (or its record expired)
                    break
                await asyncio.sleep(FINAL_POLL_S)
        except redis.RedisError:
            pass  # released below if Redis takes it; else the slot's lease runs out
        finally:
            await self.close()
        await self.settle()

    async def settle(self, output_tokens: int | None = None) -> None:
        """Give back the tokens the job did not generate (max_tokens less its output) to
        the key's tokens per minute, once it has ended (`output_tokens`: known already;
        else its record is read until it is final, while the admission is still in the
        minute window). Once per request."""
        counted, self.counted = self.counted, 0
        if not counted or self.key is None:
            return
        window_end = self.admitted_at + auth.WINDOW_MS / 1000
        try:
            while output_tokens is None:
                state, final, out = await self.r.hmget(
                    keys.job(self.job_id), "state", "final", "output_tokens"
                )
                if state is None or final is not None:
                    output_tokens = _count(out)
                elif time.monotonic() > window_end:
                    return  # the admission has left the window: nothing to give back
                else:
                    await asyncio.sleep(FINAL_POLL_S)
            await auth.refund(
                self.r, self.key, self.job_id, counted, self.max_tokens - output_tokens
            )
        except redis.RedisError as e:  # the tokens stay counted until the window passes
            log.warning("could not give back a job's unused tokens: %s", e)

    async def close(self) -> None:
        if self.renewing is not None:
            self.renewing.cancel()
            self.renewing = None
        if not self.held:
            return
        self.held = False
        assert self.key is not None
        try:
            await auth.release(self.r, self.key, self.job_id)
        except redis.RedisError:  # the slot's lease runs out instead
            log.warning("could not release a concurrency slot; it expires")


def _count(v: Any) -> int:
    """A record's count field (bytes, str or None); 0 when absent or not a count."""
    if isinstance(v, bytes):
        v = v.decode("ascii", "replace")
    return int(v) if isinstance(v, str) and v.isascii() and v.isdigit() else 0


class _Gone(Exception):
    """The client left before its answer."""


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; raises _Gone (and cancels `work`) if the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1)  # redis-py can hold a cancel a while,
            task.add_done_callback(_retrieved)  # and end the command with an error
    if task not in done:
        raise _Gone
    return task.result()


async def _close(gen: AsyncGenerator[Any, None] | AsyncIterator[Any]) -> None:
    """Close a stream's reader, unless a read that holds its cancel still runs it
    (`_unless_gone` waits a second for that): then the cancel ends it, and its own
    `finally` runs, once the read returns."""
    try:
        await gen.aclose()  # type: ignore[union-attr]
    except RuntimeError:  # "aclose(): asynchronous generator is already running"
        pass


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _head(
    batches: AsyncIterator[list[tokens.Event]], follower: tokens.TextFollower
) -> tuple[str, tokens.Event | None, list[tokens.Event]]:
    """A stream's first text, the event that brought it (or its end event), and the
    events read with it that follow it."""
    async for batch in batches:
        for i, ev in enumerate(batch):
            first = follower.feed(ev)
            if first or ev.type == tokens.END:
                return first, ev, batch[i + 1 :]
    return "", None, []


class _EventStream(Response):
    """Server-sent events from `body`, whose `close(complete)` runs once the response is
    over, sent whole or not. A client that leaves ends the body at once, even one that
    left before anything was sent (so the body's own `finally` cannot be relied on to
    release what it holds: `close` does). `data: [DONE]` is every stream's last event, so
    the chunk that carries it also ends the response, in the same write.

    A client that reads slowly holds up the sends (the server takes a chunk only once
    the previous ones have mostly left), and so the reading of its token stream
    (streams.py): what waits stays in Redis. One that takes nothing for `stall_s` (None:
    no limit) is ended, as a client that left (its connection is dropped)."""

    media_type = SSE

    def __init__(
        self,
        body: AsyncIterator[bytes],
        close: Callable[[bool], Awaitable[None]],
        stall_s: float | None = None,
    ) -> None:
        self.body_iterator = body
        self.close = close
        self.stall_s = stall_s
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        left = streaming = False
        complete = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            if streaming:
                task.cancel()

        async def put(message: dict[str, Any]) -> None:
            try:
                async with asyncio.timeout(self.stall_s):
                    await send(message)
            except TimeoutError:
                log.warning(
                    "a stream's client took nothing for %g s (PLURAI_GATEWAY_STREAM_STALL_S): "
                    "ended",
                    self.stall_s,
                )
                drop = scope.get("extensions", {}).get(CLOSE_EXTENSION)
                if drop is None:  # another server: it closes a response left unfinished
                    raise _Gone from None
                drop()
                raise _Gone from None

        watcher = asyncio.ensure_future(watch())
        try:
            streaming = True
            await asyncio.sleep(0)  # a client already gone is seen before anything is sent
            await put({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            last = False
            async for chunk in self.body_iterator:
                last = chunk.endswith(DONE)
                await put({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
            if not last:
                await put({"type": "http.response.body", "body": b"", "more_body": False})
            complete = True
        except _Gone:
            pass
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()
        finally:
            streaming = False
            watcher.cancel()
            await self.close(complete)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
