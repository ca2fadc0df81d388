"""Lua scripts that change a job's state atomically.

Each runs as one step in Redis, so a job is never half-finished: the final result, the end
entry of its token stream, the completion message and the XACK of its request entry
happen together. Scripts take every key in KEYS (named by broker_config.keys).

Each script opens by naming its KEYS and ARGV in locals, so that its body reads by name;
a variadic tail (an entry's field/value pairs, entry ids) is named by the index it starts
at.

Each script's KEYS and ARGV are built in one place only, results/jobs.py, which has one typed
function per script: call those, never a script with positional arguments.

One file, though long: every script that writes a job's keys, so that every write to them
reads in one place; each script is a few dozen lines, grouped by the job's life (submit,
take and begin, deltas and result, cancel and hand back, leases, batches).
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
# `holder`, `refused` and `queued_record` are the checks and the record write every submit
# shares.
_LANE = """
local function queued_over(stream, limit, group)
  local queued = redis.call('XLEN', stream)
  if limit <= 0 or queued < limit then return nil end
  local pending = redis.pcall('XPENDING', stream, group)
  if type(pending) == 'table' and pending.err == nil then queued = queued - pending[1] end
  if queued >= limit then return queued end
  return nil
end
-- the earlier job that holds the idempotency key (its id is a repeat's reply), or nil
local function holder(idem)
  if idem then return redis.call('GET', idem) or nil end
  return nil
end
-- why a submit adds nothing: the earlier job that holds the idempotency key (`holder`), or
-- the lane holding max_queued entries not yet taken (QUEUEFULL); else nil
local function refused(stream, idem, max_queued, group)
  local owner = holder(idem)
  if owner then return owner end
  local queued = queued_over(stream, tonumber(max_queued), group)
  if queued then return redis.error_reply('QUEUEFULL ' .. queued) end
  return nil
end
-- a new job's record as queued (`fields`: state and the rest), with its metadata and the
-- time a front received it where given; a key of another type is left as it is (pcall):
-- the job runs all the same and its worker reports bad_record
local function queued_record(record, ttl, fields, metadata, received_us)
  if type(redis.pcall('HSET', record, unpack(fields))) ~= 'number' then return end
  if metadata ~= '' then redis.call('HSET', record, 'metadata', metadata) end
  if received_us ~= '' then redis.call('HSET', record, 'received_us', received_us) end
  redis.call('EXPIRE', record, ttl)
end
"""

# KEYS: job record
# ARGV: record ttl, lane, priority, created_ms, metadata JSON or '', model, queued_us,
#       received_us or ''[, not before (unix ms) of a delayed job]
# Writes the queued job's record. Only what is missing is written: on a Cluster the two
# calls may arrive in either order, and a worker that took the entry first has written
# the record as running (its TTL too). Returns 1 when the record was new, else 0.
QUEUED = """
local record = KEYS[1]
local ttl, lane, priority, created_ms, metadata, model, queued_us, received_us = unpack(ARGV, 1, 8)
local not_before = ARGV[9]
local fields = {'lane', lane, 'priority', priority, 'created_ms', created_ms, 'model', model,
                'queued_us', queued_us}
if metadata ~= '' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = metadata end
if not_before then fields[#fields + 1] = 'not_before_ms'; fields[#fields + 1] = not_before end
if received_us ~= '' then fields[#fields + 1] = 'received_us'; fields[#fields + 1] = received_us end
if redis.call('EXISTS', record) == 0 then
  redis.call('HSET', record, 'state', 'queued', unpack(fields))
  redis.call('EXPIRE', record, ttl)
  return 1
end
for i = 1, #fields, 2 do redis.call('HSETNX', record, fields[i], fields[i + 1]) end
return 0
"""

# KEYS: request stream[, idempotency key]
# ARGV: maxlen, idempotency ttl, job id, max queued (0: no limit), group, arrivals
#       channel, then the entry's field/value pairs.
# Returns the id of the job in the queue: this one, or the earlier job with the same
# idempotency key (then nothing is added); or the error 'QUEUEFULL <queued>' when the lane
# already holds max queued entries not yet taken by a worker.
# When the reply is not this job's id, the client deletes the record QUEUED wrote.
SUBMIT = (
    _LANE
    + """
local stream, idem = KEYS[1], KEYS[2]
local maxlen, idem_ttl, job_id, max_queued, group, arrivals = unpack(ARGV, 1, 6)
local ENTRY = 7  -- ARGV[7..]: the entry's field/value pairs
local answer = refused(stream, idem, max_queued, group)
if answer then return answer end
if idem then redis.call('SET', idem, job_id, 'EX', idem_ttl) end
redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, ENTRY))
redis.call('PUBLISH', arrivals, stream)
return job_id
"""
)

# KEYS: job record, request stream[, idempotency key]
# ARGV: QUEUED's eight, then SUBMIT's: record ttl, lane, priority, created_ms, metadata JSON
#       or '', model, queued_us, received_us or '', maxlen, idempotency ttl, job id, max
#       queued, group, arrivals channel, then the entry's field/value pairs.
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
local record, stream, idem = KEYS[1], KEYS[2], KEYS[3]
local ttl, lane, priority, created_ms, metadata, model, queued_us, received_us = unpack(ARGV, 1, 8)
local maxlen, idem_ttl, job_id, max_queued, group, arrivals = unpack(ARGV, 9, 14)
local ENTRY = 15  -- ARGV[15..]: the entry's field/value pairs
local answer = refused(stream, idem, max_queued, group)
if answer then return answer end
redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, ENTRY))
redis.call('PUBLISH', arrivals, stream)
if idem then redis.call('SET', idem, job_id, 'EX', idem_ttl) end
queued_record(record, ttl, {'state', 'queued', 'lane', lane, 'priority', priority,
                            'created_ms', created_ms, 'model', model, 'queued_us', queued_us},
              metadata, received_us)
return job_id
"""
)

