"""Lua scripts that change a job's state atomically.

Each runs as one step in Redis, so a job is never half-finished: the final result, the end
entry of its token stream, the completion message and the XACK of its request entry
happen together. Scripts take every key in KEYS (named by broker_config.keys).

Each script's KEYS and ARGV are built in one place only, results/jobs.py, which has one typed
function per script: call those, never a script with positional arguments.
"""

from __future__ import annotations

# Prepended to the scripts that write with pcall: `full(reply)` tells a pcall refused
# because Redis is at maxmemory, and OOM is the error such a script answers with then.
_OOM = """
local OOM = "OOM command not allowed when used memory > 'maxmemory'."
local function full(reply)
  return type(reply) == 'table' and reply.err ~= nil and string.find(reply.err, 'OOM', 1, true) ~= nil
end
"""

# A submit is one call on a single Redis (ENQUEUE: the job's record and its entry), and
# two on a Redis Cluster, sent together: QUEUED (the job's slot), then SUBMIT (the queue
# shard's slot). Each of those touches one Cluster slot; on one Redis they run in this order.

# Prepended to the submit scripts: `queued_over(stream, limit, group)` is how many entries
# wait in the lane when that is `limit` or more (0: no limit), else nil. Workers delete an
# entry once it is acknowledged, so XLEN minus the group's pending count is what waits.
_LANE = """
local function queued_over(stream, limit, group)
  local queued = redis.call('XLEN', stream)
  if limit <= 0 or queued < limit then return nil end
  local pending = redis.pcall('XPENDING', stream, group)
  if type(pending) == 'table' and pending.err == nil then queued = queued - pending[1] end
  if queued >= limit then return queued end
  return nil
end
"""

# KEYS: job record
# ARGV: record ttl, lane, priority, created_ms, metadata JSON or '', model
# Writes the queued job's record. Only what is missing is written: on a Cluster the two
# calls may arrive in either order, and a worker that took the entry first has written
# the record as running (its TTL too). Returns 1 when the record was new, else 0.
QUEUED = """
local fields = {'lane', ARGV[2], 'priority', ARGV[3], 'created_ms', ARGV[4], 'model', ARGV[6]}
if ARGV[5] ~= '' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = ARGV[5] end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'state', 'queued', unpack(fields))
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  return 1
end
for i = 1, #fields, 2 do redis.call('HSETNX', KEYS[1], fields[i], fields[i + 1]) end
return 0
"""

# KEYS: request stream[, idempotency key]
# ARGV: maxlen, idempotency ttl, job id, max queued (0: no limit), group, then the
#       entry's field/value pairs.
# Returns the id of the job in the queue: this one, or the earlier job with the same
# idempotency key (then nothing is added); or the error 'QUEUEFULL <queued>' when the lane
# already holds max queued entries not yet taken by a worker.
# When the reply is not this job's id, the client deletes the record QUEUED wrote.
SUBMIT = (
    _LANE
    + """
if #KEYS == 2 then
  local owner = redis.call('GET', KEYS[2])
  if owner then return owner end
end
local queued = queued_over(KEYS[1], tonumber(ARGV[4]), ARGV[5])
if queued then return redis.error_reply('QUEUEFULL ' .. queued) end
if #KEYS == 2 then redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[2]) end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 6))
return ARGV[3]
"""
)

