"""API keys and quotas of the HTTP gateway.

A key's secret (`pk-` and 43 random URL-safe characters) is shown once, when it is created;
Redis keeps only its SHA-256 (a fast hash is enough for 256 random bits), which names the
key's record `keys.api_key(sha)`. The record holds the tenant, the lanes the key may use and
its limits; `keys.API_KEYS` maps each key's public id (the first 12 hex digits of the hash)
to the hash, for `plurai keys list|revoke`.

Quotas are counted in Redis, atomically, so every gateway process shares them: one Lua
script (ADMIT) checks and counts a request against the key's requests per minute, tokens
per minute and concurrent jobs, on Redis' own clock.

The minute is a sliding window: the key's admissions of the last 60 s are kept (a sorted
set scored by admission time, with the sum of their tokens kept alongside), so a key with
rpm=10 never gets an 11th request in any 60 s, whatever the wall clock's minute; a fixed
window would admit 20 across a minute boundary. The set holds at most rpm entries (or one
per admission within the minute when only tpm is limited) and expires a minute after the
last admission. A request is counted at admission as its prompt estimate plus its
max_tokens; once its job has ended, the tokens it did not generate are given back
(`refund`) if its admission is still in the window.

Running jobs hold a slot in a sorted set scored by a lease expiry; the gateway renews the
lease while the job runs (`renew`) and releases it at the end (`release`). Expired leases
are pruned at each admission, so a gateway that dies never holds a slot for longer than
its lease.

    key = await auth.authenticate(r, secret)          # None: 401
    verdict = await auth.admit(r, key, tokens, job_id)
    if not verdict.admitted: ...                      # 429, Retry-After: verdict.retry_after
    ...
    await auth.release(r, key, job_id)
    await auth.refund(r, key, job_id, tokens, max_tokens - output_tokens)
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from broker_config import keys, protocol
from broker_config.protocol import valid_job_id
from broker_config.settings import Settings

log = logging.getLogger("plurai.gateway")

SECRET_PREFIX = "pk-"
WINDOW_MS = 60_000  # the quota window: requests and tokens per minute
LEASE_S = 60.0  # a running job's slot, unless renewed
MAX_LIMIT = 10**12  # rpm, tpm and concurrent; keeps Lua's doubles exact
MAX_TOKENS = 2**40  # of one admission

_SECRET = re.compile(r"pk-[A-Za-z0-9_-]{32,128}")
_HASH = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{12}")
TENANT_CHARS = 64
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # no ':', the scoping separator
_LANE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DIGITS = re.compile(r"[0-9]{1,15}")
MAX_LANES = 32
_FIELDS = ("id", "tenant", "lanes", "default_lane", "rpm", "tpm", "concurrent", "created_ms")


class Unauthorized(Exception):
    """No valid API key where one is needed (401)."""


def loopback(host: str) -> bool:
    """Whether a gateway listening on `host` serves this machine only (and so may run
    without keys)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LaneError(ValueError):
    """The requested lane is not allowed for the key, or not configured."""


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

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.concurrent)


@dataclass(frozen=True)
class Verdict:
    """What `admit` decided. Refused: `limit` says which ("rpm", "tpm" or "concurrent"),
    `retry_after_s` when a retry can succeed. Remaining counts are None without a limit."""

    admitted: bool
    limit: str | None = None
    retry_after_s: float = 0.0
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    message: str = ""

    @property
    def retry_after(self) -> int:
        """Whole seconds, at least 1: the HTTP Retry-After header of a refusal."""
        return max(1, math.ceil(self.retry_after_s))


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
    if not isinstance(tenant, str) or _TENANT.fullmatch(tenant) is None:
        raise ValueError(
            f"tenant name: 1 to {TENANT_CHARS} letters, digits, '.', '-' or '_', starting "
            "with a letter or digit"
        )
    return tenant


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