# KEYS: the shard's delayed set[, idempotency key]
# ARGV: idempotency ttl, job id, not before (unix ms), the entry (msgpack of its lane, then
#       its field/value pairs)
# A job not to run before a time (`not_before`): its entry waits in the delayed set, scored
# by that time, until a worker moves it to the tail of its lane (DUE). Returns the job id,
# or the earlier job's that holds the idempotency key (then nothing is added). The ZADD is
# the first write: a Redis at maxmemory refuses it before anything is written.
DEFER = (
    _LANE
    + """
local delayed, idem = KEYS[1], KEYS[2]
local idem_ttl, job_id, not_before, entry = unpack(ARGV, 1, 4)
local owner = holder(idem)
if owner then return owner end
redis.call('ZADD', delayed, not_before, entry)
if idem then redis.call('SET', idem, job_id, 'EX', idem_ttl) end
return job_id
"""
)

# KEYS: job record, the shard's delayed set[, idempotency key]
# ARGV: QUEUED's nine (not before included), then DEFER's four.
# QUEUED and DEFER in one call, where the job's keys and the shard's are on one server (any
# Redis but a Cluster), as ENQUEUE is QUEUED and SUBMIT.
ENQUEUE_LATER = (
    _LANE
    + """
local record, delayed, idem = KEYS[1], KEYS[2], KEYS[3]
local ttl, lane, priority, created_ms, metadata, model, queued_us, received_us = unpack(ARGV, 1, 8)
local not_before_ms = ARGV[9]
local idem_ttl, job_id, not_before, entry = unpack(ARGV, 10, 13)
local owner = holder(idem)
if owner then return owner end
redis.call('ZADD', delayed, not_before, entry)
if idem then redis.call('SET', idem, job_id, 'EX', idem_ttl) end
queued_record(record, ttl, {'state', 'queued', 'lane', lane, 'priority', priority,
                            'created_ms', created_ms, 'model', model, 'queued_us', queued_us,
                            'not_before_ms', not_before_ms},
              metadata, received_us)
return job_id
"""
)

