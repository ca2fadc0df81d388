"""The gateway's errors as OpenAI error responses: a request raises a typed error (its own,
or one of the SDK's, Redis' or Starlette's) and the exception handlers registered here
turn it into its status, code and Retry-After. Anything else is a Plurai bug: a 500
`internal` (the server logs its traceback)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import redis
from kombu.exceptions import OperationalError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from plurai.broker_config.memory import is_oom
from plurai.gateway.auth import LaneError, Unauthorized
from plurai.gateway.openai import error_body
from plurai.producer.errors import (
    BadIdempotencyKey,
    NotReplicated,
    QueueFull,
    RedisFull,
    UnknownModel,
)
from plurai.producer.openai_body import BadRequest
from plurai.results.records import BadRecord

log = logging.getLogger("plurai.gateway")


class ApiError(Exception):
    """An error response: `status`, OpenAI's `code`, and `error`'s other arguments (`param`,
    `retry_after`, `kind`)."""

    def __init__(self, status: int, message: str, code: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra

    def response(self) -> JSONResponse:
        return error(self.status, self.message, self.code, **self.extra)


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


class _Unavailable:
    """Logs why Redis was unavailable to a request, at most once a second (an outage fails
    every request: the count of the others goes with the next line)."""

    def __init__(self) -> None:
        self.last = -math.inf
        self.quiet = 0

    def seen(self, path: str, e: Exception) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            self.quiet += 1
            return
        more = f" ({self.quiet} more since the last line)" if self.quiet else ""
        log.warning("%s: 503, Redis unavailable: %s: %s%s", path, type(e).__name__, e, more)
        self.last, self.quiet = now, 0


_unavailable = _Unavailable()


def unavailable(e: Exception | None = None) -> JSONResponse:
    """503: Redis cannot be reached, or (`e` an OOM refusal) is out of memory."""
    if e is not None and is_oom(e):
        return redis_full(RedisFull("", 1.0))
    return error(503, "the queue's Redis is unavailable", "unavailable", retry_after=1)


def redis_full(e: RedisFull) -> JSONResponse:
    """503: Redis is at its maxmemory and queues nothing until memory frees."""
    return error(503, str(e), e.code, retry_after=e.retry_after)


def no_workers() -> ApiError:
    return ApiError(503, "no worker is serving any model now", "no_workers", retry_after=5)


def model_not_found(model: str) -> ApiError:
    message = f"the model {model!r} is not served; see GET /v1/models"
    return ApiError(404, message, "model_not_found", param="model")


def _response(request: Request, e: Exception) -> Response:
    """The response of an error the handlers know."""
    if isinstance(e, ApiError):
        return e.response()
    if isinstance(e, BadRequest):
        kind = "authentication_error" if e.status == 401 else None
        return error(e.status, e.message, e.code, e.param, kind=kind)
    if isinstance(e, Unauthorized):
        return error(401, str(e), "invalid_api_key", kind="authentication_error")
    if isinstance(e, LaneError):
        return error(400, str(e), "lane_not_allowed", "lane")
    if isinstance(e, UnknownModel):  # plurai:models has no live beat of it (yet)
        return error(404, str(e), "model_not_found", "model")
    if isinstance(e, RedisFull):  # before QueueFull, of which it is one
        return redis_full(e)
    if isinstance(e, QueueFull):
        return error(429, str(e), "queue_full", retry_after=e.retry_after)
    if isinstance(e, BadIdempotencyKey):
        message = "the Idempotency-Key is held by something other than a job; use another"
        return error(409, message, "idempotency_key_conflict")
    if isinstance(e, NotReplicated):  # queued on the primary only (a failover loses it); a
        # retry with the same Idempotency-Key queues nothing twice
        return error(503, str(e), "not_replicated", retry_after=1)
    if isinstance(e, ClientDisconnect):
        return Response(status_code=499)  # nobody reads it
    if isinstance(e, BadRecord):  # a record no Plurai process wrote
        log.warning("%s: %s", request.url.path, e)
        return error(500, str(e), BadRecord.code)
    if isinstance(e, redis.ResponseError) and not is_oom(e):  # e.g. a key of another type
        log.warning("%s: Redis refused a command: %s", request.url.path, e)
        return error(500, "the stored record is damaged", "internal")
    if isinstance(e, (redis.RedisError, OperationalError)):  # or an OOM refusal of a write
        if not is_oom(e):
            _unavailable.seen(request.url.path, e)
        return unavailable(e)
    # a bug: Starlette raises it on for the server to log, after this response
    return error(500, "internal error: a bug in Plurai (see the gateway's log)", "internal")


_CLIENT_ERRORS: tuple[tuple[type[Exception], int], ...] = (
    (Unauthorized, 401),
    (LaneError, 400),
    (UnknownModel, 404),
    (BadIdempotencyKey, 409),
    (ClientDisconnect, 499),
)


def client_status(e: BaseException) -> int | None:
    """The 4xx status `_response` answers `e` with (the client's mistake, or a refusal such
    as a full queue); None where it answers 5xx (a failure on this side)."""
    if isinstance(e, RedisFull):
        return None
    if isinstance(e, QueueFull):
        return 429
    status = getattr(e, "status", None) if isinstance(e, (ApiError, BadRequest)) else None
    status = status or next((s for kind, s in _CLIENT_ERRORS if isinstance(e, kind)), None)
    return status if status is not None and status < 500 else None


async def handle(request: Request, e: Exception) -> Response:
    return _response(request, e)


# every error the handler knows; Exception last, for Starlette's outermost handler
HANDLED: tuple[type[Exception], ...] = (
    ApiError,
    BadRequest,
    Unauthorized,
    LaneError,
    UnknownModel,
    QueueFull,
    BadIdempotencyKey,
    NotReplicated,
    ClientDisconnect,
    BadRecord,
    redis.RedisError,
    OperationalError,
    Exception,
)


def handlers() -> dict[Any, Any]:
    """Starlette's `exception_handlers`."""
    return dict.fromkeys(HANDLED, handle)