# KEYS: job record, request stream[, idempotency key]
# ARGV: QUEUED's six, then SUBMIT's: record ttl, lane, priority, created_ms, metadata JSON
#       or '', model, maxlen, idempotency ttl, job id, max queued, group, then the entry's
#       field/value pairs.
# QUEUED and SUBMIT in one call, where the job's keys and the shard's are on one server
# (any Redis but a Cluster): the same replies and the same entry. The record (new: no
# worker can have the entry before this call ends) is written only with the entry, so a
# refused submit (QUEUEFULL, a taken idempotency key) leaves nothing to delete. The XADD
# is the first write: a Redis at maxmemory refuses it, and the call, before anything is
# written. A record key of another type is left as it is (pcall): the job runs all the
# same and its worker reports bad_record, as on a Cluster.
ENQUEUE = (
    _LANE
    + """
if #KEYS == 3 then
  local owner = redis.call('GET', KEYS[3])
  if owner then return owner end
end
local queued = queued_over(KEYS[2], tonumber(ARGV[10]), ARGV[11])
if queued then return redis.error_reply('QUEUEFULL ' .. queued) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', unpack(ARGV, 12))
if #KEYS == 3 then redis.call('SET', KEYS[3], ARGV[9], 'EX', ARGV[8]) end
local rec = redis.pcall('HSET', KEYS[1], 'state', 'queued', 'lane', ARGV[2], 'priority', ARGV[3],
                        'created_ms', ARGV[4], 'model', ARGV[6])
if type(rec) == 'number' then
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'metadata', ARGV[5]) end
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return ARGV[9]
"""
)

# KEYS: request streams of one shard (one hash tag), in the order to read them
# ARGV: group, consumer, count
# Takes up to count new entries for the consumer (XREADGROUP, as a worker's own read):
# from the first stream while it has some, then from the next. One call instead of a read
# per lane. Returns {stream index (1-based), entry id, fields} for each entry, in order.
TAKE = """
local out = {}
for i = 1, #KEYS do
  local left = tonumber(ARGV[3]) - #out
  if left <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left,
                         'STREAMS', KEYS[i], '>')
  if got then
    for _, e in ipairs(got[1][2]) do out[#out + 1] = {i, e[1], e[2]} end
  end
end
return out
"""

# KEYS: job record, token stream
# ARGV: worker id, now ms, ttl, deadline ms or '', lane, priority, metadata JSON or ''
# Returns 'run', or why not: 'done' (a final result exists: only ack the entry),
# 'cancelled' (cancel asked while queued), 'expired' (deadline passed), 'badkey' (the record
# is not a hash or the token stream cannot take entries: written by something else).
# Token stream writes here and below use pcall: a stream a client wrote to (e.g. an entry
# at the largest id) must not abort a script half-way. A Redis at maxmemory refuses a
# script's first write and, once one is made, none after it: a refused first XADD means
# nothing was written, and the call is answered with Redis's own OOM error (not
# 'badkey'), which the worker retries once memory frees.
BEGIN = (
    _OOM
    + """
local rt = redis.call('TYPE', KEYS[1]).ok
local st = redis.call('TYPE', KEYS[2]).ok
if (rt ~= 'hash' and rt ~= 'none') or (st ~= 'stream' and st ~= 'none') then
  return 'badkey'
end
if redis.call('HEXISTS', KEYS[1], 'final') == 1 then return 'done' end
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then return 'cancelled' end
if ARGV[4] ~= '' and tonumber(ARGV[2]) > tonumber(ARGV[4]) then return 'expired' end
if st == 'stream' then
  redis.pcall('XADD', KEYS[2], '*', 'type', 'reset')
end
local added = redis.pcall('XADD', KEYS[2], '*', 'type', 'start', 'worker', ARGV[1])
if full(added) then return redis.error_reply(OOM) end
if type(added) == 'table' and added.err then return 'badkey' end
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'started_ms', ARGV[2],
           'lane', ARGV[5], 'priority', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSETNX', KEYS[1], 'metadata', ARGV[7]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 'run'
"""
)