# KEYS: the shard's delayed set, then the shard's request streams, a lane each
# ARGV: now (unix ms), the most to move, maxlen, arrivals channel, then the lanes' names in
#       the order of KEYS[2..]
# Moves the delayed entries whose time has come (score <= now), earliest first, to the tail
# of their lanes, and tells the arrivals channel. Returns the time of the next one (unix
# ms; '' when none waits), then the entries it could not move (a lane that is not one of
# these, or bytes that do not decode), removed: the caller dead-letters them, so none is
# lost in the set.
DUE = """
local delayed = KEYS[1]
local now, most, maxlen, arrivals = unpack(ARGV, 1, 4)
local LANES = 5  -- ARGV[5..]: the lanes of KEYS[2..]
local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, most)
local bad = {}
for _, entry in ipairs(due) do
  local ok, t = pcall(cmsgpack.unpack, entry)
  local stream = nil
  if ok and type(t) == 'table' and #t >= 3 and #t % 2 == 1 then
    for i = LANES, #ARGV do
      if ARGV[i] == t[1] then stream = KEYS[i - LANES + 2] end
    end
  end
  if stream then
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(t, 2))
    redis.call('PUBLISH', arrivals, stream)
  else
    bad[#bad + 1] = entry
  end
  redis.call('ZREM', delayed, entry)
end
local nxt = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
return {nxt[2] or '', unpack(bad)}
"""

# KEYS: request streams of one shard (one hash tag), in the order to read them[, the
#       shard's loads hash (keys.loads) when balancing]
# ARGV: group, consumer, count, the hand-over consumer, wait ms (0: none)[, the consumer's
#       load (jobs it runs), balance ms, fresh ms, its turn ms (the time between its reads
#       while its engine steps)]
# Takes up to count entries for the consumer: from the first stream while it has some,
# then from the next; in a stream, first the entries of preempted jobs (pending to the
# hand-over consumer, oldest first: they keep their place), then new ones (XREADGROUP, as
# a worker's own read). One call instead of reads per lane. Returns {stream index
# (1-based), entry id, fields} for each entry, in order, and for a handed-over one its
# failed deliveries before (HAND_OVER) and the ms since it was handed over (its idle time)
# as a fourth and a fifth item. With wait ms (> 0), a stream is read only while its oldest
# waiting entry was added that long ago or more (by Redis's clock, which made the entry
# ids).
# Balancing: each consumer records "<load>:<ms>:<turn ms>" in the loads hash as it takes
# (its load counting the entries taken now). An entry is left to another consumer that
# runs fewer jobs and has not read since the entry was added (a read in the entry's own ms
# counts as before it), while that one is due to read again (within two of its turns,
# plus 20 ms, of its last read), and at most balance ms: a busier worker takes what a less
# loaded one did not want at its next read, as a router's request would wait for that
# engine's next step. Records older than fresh ms are dropped (a worker that stopped, or
# one that reads nothing while its engine is full).
TAKE = """
local group, consumer, count, handed = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local wait = tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = nil  -- with a wait: the newest entry time (ms) that may be taken
if wait > 0 then cutoff = now - wait end
local streams, loads, mine, least, young = #KEYS, nil, 0, nil, nil
local others = {}  -- {load, last read ms} of the other consumers due to read again
if ARGV[6] then
  streams, loads, mine = #KEYS - 1, KEYS[#KEYS], tonumber(ARGV[6])
  young = now - tonumber(ARGV[7])  -- entries added after this may be left to another
  local fresh, all = tonumber(ARGV[8]), redis.call('HGETALL', KEYS[#KEYS])
  for k = 1, #all, 2 do
    if all[k] ~= consumer then
      local load, at, turn = string.match(all[k + 1], '^(%d+):(%d+):?(%d*)$')
      if load and now - tonumber(at) <= fresh then
        load, at = tonumber(load), tonumber(at)
        if now <= at + 2 * (tonumber(turn) or 0) + 20 then
          others[#others + 1] = {load, at}
          if least == nil or load < least then least = load end
        end
      else
        redis.call('HDEL', loads, all[k])
      end
    end
  end
end
local function added_ms(id) return tonumber(string.match(id, '^(%d+)')) end
-- whether an entry may be taken now: waited long enough, and not left to a less loaded one
local function may(id)
  local at = added_ms(id)
  if cutoff and at > cutoff then return false end
  if young == nil or at <= young then return true end
  for _, o in ipairs(others) do
    if o[1] < mine and o[2] <= at then return false end
  end
  return true
end
-- the id of the last entry delivered to the group
local function last_delivered(stream)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
    if info['name'] == group then return info['last-delivered-id'] end
  end
  return nil
end
local out = {}
for i = 1, streams do
  local stream = KEYS[i]
  local pending = redis.call('XPENDING', stream, group, '-', '+', count - #out, handed)
  for _, p in ipairs(pending) do
    if not may(p[1]) then break end
    local c = redis.call('XCLAIM', stream, group, consumer, 0, p[1])
    if c[1] and c[1][2] then
      out[#out + 1] = {i, c[1][1], c[1][2], p[4], p[3]}
      mine = mine + 1
    else  -- deleted since: nothing to run
      redis.call('XACK', stream, group, p[1])
    end
  end
  local left = count - #out
  if left <= 0 then break end
  if cutoff or (least ~= nil and mine + left - 1 > least) then
    -- as many new entries as may be taken: entries handed over were delivered before any
    -- new one, and the new ones are in the order they were added
    local last, n = last_delivered(stream), 0
    if last then
      for _, e in ipairs(redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', left)) do
        if not may(e[1]) then break end
        n, mine = n + 1, mine + 1
      end
    end
    mine = mine - n
    left = n
  end
  if left > 0 then
    local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', left,
                           'STREAMS', stream, '>')
    if got then
      for _, e in ipairs(got[1][2]) do
        out[#out + 1] = {i, e[1], e[2]}
        mine = mine + 1
      end
    end
  end
end
if loads then
  redis.call('HSET', loads, consumer, mine .. ':' .. now .. ':' .. tonumber(ARGV[9] or 0))
  redis.call('PEXPIRE', loads, tonumber(ARGV[8]) * 10)
end
return out
"""

