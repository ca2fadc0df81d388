"""The `plurai gateway` and `plurai dashboard` entries: settings, the Redis URL, then
uvicorn serving the app (with server.py's guards against floods and slow clients).

plurai gateway [--host 127.0.0.1] [--port 8000] [--url redis://...]
plurai dashboard [--host 127.0.0.1] [--port 8001] [--url redis://...]
    the gateway's /dashboard on its own, for deployments without a gateway
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from plurai.broker_config import logs
from plurai.broker_config.connection import redact, resolve_url
from plurai.broker_config.settings import Settings

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("plurai.gateway")


def create_app(settings: Settings, url: str) -> Starlette:
    """The gateway's ASGI app: the completions endpoints (app.py), files and batches
    (batches.py) and the dashboard (dashboard.py) on one Gateway; errors.py's handlers and
    the metrics middleware."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from plurai.gateway import admin, batches, errors
    from plurai.gateway.app import Gateway
    from plurai.gateway.metrics import MetricsMiddleware

    gw = Gateway(settings, url)
    if settings.dashboard:
        from plurai.gateway.dashboard import Dashboard

        gw.dashboard = Dashboard(settings, url)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", gw.chat, methods=["POST"]),
            Route("/v1/completions", gw.completions, methods=["POST"]),
            Route("/v1/models", gw.list_models, methods=["GET"]),
            Route("/health", gw.health, methods=["GET"]),
            Route("/metrics", gw.metrics_page, methods=["GET"]),
            *batches.routes(gw),
            *admin.routes(gw),
            *(gw.dashboard.routes() if gw.dashboard else []),
        ],
        middleware=[Middleware(MetricsMiddleware, metrics=gw.metrics)],
        exception_handlers=errors.handlers(),
        lifespan=gw.lifespan,
    )
    app.state.gateway = gw
    return app


def create_dashboard_app(settings: Settings, url: str) -> Starlette:
    """The dashboard alone: /dashboard and its data, and / leading there."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import RedirectResponse
    from starlette.routing import Route

    from plurai.broker_config.connection import connect_async
    from plurai.gateway.auth import Guard
    from plurai.gateway.dashboard import Dashboard

    dash = Dashboard(settings, url)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        r = connect_async(url)
        dash.start(Guard(r, settings.gateway_host))
        try:
            yield
        finally:
            await dash.stop()
            await r.aclose()

    async def home(_request: Any) -> RedirectResponse:
        return RedirectResponse("/dashboard")

    app = Starlette(routes=[Route("/", home), *dash.routes()], lifespan=lifespan)
    app.state.dashboard = dash
    return app


def add_arguments(
    p: argparse.ArgumentParser, port: str = "PLURAI_GATEWAY_PORT, default 8000"
) -> None:
    p.add_argument("--host", help="address to listen on (PLURAI_GATEWAY_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help=f"port ({port}; 0: any)")
    p.add_argument("--url", help="Redis URL (PLURAI_REDIS_URL, else the embedded one)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (PLURAI_LOG_LEVEL)")
    p.add_argument(
        "--log-format", choices=logs.FORMATS, help="text or json lines (PLURAI_LOG_FORMAT)"
    )


def main(argv: list[str] | None = None, dashboard: bool = False) -> int:
    """`plurai gateway`, or (`dashboard`) `plurai dashboard`."""
    prog = "plurai dashboard" if dashboard else "plurai gateway"
    description = (
        "the dashboard on its own: queue, workers, recent jobs (read-only)"
        if dashboard
        else "the OpenAI-compatible HTTP API in front of the queue"
    )
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(
        p,
        "PLURAI_DASHBOARD_PORT, default 8001" if dashboard else "PLURAI_GATEWAY_PORT, default 8000",
    )
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    for name, field in (
        ("host", "gateway_host"),
        ("port", "dashboard_port" if dashboard else "gateway_port"),
        ("url", "redis_url"),
        ("log_level", "log_level"),
        ("log_format", "log_format"),
    ):
        if getattr(args, name) is not None:
            overrides[field] = getattr(args, name)
    settings = Settings(**overrides)
    if dashboard:  # served where the dashboard's port says
        settings = settings.model_copy(update={"gateway_port": settings.dashboard_port})
    logs.setup(settings.log_level, settings.log_format)
    try:
        url = resolve_url(settings.redis_url, settings)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from e
    from plurai.broker_config import memory
    from plurai.broker_config.connection import connect
    from plurai.gateway import apikeys, auth, server

    try:
        r = connect(url)
        keyed = apikeys.any_keys(r)
        memory.check_policy(r)  # an evicting Redis would drop jobs and results
    except memory.EvictingRedis as e:
        raise SystemExit(f"{prog}: {e}") from e
    except Exception as e:  # noqa: BLE001 - any failure here is reported, not raised
        raise SystemExit(f"{prog}: cannot reach Redis: {redact(str(e))}") from e
    if not keyed and auth.loopback(settings.gateway_host):
        log.warning(
            "no API keys: open to clients on this machine only "
            "(`plurai keys create --tenant NAME` makes requests need a key%s)",
            "; the dashboard an admin key: --admin" if dashboard or settings.dashboard else "",
        )
    elif not keyed:
        log.warning(
            "no API keys, and listening on %s: every request is refused until one is "
            "created (`plurai keys create --tenant NAME`)",
            settings.gateway_host,
        )

    app = (create_dashboard_app if dashboard else create_app)(settings, url)
    log.info(
        "%s on http://%s:%d (queue %s)",
        "dashboard" if dashboard else "gateway",
        settings.gateway_host,
        settings.gateway_port,
        redact(url),
    )
    server.run(app, settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
