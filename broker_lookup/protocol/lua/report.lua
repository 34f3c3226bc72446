-- report.lua: record one rank's hit count; the last expected rank completes the lookup.
-- KEYS[1] lookup hash   KEYS[2] done stream
-- The hash's fields are named in protocol/lookup_hash.py.
-- ARGV: rank, gen, hits, done maxlen, lookup id, (unused: was the hash's TTL once done),
--       done stream ttl ms, and the rank's lease token when fenced (below)
-- With a submitted_us stamp (submit.lua, rank_insights on) it also records l<rank>, the
-- µs from the submit to this report on the server's clock, and the done entry carries
-- ranks (the expected list), hits and lat (per rank in that order; lat empty where a
-- rank has no stamp) and last (the rank that completed it). Without a stamp the entry
-- is id, gen, result only.
-- The done entry (protocol/messages.py reads it): one per call that completed anything.
-- One completion is id, gen, result (and the insight fields), as above. A call that
-- completed n > 1 (a batch) writes n first, then the first completion's fields as they
-- are and each further one's with its index: id.1 gen.1 result.1 (last.1 ranks.1 hits.1
-- lat.1), id.2 ..., up to n-1. Per completion at most 7 pairs, and a rank's call is at
-- most 128 reports (workers/pipeline/reporter.py), so the entry stays far under unpack's
-- limit of about 8,000 values.
-- Returns: complete | recorded | dropped (no key: cancelled, timed out, expired)
--          | stale (another generation) | duplicate (rank already reported)
--          | settled:<n> (deadline.lua answered it <n> tokens at its deadline: nothing
--            changes; the rank keeps at most that prefix pinned, as was promised)
--          | unknown_rank | invalid (hits not in 0..tokens)
-- Never creates the key, so a late report cannot resurrect a lookup without a TTL.
-- Every rank runs this once per lookup, so a report spends as little as it can (in a
-- batch, about 7 µs of server CPU a report that does not complete: the HMGET 3, the HSET
-- 2, the Lua between them 1-2, the batch's own 1): one HMGET reads everything it decides
-- on, owed (reports still owed) and lowest (the fewest hits so far) among them (result
-- only on the rare settled path), so a report that does not complete the lookup makes two
-- commands (HMGET, HSET) and the completing one two as well (HMGET, one HSET for its hits
-- and the answer), plus the call's one XADD for everything it completed. TIME, and a
-- second read of the ranks' fields for the done entry, only with a submitted_us stamp
-- (rank_insights). A hash without owed (written by an older
-- submit.lua) is completed by reading the ranks' fields again after the HSET.
-- The script runs atomically, so reading this rank's field first is as good as an HSETNX.
-- The done stream's TTL is refreshed by every live process's beat (lifetime.py): only an
-- XADD that creates it sets it here.
-- Fencing (one owner per rank): with KEYS[3] (the rank's lease key, owner:<r>) and
-- ARGV[8] (the token the rank holds), nothing is recorded unless the lease holds that
-- token, so an old owner that was paused or cut off while another took over changes
-- nothing: returns 'fenced'. One GET more per report. The rank always passes both
-- (report_call's fence); without them the script is unfenced, as the tests of the
-- other rules call it.
-- A batch (ARGV[1] 'batch'): one call for every report a rank sends in one round trip,
-- so the fence is read once, not once per report.
--   KEYS: done stream, the lease key when fenced, then one lookup hash per report
--   ARGV: 'batch', rank, done maxlen, (unused), done stream ttl ms, the token (ignored
--         unfenced), then per report: gen, hits, lookup id
--   Returns one answer per report, in order (all 'fenced' when the lease is not held).
--   Every lookup the batch completes goes in one done entry (above): one XADD a batch,
--   none when it completed nothing (a retry after a lost reply, a fenced batch).
local batch = ARGV[1] == 'batch'
local rank, maxlen, stream_ttl, token, done, lease
if batch then
  rank, maxlen, stream_ttl, token = ARGV[2], ARGV[3], ARGV[5], ARGV[6]
  done = 1
  -- One key more than done + a hash per report is the lease (a token may be empty).
  if #KEYS == (#ARGV - 6) / 3 + 2 then lease = 2 end
else
  rank, maxlen, stream_ttl, token = ARGV[1], ARGV[4], ARGV[7], ARGV[8]
  done = 2
  if KEYS[3] then lease = 3 end
end

local function held()
  if not lease then return true end
  local holder = redis.call('GET', KEYS[lease])
  return holder and string.sub(holder, 1, #token + 1) == token .. ' '
end

-- The done entry of this call, published by one XADD at the end: 'n' and its count (left
-- out where it is one), then each completion's pairs, appended as it completes; n counts them.
local entry = {'n', 0}
local n = 0

-- Built once per call, not per report: the rank's field and its mark in ',0,1,2,'.
local own = 'r' .. rank
local mark = ',' .. rank .. ','

-- The expected ranks of 'expected' ("0,1,2"), as a list: only the paths that read every
-- rank's fields need it (a hash without owed, the done entry with a stamp).
local function listed(expected)
  local ranks = {}
  for r in string.gmatch(expected, '[^,]+') do ranks[#ranks + 1] = r end
  return ranks
end

-- One report: lookup hash KEYS[k], its generation, the hits (as sent) and the lookup id.
-- The Lua between the commands costs about as much as a command does, so the common path
-- builds no table and no closure: the rank is found in the list with one plain find.
local function report(k, gen, sent, lookup_id)
  local st = redis.call('HMGET', KEYS[k], 'state', 'gen', 'expected', 'tokens', 'submitted_us',
                        own, 'owed', 'lowest')
  if not st[1] then return 'dropped' end
  if st[2] ~= gen then return 'stale' end
  if not string.find(',' .. st[3] .. ',', mark, 1, true) then return 'unknown_rank' end
  local hits = tonumber(sent)
  if hits == nil or hits < 0 or hits > tonumber(st[4]) or hits ~= math.floor(hits) then
    return 'invalid'
  end
  if st[6] then return 'duplicate' end
  if st[1] ~= 'pending' then
    -- A partial answer decided it: a late report must not complete it again.
    return 'settled:' .. (redis.call('HGET', KEYS[k], 'result') or '0')
  end
  local stamp = st[5]
  local sec, us, lat, elapsed
  if stamp then
    sec = tonumber(string.sub(stamp, 1, -7))
    us = tonumber(string.sub(stamp, -6))
  end
  if sec and us then
    -- Integer arithmetic on seconds and micros apart: no double ever holds the epoch µs.
    local t = redis.call('TIME')
    local took = (tonumber(t[1]) - sec) * 1000000 + (tonumber(t[2]) - us)
    if took < 0 then took = 0 end  -- the server's clock stepped back
    lat, elapsed = 'l' .. rank, string.format('%d', took)
  else
    stamp = nil
  end
  local owed = tonumber(st[7])
  local lowest = tonumber(st[8])
  local min
  if owed and lowest then
    owed = owed - 1
    if hits < lowest then lowest = hits end
    if owed > 0 then
      if lat then
        redis.call('HSET', KEYS[k], 'owed', owed, 'lowest', lowest, own, sent, lat, elapsed)
      else
        redis.call('HSET', KEYS[k], 'owed', owed, 'lowest', lowest, own, sent)
      end
      return 'recorded'
    end
    min = lowest
    if lat then
      redis.call('HSET', KEYS[k], 'state', 'done', 'result', min, 'owed', 0, 'lowest', min,
                 own, sent, lat, elapsed)
    else
      redis.call('HSET', KEYS[k], 'state', 'done', 'result', min, 'owed', 0, 'lowest', min,
                 own, sent)
    end
  else
    if lat then
      redis.call('HSET', KEYS[k], own, sent, lat, elapsed)
    else
      redis.call('HSET', KEYS[k], own, sent)
    end
    local ranks = listed(st[3])
    local names = {}
    for i = 1, #ranks do names[i] = 'r' .. ranks[i] end
    local got = redis.call('HMGET', KEYS[k], unpack(names))
    for i = 1, #ranks do
      local v = tonumber(got[i])
      if not v then return 'recorded' end
      if min == nil or v < min then min = v end
    end
    redis.call('HSET', KEYS[k], 'state', 'done', 'result', min)
  end
  -- No PEXPIRE of the hash here: submit.lua gave it its TTL (the deadline plus
  -- key_grace_ms), which every command since kept, and nothing that reads it once done
  -- (the client's reconcile, a retried report, deadline.lua) needs it longer or shorter.
  -- The first completion's names are bare, a further one's carry its index (header).
  local sfx = ''
  if n > 0 then sfx = '.' .. n end
  n = n + 1
  local e = #entry
  entry[e + 1], entry[e + 2] = 'id' .. sfx, lookup_id
  entry[e + 3], entry[e + 4] = 'gen' .. sfx, gen
  entry[e + 5], entry[e + 6] = 'result' .. sfx, min
  if stamp then
    local ranks = listed(st[3])
    local names = {}
    for i = 1, #ranks do
      names[i] = 'r' .. ranks[i]
      names[#ranks + i] = 'l' .. ranks[i]
    end
    local got = redis.call('HMGET', KEYS[k], unpack(names))
    local seen = {}
    local lat = {}
    for i = 1, #ranks do
      seen[i] = got[i]
      lat[i] = got[#ranks + i] or ''
    end
    entry[e + 7], entry[e + 8] = 'last' .. sfx, rank
    entry[e + 9], entry[e + 10] = 'ranks' .. sfx, st[3]
    entry[e + 11], entry[e + 12] = 'hits' .. sfx, table.concat(seen, ',')
    entry[e + 13], entry[e + 14] = 'lat' .. sfx, table.concat(lat, ',')
  end
  return 'complete'
end

-- One done entry for every lookup this call completed (see the header): one XADD, and at
-- most one PEXPIRE, a call. A lone completion leaves out the count.
local function publish()
  if n == 0 then return end
  local first = 3
  local cap = maxlen
  if n > 1 then
    entry[2] = n
    first = 1
    -- The cap counts completions, not entries: an entry of n keeps about cap / n entries,
    -- so a stream of fat entries holds about as many completions as one of lone ones.
    cap = math.ceil(tonumber(maxlen) / n)
  end
  if not redis.call('XADD', KEYS[done], 'NOMKSTREAM', 'MAXLEN', '~', cap, '*',
                    unpack(entry, first)) then
    redis.call('XADD', KEYS[done], 'MAXLEN', '~', cap, '*', unpack(entry, first))
    redis.call('PEXPIRE', KEYS[done], stream_ttl)  -- the XADD created the stream
  end
end

if not batch then
  if not held() then return 'fenced' end
  local answer = report(1, ARGV[2], ARGV[3], ARGV[5])
  publish()
  return answer
end
local first = lease and 3 or 2
local answers = {}
local ok = held()
for i = 0, #KEYS - first do
  if ok then
    answers[i + 1] = report(first + i, ARGV[7 + 3 * i], ARGV[8 + 3 * i], ARGV[9 + 3 * i])
  else
    answers[i + 1] = 'fenced'
  end
end
publish()
return answers
