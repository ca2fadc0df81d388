"""Tracing of every job (broker_config/tracing.py, gpu_workers/spans.py): one trace per job,
from its submit to its result, across every worker that ran it.

In-process (workers driven by the test on the tiny model, spans in an in-memory exporter):
a job's spans and their attributes; a drained job resumed on another worker, and a job
whose engine fails until it is dead-lettered, each in one trace, the entry's traceparent
kept wherever the entry goes. Across processes, exporting over OTLP:
tests/integration/test_tracing_otlp.py.

The tests share the engines (a module fixture).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.worker import Worker
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker, turn_until

WORKER_PHASES = ("queue wait", "intake", "prefill", "decode", "result")


@dataclass
class Span:
    name: str
    trace_id: int
    span_id: int
    parent: int  # 0: a root
    kind: str
    start: float  # unix seconds
    end: float
    attributes: dict[str, Any]
    error: bool
    service: str
    events: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    @property
    def job(self) -> str | None:
        return self.attributes.get("plurai.job_id")


def from_sdk(s: Any) -> Span:
    """A span the in-memory exporter holds."""
    return Span(
        name=s.name,
        trace_id=s.context.trace_id,
        span_id=s.context.span_id,
        parent=s.parent.span_id if s.parent is not None else 0,
        kind=s.kind.name.lower(),
        start=s.start_time / 1e9,
        end=s.end_time / 1e9,
        attributes=dict(s.attributes),
        error=s.status.status_code.name == "ERROR",
        service=s.resource.attributes["service.name"],
        events={e.name: (e.timestamp / 1e9, dict(e.attributes)) for e in s.events},
    )


def named(spans: list[Span], name: str, **attributes: Any) -> list[Span]:
    return [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]


def one(spans: list[Span], name: str, **attributes: Any) -> Span:
    found = named(spans, name, **attributes)
    assert len(found) == 1, (name, attributes, [(s.name, s.attributes) for s in spans])
    return found[0]


# -- in-process workers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[Engine]]:
    made = [
        Engine(EngineConfig(model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32"))
        for _ in range(2)
    ]
    yield made
    for e in made:
        e.close()


def worker(url: str, engine: Engine, name: str, **settings: Any) -> Worker:
    return driven_worker(
        url, engine, name, heartbeat_interval_s=60, stream_flush_tokens=1, **settings
    )


def finished(traced: Any) -> list[Span]:
    return [from_sdk(s) for s in traced.get_finished_spans()]


def test_a_jobs_spans_from_submit_to_result(shared_redis_url: str, engines, traced) -> None:
    w = worker(shared_redis_url, engines[0], "w1")
    client = Client(shared_redis_url)
    job = client.submit(
        "trace this job", max_tokens=8, ignore_eos=True, lane="interactive", priority=7
    )
    r = connect(shared_redis_url)
    turn_until([w], lambda: records.get(r, job.id).final)
    rec = records.get(r, job.id)
    assert rec.state == records.COMPLETED
    spans = [s for s in finished(traced) if s.job == job.id]
    submit = one(spans, "submit")
    assert submit.parent == 0 and submit.kind == "producer"
    for s in spans:
        assert s.trace_id == submit.trace_id
        if s is not submit:
            assert s.parent == submit.span_id and s.service == "plurai-test"
            assert s.attributes["plurai.attempt"] == 1 and s.attributes["plurai.worker"] == "w1"
        assert s.attributes["plurai.lane"] == "interactive" and s.attributes["plurai.priority"] == 7
        assert s.attributes["plurai.model"] == "default" and not s.error
    assert sorted(s.name for s in spans) == sorted(("submit", *WORKER_PHASES))
    wait, intake, prefill, decode, result = (one(spans, n) for n in WORKER_PHASES)
    assert intake.kind == "consumer"
    # the phases follow one another: submit, wait, intake, prefill, decode, result
    assert submit.start <= wait.start + 0.01  # the entry's id: Redis's clock, in ms
    for a, b in ((wait, intake), (intake, prefill), (prefill, decode), (decode, result)):
        assert a.end <= b.start + 1e-3, (a.name, b.name)
    first_token = rec.first_token_ms / 1000
    assert abs(prefill.end - first_token) < 0.05
    at, attrs = prefill.events["first token"]
    assert at == prefill.end
    assert abs(attrs["plurai.time_to_first_token_s"] - (first_token - wait.start)) < 0.05
    assert prefill.attributes["plurai.prompt_tokens"] == rec.prompt_tokens
    assert prefill.attributes["plurai.cached_tokens"] == rec.cached_tokens
    assert prefill.attributes["plurai.resumed_tokens"] == 0
    # the queue hop: the engine's add inside the intake, and in the record, in order
    added, _ = intake.events["engine add"]
    assert intake.start <= added <= intake.end
    hops = [rec.hops_us[k] for k in ("queued_us", "taken_us", "added_us", "first_token_us")]
    assert hops == sorted(hops) and abs(hops[2] / 1e6 - added) < 1e-3
    assert abs(hops[3] / 1e6 - first_token) < 1e-3
    for s in (decode, result):
        assert s.attributes["plurai.output_tokens"] == rec.output_tokens == 8
        assert s.attributes["gen_ai.usage.output_tokens"] == 8
        assert s.attributes["plurai.prompt_tokens"] == rec.prompt_tokens
        assert s.attributes["gen_ai.usage.input_tokens"] == rec.prompt_tokens
        assert s.attributes["plurai.cached_tokens"] == rec.cached_tokens
        assert s.attributes["plurai.state"] == "completed"
        assert s.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert result.attributes["plurai.stored"] is True
    assert w.writer.results == {}  # every result span ended with its reply
    client.close()


def test_a_drained_job_resumed_elsewhere_is_one_trace(
    shared_redis_url: str, engines, traced
) -> None:
    one_w = worker(shared_redis_url, engines[0], "w1")
    client = Client(shared_redis_url)
    job = client.submit("drain me", max_tokens=40, ignore_eos=True)
    r = connect(shared_redis_url)
    turn_until([one_w], lambda: job.id in one_w.running and one_w.running[job.id].num_tokens >= 5)
    sent = one_w.running[job.id].entry.fields[b"traceparent"]
    one_w.request_stop(0)
    one_w._shut(crashed=False)  # handed over: the entry keeps its place, with its fields
    ((_, fields),) = r.xrange(keys.request_stream("standard"))
    assert fields[b"traceparent"] == sent
    two = worker(shared_redis_url, engines[1], "w2")
    turn_until([two], lambda: records.get(r, job.id).final)
    assert records.get(r, job.id).state == records.COMPLETED
    spans = [s for s in finished(traced) if s.job == job.id]
    submit = one(spans, "submit")
    assert {s.trace_id for s in spans} == {submit.trace_id}
    assert all(s.parent == submit.span_id for s in spans if s is not submit)
    first = [s for s in spans if s.attributes.get("plurai.worker") == "w1"]
    second = [s for s in spans if s.attributes.get("plurai.worker") == "w2"]
    assert sorted(s.name for s in first) == [
        "decode",
        "hand back",
        "intake",
        "prefill",
        "queue wait",
    ]
    assert sorted(s.name for s in second) == sorted(WORKER_PHASES)
    assert one(first, "decode").attributes["plurai.outcome"] == "drained"
    assert one(first, "hand back").attributes["plurai.reason"] == "drained"
    # no attempt counted for a drain; the second run resumed from the first's tokens
    assert {s.attributes["plurai.attempt"] for s in first + second} == {1}
    assert one(second, "prefill").attributes["plurai.resumed_tokens"] >= 5
    # each run's first token is marked; only the job's own first token has a TTFT
    assert "plurai.time_to_first_token_s" in one(first, "prefill").events["first token"][1]
    assert one(second, "prefill").events["first token"][1] == {}
    # the second wait counts from the hand-over, not from the entry's first add
    assert one(second, "queue wait").start >= one(first, "hand back").start - 0.01
    client.close()


def test_a_failing_job_keeps_its_trace_to_its_dead_letter(
    shared_redis_url: str, tiny_model, traced
) -> None:
    engine = Engine(
        EngineConfig(
            model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32", fault_token_id=7
        )
    )
    try:
        w = worker(shared_redis_url, engine, "w1", max_deliveries=3)
        client = Client(shared_redis_url)
        job = client.submit(token_ids=[5, 7, 9], max_tokens=8)
        r = connect(shared_redis_url)
        stream = keys.request_stream("standard")
        seen = dict(r.xrange(stream))
        sent = next(iter(seen.values()))[b"traceparent"]
        give_up = time.monotonic() + 60
        while not records.get(r, job.id).final:
            assert time.monotonic() < give_up
            w.iterate()
            seen.update(r.xrange(stream))
        w.writer.settle()
        # each failed attempt re-added the entry at the lane's tail, with its traceparent
        assert len(seen) == 3 and all(f[b"traceparent"] == sent for f in seen.values())
        rec = records.get(r, job.id)
        assert rec.error_code == "too_many_deliveries"
        spans = [s for s in finished(traced) if s.job == job.id]
        submit = one(spans, "submit")
        assert {s.trace_id for s in spans} == {submit.trace_id}
        backs = named(spans, "hand back")
        assert sorted(s.attributes["plurai.attempt"] for s in backs) == [1, 2, 3]
        assert all(s.error and s.attributes["plurai.reason"] == "failed" for s in backs)
        assert sorted(s.attributes["plurai.attempt"] for s in named(spans, "prefill")) == [1, 2, 3]
        result = one(spans, "result")
        assert result.error and result.attributes["plurai.error_code"] == "too_many_deliveries"
        client.close()
    finally:
        engine.close()