# KEYS: job record, token stream, progress
# ARGV: worker id, now ms, ttl, deadline ms or '', lane, priority, metadata JSON or '',
#       the progress header of the worker's model, the largest progress the job can have,
#       the job's tenant
# The record's `resumed_bytes` is the size of the progress this run starts from (0: from the
# first token): a reclaim compares it with the progress then, to tell a run that advanced.
# Returns 'run' ({'run', progress} where the job resumes from progress: results/progress.py;
# its stream then gets no reset), or why not: 'done' (a final result exists: only ack the entry),
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
local record, stream, progress = KEYS[1], KEYS[2], KEYS[3]
local worker, now_ms, ttl, deadline_ms, lane, priority, metadata, head, limit, tenant =
  unpack(ARGV, 1, 10)
local rt = redis.call('TYPE', record).ok
local st = redis.call('TYPE', stream).ok
if (rt ~= 'hash' and rt ~= 'none') or (st ~= 'stream' and st ~= 'none') then
  return 'badkey'
end
if redis.call('HEXISTS', record, 'final') == 1 then return 'done' end
if redis.call('HEXISTS', record, 'cancel') == 1 then return 'cancelled' end
if deadline_ms ~= '' and tonumber(now_ms) > tonumber(deadline_ms) then return 'expired' end
-- progress of this model, of a size the job can have made: the job resumes from it and
-- its stream goes on; anything else is dropped and the stream reset
local saved = false
local pt = redis.call('TYPE', progress).ok
if pt == 'string' and redis.call('STRLEN', progress) <= tonumber(limit)
   and redis.call('GETRANGE', progress, 0, #head - 1) == head then
  saved = redis.call('GET', progress)
elseif pt ~= 'none' then
  redis.call('DEL', progress)
end
if st == 'stream' and not saved then
  redis.pcall('XADD', stream, '*', 'type', 'reset')
end
local added = redis.pcall('XADD', stream, '*', 'type', 'start', 'worker', worker)
if full(added) then return redis.error_reply(OOM) end
if type(added) == 'table' and added.err then return 'badkey' end
redis.call('EXPIRE', stream, ttl)
redis.call('HSET', record, 'state', 'running', 'worker', worker, 'started_ms', now_ms,
           'lane', lane, 'priority', priority, 'tenant', tenant,
           'resumed_bytes', saved and #saved or 0)
if metadata ~= '' then redis.call('HSETNX', record, 'metadata', metadata) end
redis.call('EXPIRE', record, ttl)
if saved then return {'run', saved} end
return 'run'
"""
)

# KEYS: job record, token stream, progress, for each delta in turn
# ARGV: worker id, stream maxlen, progress ttl, then for each delta: mode ('d': one delta,
#       of one or more tokens; 'r': a reset, then the whole text so far as one delta; 'n':
#       nothing to the stream, a job that does not stream), text, token_ids JSON, choice
#       index ('' for a job of n 1: no index field), progress ('a': append the chunk; 's':
#       set the whole progress, header first), its bytes
# One call writes every delta of an engine step (a job's tokens are held back and written
# together: gpu_workers/job.py; a job of n > 1 choices has a delta per choice), and each
# job's progress with its deltas, so that the stream and the progress hold the same
# tokens. A job is written only while its record names this worker and holds no final
# result, so a worker whose job was taken over (or already finished elsewhere) never mixes
# its tokens into the new run's.
# Returns how many deltas were written; Redis's OOM error when it is full (then nothing was
# written for that job nor the ones after it: see BEGIN).
DELTAS = (
    _OOM
    + """
local worker, maxlen, ttl = ARGV[1], ARGV[2], ARGV[3]
local JOBS = 4  -- ARGV[4..]: mode, text, token_ids, index, progress mode, progress of each
local n = 0
for i = 1, #KEYS, 3 do
  local record, stream, progress = KEYS[i], KEYS[i + 1], KEYS[i + 2]
  local a = JOBS + 6 * (i - 1) / 3
  local mode, text, ids, index, pmode, saved = unpack(ARGV, a, a + 5)
  local rec = redis.pcall('HMGET', record, 'worker', 'final')
  if type(rec) == 'table' and rec.err == nil and rec[1] == worker and not rec[2] then
    -- the progress first: a full Redis refuses a script's first write, and then nothing
    -- of this job is written (the stream never gets ahead of the progress)
    local x
    if pmode == 's' then
      x = redis.pcall('SET', progress, saved, 'EX', ttl)
    elseif saved ~= '' then
      x = redis.pcall('APPEND', progress, saved)
    end
    if full(x) then return redis.error_reply(OOM) end
    -- a key of another type refuses the writes (pcall: an error table, not a reply)
    local ok = type(x) ~= 'table' or x.err == nil
    if ok and mode == 'r' then
      x = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'type', 'reset')
      if full(x) then return redis.error_reply(OOM) end
      ok = type(x) == 'string'
    end
    if ok and mode ~= 'n' then
      local entry = {'type', 'delta', 'text', text, 'token_ids', ids}
      if index ~= '' then entry[#entry + 1] = 'index'; entry[#entry + 1] = index end
      x = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(entry))
      if full(x) then return redis.error_reply(OOM) end
      ok = type(x) == 'string'
    end
    if ok then n = n + 1 end
  end
end
return n
"""
)

# KEYS: job record, token stream, progress[, request stream]
# ARGV: ttl, done channel, state, finish_reason, stream ttl, stream maxlen, resync ('1':
#       write a reset and the whole text before the end entry; '': only when deltas may be
#       missing (the record does not name the result's worker) or may be stale (the stream
#       exists and the result has no text); 'n': never, a job without deltas), group and
#       entry id of the job's request entry (or ''), then record field/value pairs (with
#       text, token_ids and worker; a job of n > 1 choices has them all in `choices`
#       (JSON), and its whole text is one delta per choice)
# Writes the final result only if none exists (HSETNX on 'final'), so a second run of the
# same job can never overwrite the first result. With the request stream (a single Redis:
# its keys and the job's on one server), then acks and deletes the job's request entry,
# in the same step as its result; on a Cluster (another slot) the worker acks it once this
# call's reply is back (results/jobs.py, acks).
# Returns 1 (stored), 0 (a result existed) or -1 (the record is not a hash: no result can
# be written, nothing is acked; the worker dead-letters the job).
FINALIZE = """
local record, stream, progress, requests = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ttl, channel, state, finish_reason, stream_ttl, maxlen, resync, group, entry_id =
  unpack(ARGV, 1, 9)
local FIELDS = 10  -- ARGV[10..]: the record's field/value pairs
local rt = redis.call('TYPE', record).ok
if rt ~= 'hash' and rt ~= 'none' then return -1 end
local stored = redis.call('HSETNX', record, 'final', '1')
if stored == 1 then
  local owner = redis.call('HGET', record, 'worker')
  local text, ids, worker, choices = '', '[]', '', nil
  for i = FIELDS, #ARGV - 1, 2 do
    if ARGV[i] == 'text' then text = ARGV[i + 1] end
    if ARGV[i] == 'token_ids' then ids = ARGV[i + 1] end
    if ARGV[i] == 'worker' then worker = ARGV[i + 1] end
    if ARGV[i] == 'choices' then choices = cjson.decode(ARGV[i + 1]) end
  end
  -- the deltas that spell the whole result: its text, or each choice's
  local whole = {{'text', text, 'token_ids', ids}}
  local said = text ~= ''
  if choices then
    whole = {}
    for _, c in ipairs(choices) do
      local cids = '[]'  -- cjson writes an empty list as {}
      if #c.token_ids > 0 then cids = cjson.encode(c.token_ids) end
      whole[#whole + 1] = {'text', c.text, 'token_ids', cids, 'index', tostring(c.index)}
      said = said or c.text ~= ''
    end
  end
  redis.call('HSET', record, 'state', state, 'finish_reason', finish_reason,
             unpack(ARGV, FIELDS))
  redis.call('EXPIRE', record, ttl)
  local st = redis.call('TYPE', stream).ok
  if st == 'stream' or st == 'none' then
    local stale = st == 'stream' and not said
    if resync == '1' or (resync == '' and ((said and owner ~= worker) or stale)) then
      redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'type', 'reset')
      for _, delta in ipairs(whole) do
        redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'type', 'delta',
                    unpack(delta))
      end
    end
    redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'type', 'end',
                'state', state, 'finish_reason', finish_reason)
    redis.call('EXPIRE', stream, stream_ttl)
  end
  redis.call('PUBLISH', channel, state)
