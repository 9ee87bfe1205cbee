"""The two Lua scripts of admission control; AdmissionControl runs them.

Each runs atomically inside Redis, so every gateway replica sees one ledger and
no request can slip between a check and its increment. Times are milliseconds
of the Redis clock (`TIME`), so skewed gateway clocks do not matter.

Limits use GCRA (the generic cell rate algorithm): per limit one key holds the
"theoretical arrival time" (TAT), the moment the tenant's budget would be full
again. A request costing `n` units, under a limit of `L` per `period`, moves
TAT to max(TAT, now) + n * period / L, and fits if that is at most
now + period. This is a sliding window without buckets: no double burst at a
minute boundary (the flaw of fixed windows), an exact Retry-After (the moment
the request would fit), one small key per limit, and returning unused tokens
is one subtraction from TAT.

Concurrency slots are members of a sorted set scored by their lease's expiry,
so a slot whose gateway died frees itself when the lease runs out.

Both may carry the request's timeline (an optional last key, in the tenant's slot,
and its fields as the last arguments; see timeline.TimelineWrite): ADMIT writes it
when it admits (arrival and admission, while the request runs), SETTLE always (the
end state), so a request's timeline costs no round trip of its own.
"""

from conveyor.gateway.tenancy.timeline import TIMELINE_LUA

ADMIT = TIMELINE_LUA + """
-- KEYS: 1 requests TAT, 2 tokens TAT, 3 concurrency ZSET, 4 reservation HASH,
--       5 (optional) the request's timeline HASH, written when admitted
-- ARGV: 1 request_id, 2 period_ms, 3 requests limit, 4 tokens limit,
--       5 concurrency limit (0 = unlimited for each), 6 token cost, 7 lease_ms,
--       8.. (with KEYS[5]) the timeline's ttl ms and fields (write_timeline)
-- Returns {status, refused_limit, retry_after_ms, req_remaining, req_reset_ms,
--          tok_remaining, tok_reset_ms, concurrent}; status 1 admitted, 0 refused,
--          -1 the token cost exceeds the whole budget, -2 request id already admitted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = tonumber(ARGV[2])
local req_limit, tok_limit, conc_limit = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cost, lease = tonumber(ARGV[6]), tonumber(ARGV[7])

local function tat_of(key)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then return now end
  return tat
end

-- new TAT after spending `amount`, and how long until that would be allowed
local function spend(tat, limit, amount)
  local new_tat = tat + amount * period / limit
  return new_tat, math.max(0, new_tat - period - now)
end

local function remaining(tat, limit)
  if limit == 0 then return -1 end
  return math.floor((period - (tat - now)) * limit / period + 1e-6)
end

local function reply(status, refused, retry, req_tat, tok_tat, concurrent)
  return {status, refused, math.ceil(retry), remaining(req_tat, req_limit),
          math.ceil(req_tat - now), remaining(tok_tat, tok_limit), math.ceil(tok_tat - now),
          concurrent}
end

local req_tat, tok_tat = tat_of(KEYS[1]), tat_of(KEYS[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local concurrent = redis.call('ZCARD', KEYS[3])
if redis.call('EXISTS', KEYS[4]) == 1 then
  return reply(-2, '', 0, req_tat, tok_tat, concurrent)
end
if tok_limit > 0 and cost > tok_limit then
  return reply(-1, 'tokens', 0, req_tat, tok_tat, concurrent)
end

local refused, retry = '', 0
local new_req_tat, new_tok_tat = req_tat, tok_tat
if req_limit > 0 then
  local wait
  new_req_tat, wait = spend(req_tat, req_limit, 1)
  if wait > retry then refused, retry = 'requests', wait end
end
if tok_limit > 0 then
  local wait
  new_tok_tat, wait = spend(tok_tat, tok_limit, cost)
  if wait > retry then refused, retry = 'tokens', wait end
end
if conc_limit > 0 and concurrent >= conc_limit and retry < 1000 then
  refused, retry = 'concurrency', 1000
end
if refused ~= '' then
  return reply(0, refused, retry, req_tat, tok_tat, concurrent)
end

local function store_tat(key, tat)
  redis.call('SET', key, string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
end
if req_limit > 0 then store_tat(KEYS[1], new_req_tat) end
if tok_limit > 0 then store_tat(KEYS[2], new_tok_tat) end
redis.call('ZADD', KEYS[3], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[3], math.ceil(lease))
local tok_ms_per_token = 0
if tok_limit > 0 then tok_ms_per_token = period / tok_limit end
redis.call('HSET', KEYS[4], 'tokens', cost, 'ms_per_token', string.format('%.9f', tok_ms_per_token))
redis.call('PEXPIRE', KEYS[4], math.ceil(lease))
if KEYS[5] then write_timeline(KEYS[5], ARGV, 8) end
return reply(1, '', 0, new_req_tat, new_tok_tat, concurrent + 1)
"""

SETTLE = TIMELINE_LUA + """
-- KEYS: 1 tokens TAT, 2 concurrency ZSET, 3 reservation HASH,
--       4 (optional) the request's timeline HASH, written in any case
-- ARGV: 1 request_id, 2 tokens to return (capped at what was reserved)
-- ARGV: 3 lease_ms (how long a settled-before-admitted tombstone is kept)
-- ARGV: 4.. (with KEYS[4]) the timeline's ttl ms and fields (write_timeline)
-- Returns the tokens returned, or -1 if there was nothing to settle (already
-- settled, never admitted, or the reservation's lease ran out). Settling an id that is
-- not admitted leaves a tombstone (a reservation hash of 0 tokens with the lease's
-- expiry), so an ADMIT of that id that arrives later (its reply lost to a cancellation,
-- the command still on the wire) is refused as a duplicate instead of leaking a slot.
if KEYS[4] then write_timeline(KEYS[4], ARGV, 4) end
local reserved = tonumber(redis.call('HGET', KEYS[3], 'tokens') or '-1')
if reserved < 0 or redis.call('HGET', KEYS[3], 'settled') then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HSET', KEYS[3], 'tokens', 0, 'ms_per_token', 0, 'settled', 1)
  redis.call('PEXPIRE', KEYS[3], math.ceil(tonumber(ARGV[3])))
  return -1
end
local ms_per_token = tonumber(redis.call('HGET', KEYS[3], 'ms_per_token'))
local unused = math.max(0, math.min(tonumber(ARGV[2]), reserved))
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[2], ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if ms_per_token == 0 or unused == 0 or tat == 0 then return unused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local new_tat = tat - unused * ms_per_token
if new_tat <= now then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], string.format('%.3f', new_tat), 'PX', math.ceil(new_tat - now) + 1000)
end
return unused
"""
