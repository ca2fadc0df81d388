"""Connection URLs: redis+sentinel:// parsed into sentinels, service, db and the two sets of
credentials; the same URL as Celery's Redis transport takes it; redis+cluster:// parsed into
nodes and credentials; mistakes said clearly; `redact`: passwords in Redis URLs never
reach logs or the CLI's output."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from plurai.broker_config import logs
from plurai.broker_config.celery_app import kombu_sentinel
from plurai.broker_config.connection import (
    ClusterURL,
    SentinelURL,
    connect,
    connect_async,
    is_cluster,
    parse_cluster,
    parse_sentinel,
    redact,
)
from plurai.broker_config.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_a_sentinel_url_names_sentinels_service_db_and_credentials() -> None:
    s = parse_sentinel(
        "redis+sentinel://app:p%40ss@10.0.0.1:26379,[::1]:26380,sentinel-3/main/2"
        "?sentinel_password=sp&sentinel_username=watch"
    )
    assert s == SentinelURL(
        hosts=[("10.0.0.1", 26379), ("::1", 26380), ("sentinel-3", 26379)],
        service="main",
        db=2,
        username="app",
        password="p@ss",
        sentinel_username="watch",
        sentinel_password="sp",
    )
    assert parse_sentinel("rediss+sentinel://h:1/main").tls
    assert parse_sentinel("redis://localhost:6379/0") is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h:26379", "ends in /<service name>"),
        ("redis+sentinel://h:26379/main/x", "ends in /<service name>"),
        ("redis+sentinel://h:port/main", "host:port"),
        ("redis+sentinel://,h:1/main", "host:port"),
        ("redis+sentinel://h:1/main?password=x", "unknown sentinel URL parameter"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel(url)


def test_connect_takes_a_sentinel_url_without_contacting_anyone() -> None:
    r = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/main/3", socket_timeout=2)
    pool = r.connection_pool
    assert pool.service_name == "main" and pool.connection_kwargs["db"] == 3


def test_celery_gets_one_sentinel_url_per_sentinel_and_the_service() -> None:
    s = parse_sentinel("redis+sentinel://:pw@a:26379,b:26380/main/1?sentinel_password=sp")
    assert s is not None
    broker, options = kombu_sentinel(s)
    assert broker == "sentinel://:pw@a:26379/1;sentinel://:pw@b:26380/1"
    assert options == {"master_name": "main", "sentinel_kwargs": {"password": "sp"}}


def test_a_cluster_url_names_nodes_and_credentials() -> None:
    c = parse_cluster("redis+cluster://app:p%40ss@10.0.0.1:7000,[::1]:7001,node-3/")
    assert c == ClusterURL(
        hosts=[("10.0.0.1", 7000), ("::1", 7001), ("node-3", 6379)],
        username="app",
        password="p@ss",
    )
    assert parse_cluster("redis+cluster://h:1") == ClusterURL(hosts=[("h", 1)])
    assert parse_cluster("redis+cluster://h:1/0") == ClusterURL(hosts=[("h", 1)])
    tls = parse_cluster("rediss+cluster://:pw@h:1/?ssl_ca_certs=/ca.pem")
    assert tls is not None and tls.tls and tls.password == "pw" and tls.username is None
    assert tls.node_kwargs["ssl"] and tls.node_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert parse_cluster("redis://localhost:6379/0") is None
    assert parse_cluster("redis+sentinel://h:1/main") is None
    assert parse_sentinel("redis+cluster://h:1/") is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://h:1/2", "only db 0"),
        ("redis+cluster://h:1/main", "only db 0 at most"),
        ("redis+cluster://h:1/0/0", "only db 0 at most"),
        ("redis+cluster://h:port/", "host:port"),
        ("redis+cluster://h:1,,h:2/", "host:port"),
        ("redis+cluster://h:70000/", "host:port"),
        ("redis+cluster:///", "host:port"),
        ("redis+cluster://h:1/?password=x", "unknown cluster URL parameter"),
        ("redis+cluster://h:1/?ssl_ca_certs=/ca.pem", "unknown cluster URL parameter"),
    ],
)
def test_a_bad_cluster_url_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_cluster(url)


def test_a_cluster_url_is_redacted() -> None:
    url = "rediss+cluster://u:s3cret@a:7000,b:7001/?ssl_ca_certs=/ca.pem"
    assert redact(url) == "rediss+cluster://***@a:7000,b:7001/?ssl_ca_certs=/ca.pem"


def test_connect_async_takes_a_cluster_url_without_contacting_anyone() -> None:
    r = connect_async("redis+cluster://:pw@127.0.0.1:1,127.0.0.1:2/")
    assert is_cluster(r)
    assert [(n.host, n.port) for n in r.startup_nodes] == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert not is_cluster(connect("redis://127.0.0.1:1/0"))


# -- redact: passwords in Redis URLs never reach logs or the CLI's output


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
def test_redact_hides_the_passwords_of_every_url_in_a_text(url, shown):
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
        [sys.executable, "-m", "plurai.cli", "status", "--url", url, *flags],
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
