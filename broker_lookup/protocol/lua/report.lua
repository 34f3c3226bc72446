-- report.lua: record one rank's hit count; the last expected rank completes the lookup.
-- KEYS[1] lookup hash   KEYS[2] done stream
-- The hash's fields are named in protocol/lookup_hash.py.
-- ARGV: rank, gen, hits, done maxlen, lookup id, ttl ms once done
-- Returns: complete | recorded | dropped (no key: cancelled, timed out, expired)
--          | stale (another generation) | duplicate (rank already reported)
--          | settled (deadline.lua answered it at its deadline: nothing changes)
--          | unknown_rank | invalid (hits not in 0..tokens)
-- Never creates the key, so a late report cannot resurrect a lookup without a TTL.
local st = redis.call('HMGET', KEYS[1], 'state', 'gen', 'expected', 'tokens')
if not st[1] then return 'dropped' end
if st[2] ~= ARGV[2] then return 'stale' end
local known = false
for r in string.gmatch(st[3], '[^,]+') do
  if r == ARGV[1] then known = true end
end
if not known then return 'unknown_rank' end
local hits = tonumber(ARGV[3])
if hits == nil or hits < 0 or hits > tonumber(st[4]) or hits ~= math.floor(hits) then
  return 'invalid'
end
if st[1] ~= 'pending' then
  if redis.call('HEXISTS', KEYS[1], 'r' .. ARGV[1]) == 1 then return 'duplicate' end
  return 'settled'  -- a partial answer decided it: a late report must not complete it again
end
if redis.call('HSETNX', KEYS[1], 'r' .. ARGV[1], ARGV[3]) == 0 then return 'duplicate' end
local min = nil
for r in string.gmatch(st[3], '[^,]+') do
  local v = redis.call('HGET', KEYS[1], 'r' .. r)
  if not v then return 'recorded' end
  v = tonumber(v)
  if min == nil or v < min then min = v end
end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', min)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'id', ARGV[5], 'gen', ARGV[2],
           'result', min)
return 'complete'
