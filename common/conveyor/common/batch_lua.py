"""The Lua scripts that move a batch between statuses and record its lines.

Each runs atomically in Redis, so a status check and the write it guards can
never interleave with another worker's or gateway's.
"""

TRANSITION = """
-- KEYS: batch hash, stats hash. ARGV: allowed from-statuses (comma list), to-status,
-- its timestamp field, now, then field/value pairs to set as well.
-- Returns {1, to} when moved, {0, current status or ''} when not.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, ''} end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == status then allowed = true end
end
if not allowed then return {0, status} end
redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[3], ARGV[4])
for i = 5, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HINCRBY', KEYS[2], 'status:' .. status, -1)
redis.call('HINCRBY', KEYS[2], 'status:' .. ARGV[2], 1)
return {1, ARGV[2]}
"""

RECORD_LINE = """
-- KEYS: batch hash, results hash, stats hash.
-- ARGV: line index, result JSON, ok (1/0), input tokens, output tokens, cached tokens, now.
-- Returns -1 (batch not in progress: nothing written), 0 (line already written),
-- 1 (written), 2 (written, and it was the last line: the batch is now finalizing).
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
local outcome = (ARGV[3] == '1') and 'completed' or 'failed'
redis.call('HINCRBY', KEYS[1], outcome, 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[3], 'lines:' .. outcome, 1)
local done = tonumber(redis.call('HGET', KEYS[1], 'completed') or '0')
  + tonumber(redis.call('HGET', KEYS[1], 'failed') or '0')
if done < tonumber(redis.call('HGET', KEYS[1], 'total')) then return 1 end
redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[7],
           'ending', 'completed')
redis.call('HINCRBY', KEYS[3], 'status:in_progress', -1)
redis.call('HINCRBY', KEYS[3], 'status:finalizing', 1)
return 2
"""