def _field_text(raw: Mapping[Any, Any], name: str) -> str:
    v = raw.get(name, raw.get(name.encode()))
    if isinstance(v, bytes):
        try:
            v = v.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRecord(f"field {name!r} is not UTF-8") from None
    if not isinstance(v, str):
        raise BadRecord(f"field {name!r} is missing")
    return v


def _field_int(raw: Mapping[Any, Any], name: str, cap: int = MAX_LIMIT) -> int:
    v = _field_text(raw, name)
    if _DIGITS.fullmatch(v) is None or int(v) > cap:
        raise BadRecord(f"field {name!r} is not a count")
    return int(v)


def parse_record(key_hash: str, raw: Mapping[Any, Any]) -> Key:
    """The Key of a record read from Redis (bytes or str values); BadRecord when any field
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
    return Key(
        id=kid,
        tenant=tenant,
        lanes=lanes,
        default_lane=default,
        rpm=_field_int(raw, "rpm"),
        tpm=_field_int(raw, "tpm"),
        concurrent=_field_int(raw, "concurrent"),
        created_ms=_field_int(raw, "created_ms", cap=10**15),
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
        )
        if r.hsetnx(keys.API_KEYS, key.id, h):
            r.hset(keys.api_key(h), mapping=_record(key))
            return secret, key
    raise RuntimeError("could not find a free key id")


def list_keys(r: redis.Redis) -> tuple[list[Key], list[str]]:
    """Every key (oldest first), and the ids of index entries whose record is missing or
    damaged."""
    index = r.hgetall(keys.API_KEYS)
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
        pipe.hgetall(keys.api_key(h))
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
    h = _as_text(r.hget(keys.API_KEYS, kid))
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


def _as_text(v: Any) -> str | None:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return v if isinstance(v, str) else None


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
    pipe.hgetall(keys.api_key(h))
    pipe.hget(keys.API_KEYS, kid)
    try:
        raw, listed = await pipe.execute(raise_on_error=False)
    except UnicodeDecodeError:  # a connection that decodes replies, and a record that is not UTF-8
        log.warning("API key %s: its record or index entry is not UTF-8; treated as unknown", kid)
        return None
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


# -- quotas ----------------------------------------------------------------------------

# KEYS: window (sorted set), window tokens (string), running (sorted set)
# ARGV: window ms, rpm, tpm, concurrent (each 0: no limit), tokens, job id, lease ms
# Returns {admitted 1|0, limit ('', 'rpm', 'tpm', 'tpm_request' or 'concurrent'), retry ms,
# requests left in the window (-1: no limit), tokens left (-1: no limit)}. A refusal counts
# nothing; pruning what fell out of the window, or out of its lease, is not counting. Time
# is Redis' own (TIME), the same for every gateway process. An admission already counted
# (the same job id and tokens within the window: a retried call) is admitted again without
# counting. A key of the wrong type (written by something else) is reset.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local conc, tokens, job, lease = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local member = job .. ':' .. ARGV[5]
local function int(x) return string.format('%d', x) end
local function tok(m) return tonumber(string.match(m, ':(%d+)$')) or 0 end
for i = 1, 3 do
  local ty = redis.call('TYPE', KEYS[i]).ok
  if ty ~= 'none' and ty ~= (i == 2 and 'string' or 'zset') then redis.call('DEL', KEYS[i]) end
end
local limited = rpm > 0 or tpm > 0
local n, used = 0, 0
if limited then
  local cutoff = now - window
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff) end
  n = redis.call('ZCARD', KEYS[1])
  used = tonumber(redis.call('GET', KEYS[2]) or '')
  local stale = #old > 0
  if used ~= nil then
    for _, m in ipairs(old) do used = used - tok(m) end
  end
  if used == nil or used < 0 or n == 0 then
    used, stale = 0, true
    for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do used = used + tok(m) end
  end
  if n == 0 then
    redis.call('DEL', KEYS[2])
  elseif stale then
    redis.call('SET', KEYS[2], int(used), 'PX', window)
  end
  if redis.call('ZSCORE', KEYS[1], member) then
    return {1, '', 0, rpm > 0 and rpm - n or -1, tpm > 0 and tpm - used or -1}
  end
  if rpm > 0 and n >= rpm then
    local e = redis.call('ZRANGE', KEYS[1], n - rpm, n - rpm, 'WITHSCORES')
    return {0, 'rpm', tonumber(e[2]) + window - now, 0, tpm > 0 and tpm - used or -1}
  end
  if tpm > 0 and tokens > tpm then return {0, 'tpm_request', window, -1, tpm - used} end
  if tpm > 0 and used + tokens > tpm then
    local need, freed = used + tokens - tpm, 0
    local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
    for i = 1, #all, 2 do
      freed = freed + tok(all[i])
      if freed >= need then
        return {0, 'tpm', tonumber(all[i + 1]) + window - now, -1, tpm - used}
      end
    end
    return {0, 'tpm', window, -1, tpm - used}
  end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if not redis.call('ZSCORE', KEYS[3], job) and redis.call('ZCARD', KEYS[3]) >= conc then
    local e = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {0, 'concurrent', math.min(tonumber(e[2]) - now, 1000), -1, -1}
  end
end
if limited then
  redis.call('ZADD', KEYS[1], int(now), member)
  used = used + tokens
  redis.call('SET', KEYS[2], int(used), 'PX', window)
  redis.call('PEXPIRE', KEYS[1], window)
  n = n + 1
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], int(now + lease), job)
  if redis.call('PTTL', KEYS[3]) < lease then redis.call('PEXPIRE', KEYS[3], lease) end
end
return {1, '', 0, rpm > 0 and rpm - n or -1, tpm > 0 and tpm - used or -1}
"""