# KEYS: job record, token stream, for each job in turn
# ARGV: worker id, stream maxlen, then for each job: mode ('d': one delta, of one or more
#       tokens; 'r': a reset, then the whole text so far as one delta), text, token_ids JSON
# One call writes every delta of an engine step (a job's tokens are held back and written
# together: gpu_workers/job.py). A job's stream is written only while its
# record names this worker and holds no final result, so a worker whose job was taken
# over (or already finished elsewhere) never mixes its tokens into the new run's stream.
# Returns how many jobs were written; Redis's OOM error when it is full (then nothing was
# written: see BEGIN).
DELTAS = (
    _OOM
    + """
local n = 0
for i = 1, #KEYS, 2 do
  local a = 3 * (i - 1) / 2 + 3
  local rec = redis.pcall('HMGET', KEYS[i], 'worker', 'final')
  if type(rec) == 'table' and rec.err == nil and rec[1] == ARGV[1] and not rec[2] then
    -- a key of another type refuses the XADD (pcall: an error table, not an entry id)
    local ok = true
    if ARGV[a] == 'r' then
      local x = redis.pcall('XADD', KEYS[i + 1], 'MAXLEN', '~', ARGV[2], '*', 'type', 'reset')
      if full(x) then return redis.error_reply(OOM) end
      ok = type(x) == 'string'
    end
    if ok then
      local x = redis.pcall('XADD', KEYS[i + 1], 'MAXLEN', '~', ARGV[2], '*', 'type',
                            'delta', 'text', ARGV[a + 1], 'token_ids', ARGV[a + 2])
      if full(x) then return redis.error_reply(OOM) end
      if type(x) == 'string' then n = n + 1 end
    end
  end
end
return n
"""
)

# KEYS: job record, token stream[, request stream]
# ARGV: ttl, done channel, state, finish_reason, stream ttl, stream maxlen, resync ('1':
#       write a reset and the whole text before the end entry; '': only when deltas may be
#       missing (the record does not name the result's worker) or may be stale (the stream
#       exists and the result has no text); 'n': never, a job without deltas), group and
#       entry id of the job's request entry (or ''), then record field/value pairs (with
#       text, token_ids and worker)
# Writes the final result only if none exists (HSETNX on 'final'), so a second run of the
# same job can never overwrite the first result. With the request stream (a single Redis:
# its keys and the job's on one server), then acks and deletes the job's request entry,
# in the same step as its result; on a Cluster (another slot) the worker acks it once this
# call's reply is back (results/jobs.py, acks).
# Returns 1 (stored), 0 (a result existed) or -1 (the record is not a hash: no result can
# be written, nothing is acked; the worker dead-letters the job).
FINALIZE = """
local rt = redis.call('TYPE', KEYS[1]).ok
if rt ~= 'hash' and rt ~= 'none' then return -1 end
local stored = redis.call('HSETNX', KEYS[1], 'final', '1')
if stored == 1 then
  local owner = redis.call('HGET', KEYS[1], 'worker')
  local text, ids, worker = '', '[]', ''
  for i = 10, #ARGV - 1, 2 do
    if ARGV[i] == 'text' then text = ARGV[i + 1] end
    if ARGV[i] == 'token_ids' then ids = ARGV[i + 1] end
    if ARGV[i] == 'worker' then worker = ARGV[i + 1] end
  end
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finish_reason', ARGV[4], unpack(ARGV, 10))
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  local st = redis.call('TYPE', KEYS[2]).ok
  if st == 'stream' or st == 'none' then
    local stale = st == 'stream' and text == ''
    if ARGV[7] == '1' or (ARGV[7] == '' and ((text ~= '' and owner ~= worker) or stale)) then
      redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'type', 'reset')
      redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'type', 'delta',
                  'text', text, 'token_ids', ids)
    end
    redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'type', 'end',
                'state', ARGV[3], 'finish_reason', ARGV[4])
    redis.call('EXPIRE', KEYS[2], ARGV[5])
  end
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
if #KEYS == 3 then  -- pcall: a request stream of another type must not fail a stored result
  redis.pcall('XACK', KEYS[3], ARGV[8], ARGV[9])
  redis.pcall('XDEL', KEYS[3], ARGV[9])
end
return stored
"""

