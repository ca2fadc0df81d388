"""Tracing of every job (broker_config/tracing.py, gpu_workers/spans.py) across processes:
workers and a gateway with OTEL_* set, exporting to a small OTLP/HTTP receiver run here.
A request through the gateway that continues its client's traceparent; a job whose worker
is SIGKILLed mid-generation and which another worker finishes; a job with a malformed
traceparent, which runs untraced. In-process: tests/integration/test_tracing.py.

The tests share the OTLP receiver, the workers and the gateway (module fixtures).
"""

from __future__ import annotations

import gzip
import json
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.producer.client import Client
from plurai.results import records

from .conftest import Workers
from .faults import FAST
from .test_gateway import Gateway
from .test_tracing import WORKER_PHASES, Span, from_sdk, named, one


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Receiver:
    """An OTLP/HTTP traces endpoint on a free port that keeps every span it is sent."""

    KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            name=s.name,
                            trace_id=int.from_bytes(s.trace_id, "big"),
                            span_id=int.from_bytes(s.span_id, "big"),
                            parent=int.from_bytes(s.parent_span_id, "big")
                            if s.parent_span_id
                            else 0,
                            kind=self.KINDS[s.kind],
                            start=s.start_time_unix_nano / 1e9,
                            end=s.end_time_unix_nano / 1e9,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == 2,
                            service=resource.get("service.name", ""),
                        )
                    )
        with self.lock:
            self.spans += got

    def of(self, job_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.job == job_id]

    def wait(self, done: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        give_up = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            assert time.monotonic() < give_up, sorted((s.name, s.job) for s in spans)
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def has(spans: list[Span], job_id: str, name: str, **attributes: Any) -> bool:
    return bool(named([s for s in spans if s.job == job_id], name, **attributes))


def traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


# -- processes exporting over OTLP -----------------------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    rec = Receiver()
    yield rec
    rec.close()


@dataclass
class Stack:
    url: str
    workers: Workers
    gateway: Gateway
    receiver: Receiver
    model: str
    r: redis.Redis


@pytest.fixture(scope="module")
def stack(module_redis_url, tiny_model, tmp_path_factory, receiver) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    env = {
        **FAST,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # exported before a SIGKILL can lose them
        "OTEL_SERVICE_NAME": "",
        "OTEL_TRACES_EXPORTER": "",
        "OTEL_SDK_DISABLED": "",
    }
    w = Workers(module_redis_url, tiny_model, logs)
    w.start(1, "--worker-id", "first", env=env)
    w.start(1, "--worker-id", "second", env=env)
    gw = Gateway(module_redis_url, logs / "gateway.log", env=env)
    yield Stack(module_redis_url, w, gw, receiver, tiny_model.name, connect(module_redis_url))
    gw.stop()
    w.stop()


def test_a_request_through_the_gateway_is_one_trace(stack: Stack) -> None:
    sent = traceparent()
    caller = int(sent.split("-")[2], 16)
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "Trace me."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    url = stack.gateway.base + "/v1/chat/completions"
    answer = httpx.post(url, json=body, headers={"traceparent": sent}, timeout=60)
    assert answer.status_code == 200, answer.text
    job_id = answer.json()["id"].split("-", 1)[1]
    rec = records.get(stack.r, job_id)
    spans = stack.receiver.wait(
        lambda s: has(s, job_id, "result") and has(s, job_id, "POST /v1/chat/completions")
    )
    trace_id = int(sent.split("-")[1], 16)
    mine = [s for s in spans if s.trace_id == trace_id]
    assert {s.job for s in mine} == {job_id}  # one trace: this job's, nothing else in it
    request = one(mine, "POST /v1/chat/completions")
    assert request.parent == caller and request.kind == "server"
    assert request.service == "plurai-gateway"
    assert request.attributes["http.response.status_code"] == 200 and not request.error
    submit = one(mine, "submit")
    assert submit.parent == request.span_id and submit.service == "plurai-gateway"
    work = [s for s in mine if s.service == "plurai-worker"]
    assert sorted(s.name for s in work) == sorted(WORKER_PHASES)
    assert all(s.parent == submit.span_id for s in work)
    for s in [submit, *work]:
        assert s.attributes["plurai.lane"] == "standard" and s.attributes["plurai.priority"] == 0
        assert s.attributes["plurai.model"] == "default"
    assert {s.attributes["plurai.worker"] for s in work} == {rec.worker}
    result = one(work, "result")
    assert result.attributes["plurai.prompt_tokens"] == rec.prompt_tokens
    assert result.attributes["plurai.cached_tokens"] == rec.cached_tokens
    assert result.attributes["plurai.output_tokens"] == rec.output_tokens == 6
    assert one(work, "prefill").attributes["plurai.prompt_tokens"] == rec.prompt_tokens

    # streamed, without a traceparent: a trace of its own, its request span ended with
    # the stream
    body["stream"] = True
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    job_id = json.loads(lines[0][6:])["id"].split("-", 1)[1]
    spans = stack.receiver.wait(
        lambda s: has(s, job_id, "result") and has(s, job_id, "POST /v1/chat/completions")
    )
    request = one([s for s in spans if s.job == job_id], "POST /v1/chat/completions")
    assert request.parent == 0 and request.attributes["plurai.client_left"] is False
    assert {s.trace_id for s in spans if s.job == job_id} == {request.trace_id}


def test_a_malformed_traceparent_runs_untraced(stack: Stack) -> None:
    stream = keys.request_stream("standard")
    jobs, sent = {}, traceparent()
    for name, value in (
        ("bad", "00-" + "A" * 32 + "-" + "b" * 16 + "-01"),  # uppercase: not W3C
        ("zero", f"00-{'0' * 32}-{'b' * 16}-01"),
        ("junk", "\udcff garbage"),
        ("good", sent),
    ):
        job_id = f"trace-{name}-{secrets.token_hex(4)}"
        body = json.dumps({"prompt": f"the {name} one", "ignore_eos": True})
        fields = {"v": "2", "id": job_id, "max_tokens": "4", "body": body}
        stack.r.xadd(stream, {**fields, "traceparent": value.encode("utf-8", "surrogateescape")})
        jobs[name] = job_id
    give_up = time.monotonic() + 60
    while not all(records.get(stack.r, j).final for j in jobs.values()):
        assert time.monotonic() < give_up
        time.sleep(0.05)
    for job_id in jobs.values():
        rec = records.get(stack.r, job_id)
        assert rec.state == records.COMPLETED and rec.output_tokens == 4, rec
    stack.receiver.wait(lambda s: has(s, jobs["good"], "result"))
    time.sleep(0.5)  # ten export intervals: what the others would have sent is in
    for name in ("bad", "zero", "junk"):
        assert stack.receiver.of(jobs[name]) == []
    good = stack.receiver.of(jobs["good"])
    assert {s.trace_id for s in good} == {int(sent.split("-")[1], 16)}
    assert sorted(s.name for s in good) == sorted(WORKER_PHASES)


def test_a_sigkilled_workers_job_has_both_attempts_in_its_trace(stack: Stack, traced) -> None:
    client = Client(stack.url)
    job = client.submit("kill my worker", max_tokens=4000, ignore_eos=True, lane="interactive")
    (submit,) = [from_sdk(s) for s in traced.get_finished_spans() if s.name == "submit"]
    give_up = time.monotonic() + 60
    while not (stack.r.exists(keys.progress(job.id)) and records.get(stack.r, job.id).worker):
        assert time.monotonic() < give_up, "the job never made progress"
        time.sleep(0.01)
    owner = records.get(stack.r, job.id).worker
    time.sleep(1.0)  # its worker renews its lease meanwhile (FAST: every 0.3 s)
    stack.receiver.wait(lambda s: has(s, job.id, "prefill", **{"plurai.worker": owner}))
    victim = stack.workers.procs[["first", "second"].index(owner)]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert not records.get(stack.r, job.id).final, "the job ended before the kill"
    rec = client.job(job.id).result(timeout=120)
    assert rec.output_tokens == 4000 and rec.worker != owner
    spans = stack.receiver.wait(lambda s: has(s, job.id, "result"))
    spans = [s for s in spans if s.job == job.id]
    assert {s.trace_id for s in spans} == {submit.trace_id}
    assert all(s.parent == submit.span_id for s in spans)
    killed = [s for s in spans if s.attributes["plurai.worker"] == owner]
    took = [s for s in spans if s.attributes["plurai.worker"] == rec.worker]
    # the killed run's phases that had ended, exported before the kill; its decode is lost
    assert sorted(s.name for s in killed) == ["intake", "prefill", "queue wait"]
    assert {s.attributes["plurai.attempt"] for s in killed} == {1}
    assert sorted(s.name for s in took) == sorted(WORKER_PHASES)
    # the dead run had made tokens: no failed run of the job (test_faults_poison)
    assert one(took, "prefill").attributes["plurai.resumed_tokens"] > 0
    assert {s.attributes["plurai.attempt"] for s in took} == {1}
    # the second wait starts when the dead worker last renewed its lease, not when the job
    # was submitted
    assert one(took, "queue wait").start > one(killed, "intake").end + 0.2
    assert one(took, "result").attributes["plurai.state"] == "completed"
    client.close()