end
redis.call('DEL', progress)
if requests then  -- pcall: a request stream of another type must not fail a stored result
  redis.pcall('XACK', requests, group, entry_id)
  redis.pcall('XDEL', requests, entry_id)
end
return stored
"""

# KEYS: job record, token stream, progress
# ARGV: ttl, done channel, cancel channel, job id, now ms, stream ttl
# A queued (or unknown) job is cancelled at once; the worker that later reads its entry
# only acks it. A running job is flagged and its worker told on the cancel channel. The
# token stream of a job cancelled here expires as a finished job's does (stream ttl), not
# with its record.
# Returns the state after the call: 'cancelled', 'cancelling', or the final state it had.
CANCEL = """
local record, stream, progress = KEYS[1], KEYS[2], KEYS[3]
local ttl, done_channel, cancel_channel, job_id, now_ms, stream_ttl = unpack(ARGV, 1, 6)
if redis.call('HEXISTS', record, 'final') == 1 then
  return redis.call('HGET', record, 'state')
end
redis.call('HSET', record, 'cancel', '1')
if redis.call('HGET', record, 'state') == 'running' then
  redis.call('PUBLISH', cancel_channel, job_id)
  return 'cancelling'
end
redis.call('HSET', record, 'final', '1', 'state', 'cancelled', 'finish_reason', 'abort',
           'finished_ms', now_ms)
