-- progress.lua: record the prefix one rank confirmed loaded and pinned so far.
-- KEYS[1] lookup hash   KEYS[2] (optional) the rank's lease key
-- ARGV: rank, gen, tokens, then with KEYS[2] the rank's fencing token. Built by
-- progress_call (protocol/scripts.py); the hash's fields are named in protocol/lookup_hash.py.
-- Returns: recorded | behind (not above what the rank confirmed before) | reported
--          (the rank's final report is in) | settled (answered already) | dropped
--          (no key) | stale (another generation) | unknown_rank | invalid | fenced
-- Monotone and idempotent: a re-sent or reordered progress report never lowers the
-- value; it never creates the key, so nothing is resurrected.
-- Fenced as report.lua: with KEYS[2] (the rank's lease key) and ARGV[4] (its token),
-- nothing is recorded unless the lease holds that token.
if KEYS[2] then
  local lease = redis.call('GET', KEYS[2])
  if not lease or string.sub(lease, 1, #ARGV[4] + 1) ~= ARGV[4] .. ' ' then
    return 'fenced'
  end
end
local st = redis.call('HMGET', KEYS[1], 'state', 'gen', 'expected', 'tokens')
if not st[1] then return 'dropped' end
if st[2] ~= ARGV[2] then return 'stale' end
if st[1] ~= 'pending' then return 'settled' end
local known = false
for r in string.gmatch(st[3], '[^,]+') do
  if r == ARGV[1] then known = true end
end
if not known then return 'unknown_rank' end
local tokens = tonumber(ARGV[3])
if tokens == nil or tokens < 0 or tokens > tonumber(st[4]) or tokens ~= math.floor(tokens) then
  return 'invalid'
end
if redis.call('HEXISTS', KEYS[1], 'r' .. ARGV[1]) == 1 then return 'reported' end
local before = tonumber(redis.call('HGET', KEYS[1], 'p' .. ARGV[1]) or '-1')
if tokens <= before then return 'behind' end
redis.call('HSET', KEYS[1], 'p' .. ARGV[1], ARGV[3])
return 'recorded'
