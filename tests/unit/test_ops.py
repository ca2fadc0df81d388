"""Logging formats, the metrics port rules and the queue reading behind `plurai status`."""

from __future__ import annotations

import json
import logging
import socket
import urllib.request
from types import SimpleNamespace

import fakeredis
import pytest

from plurai.broker_config import keys, logs, stats
from plurai.broker_config.settings import DEFAULT_METRICS_PORT, Settings
from plurai.gpu_workers.serve import serve_metrics
from plurai.gpu_workers.startup import StartError
from plurai.gpu_workers.worker import Worker
from tests.helpers import beat


def record(**extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("plurai.worker", logging.INFO, __file__, 1, "job %s", ("ended",), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_lines_carry_extra_fields_and_tracebacks():
    line = json.loads(logs.JsonFormatter().format(record(job_id="j1", code="invalid_prompt")))
    assert line["message"] == "job ended" and line["level"] == "INFO"
    assert (line["job_id"], line["code"], line["logger"]) == (
        "j1",
        "invalid_prompt",
        "plurai.worker",
    )
    assert line["ts"].endswith("Z") and "T" in line["ts"]
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = record()
        rec.exc_info = sys.exc_info()
    line = json.loads(logs.JsonFormatter().format(rec))
    assert "ValueError: boom" in line["exc"]
    assert logs.TextFormatter().format(record(job_id="j2")).endswith("job ended job_id=j2")


def test_setup_refuses_unknown_level_or_format():
    with pytest.raises(ValueError, match="log level"):
        logs.setup("LOUD")
    with pytest.raises(ValueError, match="log format"):
        logs.setup("INFO", "xml")
    with pytest.raises(ValueError):
        Settings(log_format="xml")
    with pytest.raises(ValueError, match="log level"):
        Settings(log_level="LOUD")
    assert Settings(log_level="debug").log_level == "DEBUG"


def _worker(**settings: object) -> Worker:
    engine = SimpleNamespace(
        max_model_len=4096, max_num_seqs=64, step_tokens=512, model_fingerprint="x"
    )  # not run
    return Worker(engine, fakeredis.FakeRedis(), Settings(**settings), worker_id="w")


def _take(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:  # taken already, by something else: just as good here
        s.close()
        return None
    s.listen()
    return s


def test_metrics_port_rules():
    url = "redis://127.0.0.1:1/0"  # never reached: no scrape reads the queue here
    assert serve_metrics(_worker(), url, Settings(metrics_port=-1)) == 0
    busy = _take(0)
    assert busy is not None
    port = busy.getsockname()[1]
    default = _take(DEFAULT_METRICS_PORT)
    try:
        # a port asked for explicitly must be free
        settings = Settings(metrics_port=port, metrics_host="127.0.0.1")
        with pytest.raises(StartError, match="--metrics-port"):
            serve_metrics(_worker(), url, settings)
        # the default port, taken (another worker on this host): any free one instead
        settings = Settings(metrics_host="127.0.0.1")
        w = _worker()
        got = serve_metrics(w, url, settings)
        assert got not in (0, DEFAULT_METRICS_PORT)
        w.metrics.generation_tokens.inc(3)
        with urllib.request.urlopen(f"http://127.0.0.1:{got}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert "plurai_generation_tokens_total 3.0" in text
        assert "plurai_redis_up 0.0" in text  # the queue could not be read: said, not hidden
    finally:
        busy.close()
        if default is not None:
            default.close()


def test_lane_reading_counts_waiting_and_pending():
    r = fakeredis.FakeRedis()
    stream = keys.request_stream("batch")
    for i in range(3):
        r.xadd(stream, {"n": i})
    snap = stats.snapshot(r, ["interactive", "batch"])
    batch = snap.lanes[1]
    assert (batch.waiting, batch.pending) == (3, 0)  # no group yet: everything waits
    assert batch.oldest_waiting_age_s is not None
    assert (snap.lanes[0].waiting, snap.lanes[0].oldest_waiting_age_s) == (0, None)
    r.xgroup_create(stream, keys.GROUP, id="0")
    r.xreadgroup(keys.GROUP, "w1", {stream: ">"}, count=2)
    batch = stats.snapshot(r, ["batch"]).lanes[0]
    assert (batch.waiting, batch.pending, batch.consumers) == (1, 2, 1)
    beat(r, "w1", beat_ms=1, kv_blocks_total=64, tokens_per_s=2.5)
    r.sadd(keys.WORKERS, "gone")  # a worker without a heartbeat
    snap = stats.snapshot(r, ["batch"])
    assert [w.id for w in snap.workers] == ["w1"] and snap.stale_workers == 1
    assert (snap.workers[0].kv_blocks_total, snap.workers[0].tokens_per_s) == (64, 2.5)