redis.call('EXPIRE', record, ttl)
if redis.call('TYPE', stream).ok == 'stream' then  -- deltas of a run handed back: void
  redis.pcall('XADD', stream, '*', 'type', 'reset')
end
redis.pcall('XADD', stream, '*', 'type', 'end', 'state', 'cancelled', 'finish_reason', 'abort')
redis.call('EXPIRE', stream, stream_ttl)
redis.call('DEL', progress)
redis.call('PUBLISH', done_channel, 'cancelled')
return 'cancelled'
"""

# Handing a job back is two calls: RELEASE (the job's slot), then REQUEUE (the queue's).

# KEYS: job record
# Marks the job queued again, unless a final result exists. Returns 1 when the job is to
# be re-added (a record of another type too: the next worker to take it reports
# bad_record), 0 when it has a result (its entry is only acked).
RELEASE = """
local record = KEYS[1]
local rt = redis.call('TYPE', record).ok
if rt ~= 'hash' and rt ~= 'none' then return 1 end
if redis.call('HEXISTS', record, 'final') == 1 then return 0 end
redis.call('HSET', record, 'state', 'queued')
redis.call('HDEL', record, 'worker', 'started_ms')
return 1
"""

# KEYS: request stream[, the shard's delayed set]
# ARGV: group, entry id, maxlen, re-add ('1' or ''), lane, not before (unix ms, or '': at
#       once), then the entry's field/value pairs
# Re-adds the entry at the tail of its lane (when told to), or with a time (a job's retry
# backoff) to the delayed set, to be moved to its lane then (DUE), then acks and deletes
# the old one; only while the old one is pending: a second run of the same call (a client library
# retrying after a reply it lost) finds it acked and adds nothing, so the job is queued
# once. The XADD comes first so that a Redis at maxmemory, which refuses it, aborts the
# script before the ack: the entry stays pending (reclaimed later), never lost.
# Returns 1 when the entry was re-added, else 0.
REQUEUE = """
local stream, delayed = KEYS[1], KEYS[2]
local group, entry_id, maxlen, again, lane, not_before = unpack(ARGV, 1, 6)
local ENTRY = 7  -- ARGV[7..]: the entry's field/value pairs
if #redis.call('XPENDING', stream, group, entry_id, entry_id, 1) == 0 then return 0 end
if again == '1' and not_before ~= '' then
  redis.call('ZADD', delayed, not_before, cmsgpack.pack({lane, unpack(ARGV, ENTRY)}))
