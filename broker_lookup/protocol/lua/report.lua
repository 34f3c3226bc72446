-- report.lua: record one rank's hit count; the last expected rank completes the lookup.
-- KEYS[1] lookup hash   KEYS[2] done stream
-- The hash's fields are named in protocol/lookup_hash.py.
-- ARGV: rank, gen, hits, done maxlen, lookup id, ttl ms once done, done stream ttl ms,
--       and the rank's lease token when fenced (below)
-- With a submitted_us stamp (submit.lua, rank_insights on) it also records l<rank>, the
-- µs from the submit to this report on the server's clock, and the done entry carries
-- ranks (the expected list), hits and lat (per rank in that order; lat empty where a
-- rank has no stamp) and last (the rank that completed it). Without a stamp the entry
-- is id, gen, result only.
-- Returns: complete | recorded | dropped (no key: cancelled, timed out, expired)
--          | stale (another generation) | duplicate (rank already reported)
--          | settled:<n> (deadline.lua answered it <n> tokens at its deadline: nothing
--            changes; the rank keeps at most that prefix pinned, as was promised)
--          | unknown_rank | invalid (hits not in 0..tokens)
-- Never creates the key, so a late report cannot resurrect a lookup without a TTL.
-- Each command a script calls costs the server 1-3 µs, several times the Lua around it; every
-- rank runs this once per lookup: a report that does not complete the lookup makes
-- three (HMGET, TIME, HSET), the completing one seven. The script runs atomically, so
-- reading this rank's field in the first HMGET is as good as an HSETNX.
-- Fencing (one owner per rank): with KEYS[3] (the rank's lease key, owner:<r>) and
-- ARGV[8] (the token the rank holds), nothing is recorded unless the lease holds that
-- token, so an old owner that was paused or cut off while another took over changes
-- nothing: returns 'fenced'. One GET more per report. The rank always passes both
-- (report_call's fence); without them the script is unfenced, as the tests of the
-- other rules call it.
if KEYS[3] then
  local lease = redis.call('GET', KEYS[3])
  if not lease or string.sub(lease, 1, #ARGV[8] + 1) ~= ARGV[8] .. ' ' then
    return 'fenced'
  end
end
local own = 'r' .. ARGV[1]
local st = redis.call('HMGET', KEYS[1], 'state', 'gen', 'expected', 'tokens', 'submitted_us',
                      own)
if not st[1] then return 'dropped' end
if st[2] ~= ARGV[2] then return 'stale' end
local ranks = {}
local known = false
for r in string.gmatch(st[3], '[^,]+') do
  ranks[#ranks + 1] = r
  if r == ARGV[1] then known = true end
end
if not known then return 'unknown_rank' end
local hits = tonumber(ARGV[3])
if hits == nil or hits < 0 or hits > tonumber(st[4]) or hits ~= math.floor(hits) then
  return 'invalid'
end
if st[6] then return 'duplicate' end
if st[1] ~= 'pending' then
  -- A partial answer decided it: a late report must not complete it again.
  return 'settled:' .. (redis.call('HGET', KEYS[1], 'result') or '0')
end
local stamp = st[5]
local sec, us
if stamp then
  sec = tonumber(string.sub(stamp, 1, -7))
  us = tonumber(string.sub(stamp, -6))
end
if sec and us then
  -- Integer arithmetic on seconds and micros apart: no double ever holds the epoch µs.
  local t = redis.call('TIME')
  local elapsed = (tonumber(t[1]) - sec) * 1000000 + (tonumber(t[2]) - us)
  if elapsed < 0 then elapsed = 0 end  -- the server's clock stepped back
  redis.call('HSET', KEYS[1], own, ARGV[3], 'l' .. ARGV[1], string.format('%d', elapsed))
else
  stamp = nil
  redis.call('HSET', KEYS[1], own, ARGV[3])
end
local names = {}
for i = 1, #ranks do names[i] = 'r' .. ranks[i] end
if stamp then
  for i = 1, #ranks do names[#ranks + i] = 'l' .. ranks[i] end
end
local got = redis.call('HMGET', KEYS[1], unpack(names))
local min = nil
for i = 1, #ranks do
  local v = tonumber(got[i])
  if not v then return 'recorded' end
  if min == nil or v < min then min = v end
end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', min)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
if stamp then
  local seen = {}
  local lat = {}
  for i = 1, #ranks do
    seen[i] = got[i]
    lat[i] = got[#ranks + i] or ''
  end
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'id', ARGV[5], 'gen', ARGV[2],
             'result', min, 'last', ARGV[1], 'ranks', st[3], 'hits', table.concat(seen, ','),
             'lat', table.concat(lat, ','))
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'id', ARGV[5], 'gen', ARGV[2],
             'result', min)
end
redis.call('PEXPIRE', KEYS[2], ARGV[7])  -- the XADD may have created the stream
return 'complete'
