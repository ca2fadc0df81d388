"""Lua scripts that change a job's state atomically.

Each runs as one step in Redis, so a job is never half-finished: the final result, the end
entry of its token stream, the completion message and the XACK of its request entry
happen together. Scripts take every key in KEYS (named by broker_config.keys).
"""

from __future__ import annotations

# KEYS: request stream, job record[, idempotency key]
# ARGV: maxlen, record ttl, idempotency ttl, job id, created_ms, lane, priority,
#       metadata JSON or '', max queued (0: no limit), group, then the entry's field/value
#       pairs.
# Returns the id of the job in the queue: this one, or the earlier job with the same
# idempotency key (then nothing is added); or the error 'QUEUEFULL <queued>' when the lane
# already holds max queued entries not yet taken by a worker. Workers delete an entry once
# it is acknowledged, so XLEN minus the group's pending count is what waits in the lane.
SUBMIT = """
if #KEYS == 3 then
  local owner = redis.call('GET', KEYS[3])
  if owner then return owner end
end
local limit = tonumber(ARGV[9])
local queued = redis.call('XLEN', KEYS[1])
if limit > 0 and queued >= limit then
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[10])
  if type(pending) == 'table' and pending.err == nil then queued = queued - pending[1] end
  if queued >= limit then return redis.error_reply('QUEUEFULL ' .. queued) end
end
if #KEYS == 3 then redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[3]) end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 11))
redis.call('HSET', KEYS[2], 'state', 'queued', 'lane', ARGV[6], 'priority', ARGV[7],
           'created_ms', ARGV[5])
if ARGV[8] ~= '' then redis.call('HSET', KEYS[2], 'metadata', ARGV[8]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return ARGV[4]
"""

# KEYS: job record, token stream
# ARGV: worker id, now ms, ttl, deadline ms or '', lane, priority, metadata JSON or ''
# Returns 'run', or why not: 'done' (a final result exists: only ack the entry),
# 'cancelled' (cancel asked while queued), 'expired' (deadline passed).
BEGIN = """
if redis.call('HEXISTS', KEYS[1], 'final') == 1 then return 'done' end
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then return 'cancelled' end
if ARGV[4] ~= '' and tonumber(ARGV[2]) > tonumber(ARGV[4]) then return 'expired' end
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'started_ms', ARGV[2],
           'lane', ARGV[5], 'priority', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSETNX', KEYS[1], 'metadata', ARGV[7]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'type', 'reset')
end
redis.call('XADD', KEYS[2], '*', 'type', 'start', 'worker', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 'run'
"""

# KEYS: token streams, one per delta
# ARGV: text, token_ids JSON, for each key in turn
# One call writes every delta of an engine step.
DELTAS = """
for i, key in ipairs(KEYS) do
  redis.call('XADD', key, '*', 'type', 'delta', 'text', ARGV[2 * i - 1], 'token_ids', ARGV[2 * i])
end
return #KEYS
"""

# KEYS: job record, token stream[, request stream to XACK]
# ARGV: group, entry id, ttl, done channel, state, finish_reason, then record field/value pairs
# Writes the final result only if none exists (HSETNX on 'final'), so a second run of the
# same job can never overwrite the first result. Acks and deletes the entry either way.
FINALIZE = """
local fresh = redis.call('HSETNX', KEYS[1], 'final', '1') == 1
if fresh then
  redis.call('HSET', KEYS[1], 'state', ARGV[5], 'finish_reason', ARGV[6], unpack(ARGV, 7))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('XADD', KEYS[2], '*', 'type', 'end', 'state', ARGV[5], 'finish_reason', ARGV[6])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
end
if #KEYS == 3 then
  redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[2])
end
if fresh then return 1 end
return 0
"""

# KEYS: job record, token stream
# ARGV: ttl, done channel, cancel channel, job id, now ms
# A queued (or unknown) job is cancelled at once; the worker that later reads its entry
# only acks it. A running job is flagged and its worker told on the cancel channel.
# Returns the state after the call: 'cancelled', 'cancelling', or the final state it had.
CANCEL = """
if redis.call('HEXISTS', KEYS[1], 'final') == 1 then
  return redis.call('HGET', KEYS[1], 'state')
end
redis.call('HSET', KEYS[1], 'cancel', '1')
if redis.call('HGET', KEYS[1], 'state') == 'running' then
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 'cancelling'
end
redis.call('HSET', KEYS[1], 'final', '1', 'state', 'cancelled', 'finish_reason', 'abort',
           'finished_ms', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], '*', 'type', 'end', 'state', 'cancelled', 'finish_reason', 'abort')
redis.call('EXPIRE', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[2], 'cancelled')
return 'cancelled'
"""

# KEYS: request stream, job record
# ARGV: group, entry id, maxlen, then the entry's original field/value pairs
# Hands a job back: re-adds its entry at the tail of its lane and acks (and deletes) the old
# one, unless a final result exists already. Returns 1 when re-added.
REQUEUE = """
if redis.call('HEXISTS', KEYS[2], 'final') == 0 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
  redis.call('HSET', KEYS[2], 'state', 'queued')
  redis.call('HDEL', KEYS[2], 'worker', 'started_ms')
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
  return 1
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 0
"""