elseif again == '1' then
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, ENTRY))
end
redis.call('XACK', stream, group, entry_id)
redis.call('XDEL', stream, entry_id)
return again == '1' and 1 or 0
"""

# KEYS: dead-letter stream, job record, token stream, progress, request stream
# ARGV: dead entry id, QUEUED's eight (record ttl, lane, priority, created_ms, metadata JSON
#       or '', model, queued_us, ''), maxlen, max queued (0: no limit), group, arrivals
#       channel, then the entry's field/value pairs.
# An operator's requeue of a dead-lettered job (`plurai dead-letters requeue`): its entry
# is added to its lane again and its record, token stream and progress start over, as a
# new submit of the same job id would have them; the dead letter is deleted. One step, so
# that a job is never left with a queued record and no entry, or an entry and a result.
# Returns 1; 'GONE' when the dead letter is not there (requeued or dropped already),
# 'ACTIVE' when the job has a record that is not final (it is queued or runs: nothing to
# do), or the error QUEUEFULL as a submit.
REVIVE = (
    _LANE
    + """
local dead, record, out, progress, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local dead_id = ARGV[1]
local ttl, lane, priority, created_ms, metadata, model, queued_us = unpack(ARGV, 2, 8)
local maxlen, max_queued, group, arrivals = unpack(ARGV, 10, 13)
local ENTRY = 14  -- ARGV[14..]: the entry's field/value pairs
if #redis.call('XRANGE', dead, dead_id, dead_id) == 0 then return 'GONE' end
if redis.call('TYPE', record).ok == 'hash' and redis.call('HEXISTS', record, 'final') == 0 then
  return 'ACTIVE'
end
local queued = queued_over(stream, tonumber(max_queued), group)
if queued then return redis.error_reply('QUEUEFULL ' .. queued) end
redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, ENTRY))
redis.call('DEL', record, out, progress)
redis.call('HSET', record, 'state', 'queued', 'lane', lane, 'priority', priority,
           'created_ms', created_ms, 'model', model, 'queued_us', queued_us)
if metadata ~= '' then redis.call('HSET', record, 'metadata', metadata) end
redis.call('EXPIRE', record, ttl)
redis.call('XDEL', dead, dead_id)
redis.call('PUBLISH', arrivals, stream)
return 1
"""
)

# KEYS: request stream
# ARGV: group, then entry ids
# A purge's second step, once the entries' jobs are cancelled (`plurai lane purge`): deletes
# those of the entries no consumer of the group has read yet (after its last-delivered id;
# every one when there is no group yet), so the lane's depth drops at once. An entry read
# meanwhile stays for its worker, which answers it (its job is cancelled), so no delivered
# entry is ever deleted under a worker. Returns how many were deleted.
UNQUEUE = """
local stream, group = KEYS[1], ARGV[1]
local FIRST = 2  -- ARGV[2..]: entry ids
local groups = redis.pcall('XINFO', 'GROUPS', stream)
if groups.err then return 0 end  -- no such stream any more
local last = nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == group then last = info['last-delivered-id'] end
end
local function after(id, base)  -- whether stream id `id` comes after `base`
  local a, b = string.match(id, '^(%d+)-(%d+)$')
  local c, d = string.match(base, '^(%d+)-(%d+)$')
  if a == nil or c == nil then return false end
  a, b, c, d = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
  return a > c or (a == c and b > d)
