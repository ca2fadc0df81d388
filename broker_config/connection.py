"""Redis connections from a URL.

The URL carries everything redis-py understands, passed through untouched:

    redis://localhost:6379/0                      plain TCP
    redis://:password@host:6379/0                 password (requirepass)
    redis://user:password@host:6379/0             ACL user
    rediss://user:password@host:6380/0            TLS (verifies the server certificate)
    rediss://host:6380/0?ssl_ca_certs=/etc/ca.pem custom CA
    unix:///run/redis.sock?db=0                   Unix socket

`decode=False` returns bytes (the worker reads msgpack bodies); `decode=True` returns
str (clients reading records and token streams).

A URL can hold a password: print or log one only through `redact`.
"""

from __future__ import annotations

import re
from pathlib import Path

import redis
import redis.asyncio

from broker_config.settings import Settings

# the user info of any URL (to its last @, even a stray one in a password left unescaped),
# and a password= parameter
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@")
_PASSWORD_PARAM = re.compile(r"([?&]password=)[^&#\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` (a URL, or a message holding URLs) with every URL's user and password, and
    any password= parameter, replaced by ***:
    redis://user:pw@host:6379/0?password=pw -> redis://***@host:6379/0?password=***"""
    return _PASSWORD_PARAM.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def connect(url: str, *, decode: bool = False) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=decode, socket_keepalive=True)


def connect_async(url: str, *, decode: bool = False) -> redis.asyncio.Redis:
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