# KEYS: running (sorted set)
# ARGV: job id, lease ms
# Returns 1 (the job's lease now ends lease ms from now) or 0 (the job holds no slot:
# released, or its lease expired and another admission pruned it).
RENEW = """
if redis.call('TYPE', KEYS[1]).ok ~= 'zset' then return 0 end
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%d', now + lease), ARGV[1])
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
return 1
"""

# KEYS: window (sorted set), window tokens (string)
# ARGV: window ms, job id, tokens counted at admission, tokens to give back
# Returns the tokens given back: 0 when the admission is no longer in the window (or was
# given back already, its member renamed), so a retried call gives nothing twice.
REFUND = """
if redis.call('TYPE', KEYS[1]).ok ~= 'zset' then return 0 end
local old = ARGV[2] .. ':' .. ARGV[3]
local score = redis.call('ZSCORE', KEYS[1], old)
if not score then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(score) <= now - tonumber(ARGV[1]) then return 0 end
local back = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]))
if back <= 0 then return 0 end
redis.call('ZREM', KEYS[1], old)
redis.call('ZADD', KEYS[1], score, ARGV[2] .. ':' .. string.format('%d', tonumber(ARGV[3]) - back))
if redis.call('TYPE', KEYS[2]).ok == 'string' then
  local used = tonumber(redis.call('GET', KEYS[2]) or '')
  if used ~= nil and used >= back then
    redis.call('DECRBY', KEYS[2], back)
  else
    redis.call('DEL', KEYS[2])
  end
end
return back
"""

_SCRIPTS = {"ADMIT": ADMIT, "RENEW": RENEW, "REFUND": REFUND}
_SHA = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in _SCRIPTS.items()}


async def _run(r: redis.asyncio.Redis, name: str, names: list[str], args: Iterable[Any]) -> Any:
    """EVALSHA the script `name`; on NOSCRIPT, load it and run it again."""
    argv = list(args)
    try:
        return await r.evalsha(_SHA[name], len(names), *names, *argv)
    except redis.exceptions.NoScriptError:
        await r.script_load(_SCRIPTS[name])
        return await r.evalsha(_SHA[name], len(names), *names, *argv)


def _lease_ms(lease_s: float) -> int:
    if not 0 < lease_s <= 86_400:
        raise ValueError(f"lease_s: seconds from 0 to 86400, got {lease_s!r}")
    return max(1, int(lease_s * 1000))


