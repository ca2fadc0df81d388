"""What tracing costs: the same jobs through Redis and one worker with tracing off, and on
(every span exported over OTLP/HTTP to a collector this bench runs on loopback).

    python bench/tracing.py [--model DIR] [--jobs 300] [--max-tokens 16] [--runs 3] [--smoke]

The tiny model's steps are fast, as a GPU fleet's are heading, so a job's fixed costs (its
submit, intake and result, where the spans are made) weigh most. Runs alternate off and on;
each run starts a fresh worker, submits the jobs at once (`submit_many`) and waits for all.
Figures: jobs/s and tokens/s (medians), the ratio on/off, the spans the collector received
per job (the bench's submit spans and the worker's) and their bytes. The last line is one JSON object of measured figures and ratios.
--smoke: one run each way of eight jobs of four tokens on the smoke runs' tiny model: a
check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.queue_overhead import WORDS, start_worker  # noqa: E402
from bench.workload import add_smoke_arg, json_line, smoke_model  # noqa: E402
from plurai.broker_config import tracing  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.producer.client import Client  # noqa: E402


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that counts what it is sent and answers 200."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans = self.bytes = 0
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.headers.get("content-encoding") == "gzip":
            import gzip

            body = gzip.decompress(body)
        req = ExportTraceServiceRequest.FromString(body)
        n = sum(len(s.spans) for r in req.resource_spans for s in r.scope_spans)
        with self.server.lock:
            self.server.spans += n
            self.server.bytes += len(body)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


def run(model: str, url: str, jobs: int, max_tokens: int, env: dict[str, str]) -> dict:
    worker = start_worker(model, url, env)
    try:
        client = Client(url)
        reqs = [
            {
                "prompt": f"Note {i}: {' '.join(WORDS[: 4 + i % 9])}",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            for i in range(jobs)
        ]
        t = time.perf_counter()
        recs = client.wait_all(client.submit_many(reqs), timeout=600)
        seconds = time.perf_counter() - t
        assert all(r.state == "completed" for r in recs), {r.state for r in recs}
        tokens = sum(r.output_tokens or 0 for r in recs)
        client.close()
    finally:
        worker.terminate()  # a clean stop flushes the worker's spans
        worker.wait(timeout=120)
    return {"jobs_per_s": jobs / seconds, "tokens_per_s": tokens / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.model, a.jobs, a.max_tokens, a.runs = str(smoke_model()), 8, 4, 1
    if not (Path(a.model) / "config.json").exists():
        from plurai.gpu_workers.models.factory import make_model

        make_model(Path(a.model), family="llama", size="tiny", train=True)
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    on = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
        "OTEL_BSP_SCHEDULE_DELAY": "1000",
    }
    os.environ.update(on)  # this process's submit spans: the parents of the worker's
    tracing.ON = True
    tracing.setup("plurai-bench")
    figures: dict[str, list[dict]] = {"off": [], "on": []}
    spans_on = 0
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        for i in range(a.runs):
            for name in ("off", "on"):
                env = on if name == "on" else {"OTEL_TRACES_EXPORTER": "none"}
                tracing.ON = name == "on"
                before = collector.spans
                got = run(a.model, url, a.jobs, a.max_tokens, env)
                time.sleep(1.5)  # the last batch of spans in flight
                if name == "on":
                    spans_on += collector.spans - before
                figures[name].append(got)
                print(f"run {i + 1} tracing {name}: {got}", flush=True)
    med = {
        name: {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
        for name, runs in figures.items()
    }
    tracing.shutdown()
    json_line(
        {
            "bench": "tracing",
            "model": Path(a.model).name,
            "jobs": a.jobs,
            "max_tokens": a.max_tokens,
            "runs": a.runs,
            "off": med["off"],
            "on": med["on"],
            "jobs_per_s_on_vs_off": round(med["on"]["jobs_per_s"] / med["off"]["jobs_per_s"], 3),
            "spans_per_job": round(spans_on / (a.runs * a.jobs), 2),  # submit's too
            "otlp_bytes_per_span": round(collector.bytes / max(1, collector.spans), 1),
            "cpus": os.cpu_count(),
        },
        a.smoke,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
