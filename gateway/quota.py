"""An API key's quotas, counted in Redis atomically so every gateway process shares them:
one Lua script (QUOTA_ADMIT) checks and counts a request against the key's requests per
minute, tokens per minute and concurrent jobs, on Redis' own clock.

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
its lease. The scripts run through results.jobs, like every other script.

    verdict = await quota.admit(r, key, tokens, job_id)
    if not verdict.admitted: ...                      # 429, Retry-After: verdict.retry_after
    await quota.release(r, key, job_id)
    await quota.refund(r, key, job_id, tokens, max_tokens - output_tokens)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.protocol import valid_job_id
from plurai.broker_config.text import text
from plurai.gateway.apikeys import Key
from plurai.results import jobs

WINDOW_MS = 60_000  # the quota window: requests and tokens per minute
LEASE_S = 60.0  # a running job's slot, unless renewed
MAX_TOKENS = 2**40  # of one admission

# Returns {admitted 1|0, limit ('', 'rpm', 'tpm', 'tpm_request' or 'concurrent'), retry ms,
# requests left in the window (-1: no limit), tokens left (-1: no limit)}. A refusal counts
# nothing; pruning what fell out of the window, or out of its lease, is not counting. Time
# is Redis' own (TIME), the same for every gateway process. An admission already counted
# (the same job id and tokens within the window: a retried call) is admitted again without
# counting. A key of the wrong type (written by something else) is reset.
QUOTA_ADMIT = """
local window_key, tokens_key, running_key = KEYS[1], KEYS[2], KEYS[3]
local window, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local conc, tokens_text, job, lease = tonumber(ARGV[4]), ARGV[5], ARGV[6], tonumber(ARGV[7])
local tokens = tonumber(tokens_text)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member = job .. ':' .. tokens_text
local function int(x) return string.format('%d', x) end
local function tok(m) return tonumber(string.match(m, ':(%d+)$')) or 0 end
local function reset(key, kind)
  local ty = redis.call('TYPE', key).ok
  if ty ~= 'none' and ty ~= kind then redis.call('DEL', key) end
end
reset(window_key, 'zset')
reset(tokens_key, 'string')
reset(running_key, 'zset')
local limited = rpm > 0 or tpm > 0
local n, used = 0, 0
if limited then
  local cutoff = now - window
  local old = redis.call('ZRANGEBYSCORE', window_key, '-inf', cutoff)
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', window_key, '-inf', cutoff) end
  n = redis.call('ZCARD', window_key)
  used = tonumber(redis.call('GET', tokens_key) or '')
  local stale = #old > 0
  if used ~= nil then
    for _, m in ipairs(old) do used = used - tok(m) end
  end
  if used == nil or used < 0 or n == 0 then
    used, stale = 0, true
    for _, m in ipairs(redis.call('ZRANGE', window_key, 0, -1)) do used = used + tok(m) end
  end
  if n == 0 then
    redis.call('DEL', tokens_key)
  elseif stale then
    redis.call('SET', tokens_key, int(used), 'PX', window)
  end
  if redis.call('ZSCORE', window_key, member) then
    return {1, '', 0, rpm > 0 and rpm - n or -1, tpm > 0 and tpm - used or -1}
  end
  if rpm > 0 and n >= rpm then
    local e = redis.call('ZRANGE', window_key, n - rpm, n - rpm, 'WITHSCORES')
    return {0, 'rpm', tonumber(e[2]) + window - now, 0, tpm > 0 and tpm - used or -1}
  end
  if tpm > 0 and tokens > tpm then return {0, 'tpm_request', window, -1, tpm - used} end
  if tpm > 0 and used + tokens > tpm then
    local need, freed = used + tokens - tpm, 0
    local all = redis.call('ZRANGE', window_key, 0, -1, 'WITHSCORES')
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
  redis.call('ZREMRANGEBYSCORE', running_key, '-inf', now)
  if not redis.call('ZSCORE', running_key, job) and redis.call('ZCARD', running_key) >= conc then
    local e = redis.call('ZRANGE', running_key, 0, 0, 'WITHSCORES')
    return {0, 'concurrent', math.min(tonumber(e[2]) - now, 1000), -1, -1}
  end
end
if limited then
  redis.call('ZADD', window_key, int(now), member)
  used = used + tokens
  redis.call('SET', tokens_key, int(used), 'PX', window)
  redis.call('PEXPIRE', window_key, window)
  n = n + 1
end
if conc > 0 then
  redis.call('ZADD', running_key, int(now + lease), job)
  if redis.call('PTTL', running_key) < lease then redis.call('PEXPIRE', running_key, lease) end
