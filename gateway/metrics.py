"""The gateway's own Prometheus figures: requests by route and status, their latency, and
the streams open now. Served at GET /metrics; every request is counted by one middleware
(MetricsMiddleware), at its response's start."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "plurai_gateway_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "plurai_gateway_request_seconds",
            "Time to the response's start (for a stream: its first token), by route.",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.loop_lag = Histogram(
            "plurai_gateway_loop_lag_seconds",
            "How late the event loop ran a 0.1 s timer: every request waits as long.",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.open_streams = Gauge(
            "plurai_gateway_open_streams", "Streams being sent now.", registry=self.registry
        )

    def done(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# the routes counted, by path (exact, else the first prefix that matches)
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
PREFIXES = (("/v1/files", "files"), ("/v1/batches", "batches"))


def route_of(path: str) -> str | None:
    if path in ROUTES:
        return ROUTES[path]
    return next((name for prefix, name in PREFIXES if path.startswith(prefix)), None)


class MetricsMiddleware:
    """Counts each request of a counted route by its status, and times it to its
    response's start (a stream's: its first token). A request that raised is a 500; one
    whose client left before anything was sent, a 499."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = route_of(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def sent(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start" and not status:
                status = message["status"]
                self.metrics.done(route, status, time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, sent)
        except Exception:
            if not status:  # a bug: the outermost handler answers its 500
                status = 500
                self.metrics.done(route, status, time.perf_counter() - start)
            raise
        if not status:
            self.metrics.done(route, 499, time.perf_counter() - start)
