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

and Redis Cluster, which routes each key to the node that holds its hash slot (keys that
one command or script touches together must share a {hash tag}):

    redis+cluster://[user:password@]host:6379[,host:6379...][/]
    rediss+cluster://...?ssl_ca_certs=/etc/ca.pem TLS to every node, custom CA optional

Any of the listed nodes is enough to find the others. A cluster has only db 0.

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
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.commands.policies import (
    CommandPolicies,
    RequestPolicy,
    ResponsePolicy,
    StaticPolicyResolver,
)

from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text

# the user info of any URL (to its last @, even a stray one in a password left unescaped),
# and a password= parameter
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@")
_PASSWORD_PARAM = re.compile(r"([?&](?:sentinel_)?password=)[^&#\s]*", re.IGNORECASE)
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

Client = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


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


@dataclass(frozen=True)
class ClusterURL:
    """A redis+cluster:// URL, parsed."""

    hosts: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None

    @property
    def node_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"username": self.username, "password": self.password}
        if self.tls:
            kw["ssl"] = True
            if self.ssl_ca_certs:
                kw["ssl_ca_certs"] = self.ssl_ca_certs
        return kw


def _split(url: str) -> tuple[str, str, str, str, str]:
    """scheme, user info, host list, path and query of a URL with several hosts."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    authority, _, path = rest.partition("/")
    userinfo, at, hostlist = authority.rpartition("@")
    if not at:
        userinfo, hostlist = "", authority
    return scheme.lower(), userinfo, hostlist, path, query


def _hosts(hostlist: str, default_port: int, kind: str) -> list[tuple[str, int]]:
    hosts = []
    for item in hostlist.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = item.strip(), str(default_port)
        host = host.strip("[]")  # [::1]:26379
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a {kind} URL names host:port pairs; {item.strip()!r} is not one")
        hosts.append((host, int(port)))
    return hosts


def parse_sentinel(url: str) -> SentinelURL | None:
    """The parts of a redis+sentinel:// URL; None for any other URL. ValueError saying what
    is wrong with a sentinel URL that does not parse."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        return None
    scheme, userinfo, hostlist, path, query = _split(url)
    hosts = _hosts(hostlist, 26379, "sentinel")
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
        tls=scheme == "rediss+sentinel",
    )