# KEYS: job record, token stream
# ARGV: ttl, done channel, cancel channel, job id, now ms, stream ttl
# A queued (or unknown) job is cancelled at once; the worker that later reads its entry
# only acks it. A running job is flagged and its worker told on the cancel channel. The
# token stream of a job cancelled here expires as a finished job's does (stream ttl), not
# with its record.
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
if redis.call('TYPE', KEYS[2]).ok == 'stream' then  -- deltas of a run handed back: void
  redis.pcall('XADD', KEYS[2], '*', 'type', 'reset')
end
redis.pcall('XADD', KEYS[2], '*', 'type', 'end', 'state', 'cancelled', 'finish_reason', 'abort')
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('PUBLISH', ARGV[2], 'cancelled')
return 'cancelled'
"""

# Handing a job back is two calls: RELEASE (the job's slot), then REQUEUE (the queue's).

# KEYS: job record
# Marks the job queued again, unless a final result exists. Returns 1 when the job is to
# be re-added (a record of another type too: the next worker to take it reports
# bad_record), 0 when it has a result (its entry is only acked).
RELEASE = """
local rt = redis.call('TYPE', KEYS[1]).ok
if rt ~= 'hash' and rt ~= 'none' then return 1 end
if redis.call('HEXISTS', KEYS[1], 'final') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('HDEL', KEYS[1], 'worker', 'started_ms')
return 1
"""

# KEYS: request stream
# ARGV: group, entry id, maxlen, re-add ('1' or ''), then the entry's field/value pairs
# Re-adds the entry at the tail of its lane (when told to), then acks and deletes the old
# one; only while the old one is pending: a second run of the same call (a client library
# retrying after a reply it lost) finds it acked and adds nothing, so the job is queued
# once. The XADD comes first so that a Redis at maxmemory, which refuses it, aborts the
# script before the ack: the entry stays pending (reclaimed later), never lost.
# Returns 1 when the entry was re-added, else 0.
REQUEUE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return 0 end
if ARGV[4] == '1' then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 5))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return ARGV[4] == '1' and 1 or 0
"""

# KEYS: request stream
# ARGV: group, consumer, then entry ids
# Renews the lease on the entries this consumer still owns (XCLAIM JUSTID resets their idle
# time, not their delivery count) and returns the ids another consumer owns now: it
# reclaimed them while this one stalled. Entries pending to nobody (deleted or trimmed by
# hand) are left alone: their job runs on and its result is stored as usual.
RENEW = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  elseif #p == 1 then
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# KEYS: job records of the jobs a worker runs
# Returns one number per job: 0 run on, 1 a cancel was asked (its message may have been
# lost), 2 the record is no longer a hash (written by something else).
CHECK = """
local out = {}
for i, key in ipairs(KEYS) do
  local rt = redis.call('TYPE', key).ok
  if rt ~= 'hash' and rt ~= 'none' then
    out[i] = 2
  else
    out[i] = redis.call('HEXISTS', key, 'cancel')
  end
end
return out
"""


# -- bulk batches (producer/bulk/store.py) ----------------------------------------------

# KEYS: batch lines, batch record
# ARGV: index, line JSON, ok (1/0), prompt tokens, output tokens, now ms, TTL seconds of
#       both keys
# Stores a line's one result; the counts move only when it was new. Returns 1, or 0 when
# the line had a result already.
BATCH_LINE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3] == '1' and 'completed' or 'failed', 1)
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[2], 'output_tokens', ARGV[5])
redis.call('HSET', KEYS[2], 'beat_ms', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 1
"""

# KEYS: batch record
# Returns the new generation, or false if there is no record (HINCRBY alone would create
# one, without a TTL).
BATCH_GEN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('HINCRBY', KEYS[1], 'gen', 1)
"""

# KEYS: batch record
# ARGV: new status, then the statuses it may replace
# Returns the status after the call, or false if there is no record.
BATCH_MOVE = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
for i = 2, #ARGV do
  if cur == ARGV[i] then redis.call('HSET', KEYS[1], 'status', ARGV[1]) return ARGV[1] end
end
return cur
"""
