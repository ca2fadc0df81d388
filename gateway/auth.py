"""Who may use the gateway, and on which lanes: an open gateway (no keys, loopback only),
a request's lane, and what is scoped under its tenant (idempotency keys, cache salts).
API keys themselves are apikeys.py's; their quotas, quota.py's."""

from __future__ import annotations

import ipaddress

from broker_config import protocol
from broker_config.settings import Settings
from gateway.apikeys import Key


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
