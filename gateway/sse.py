"""Server-sent events: the response that sends a stream's chunks (EventStream), the
chunks of one job's stream (SseBody), and waiting on work unless the client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import redis
import redis.asyncio
from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import Response

from plurai.gateway import openai
from plurai.gateway.openai import error_body
from plurai.gateway.server import CLOSE_EXTENSION
from plurai.producer.openai_body import Job
from plurai.results import records, tokens

log = logging.getLogger("plurai.gateway")

SSE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
BAD_RECORD = "the job's token stream or record in Redis is damaged"
EXPIRED = "job {} has no record: its result expired (PLURAI_RESULT_TTL_S after it ended)"
# the most text in one SSE chunk: a send waits for its client only between chunks, so
# this bounds what a slow reader holds in the gateway's send buffer beyond its high mark
CHUNK_CHARS = 8192
T = TypeVar("T")


class Gone(Exception):
    """The client left before its answer."""


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; raises Gone (and cancels `work`) if the client leaves first."""
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
        raise Gone
    return task.result()


async def close_reader(gen: AsyncGenerator[Any, None] | AsyncIterator[Any]) -> None:
    """Close a stream's reader, unless a read that holds its cancel still runs it
    (`unless_gone` waits a second for that): then the cancel ends it, and its own
    `finally` runs, once the read returns."""
    try:
        await gen.aclose()  # type: ignore[union-attr]
    except RuntimeError:  # "aclose(): asynchronous generator is already running"
        pass


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def head(
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


class EventStream(Response):
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
                    raise Gone from None
                drop()
                raise Gone from None

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
        except Gone:
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


class SseBody:
    """The SSE chunks of a stream whose first text (or end) is read: one chunk per batch of
    events read together (of each choice, a job of n > 1 choices having chunks of each,
    with its index), the end's chunks (each choice's finish_reason, and logprobs or usage
    when asked) carrying the text that came with it, and `[DONE]` in the same write.

    `cancel` cancels the job (one nobody will read on); `damaged` is told of a damaged
    entry or record, whose job it cancels unless it runs in the background."""

    def __init__(
        self,
        r: redis.asyncio.Redis,
        job: Job,
        job_id: str,
        created: int,
        follower: tokens.TextFollower,
        open_streams: Gauge,
        cancel: Callable[[], None],
        damaged: Callable[[Exception], None],
    ) -> None:
        self.r, self.job, self.job_id, self.created = r, job, job_id, created
        self.follower, self.open_streams = follower, open_streams
        self.cancel, self.damaged = cancel, damaged
        self.text: dict[int, str] = {}  # read, not yet sent, by choice
        self.started: set[int] = set()  # the choices whose first chunk is sent

    def _chunk(self, text: str | None, reason: str | None = None, index: int = 0) -> dict[str, Any]:
        first = index not in self.started
        self.started.add(index)
        return openai.chunk(self.job, self.job_id, self.created, text, reason, first, index)

    def _take(self, batch: list[tokens.Event]) -> tokens.Event | None:
        """Feed a batch's text in; its end event, if it holds one."""
        for e in batch:
            new = self.follower.feed(e)
            if new:
                self.text[e.index] = self.text.get(e.index, "") + new
            if e.type == tokens.END:
                return e
        return None

    def _pieces(self, keep: int = 0) -> list[bytes]:
        """Chunks of the text read, CHUNK_CHARS each, until at most `keep` chars of each
        choice are left."""
        out = []
        for i, text in self.text.items():
            while len(text) > keep:
                piece, text = text[:CHUNK_CHARS], text[CHUNK_CHARS:]
                out.append(_event(self._chunk(piece, index=i)))
            self.text[i] = text
        self.text = {i: t for i, t in self.text.items() if t}
        return out

    def _failed(self, message: str, code: str) -> bytes:
        """The end of a stream that cannot finish: the text not yet sent, the error event,
        [DONE]."""
        unsent = b"".join(_event(self._chunk(t, index=i)) for i, t in self.text.items() if t)
        return unsent + _event(error_body(message, code, kind="server_error")) + DONE

    async def chunks(
        self,
        first: str,
        ev: tokens.Event | None,
        rest: list[tokens.Event],
        batches: AsyncIterator[list[tokens.Event]],
    ) -> AsyncGenerator[bytes, None]:
        """Every chunk, from the first text (or end) `ev` brought and the events read with
        it (`rest`), on through `batches`."""
        if first and ev is not None:
            self.text[ev.index] = first
        end = ev if ev is not None and ev.type == tokens.END else None
        self.open_streams.inc()
        try:
            async with aclosing(batches):  # type: ignore[type-var]
                try:
                    if end is None:
                        end = self._take(rest)
                    while end is None:
                        for piece in self._pieces():
                            yield piece
                        batch = await anext(batches, None)
                        if batch is None:
                            break
                        end = self._take(batch)
                except tokens.JobRestarted as e:
                    if not self.job.background:  # nobody will read what it writes
                        self.cancel()
                    yield self._failed(str(e), "job_restarted")
                    return
            for piece in self._pieces(keep=CHUNK_CHARS):  # all but the closing chunk's text
                yield piece
            job = self.job
            if end is not None and end.state == records.COMPLETED:
                if not job.include_usage and job.logprobs is None and job.n == 1:
                    # the end entry says all the closing chunk needs: no record to read
                    last = self._chunk(self.text.pop(0, None), end.finish_reason or "stop")
                    yield _event(last) + DONE
                    return
            rec = await records.get_async(self.r, self.job_id)
        except redis.RedisError:
            # the client learns why its stream ends; the job goes on (Redis cannot take a
            # cancel now), its record readable once Redis is back
            yield self._failed("the queue's Redis is unavailable", "unavailable")
            return
        except records.BadRecord as e:  # a damaged entry (streams.py) or record
            self.damaged(e)
            yield self._failed(BAD_RECORD, "bad_record")
            return
        finally:
            self.open_streams.dec()
        yield self._closing(rec)

    def _closing(self, rec: records.JobRecord) -> bytes:
        """The last chunks of a stream, from its job's record."""
        if rec.state == records.UNKNOWN:
            return self._failed(EXPIRED.format(self.job_id), "job_expired")
        if rec.state != records.COMPLETED:
            message = rec.error_message or f"the job ended {rec.state}"
            return self._failed(message, rec.error_code or rec.state)
        job = self.job
        closing = b""
        for c in rec.choices:  # each choice's closing chunk, with its finish reason
            last = self._chunk(self.text.pop(c.index, None), c.finish_reason or "stop", c.index)
            # the token stream carries no logprobs: they come whole, on the last chunk
            last["choices"][0]["logprobs"] = openai.logprobs_body(job, c.logprobs)
            closing += _event(last)
        if job.include_usage:
            closing += _event(openai.usage_chunk(job, rec, self.created))
        return closing + DONE
