"""Tracing without Redis: when the OTEL_* variables turn it on, the traceparent field's
checks (any malformed value is ignored, never refused), the SDK's submit span and the
field it adds to the entry (none while tracing is off), and how the submit's reply ends
the span."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from plurai.broker_config import protocol, tracing
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.producer.request import check, prepare
from plurai.producer.submit import Plan

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ROOT = Path(__file__).resolve().parents[2]

# a process that submits (the SDK's prepare) and parses an entry with a traceparent, as
# the gateway and the worker do, then says whether OpenTelemetry's tracing SDK was
# imported (redis-py itself imports OpenTelemetry's API and metrics SDK where installed)
OFF_PROBE = f"""
import sys
import plurai.gateway.app, plurai.gpu_workers.worker, plurai.producer.aio, plurai.producer.client
from plurai.broker_config import protocol
from plurai.broker_config.settings import Settings
from plurai.producer.request import prepare
prepare(Settings(), prompt="x")
fields = {{b"v": b"2", b"id": b"job-12345678", b"max_tokens": b"4", b"body": b'{{"prompt": "a"}}',
          b"traceparent": b"{GOOD}"}}
protocol.parse_request(fields, protocol.Limits())
print("imported", "opentelemetry.sdk.trace" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize(
    "value",
    [
        GOOD,
        GOOD.encode(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",  # not sampled
        "00-00000000000000000000000000000001-0000000000000001-ff",
    ],
)
def test_a_w3c_traceparent_of_version_00_is_taken(value: str | bytes) -> None:
    assert tracing.valid(value) == (value.decode() if isinstance(value, bytes) else value)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        GOOD[:-1],  # too short
        GOOD + "0",  # too long
        GOOD + "-extra",  # a later version's fields, under version 00
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # uppercase
        "00-0af7651916cd43dd8448eb211c80319c-B7AD6B7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0A",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # another version
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",  # not hex
        "00_0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331_01",
        " 0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-٠af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # a non-ASCII digit
        b"\xff" * 55,  # not UTF-8
        b"00-0af7651916cd43dd8448eb211c80319\xff-b7ad6b7169203331-01",
        b"x" * 100_000,
    ],
)
def test_anything_else_is_ignored(value: str | bytes | None) -> None:
    assert tracing.valid(value) is None


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "zipkin,Console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, False),  # none this process has
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, True),
        ({"OTEL_SERVICE_NAME": "x"}, False),
    ],
)
def test_only_the_otel_variables_turn_it_on(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled(env) is on


def fields(traceparent: bytes | None) -> dict[bytes, bytes]:
    f = {
        b"v": b"2",
        b"id": b"job-12345678",
        b"max_tokens": b"4",
        b"content_type": b"application/json",
        b"body": b'{"prompt": "hi"}',
    }
    if traceparent is not None:
        f[b"traceparent"] = traceparent
    return f


@pytest.mark.parametrize(
    "value", [b"garbage", b"\xff\xfe" * 30, GOOD.upper().encode(), b"", b"0" * 4096]
)
def test_an_entry_with_a_malformed_traceparent_parses_untraced(traced, value: bytes) -> None:
    req = protocol.parse_request(fields(value), protocol.Limits())
    assert req.prompt == "hi" and req.envelope.max_tokens == 4
    assert req.envelope.traceparent is None


def test_an_entry_carries_its_traceparent_only_while_tracing_is_on(traced) -> None:
    assert (
        protocol.parse_request(fields(GOOD.encode()), protocol.Limits()).envelope.traceparent
        == GOOD
    )
    tracing.use(None)  # off: the field is not even read
    assert tracing.ON is False
    assert (
        protocol.parse_request(fields(GOOD.encode()), protocol.Limits()).envelope.traceparent
        is None
    )


def entry(sub) -> dict[str, object]:
    """The entry's fields (SUBMIT's ARGV after its six arguments)."""
    flat = sub.queue_args[6:]
    return dict(zip(flat[::2], flat[1::2], strict=True))


def test_the_sdk_submit_adds_its_span_as_the_entrys_traceparent(traced) -> None:
    s = Settings()
    sub = prepare(s, prompt="hello", lane="interactive", priority=-3, model="m")
    value = entry(sub)["traceparent"]
    assert tracing.valid(value) == value
    ctx = sub.span.get_span_context()
    assert value == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert (
        protocol.parse_request(
            {
                k.encode(): str(v).encode() if not isinstance(v, bytes) else v
                for k, v in entry(sub).items()
            },
            s.limits(),
        ).envelope.traceparent
        == value
    )
    # every job of a submit_many gets a trace of its own
    other = check(s, prompt="x").submission()
    assert other.span.get_span_context().trace_id != ctx.trace_id


def test_a_submit_inside_a_span_joins_its_trace(traced) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    outer = TracerProvider().get_tracer("app").start_span("the caller's")
    token = tracing.attach(outer)
    try:
        sub = prepare(Settings(), prompt="hello")
    finally:
        tracing.detach(token)
    assert sub.span.get_span_context().trace_id == outer.get_span_context().trace_id
    assert sub.span.parent.span_id == outer.get_span_context().span_id


def test_without_tracing_the_entry_has_no_traceparent_and_no_span() -> None:
    tracing.use(None)
    if tracing.ON:
        pytest.skip("the OTEL_* variables of this environment turn tracing on")
    sub = prepare(Settings(), prompt="hello")
    assert "traceparent" not in entry(sub) and sub.span is None


@dataclass
class Job:
    id: str


def plan(subs: list) -> Plan:
    s = Settings()
    return Plan(subs, Routes(s), s, False, [], Job)


def test_the_submit_span_ends_with_the_reply(traced) -> None:
    s = Settings()
    queued, repeat, full = (prepare(s, prompt=p) for p in ("a", "b", "c"))
    p = plan([queued, repeat, full])
    list(p.commands())
    earlier = "an-earlier-job-id"
    p.lost([0, queued.job_id, earlier, ResponseError("QUEUEFULL 9")])
    assert not traced.get_finished_spans()  # open while Redis works on them
    p.settle()
    ended = {sp.attributes["plurai.job_id"]: sp for sp in traced.get_finished_spans()}
    assert set(ended) == {queued.job_id, repeat.job_id, full.job_id}
    assert all(sp.name == "submit" for sp in ended.values())
    assert ended[queued.job_id].status.is_ok
    assert ended[repeat.job_id].attributes["plurai.job_of_key"] == earlier
    refused = ended[full.job_id]
    assert not refused.status.is_ok and refused.attributes["plurai.error_code"] == "queue_full"
    assert refused.attributes["plurai.lane"] == "standard"


@pytest.mark.parametrize(
    ("env", "imported"),
    [
        ({}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ],
)
def test_off_no_process_imports_opentelemetry(env: dict[str, str], imported: bool) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", OFF_PROBE],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert f"imported {imported}" in out.stderr
