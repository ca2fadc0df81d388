"""OpenTelemetry tracing of every job: one trace per job, from the client's submit through
its queue wait, each worker's intake, prefill and decode, hand-backs, to its result.

Off unless the standard OTEL_* variables ask for it (`enabled`). Off, nothing of Plurai
imports OpenTelemetry's tracing (redis-py imports its API and metrics SDK itself where they
are installed) and callers check `ON` before any per-job work. On, spans go to OTLP over
HTTP (protobuf; OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, ...) or the console,
through a BatchSpanProcessor (OTEL_BSP_*), as service OTEL_SERVICE_NAME, else the
process's default (plurai-worker, plurai-gateway, plurai-client). An application that
set up its own SDK TracerProvider gets Plurai's spans in it.

The trace context travels in the request entry's optional `traceparent` field (W3C Trace
Context, version 00; docs/protocol.md): the submit span's context, the parent of every
worker span. A field that is not a valid traceparent is ignored: the job runs untraced.
Spans are per phase and each ends with its phase, so a SIGKILLed worker loses only the
span of the phase it was in (gpu_workers/spans.py).

    tracing.use(InMemorySpanExporter())  # tests: every span to the exporter, at once
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("plurai.tracing")

TRACEPARENT = "traceparent"  # the entry field, and the HTTP header
# W3C Trace Context, version 00 only: trace id, parent span id, flags, lowercase hex
_TRACEPARENT = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_LENGTH = 55
_EXPORTERS = ("otlp", "console")


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces: OTEL_TRACES_EXPORTER otlp or console,
    or, with it unset, an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). OTEL_TRACES_EXPORTER=none or
    OTEL_SDK_DISABLED=true turn it off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _names(env)
    if names:
        return any(n in _EXPORTERS for n in names)
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _names(env: Mapping[str, str]) -> list[str]:
    raw = env.get("OTEL_TRACES_EXPORTER", "")
    return [n.strip().lower() for n in raw.split(",") if n.strip()]


ON = enabled()  # checked first wherever a job would be traced
_tracer: Any = None
_provider: Any = None  # the TracerProvider made here (not the application's)
_lock = threading.Lock()


def setup(service: str) -> None:
    """Make the tracer now, `service` the service name unless OTEL_SERVICE_NAME gives one
    (the SDK client's first span makes it otherwise, as plurai-client)."""
    global _tracer, _provider
    if not ON:
        return
    with _lock:
        if _tracer is not None:
            return
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        own = trace.get_tracer_provider()
        if isinstance(own, TracerProvider):  # the application's own set-up
            _tracer = own.get_tracer("plurai")
            return
        name = os.environ.get("OTEL_SERVICE_NAME") or service
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        for exporter in _exporters():
            provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* apply
        _provider, _tracer = provider, provider.get_tracer("plurai")


def _exporters() -> list[Any]:
    names = _names(os.environ) or ["otlp"]
    out: list[Any] = []
    for name in dict.fromkeys(names):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                log.warning(
                    "OTLP protocol %r is not available; traces go as http/protobuf", protocol
                )
            out.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER %r is not available; use otlp or console", name)
    return out


def use(exporter: Any, service: str = "plurai-test") -> None:
    """Tests: tracing on, every span handed to `exporter` (an SDK SpanExporter, e.g. the
    InMemorySpanExporter) as it ends; None: back to what the OTEL_* variables say."""
    global ON, _tracer, _provider
    with _lock:
        if exporter is None:
            ON, _tracer, _provider = enabled(), None, None
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        ON, _provider, _tracer = True, None, provider.get_tracer("plurai")


def shutdown() -> None:
    """Export the spans not sent yet and stop the exporters `setup` made (a clean stop);
    a later span sets up anew."""
    global _tracer, _provider
    with _lock:
        provider, _provider = _provider, None
        if provider is None:
            return
        _tracer = None
    provider.shutdown()  # flushes the batch processors first


def _get() -> Any:
    if _tracer is None:
        setup("plurai-client")
    return _tracer


# -- the trace context in the request entry --------------------------------------------


def valid(value: bytes | str | None) -> str | None:
    """`value` if it is a W3C traceparent of version 00 (lowercase hex, ids not all zero),
    else None: any other value is ignored."""
    if value is None or len(value) != _LENGTH:
        return None
    raw = value.encode("utf-8", "replace") if isinstance(value, str) else value
    m = _TRACEPARENT.fullmatch(raw)
    if m is None or not int(m[1], 16) or not int(m[2], 16):
        return None
    return raw.decode()


def parent(traceparent: str | None) -> Any:
    """The context of a valid traceparent (`valid`'s), for the spans of its job; None
    without one."""
    if traceparent is None:
        return None
    from opentelemetry import trace

    _, trace_id, span_id, flags = traceparent.split("-")
    ctx = trace.SpanContext(
        int(trace_id, 16), int(span_id, 16), True, trace.TraceFlags(int(flags, 16))
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def traceparent(span: Any) -> str | None:
    """The traceparent naming `span` as the parent: what goes in its job's entry."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def incoming(headers: Mapping[str, str]) -> Any:
    """The context an HTTP request's traceparent (and tracestate) header carries; without
    a valid one, an empty context: the request starts a trace."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def attach(span: Any) -> Any:
    """Make `span` the current span (of this thread or task) until `detach`."""
    from opentelemetry import context, trace

    return context.attach(trace.set_span_in_context(span))


def detach(token: Any) -> None:
    from opentelemetry import context

    context.detach(token)


# -- spans -----------------------------------------------------------------------------

_KINDS = ("internal", "server", "client", "producer", "consumer")


def span(
    name: str,
    parent: Any = None,
    start_s: float | None = None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
) -> Any:
    """Start a span (not made current): a child of the context `parent`, else of the
    current one. `start_s`: unix seconds, else now."""
    from opentelemetry.trace import SpanKind

    start = None if start_s is None else int(start_s * 1e9)
    return _get().start_span(
        name,
        context=parent,
        kind=SpanKind(_KINDS.index(kind)),
        attributes=_clean(attributes) if attributes else None,
        start_time=start,
    )


def end(span: Any, end_s: float | None = None, error: str = "", **attributes: Any) -> None:
    """End `span` at `end_s` (unix seconds, else now) with more attributes; `error` (a
    code) sets its status to error."""
    if attributes:
        span.set_attributes(_clean(attributes))
    if error:
        failed(span, error)
    span.end(None if end_s is None else int(end_s * 1e9))


def event(span: Any, name: str, at_s: float, **attributes: Any) -> None:
    """Add the event `name` to `span` at `at_s` (unix seconds)."""
    span.add_event(name, _clean(attributes), timestamp=int(at_s * 1e9))


def failed(span: Any, error: str) -> None:
    """Mark `span` failed with the error code `error`."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attributes({"plurai.error_code": error, "error.type": error})
    span.set_status(Status(StatusCode.ERROR, error))


def done(
    name: str,
    parent: Any,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any],
    kind: str = "internal",
    error: str = "",
) -> None:
    """The span of a phase already over, started and ended at once."""
    end(span(name, parent, start_s, attributes, kind), max(end_s, start_s), error)


def job_attributes(
    job_id: str,
    lane: str,
    priority: int | None,
    model: str,
    attempts: int,
    worker: str,
    tenant: str | None = None,
) -> dict[str, Any]:
    """What every worker span of a job carries (`attempts`: its failed processings before)."""
    return {
        "plurai.job_id": job_id,
        "plurai.tenant": tenant,
        "plurai.lane": lane,
        "plurai.priority": priority,
        "plurai.model": model,
        "gen_ai.request.model": model,
        "plurai.attempt": attempts + 1,
        "plurai.worker": worker,
    }


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}
