"""Connection URLs: redis+sentinel:// parsed into sentinels, service, db and the two sets of
credentials; the same URL as Celery's Redis transport takes it; redis+cluster:// parsed into
nodes and credentials; mistakes said clearly."""

from __future__ import annotations

import pytest

from broker_config.celery_app import kombu_sentinel
from broker_config.connection import (
    ClusterURL,
    SentinelURL,
    connect,
    connect_async,
    is_cluster,
    parse_cluster,
    parse_sentinel,
    redact,
)


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