def parse_cluster(url: str) -> ClusterURL | None:
    """The parts of a redis+cluster:// URL; None for any other URL. ValueError saying what
    is wrong with a cluster URL that does not parse."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        return None
    scheme, userinfo, hostlist, path, query = _split(url)
    hosts = _hosts(hostlist, 6379, "cluster")
    path = path.strip("/")
    if path and path != "0":
        if path.isdigit():
            raise ValueError(f"Redis Cluster has only db 0; the URL asks for db {path}")
        raise ValueError(
            "a cluster URL names no service nor path, only db 0 at most, e.g. "
            "redis+cluster://h1:6379,h2:6379/"
        )
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    allowed = {"ssl_ca_certs"} if scheme == "rediss+cluster" else set()
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"unknown cluster URL parameter(s) {unknown}")
    user, _, password = userinfo.partition(":")
    return ClusterURL(
        hosts=hosts,
        username=unquote(user) or None,
        password=unquote(password) or None,
        tls=scheme == "rediss+cluster",
        ssl_ca_certs=params.get("ssl_ca_certs"),
    )


def is_cluster(r: object) -> bool:
    """Whether `r` (sync or asyncio) is a Redis Cluster client."""
    return isinstance(r, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


class _ScriptsByKey(StaticPolicyResolver):
    """Route script calls by their first key in cluster pipelines too: without this,
    redis-py asks the server (COMMAND GETKEYS) for every EVALSHA it pipelines, a round
    trip per script call."""

    KEYED = CommandPolicies(RequestPolicy.DEFAULT_KEYED, ResponsePolicy.DEFAULT_KEYED)

    def resolve(self, command_name: str) -> CommandPolicies | None:
        if command_name in ("eval", "evalsha"):
            return self.KEYED
        return super().resolve(command_name)


class _Cluster(redis.cluster.RedisCluster):
    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)
        pipe._policy_resolver = self._policy_resolver  # redis-py gives pipelines the default
        return pipe

    def determine_slot(self, *args: Any) -> int | None:
        """XREAD and XREADGROUP name their streams after STREAMS; redis-py would ask the
        server for them (COMMAND GETKEYS) on every read."""
        command = str(args[0]).upper()
        if command in ("XREAD", "XREADGROUP"):
            words = [text(a).upper() for a in args]
            start = 4 if command == "XREADGROUP" else 1  # past GROUP <group> <consumer>
            streams = args[words.index("STREAMS", start) + 1 :]
            slots = {self.keyslot(k) for k in streams[: len(streams) // 2]}
            if len(slots) != 1:
                raise redis.RedisClusterException(f"{command} of streams in several slots")
            return slots.pop()
        return super().determine_slot(*args)


# redis-py 8 gives a connection a 5 s read timeout unless told otherwise (earlier versions
# none): a blocking read that waits its whole time (the gateway's shared XREAD blocks 5 s; a
# worker's XREADGROUP block_ms; WAIT for replicas) then failed as a timeout, and a gateway
# whose streams all waited in the queue for 15 s answered them 503. Plurai's blocking
# commands wait at most BLOCK_LIMIT_MS (settings); this bound is for a dead connection.
SOCKET_TIMEOUT_S = 60.0


def connect(url: str, *, decode: bool = False, **options: Any) -> Client:
    """A client of the URL's Redis; `options`: more of redis-py's connection settings
    (socket_timeout, retry, ...). A RedisCluster for a redis+cluster:// URL (see
    is_cluster); it connects to a node at once."""
    options.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    if not _unix(url):  # a Unix socket connection takes no TCP options
        options.setdefault("socket_keepalive", True)
    c = parse_cluster(url)
    if c is not None:
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in c.hosts]
        return _Cluster(
            startup_nodes=nodes,
            decode_responses=decode,
            policy_resolver=_ScriptsByKey(),
            **c.node_kwargs,
            **options,
        )
    s = parse_sentinel(url)
    if s is not None:
        sentinel = redis.sentinel.Sentinel(s.hosts, sentinel_kwargs=s.sentinel_kwargs)
        return sentinel.master_for(s.service, decode_responses=decode, **s.master_kwargs, **options)
    return redis.Redis.from_url(url, decode_responses=decode, **DRIVER, **options)


def _driver() -> dict[str, Any]:
    """redis-py's name and version for CLIENT SETINFO, found once: redis-py 8 looks its own
    version up in the package metadata for every new connection (about 2 ms of CPU, most of
    what a gateway spends taking a request while its pool grows under a flood)."""
    try:
        from redis.driver_info import DriverInfo  # redis-py 8
    except ImportError:
        return {"lib_version": redis.__version__}
    return {"driver_info": DriverInfo()}


DRIVER = _driver()

ASYNC_MAX_CONNECTIONS = 1024  # an asyncio client's connections to a Redis at most
ASYNC_POOL_WAIT_S = 30.0  # how long a command waits for one of them


def connect_async(url: str, *, decode: bool = False) -> AsyncClient:
    c = parse_cluster(url)
    if c is not None:
        nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in c.hosts]
        return redis.asyncio.cluster.RedisCluster(
            startup_nodes=nodes,
            decode_responses=decode,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_keepalive=True,
            max_connections=ASYNC_MAX_CONNECTIONS,  # per node
            **c.node_kwargs,
        )
    s = parse_sentinel(url)
    if s is not None:
        sentinel = redis.asyncio.sentinel.Sentinel(s.hosts, sentinel_kwargs=s.sentinel_kwargs)
        return sentinel.master_for(
            s.service,
            decode_responses=decode,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_keepalive=True,
            max_connections=ASYNC_MAX_CONNECTIONS,
            **s.master_kwargs,
        )
    # redis-py's asyncio pool refuses the 101st concurrent command at once (MaxConnectionsError);
    # a gateway under a flood has hundreds in flight, blocking reads among them, so a command
    # waits for a connection of a larger pool instead (and fails only after ASYNC_POOL_WAIT_S)
    extra = {} if _unix(url) else {"socket_keepalive": True}
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        decode_responses=decode,
        max_connections=ASYNC_MAX_CONNECTIONS,
        timeout=ASYNC_POOL_WAIT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        **DRIVER,
        **extra,
    )
    return redis.asyncio.Redis(connection_pool=pool)


def _unix(url: str) -> bool:
    return url.partition("://")[0].lower() == "unix"


def resolve_url(url: str | None = None, settings: Settings | None = None) -> str:
    """The URL to use: the argument, else PLURAI_REDIS_URL, else the URL of an embedded
    redis-server already running from the data folder (started by a worker or the demo).
    Nothing is started here."""
    if url:
        return url
    settings = settings or Settings()
    if settings.redis_url:
        return settings.redis_url
    from plurai.broker_config.embedded import running_url

    found = running_url(Path(settings.data_dir))
    if found:
        return found
    raise ValueError(
        "no Redis URL: pass one, set PLURAI_REDIS_URL, or start a worker without a URL "
        f"(it starts an embedded redis-server under {settings.data_dir}/redis)"
    )