end
return {1, '', 0, rpm > 0 and rpm - n or -1, tpm > 0 and tpm - used or -1}
"""

# Returns 1 (the job's lease now ends lease ms from now) or 0 (the job holds no slot:
# released, or its lease expired and another admission pruned it).
QUOTA_RENEW = """
local running_key = KEYS[1]
local job, lease = ARGV[1], tonumber(ARGV[2])
if redis.call('TYPE', running_key).ok ~= 'zset' then return 0 end
if not redis.call('ZSCORE', running_key, job) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', running_key, string.format('%d', now + lease), job)
if redis.call('PTTL', running_key) < lease then redis.call('PEXPIRE', running_key, lease) end
return 1
"""

# Returns the tokens given back: 0 when the admission is no longer in the window (or was
# given back already, its member renamed), so a retried call gives nothing twice.
QUOTA_REFUND = """
local window_key, tokens_key = KEYS[1], KEYS[2]
local window, job, counted_text, unused = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local counted = tonumber(counted_text)
if redis.call('TYPE', window_key).ok ~= 'zset' then return 0 end
local old = job .. ':' .. counted_text
local score = redis.call('ZSCORE', window_key, old)
if not score then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(score) <= now - window then return 0 end
local back = math.min(unused, counted)
if back <= 0 then return 0 end
redis.call('ZREM', window_key, old)
redis.call('ZADD', window_key, score, job .. ':' .. string.format('%d', counted - back))
if redis.call('TYPE', tokens_key).ok == 'string' then
  local used = tonumber(redis.call('GET', tokens_key) or '')
  if used ~= nil and used >= back then
    redis.call('DECRBY', tokens_key, back)
  else
    redis.call('DEL', tokens_key)
  end
end
return back
"""

jobs.register(QUOTA_ADMIT=QUOTA_ADMIT, QUOTA_RENEW=QUOTA_RENEW, QUOTA_REFUND=QUOTA_REFUND)


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


def _lease_ms(lease_s: float) -> int:
    if not 0 < lease_s <= 86_400:
        raise ValueError(f"lease_s: seconds from 0 to 86400, got {lease_s!r}")
    return max(1, int(lease_s * 1000))


def _reply_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise redis.ResponseError(f"a quota script replied {type(v).__name__}, not an integer")
    return v


def _left(n: int) -> int | None:
    return n if n >= 0 else None


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
    args = [WINDOW_MS, key.rpm, key.tpm, key.concurrent, tokens, job_id, lease]
    reply = await jobs.run_async(r, jobs.Call("QUOTA_ADMIT", keys.quota_all(key.id), args))
    if not isinstance(reply, list) or len(reply) != 5:
        raise redis.ResponseError("QUOTA_ADMIT replied something other than 5 values")
    ok, retry_ms, left_req, left_tok = (_reply_int(reply[i]) for i in (0, 2, 3, 4))
    limit = text(reply[1]) or None
    if ok == 1:
        return Verdict(True, remaining_requests=_left(left_req), remaining_tokens=_left(left_tok))
    if limit not in _REFUSALS:
        raise redis.ResponseError(f"QUOTA_ADMIT refused with an unknown limit {limit!r}")
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
        remaining_requests=_left(left_req),
        remaining_tokens=_left(left_tok),
        message=message,
    )


async def renew(r: redis.asyncio.Redis, key: Key, job_id: str, lease_s: float = LEASE_S) -> bool:
    """Extend a running job's slot to `lease_s` from now; False if it holds none (released,
    or expired and pruned). True for a key without a concurrency limit (nothing to renew).
    Renew well within the lease (e.g. every third of it)."""
    lease = _lease_ms(lease_s)
    if not key.concurrent:
        return True
    call = jobs.Call("QUOTA_RENEW", [keys.quota_running(key.id)], [job_id, lease])
    return _reply_int(await jobs.run_async(r, call)) == 1


async def refund(r: redis.asyncio.Redis, key: Key, job_id: str, counted: int, unused: int) -> int:
    """Give back `unused` of the `counted` tokens a job was admitted with (its max_tokens
    less the tokens it generated) to the key's tokens per minute, while its admission is
    still in the window; once per admission. Returns the tokens given back."""
    if not key.tpm or unused <= 0:
        return 0
    if type(counted) is not int or not 0 <= counted <= MAX_TOKENS:
        raise ValueError(f"counted: an integer from 0 to {MAX_TOKENS}, got {counted!r}")
    names = [keys.quota_window(key.id), keys.quota_tokens(key.id)]
    call = jobs.Call("QUOTA_REFUND", names, [WINDOW_MS, job_id, counted, unused])
    return _reply_int(await jobs.run_async(r, call))


async def release(r: redis.asyncio.Redis, key: Key, job_id: str) -> bool:
    """Free a job's slot; False if it held none."""
    if not key.concurrent:
        return False
    try:
        return bool(await r.zrem(keys.quota_running(key.id), job_id))
    except redis.ResponseError:  # not a sorted set: the next admission resets it
        return False