def _reply_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise redis.ResponseError(f"ADMIT replied {type(v).__name__}, not an integer")
    return v


_REFUSALS = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "tpm_request": "tokens per minute",
    "concurrent": "concurrent jobs",
}


async def admit(
    r: redis.asyncio.Redis, key: Key, tokens: int, job_id: str, lease_s: float = LEASE_S
) -> Verdict:
    """Count one request of `tokens` (its prompt estimate plus max_tokens) against the key's
    limits, atomically across gateway processes, or refuse it counting nothing. Admitted
    with a concurrency limit, the job holds a slot until `release`, or until its lease
    (`lease_s`, extended by `renew`) ends."""
    if type(tokens) is not int or not 0 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens: an integer from 0 to {MAX_TOKENS}, got {tokens!r}")
    if not valid_job_id(job_id):
        raise ValueError("job_id: 8 to 128 of [A-Za-z0-9_-]")
    lease = _lease_ms(lease_s)
    if not key.limited:
        return Verdict(admitted=True)
    reply = await _run(
        r,
        "ADMIT",
        keys.quota_all(key.id),
        [WINDOW_MS, key.rpm, key.tpm, key.concurrent, tokens, job_id, lease],
    )
    if not isinstance(reply, list) or len(reply) != 5:
        raise redis.ResponseError("ADMIT replied something other than 5 values")
    ok, retry_ms, left_req, left_tok = (_reply_int(reply[i]) for i in (0, 2, 3, 4))
    limit = _as_text(reply[1]) or None
    if ok == 1:
        return Verdict(
            admitted=True,
            remaining_requests=left_req if left_req >= 0 else None,
            remaining_tokens=left_tok if left_tok >= 0 else None,
        )
    if limit not in _REFUSALS:
        raise redis.ResponseError(f"ADMIT refused with an unknown limit {limit!r}")
    if limit == "tpm_request":
        message = (
            f"this request needs {tokens} tokens, more than the key's {key.tpm} tokens per minute"
        )
        limit = "tpm"
    else:
        message = f"rate limit reached: {_REFUSALS[limit]}"
    return Verdict(
        admitted=False,
        limit=limit,
        retry_after_s=max(retry_ms, 1) / 1000,
        remaining_requests=left_req if left_req >= 0 else None,
        remaining_tokens=left_tok if left_tok >= 0 else None,
        message=message,
    )


async def renew(r: redis.asyncio.Redis, key: Key, job_id: str, lease_s: float = LEASE_S) -> bool:
    """Extend a running job's slot to `lease_s` from now; False if it holds none (released,
    or expired and pruned). True for a key without a concurrency limit (nothing to renew).
    Renew well within the lease (e.g. every third of it)."""
    lease = _lease_ms(lease_s)
    if not key.concurrent:
        return True
    return _reply_int(await _run(r, "RENEW", [keys.quota_running(key.id)], [job_id, lease])) == 1


async def refund(r: redis.asyncio.Redis, key: Key, job_id: str, counted: int, unused: int) -> int:
    """Give back `unused` of the `counted` tokens a job was admitted with (its max_tokens
    less the tokens it generated) to the key's tokens per minute, while its admission is
    still in the window; once per admission. Returns the tokens given back."""
    if not key.tpm or unused <= 0:
        return 0
    if type(counted) is not int or not 0 <= counted <= MAX_TOKENS:
        raise ValueError(f"counted: an integer from 0 to {MAX_TOKENS}, got {counted!r}")
    names = [keys.quota_window(key.id), keys.quota_tokens(key.id)]
    return _reply_int(await _run(r, "REFUND", names, [WINDOW_MS, job_id, counted, unused]))


async def release(r: redis.asyncio.Redis, key: Key, job_id: str) -> bool:
    """Free a job's slot; False if it held none."""
    if not key.concurrent:
        return False
    try:
        return bool(await r.zrem(keys.quota_running(key.id), job_id))
    except redis.ResponseError:  # not a sorted set: the next admission resets it
        return False
