"""API keys of the HTTP gateway: their records in Redis, managing them, and finding the
key of a request's secret.

A key's secret (`pk-` and 43 random URL-safe characters) is shown once, when it is created;
Redis keeps only its SHA-256 (a fast hash is enough for 256 random bits), which names the
key's record `keys.api_key(sha)`. The record holds the tenant, the lanes the key may use and
its limits; `keys.API_KEYS` maps each key's public id (the first 12 hex digits of the hash)
to the hash, for `plurai keys list|revoke`.

Records and the index are always read as bytes (undecoded), on every connection, and each
field is checked where it is parsed (BadRecord).

    key = await apikeys.authenticate(r, secret)       # None: 401
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.client import NEVER_DECODE

from plurai.broker_config import keys, protocol
from plurai.broker_config.settings import Settings

log = logging.getLogger("plurai.gateway")

SECRET_PREFIX = "pk-"
MAX_LIMIT = 10**12  # rpm, tpm and concurrent; keeps Lua's doubles exact

_SECRET = re.compile(r"pk-[A-Za-z0-9_-]{32,128}")
_HASH = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{12}")
_LANE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DIGITS = re.compile(r"[0-9]{1,15}")
MAX_LANES = 32


class BadRecord(ValueError):
    """A key record in Redis that is not one this module wrote."""


@dataclass(frozen=True)
class Key:
    """An API key, as its record in Redis describes it (never its secret). Limits: 0 is
    no limit."""

    id: str  # public: the first 12 hex digits of the secret's SHA-256
    tenant: str
    lanes: tuple[str, ...]
    default_lane: str
    rpm: int = 0
    tpm: int = 0
    concurrent: int = 0
    created_ms: int = 0
    admin: bool = False  # may read the dashboard (every tenant's jobs and the workers)

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.concurrent)


# -- secrets and records ---------------------------------------------------------------


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)  # 256 random bits


def hash_secret(secret: str) -> str:
    """SHA-256 (hex) of the secret: the key's name in Redis."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def key_id(key_hash: str) -> str:
    return key_hash[:12]


