"""Redis connections from a URL.

The URL carries everything redis-py understands, passed through untouched:

    redis://localhost:6379/0                      plain TCP
    redis://:password@host:6379/0                 password (requirepass)
    redis://user:password@host:6379/0             ACL user
    rediss://user:password@host:6380/0            TLS (verifies the server certificate)
    rediss://host:6380/0?ssl_ca_certs=/etc/ca.pem custom CA
    unix:///run/redis.sock?db=0                   Unix socket

and Redis Sentinel, which finds the current primary of a monitored service and finds it
again after a failover:

    redis+sentinel://[user:password@]host:26379[,host:26379...]/<service>[/<db>]
        [?sentinel_password=...&sentinel_username=...]
    rediss+sentinel://...                         TLS to the primary and replicas

The user and password are the primary's; sentinel_password (and sentinel_username) are
the sentinels' own, when they require one.

`decode=False` returns bytes (the worker reads msgpack bodies); `decode=True` returns
str (clients reading records and token streams).

A URL can hold a password: print or log one only through `redact`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from broker_config.settings import Settings

# the user info of any URL (to its last @, even a stray one in a password left unescaped),
# and a password= parameter
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@")
_PASSWORD_PARAM = re.compile(r"([?&](?:sentinel_)?password=)[^&#\s]*", re.IGNORECASE)
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


def redact(text: str) -> str:
    """`text` (a URL, or a message holding URLs) with every URL's user and password, and
    any password= parameter, replaced by ***:
    redis://user:pw@host:6379/0?password=pw -> redis://***@host:6379/0?password=***"""
    return _PASSWORD_PARAM.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


@dataclass(frozen=True)
class SentinelURL:
    """A redis+sentinel:// URL, parsed."""

    hosts: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False

    @property
    def master_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"db": self.db, "username": self.username, "password": self.password}
        if self.tls:
            kw["ssl"] = True
        return kw

    @property
    def sentinel_kwargs(self) -> dict[str, Any]:
        """For the connections to the sentinels only: a dead sentinel costs at most 2 s."""
        return {
            "username": self.sentinel_username,
            "password": self.sentinel_password,
            "socket_timeout": 2.0,
            "socket_connect_timeout": 2.0,
        }


def parse_sentinel(url: str) -> SentinelURL | None:
    """The parts of a redis+sentinel:// URL; None for any other URL. ValueError saying what
    is wrong with a sentinel URL that does not parse."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        return None
    rest, _, query = rest.partition("?")
    authority, _, path = rest.partition("/")
    userinfo, at, hostlist = authority.rpartition("@")
    if not at:
        userinfo, hostlist = "", authority
    hosts = []
    for item in hostlist.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = item.strip(), "26379"
        host = host.strip("[]")  # [::1]:26379
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a sentinel URL names host:port pairs; {item.strip()!r} is not one")
        hosts.append((host, int(port)))
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(
            "a sentinel URL ends in /<service name>[/<db>], e.g. "
            "redis+sentinel://h1:26379,h2:26379/mymaster/0"
        )
    user, _, password = userinfo.partition(":")
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = sorted(set(params) - {"sentinel_password", "sentinel_username"})
    if unknown:
        raise ValueError(f"unknown sentinel URL parameter(s) {unknown}")
    return SentinelURL(
        hosts=hosts,
        service=parts[0],
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=params.get("sentinel_username"),
        sentinel_password=params.get("sentinel_password"),
        tls=scheme.lower() == "rediss+sentinel",
    )


def connect(url: str, *, decode: bool = False, **options: Any) -> redis.Redis:
    """A client of the URL's Redis; `options`: more of redis-py's connection settings
    (socket_timeout, retry, ...)."""
    options.setdefault("socket_keepalive", True)
    s = parse_sentinel(url)
    if s is not None:
        sentinel = redis.sentinel.Sentinel(s.hosts, sentinel_kwargs=s.sentinel_kwargs)
        return sentinel.master_for(s.service, decode_responses=decode, **s.master_kwargs, **options)
    return redis.Redis.from_url(url, decode_responses=decode, **options)


def connect_async(url: str, *, decode: bool = False) -> redis.asyncio.Redis:
    s = parse_sentinel(url)
    if s is not None:
        sentinel = redis.asyncio.sentinel.Sentinel(s.hosts, sentinel_kwargs=s.sentinel_kwargs)
        return sentinel.master_for(
            s.service, decode_responses=decode, socket_keepalive=True, **s.master_kwargs
        )
    return redis.asyncio.Redis.from_url(url, decode_responses=decode, socket_keepalive=True)


def resolve_url(url: str | None = None, settings: Settings | None = None) -> str:
    """The URL to use: the argument, else PLURAI_REDIS_URL, else the URL of an embedded
    redis-server already running from the data folder (started by a worker or the demo).
    Nothing is started here."""
    if url:
        return url
    settings = settings or Settings()
    if settings.redis_url:
        return settings.redis_url
    from broker_config.embedded import running_url

    found = running_url(Path(settings.data_dir))
    if found:
        return found
    raise ValueError(
        "no Redis URL: pass one, set PLURAI_REDIS_URL, or start a worker without a URL "
        f"(it starts an embedded redis-server under {settings.data_dir}/redis)"
    )
