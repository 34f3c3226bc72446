-- report.lua: record one rank's hit count; the last expected rank completes the lookup.
-- KEYS[1] lookup hash   KEYS[2] done stream
-- The hash's fields are named in protocol/lookup_hash.py.
-- ARGV: rank, gen, hits, done maxlen, lookup id, ttl ms once done, done stream ttl ms,
--       and the rank's lease token when fenced (below)
-- With a submitted_us stamp (submit.lua, rank_insights on) it also records l<rank>, the
-- µs from the submit to this report on the server's clock, and the done entry carries
-- ranks (the expected list), hits and lat (per rank in that order; lat empty where a
-- rank has no stamp) and last (the rank that completed it). Without a stamp the entry
-- is id, gen, result, as before.
-- Returns: complete | recorded | dropped (no key: cancelled, timed out, expired)
--          | stale (another generation) | duplicate (rank already reported)
--          | settled:<n> (deadline.lua answered it <n> tokens at its deadline: nothing
--            changes; the rank keeps at most that prefix pinned, as was promised)
--          | unknown_rank | invalid (hits not in 0..tokens)
-- Never creates the key, so a late report cannot resurrect a lookup without a TTL.
-- Each command a script calls costs the server 3-5 µs, several times the Lua around it, and
-- every rank runs this once per lookup: so one HGETALL reads everything a report decides on
-- (its own field, the other ranks' for the completion), a report that does not complete
-- the lookup makes two commands (HGETALL, HSET) and the completing one four (HGETALL, one
-- HSET for its hits and the answer, PEXPIRE, XADD); TIME only with a submitted_us stamp.
-- The script runs atomically, so reading this rank's field first is as good as an HSETNX.
-- The done stream's TTL is refreshed by every live process's beat (lifetime.py): only an
-- XADD that creates it sets it here.
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
local flat = redis.call('HGETALL', KEYS[1])
local h = {}
for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
if not h.state then return 'dropped' end
if h.gen ~= ARGV[2] then return 'stale' end
local ranks = {}
local known = false
for r in string.gmatch(h.expected, '[^,]+') do
  ranks[#ranks + 1] = r
  if r == ARGV[1] then known = true end
end
if not known then return 'unknown_rank' end
local hits = tonumber(ARGV[3])
if hits == nil or hits < 0 or hits > tonumber(h.tokens) or hits ~= math.floor(hits) then
  return 'invalid'
end
local own = 'r' .. ARGV[1]
if h[own] then return 'duplicate' end
if h.state ~= 'pending' then
  -- A partial answer decided it: a late report must not complete it again.
  return 'settled:' .. (h.result or '0')
end
h[own] = ARGV[3]
local min = nil
for i = 1, #ranks do
  local v = tonumber(h['r' .. ranks[i]])
  if not v then
    min = nil
    break
  end
  if min == nil or v < min then min = v end
end
local stamp = h.submitted_us
local sec, us
if stamp then
  sec = tonumber(string.sub(stamp, 1, -7))
  us = tonumber(string.sub(stamp, -6))
end
local timed = {own, ARGV[3]}
if sec and us then
  -- Integer arithmetic on seconds and micros apart: no double ever holds the epoch µs.
  local t = redis.call('TIME')
  local elapsed = (tonumber(t[1]) - sec) * 1000000 + (tonumber(t[2]) - us)
  if elapsed < 0 then elapsed = 0 end  -- the server's clock stepped back
  h['l' .. ARGV[1]] = string.format('%d', elapsed)
  timed = {own, ARGV[3], 'l' .. ARGV[1], h['l' .. ARGV[1]]}
else
  stamp = nil
end
if min == nil then
  redis.call('HSET', KEYS[1], unpack(timed))
  return 'recorded'
end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', min, unpack(timed))
redis.call('PEXPIRE', KEYS[1], ARGV[6])
local entry
if stamp then
  local seen = {}
  local lat = {}
  for i = 1, #ranks do
    seen[i] = h['r' .. ranks[i]]
    lat[i] = h['l' .. ranks[i]] or ''
  end
  entry = {'id', ARGV[5], 'gen', ARGV[2], 'result', min, 'last', ARGV[1], 'ranks', h.expected,
           'hits', table.concat(seen, ','), 'lat', table.concat(lat, ',')}
else
  entry = {'id', ARGV[5], 'gen', ARGV[2], 'result', min}
end
if not redis.call('XADD', KEYS[2], 'NOMKSTREAM', 'MAXLEN', '~', ARGV[4], '*', unpack(entry)) then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(entry))
  redis.call('PEXPIRE', KEYS[2], ARGV[7])  -- the XADD created the stream
end
return 'complete'