def bearer(authorization: str | None) -> str | None:
    """The secret of an `Authorization: Bearer <secret>` header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


def check_tenant(tenant: str) -> str:
    return protocol.tenant_name(tenant)


def _check_lanes(lanes: Sequence[str]) -> tuple[str, ...]:
    if not lanes or len(lanes) > MAX_LANES or len(set(lanes)) != len(lanes):
        raise ValueError(f"lanes: 1 to {MAX_LANES} distinct names")
    for lane in lanes:
        if not isinstance(lane, str) or _LANE.fullmatch(lane) is None:
            raise ValueError(f"lane name {lane!r}: use letters, digits, '-' or '_'")
    return tuple(lanes)


def _check_limit(name: str, value: int) -> int:
    if type(value) is not int or not 0 <= value <= MAX_LIMIT:
        raise ValueError(f"{name}: an integer from 0 (no limit) to {MAX_LIMIT}, got {value!r}")
    return value


def _field_text(raw: Mapping[bytes, bytes], name: str) -> str:
    v = raw.get(name.encode())
    if v is None:
        raise BadRecord(f"field {name!r} is missing")
    t = _as_text(v)
    if t is None:
        raise BadRecord(f"field {name!r} is not UTF-8")
    return t


def _field_int(raw: Mapping[bytes, bytes], name: str, cap: int = MAX_LIMIT) -> int:
    v = _field_text(raw, name)
    if _DIGITS.fullmatch(v) is None or int(v) > cap:
        raise BadRecord(f"field {name!r} is not a count")
    return int(v)


def parse_record(key_hash: str, raw: Mapping[bytes, bytes]) -> Key:
    """The Key of a record read from Redis (undecoded); BadRecord when any field
    is missing or not what `create_key` writes."""
    kid = _field_text(raw, "id")
    if kid != key_id(key_hash):
        raise BadRecord("field 'id' does not match the key's hash")
    try:
        tenant = check_tenant(_field_text(raw, "tenant"))
        lanes = _check_lanes(_field_text(raw, "lanes").split(","))
    except ValueError as e:
        raise BadRecord(f"bad tenant or lanes ({e})") from None
    default = _field_text(raw, "default_lane")
    if default not in lanes:
        raise BadRecord("field 'default_lane' is not one of its lanes")
    admin = raw.get(b"admin", b"0")  # records made before the field existed have none
    if admin not in (b"0", b"1"):
        raise BadRecord("field 'admin' is not 0 or 1")
    return Key(
        id=kid,
        tenant=tenant,
        lanes=lanes,
        default_lane=default,
        rpm=_field_int(raw, "rpm"),
        tpm=_field_int(raw, "tpm"),
        concurrent=_field_int(raw, "concurrent"),
        created_ms=_field_int(raw, "created_ms", cap=10**15),
        admin=admin == b"1",
    )


def _record(key: Key) -> dict[str, str]:
    return {
        "id": key.id,
        "tenant": key.tenant,
        "lanes": ",".join(key.lanes),
        "default_lane": key.default_lane,
        "rpm": str(key.rpm),
        "tpm": str(key.tpm),
        "concurrent": str(key.concurrent),
        "created_ms": str(key.created_ms),
        "admin": "1" if key.admin else "0",
    }


# -- managing keys (plurai keys) ---------------------------------------------------------


def create_key(
    r: redis.Redis,
    tenant: str,
    *,
    lanes: Sequence[str] | None = None,
    default_lane: str | None = None,
    rpm: int = 0,
    tpm: int = 0,
    concurrent: int = 0,
    admin: bool = False,
    settings: Settings | None = None,
) -> tuple[str, Key]:
    """Create a key: returns its secret (show it once; it is stored nowhere) and the Key.
    `lanes` must be configured lanes (default: all of them); `default_lane` one of them
    (default: the configured default if allowed, else the first)."""
    settings = settings or Settings()
    check_tenant(tenant)
    allowed = _check_lanes(list(lanes) if lanes is not None else settings.lanes)
    unknown = [lane for lane in allowed if lane not in settings.lanes]
    if unknown:
        raise ValueError(f"unknown lane(s) {unknown}; configured lanes: {settings.lanes}")
    if default_lane is None:
        default_lane = settings.default_lane if settings.default_lane in allowed else allowed[0]
    if default_lane not in allowed:
        raise ValueError(f"default lane {default_lane!r} is not one of the key's lanes {allowed}")
    for name, value in (("rpm", rpm), ("tpm", tpm), ("concurrent", concurrent)):
        _check_limit(name, value)
    for _ in range(5):  # a new secret if its 48-bit public id is taken (never in practice)
        secret = new_secret()
        h = hash_secret(secret)
        key = Key(
            id=key_id(h),
            tenant=tenant,
            lanes=allowed,
            default_lane=default_lane,
            rpm=rpm,
            tpm=tpm,
            concurrent=concurrent,
            created_ms=int(time.time() * 1000),
            admin=admin,
        )
        if r.hsetnx(keys.API_KEYS, key.id, h):
            r.hset(keys.api_key(h), mapping=_record(key))
            return secret, key
    raise RuntimeError("could not find a free key id")


def list_keys(r: redis.Redis) -> tuple[list[Key], list[str]]:
    """Every key (oldest first), and the ids of index entries whose record is missing or
    damaged."""
    index = r.execute_command("HGETALL", keys.API_KEYS, **_RAW)
    found: list[tuple[str, str]] = []
    broken: list[str] = []
    for raw_id, raw_hash in index.items():
        kid = _as_text(raw_id)
        h = _as_text(raw_hash)
        if kid is None or _KEY_ID.fullmatch(kid) is None:
            continue  # not an id this module wrote: nothing to show or revoke by it
        if h is None or _HASH.fullmatch(h) is None:
            broken.append(kid)
        else:
            found.append((kid, h))
    pipe = r.pipeline(transaction=False)
    for _, h in found:
        pipe.execute_command("HGETALL", keys.api_key(h), **_RAW)
    listed = []
    for (kid, h), raw in zip(found, pipe.execute(raise_on_error=False), strict=True):
        try:
            if isinstance(raw, Exception):
                raise BadRecord("the record is not a hash")
            listed.append(parse_record(h, raw))
        except BadRecord as e:
            log.warning("API key %s: damaged record (%s)", kid, e)
            broken.append(kid)
    listed.sort(key=lambda k: (k.created_ms, k.id))
    return listed, sorted(broken)


def revoke(r: redis.Redis, kid: str) -> bool:
    """Delete the key `kid` (its public id) and its quota counters; from the next request
    on, in every gateway process, it is unknown. False if no such key."""
    if not isinstance(kid, str) or _KEY_ID.fullmatch(kid) is None:
        return False
    h = _as_text(r.execute_command("HGET", keys.API_KEYS, kid, **_RAW))
    if h is None:
        return False
    pipe = r.pipeline(transaction=True)
    if _HASH.fullmatch(h) is not None:
        pipe.delete(keys.api_key(h))
    pipe.delete(*keys.quota_all(kid))
    pipe.hdel(keys.API_KEYS, kid)
    pipe.execute()
    return True


def any_keys(r: redis.Redis) -> bool:
    """Whether any key is configured (the gateway then requires one). A damaged index
    counts as keys, so that it never opens the gateway."""
    return bool(r.exists(keys.API_KEYS))


async def any_keys_async(r: redis.asyncio.Redis) -> bool:
    return bool(await r.exists(keys.API_KEYS))


_RAW: dict[str, Any] = {NEVER_DECODE: []}  # an option of execute_command: reply as bytes


def _as_text(v: Any) -> str | None:
    """Undecoded reply bytes as text; None when they are no UTF-8 (or no bytes)."""
    if not isinstance(v, bytes):
        return None
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return None


# -- each request ----------------------------------------------------------------------


async def authenticate(r: redis.asyncio.Redis, secret: str | None) -> Key | None:
    """The key whose secret this is, or None (unknown, revoked or damaged: a 401). One
    round trip: its record, and its entry in the index (a record the index does not name
    is no key: `plurai keys list` cannot show it nor `revoke` remove it). The secret itself
    is never logged."""
    if not isinstance(secret, str) or _SECRET.fullmatch(secret) is None:
        return None
    h = hash_secret(secret)
    kid = key_id(h)
    pipe = r.pipeline(transaction=False)
    pipe.execute_command("HGETALL", keys.api_key(h), **_RAW)
    pipe.execute_command("HGET", keys.API_KEYS, kid, **_RAW)
    raw, listed = await pipe.execute(raise_on_error=False)
    for reply in (raw, listed):
        if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
            raise reply
    if isinstance(raw, Exception):
        log.warning("API key %s: its record is not a hash; treated as unknown", kid)
        return None
    if not raw:
        return None
    try:
        key = parse_record(h, raw)
    except BadRecord as e:
        log.warning("API key %s: damaged record (%s); treated as unknown", kid, e)
        return None
    if _as_text(listed) != h:  # its entry missing or damaged, or the index not a hash
        log.warning("API key %s: not in the key index; treated as unknown", kid)
        return None
    return key
