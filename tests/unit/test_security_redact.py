"""Passwords in Redis URLs never reach logs or the CLI's output."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from broker_config import logs
from broker_config.connection import redact
from broker_config.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:s3cret@h:6379/0", "redis://***@h:6379/0"),
        ("redis://worker:s3cret@h:6379/0", "redis://***@h:6379/0"),
        (
            "rediss://u:s3c@ret@h:6380/0?ssl_ca_certs=/ca.pem",
            "rediss://***@h:6380/0?ssl_ca_certs=/ca.pem",
        ),
        ("redis://h:6379/0?db=1&password=s3cret", "redis://h:6379/0?db=1&password=***"),
        ("unix://u:s3cret@/run/redis.sock?db=0", "unix://***@/run/redis.sock?db=0"),
        ("redis://:s3/cr?e#t@h/0", "redis://***@h/0"),
        (
            "redis+sentinel://:s3cret@a:26379,b:26379/main/0?sentinel_password=s3cret",
            "redis+sentinel://***@a:26379,b:26379/main/0?sentinel_password=***",
        ),
        (
            "cannot reach redis://:s3cret@a:1/0 nor rediss://x:s3cret@b:2/0.",
            "cannot reach redis://***@a:1/0 nor rediss://***@b:2/0.",
        ),
    ],
)
def test_redact(url, shown):
    assert redact(url) == shown
    assert "s3" not in redact(url)


def record(msg: str, *args, **extra) -> logging.LogRecord:
    r = logging.LogRecord("plurai.worker", logging.INFO, __file__, 1, msg, args, None)
    r.__dict__.update(extra)
    return r


def test_log_lines_are_redacted_in_both_formats():
    rec = record(
        "started embedded redis-server at %s",
        "redis://default:s3cret@127.0.0.1:5/0",
        url="redis://:s3cret@h/0",
    )
    text = logs.TextFormatter().format(rec)
    assert (
        "s3cret" not in text
        and "redis://***@127.0.0.1:5/0" in text
        and "url=redis://***@h/0" in text
    )
    line = json.loads(logs.JsonFormatter().format(rec))
    assert line["message"] == "started embedded redis-server at redis://***@127.0.0.1:5/0"
    assert line["url"] == "redis://***@h/0"
    try:
        raise ConnectionError("lost redis://:s3cret@h/0")
    except ConnectionError:
        rec = record("boom")
        rec.exc_info = sys.exc_info()
    for fmt in (logs.TextFormatter(), logs.JsonFormatter()):
        out = fmt.format(rec)
        assert "s3cret" not in out and "redis://***@h/0" in out


@pytest.mark.parametrize("flags", [["--once"], ["--json"], []])
def test_status_against_a_dead_url_never_prints_the_password(flags):
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"  # nothing listens there
    run = subprocess.run(
        [sys.executable, "-m", "cli", "status", "--url", url, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "s3cret" not in run.stdout + run.stderr
    assert run.stdout == ""
    assert "plurai: cannot read Redis at redis://***@127.0.0.1:" in run.stderr
    assert "Connection refused" in run.stderr or "connecting" in run.stderr
