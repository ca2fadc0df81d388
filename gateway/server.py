"""uvicorn, guarded against floods of connections and slow clients.

uvicorn's own options cover the idle time between a kept-alive connection's requests
(`timeout_keep_alive`) and the listen backlog; its httptools protocol has no limit on
the time a request's headers or body may take to arrive (a client sending a byte every
few seconds holds its connection for ever), on the size of a request's head, nor on
the time a response may wait for its client to read it. `Guarded` adds them:

- the head (request line and headers) within `header_timeout_s` of the connection (or
  of its first byte, for a kept-alive connection's next request) and under
  `max_header_bytes`: else 408 or 431, and the connection is closed; a connection that
  sent nothing is closed without a word;
- the body within `body_timeout_s` of the head: else 408 (if nothing was answered yet)
  and closed;
- beyond `max_connections` open connections, a request gets 503 `too_many_connections`
  and its connection is closed (one that sends no request in `OVER_CAP_S` is closed);
- a response its client does not read for `stream_stall_s` once it has been written:
  the connection is dropped. Streams stop on their own after the same time
  (sse.py's `EventStream`, through the scope's `plurai.close` extension).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from plurai.broker_config.settings import Settings
from plurai.gateway.openai import error_body

log = logging.getLogger("plurai.gateway")

OVER_CAP_S = 1.0  # an over-cap connection's time to send its request and get its 503
CLOSE_EXTENSION = "plurai.close"  # scope["extensions"]: drops the connection
RESERVED_FDS = 64  # files the gateway holds besides its client connections

_PHRASES = {
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response (OpenAI's error shape) that closes its connection."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(error_body(message, code, None, kind)).encode()
    head = [
        f"HTTP/1.1 {status} {_PHRASES[status]}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _over_cap(scope: Any, receive: Any, send: Any) -> None:
    message = (
        "this gateway has too many open connections (PLURAI_GATEWAY_MAX_CONNECTIONS); "
        "retry, or use another gateway"
    )
    body = json.dumps(error_body(message, "too_many_connections", None, "server_error")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Guarded(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards above; `protocol(settings)` makes the
    class uvicorn is given."""

    settings: Settings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timer: asyncio.TimerHandle | None = None
        self.head = True  # reading a request's head (or waiting for one)
        self.head_bytes = 0
        self.heard = False  # any byte received
        self.fresh = True  # its first request's head is still to come
        self.over = False  # opened beyond the connection cap

    # -- timers ---------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _refuse(self, status: int, message: str, code: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(refusal(status, message, code))
            self.transport.close()

    def _head_late(self) -> None:
        self.timer = None
        if not self.heard or self.over:
            self.transport.close()  # said nothing (an idle connection): nothing to answer
            return
        s = self.settings
        self._refuse(
            408,
            f"the request's headers did not arrive within {s.gateway_header_timeout_s:g} s "
            "(PLURAI_GATEWAY_HEADER_TIMEOUT_S)",
            "request_timeout",
        )

    def _body_late(self) -> None:
        self.timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        cycle.disconnected = True  # the app reads a disconnect, and sends nothing
        cycle.message_event.set()
        s = self.settings
        self._refuse(
            408,
            f"the request body did not arrive within {s.gateway_body_timeout_s:g} s "
            "(PLURAI_GATEWAY_BODY_TIMEOUT_S)",
            "request_timeout",
        )

    def _drop(self) -> None:
        """End the connection at once, whatever is unsent: its client stopped reading."""
        self._disarm()
        self.transport.abort()

    # -- protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.over = len(self.connections) > self.settings.gateway_max_connections
        limit = OVER_CAP_S if self.over else self.settings.gateway_header_timeout_s
        self._arm(limit, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.heard = True
        if self.head:
            self.head_bytes += len(data)
        super().data_received(data)
        if self.head and self.head_bytes > self.settings.gateway_max_header_bytes:
            self._disarm()
            self._refuse(
                431,
                f"the request's head is over {self.settings.gateway_max_header_bytes} bytes "
                "(PLURAI_GATEWAY_MAX_HEADER_BYTES)",
                "headers_too_large",
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head = True
        if not self.fresh:  # a kept-alive connection's next request: from its first byte
            self._arm(self.settings.gateway_header_timeout_s, self._head_late)

    def on_headers_complete(self) -> None:
        self.head, self.head_bytes, self.fresh = False, 0, False
        self.scope["extensions"] = {CLOSE_EXTENSION: self._drop}  # type: ignore[typeddict-unknown-key]
        if self.over:
            self.app = _over_cap
        super().on_headers_complete()
        if self.over:
            self._disarm()
        else:
            self._arm(self.settings.gateway_body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def timeout_keep_alive_handler(self) -> None:
        # idle since its last response was handed over; if that is still unread, give the
        # client stream_stall_s more, then drop it (a close waits for the unsent data)
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size():
            self._arm(self.settings.gateway_stream_stall_s, self._stalled)
        else:
            self.transport.close()

    def _stalled(self) -> None:
        self.timer = None
        if self.transport.get_write_buffer_size():
            self._drop()
        else:
            self.transport.close()


def protocol(settings: Settings) -> type[Guarded]:
    return type("GuardedProtocol", (Guarded,), {"settings": settings})


def raise_file_limit(connections: int) -> int:
    """Raise this process's open-file limit to its hard limit (every connection is a file;
    the usual soft limit, 1024, is far below a gateway's); warn when it is still below
    `connections`. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d: %s", soft, e)
    if soft != resource.RLIM_INFINITY and soft < connections + RESERVED_FDS:
        log.warning(
            "the open-file limit (%d) is below PLURAI_GATEWAY_MAX_CONNECTIONS (%d) plus %d: "
            "connections beyond it fail at accept; raise `ulimit -n` or lower the cap",
            soft,
            connections,
            RESERVED_FDS,
        )
    return soft


def run(app: Any, settings: Settings) -> None:
    """Serve `app` with uvicorn and the guards (blocks until SIGINT or SIGTERM)."""
    import uvicorn

    raise_file_limit(settings.gateway_max_connections)
    uvicorn.run(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        http=protocol(settings),
        ws="none",
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_keep_alive=settings.gateway_keepalive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=10,
        backlog=max(2048, min(settings.gateway_max_connections, 65535)),
    )