end
local n = 0
for i = FIRST, #ARGV do
  if last == nil or after(ARGV[i], last) then n = n + redis.call('XDEL', stream, ARGV[i]) end
end
return n
"""

# KEYS: request stream
# ARGV: group, consumer, entry id, the hand-over consumer, re-add ('1' or '')
# A preempted job's entry keeps its place: it moves from `consumer` to the hand-over
# consumer, its delivery count set to the failed deliveries before this one (none for the
# preemption), and the next worker to take from its lane (TAKE) takes it before the newer
# entries, with no attempt charged. Only while `consumer` owns it: one
# reclaimed by another worker is theirs. When RELEASE found a result (re-add ''), the entry
# is acked and deleted instead. Returns 1 when handed over, else 0.
HAND_OVER = """
local stream = KEYS[1]
local group, consumer, entry_id, to, again = unpack(ARGV, 1, 5)
local p = redis.call('XPENDING', stream, group, entry_id, entry_id, 1)
if #p == 0 or p[1][2] ~= consumer then return 0 end
if again ~= '1' then
  redis.call('XACK', stream, group, entry_id)
  redis.call('XDEL', stream, entry_id)
  return 0
end
-- the deliveries before this worker's ended without a result: failures, kept in the count
redis.call('XCLAIM', stream, group, to, 0, entry_id, 'RETRYCOUNT', p[1][4] - 1, 'JUSTID')
return 1
"""

# KEYS: job record, progress
# Whether the job's progress grew since its last run began (the record's resumed_bytes, set
# by BEGIN): 1, and the size now noted as the new start, so that one advance is counted
# once; else 0. A reclaim asks it of the run whose worker died or stalled.
ADVANCED = """
local record, progress = KEYS[1], KEYS[2]
if redis.call('TYPE', record).ok ~= 'hash' then return 0 end
local now = 0
if redis.call('TYPE', progress).ok == 'string' then now = redis.call('STRLEN', progress) end
local was = tonumber(redis.call('HGET', record, 'resumed_bytes') or '0') or 0
if now <= was then return 0 end
redis.call('HSET', record, 'resumed_bytes', now)
return 1
"""

# KEYS: request stream
# ARGV: group, consumer, then entry ids
# Renews the lease on the entries this consumer still owns (XCLAIM JUSTID resets their idle
# time, not their delivery count) and returns the ids another consumer owns now: it
# reclaimed them while this one stalled. Entries pending to nobody (deleted or trimmed by
# hand) are left alone: their job runs on and its result is stored as usual.
RENEW = """
local stream = KEYS[1]
local group, consumer = ARGV[1], ARGV[2]
local IDS = 3  -- ARGV[3..]: the entry ids
local lost = {}
for i = IDS, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p == 1 and p[1][2] == consumer then
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
  elseif #p == 1 then
    lost[#lost + 1] = id
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
local lines, batch = KEYS[1], KEYS[2]
local index, line, ok, prompt_tokens, output_tokens, now_ms, ttl = unpack(ARGV, 1, 7)
if redis.call('HSETNX', lines, index, line) == 0 then return 0 end
redis.call('HINCRBY', batch, ok == '1' and 'completed' or 'failed', 1)
redis.call('HINCRBY', batch, 'prompt_tokens', prompt_tokens)
redis.call('HINCRBY', batch, 'output_tokens', output_tokens)
redis.call('HSET', batch, 'beat_ms', now_ms)
redis.call('EXPIRE', lines, ttl)
redis.call('EXPIRE', batch, ttl)
return 1
"""

# KEYS: batch record
# Returns the new generation, or false if there is no record (HINCRBY alone would create
# one, without a TTL).
BATCH_GEN = """
local batch = KEYS[1]
if redis.call('EXISTS', batch) == 0 then return false end
return redis.call('HINCRBY', batch, 'gen', 1)
"""

# KEYS: batch record
# ARGV: new status, then the statuses it may replace
# Returns the status after the call, or false if there is no record.
BATCH_MOVE = """
local batch = KEYS[1]
local status = ARGV[1]
local FROM = 2  -- ARGV[2..]: the statuses it may replace
local cur = redis.call('HGET', batch, 'status')
if not cur then return false end
for i = FROM, #ARGV do
  if cur == ARGV[i] then redis.call('HSET', batch, 'status', status) return status end
end
return cur
"""
