"""Who may use the gateway, and on which lanes: an open gateway (no keys, loopback only),
a request's lane, and what is scoped under its tenant (idempotency keys, cache salts).
API keys themselves are apikeys.py's; their quotas, quota.py's."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import time

import redis.asyncio

from plurai.broker_config import protocol
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys
from plurai.gateway.apikeys import Key


class Unauthorized(Exception):
    """No valid API key where one is needed (401)."""


class LaneError(ValueError):
    """The requested lane is not allowed for the key, or not configured."""


def loopback(host: str) -> bool:
    """Whether a gateway listening on `host` serves this machine only (and so may run
    without keys)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Guard:
    """The API key of a request, or None on an open gateway (no keys exist, and it listens
    on loopback only). Whether keys exist is read at most once a second; the key itself on
    every request, so a revoked key fails at once."""

    def __init__(self, r: redis.asyncio.Redis, host: str) -> None:
        self.r = r
        self.loopback = loopback(host)
        self.keyed = (False, -1.0)  # whether keys exist, and when that was read
        self.keys_read: asyncio.Future[bool] | None = None  # that read, while in flight

    async def key(
        self, authorization: str | None, host: str | None = None, basic: bool = False
    ) -> Key | None:
        """Raises Unauthorized. `host`: the request's Host header, which an open gateway
        wants to name this machine. `basic`: HTTP Basic credentials are taken too (the key
        as the password, any user name): what a browser sends after its login prompt."""
        exist, at = self.keyed
        if time.monotonic() - at > 1.0:  # one read at a time, the others wait for it
            if self.keys_read is None or self.keys_read.done():
                self.keys_read = asyncio.ensure_future(apikeys.any_keys_async(self.r))
            exist = await asyncio.shield(self.keys_read)
            self.keyed = (exist, time.monotonic())
        if not exist:
            if self.loopback and loopback_host(host):
                return None
            if self.loopback:  # a web page whose name now points here (DNS rebinding)
                raise Unauthorized(
                    "this gateway has no API keys and serves this machine's own clients "
                    f"only: address it as localhost or 127.0.0.1, not {str(host)[:100]!r}"
                )
            raise Unauthorized(
                "this gateway listens beyond localhost and has no API keys yet: "
                "create one with `plurai keys create --tenant NAME`"
            )
        secret = apikeys.bearer(authorization) or (basic_password(authorization) if basic else None)
        if secret is None:
            raise Unauthorized("an API key is required: Authorization: Bearer <key>")
        key = await apikeys.authenticate(self.r, secret)
        if key is None:
            raise Unauthorized("the API key is not valid (unknown or revoked)")
        return key


def loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine: localhost, a *.localhost name or a
    loopback address, any port; no header (HTTP/1.0) too."""
    if not host:
        return True
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    return name == "localhost" or name.endswith(".localhost") or loopback(name)


def basic_password(authorization: str | None) -> str | None:
    """The password of an `Authorization: Basic <base64 user:password>` header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "basic" or len(value) > 1024:
        return None
    try:
        pair = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, sep, password = pair.partition(":")
    return password if sep and password else None


def lane_for(key: Key | None, requested: str | None, settings: Settings) -> str:
    """The lane of a request: the requested one, else the key's default (no key: the
    configured default). LaneError when the key may not use it or it is not configured."""
    if key is None:
        try:
            return settings.lane_or_default(requested)
        except ValueError as e:
            raise LaneError(str(e)) from None
    lane = requested or key.default_lane
    if lane not in key.lanes:
        raise LaneError(
            f"lane {lane!r} is not allowed for this API key; allowed: {list(key.lanes)}"
        )
    if lane not in settings.lanes:
        raise LaneError(f"lane {lane!r} is not configured; configured lanes: {settings.lanes}")
    return lane


def scoped_idempotency_key(key: Key | None, idem: str | None) -> str | None:
    """The idempotency key to submit with: scoped under the key's tenant, so that two
    tenants using the same key never get each other's job. Without an API key (an open
    gateway) it is left as given."""
    if idem is None or key is None:
        return idem
    return f"tenant:{key.tenant}:{idem}"


def tenant_salt(key: Key | None, cache_salt: str | None) -> str | None:
    """The cache salt to submit with: the tenant's name by default, so that tenants never
    share cached prefixes; a client's own salt is scoped under its tenant ('tenant:salt',
    or 'tenant:sha256:<hex>' where that would exceed the protocol's salt length). Validate
    the client's salt (protocol limits) before. Without an API key: as given."""
    if key is None:
        return cache_salt
    return protocol.tenant_salt(key.tenant, cache_salt)
