"""Connection URLs: redis+sentinel:// parsed into sentinels, service, db and the two sets of
credentials; the same URL as Celery's Redis transport takes it; mistakes said clearly."""

from __future__ import annotations

import pytest

from broker_config.celery_app import kombu_sentinel
from broker_config.connection import SentinelURL, connect, parse_sentinel


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
