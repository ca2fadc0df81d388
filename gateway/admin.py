"""The admin API: an operator's controls of lanes and dead letters over HTTP, as `plurai
lane` and `plurai dead-letters` run them (producer/lanes.py, producer/dead_letters.py).

    GET    /admin/lanes                       the paused lanes
    POST   /admin/lanes/{lane}/pause          ?model=NAME (default: PLURAI_DEFAULT_MODEL)
    POST   /admin/lanes/{lane}/resume
    POST   /admin/lanes/{lane}/purge          every job waiting in it ends cancelled
    GET    /admin/dead-letters                ?count=N (newest first, at most 10,000)
    POST   /admin/dead-letters/{id}/requeue   its job queued again under its own id
    DELETE /admin/dead-letters/{id}

Every call needs an API key of admin scope (`plurai keys create --tenant NAME --admin`) as
`Authorization: Bearer <key>`, also on a gateway without keys: a web page could otherwise
post to a gateway on the operator's own machine. Errors are OpenAI error bodies with the
controls' codes (`unknown_lane`, `not_requeueable`, ...).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from plurai.broker_config.connection import connect
from plurai.broker_config.errors import CodedError
from plurai.broker_config.protocol import Code
from plurai.gateway.auth import Unauthorized
from plurai.gateway.errors import ApiError
from plurai.producer import dead_letters as dead
from plurai.producer import lanes
from plurai.producer.lanes import LaneCode

if TYPE_CHECKING:
    from plurai.gateway.app import Gateway

_STATUS = {  # a control's refusal -> its HTTP status
    LaneCode.UNKNOWN_LANE: 404,
    LaneCode.BAD_MODEL: 400,
    dead.DeadCode.UNKNOWN: 404,
    dead.DeadCode.NOT_REQUEUEABLE: 422,
    dead.DeadCode.JOB_ACTIVE: 409,
    dead.DeadCode.CLUSTER: 501,
    Code.QUEUE_FULL: 429,
}


class Admin:
    """The admin endpoints of one gateway: its own blocking Redis client (the controls are
    the CLI's), each call run in a thread."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.r: Any = None

    async def _run(self, request: Request, fn: Any, *args: Any) -> Any:
        """`fn(r, *args)` for a request whose key has the admin scope."""
        await self._admitted(request)
        if self.r is None:
            self.r = connect(self.gw.url)
        try:
            return await asyncio.to_thread(fn, self.r, *args)
        except CodedError as e:
            raise ApiError(_STATUS.get(e.code, 400), e.message, e.code) from None

    async def _admitted(self, request: Request) -> None:
        key = await self.gw.authorize(request)
        if key is None:
            raise Unauthorized(
                "the admin API needs an API key of admin scope, also on a gateway without "
                "keys: `plurai keys create --tenant NAME --admin`"
            )
        if not key.admin:
            raise ApiError(
                403,
                f"API key {key.id} has no admin scope; make one with "
                "`plurai keys create --tenant NAME --admin`",
                "admin_scope_required",
                kind="permission_error",
            )

    def close(self) -> None:
        if self.r is not None:
            self.r.close()

    # -- lanes ----------------------------------------------------------------------------

    async def paused(self, request: Request) -> JSONResponse:
        found = await self._run(request, lanes.paused)
        return JSONResponse({"paused": [{"model": m, "lane": lane} for m, lane in found]})

    async def pause(self, request: Request) -> JSONResponse:
        lane, model = request.path_params["lane"], request.query_params.get("model")
        changed = await self._run(request, lanes.pause, lane, model, self.gw.settings)
        return JSONResponse({"lane": lane, "paused": True, "changed": changed})

    async def resume(self, request: Request) -> JSONResponse:
        lane, model = request.path_params["lane"], request.query_params.get("model")
        changed = await self._run(request, lanes.resume, lane, model, self.gw.settings)
        return JSONResponse({"lane": lane, "paused": False, "changed": changed})

    async def purge(self, request: Request) -> JSONResponse:
        lane, model = request.path_params["lane"], request.query_params.get("model")
        n = await self._run(request, lanes.purge, lane, model, self.gw.settings)
        return JSONResponse({"lane": lane, "cancelled": n})

    # -- dead letters ---------------------------------------------------------------------

    async def dead_letters(self, request: Request) -> JSONResponse:
        count = request.query_params.get("count", "100")
        if not (count.isascii() and count.isdigit() and 1 <= int(count) <= dead.MAX_LIST):
            raise ApiError(400, f"count must be 1 to {dead.MAX_LIST}", "bad_count", param="count")
        found = await self._run(request, dead.list_dead, int(count))
        return JSONResponse({"data": [{**vars(d), "at_ms": d.at_ms} for d in found]})

    async def requeue(self, request: Request) -> JSONResponse:
        dead_id = request.path_params["dead_id"]
        job_id = await self._run(request, dead.requeue, dead_id, self.gw.settings)
        return JSONResponse({"id": dead_id, "job_id": job_id})

    async def drop(self, request: Request) -> JSONResponse:
        dead_id = request.path_params["dead_id"]
        n = await self._run(request, dead.drop, [dead_id])
        if not n:
            raise ApiError(404, f"no dead letter {dead_id[:64]!r}", dead.DeadCode.UNKNOWN)
        return JSONResponse({"id": dead_id, "dropped": True})


def routes(gw: Gateway) -> list[Route]:
    api = Admin(gw)
    gw.closers.append(api.close)
    return [
        Route("/admin/lanes", api.paused, methods=["GET"]),
        Route("/admin/lanes/{lane}/pause", api.pause, methods=["POST"]),
        Route("/admin/lanes/{lane}/resume", api.resume, methods=["POST"]),
        Route("/admin/lanes/{lane}/purge", api.purge, methods=["POST"]),
        Route("/admin/dead-letters", api.dead_letters, methods=["GET"]),
        Route("/admin/dead-letters/{dead_id}/requeue", api.requeue, methods=["POST"]),
        Route("/admin/dead-letters/{dead_id}", api.drop, methods=["DELETE"]),
    ]
