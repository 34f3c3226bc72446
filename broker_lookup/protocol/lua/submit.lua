-- submit.lua: register one generation of a lookup and broadcast it to every rank.
-- KEYS[1] lookup hash   KEYS[2] request stream
-- ARGV: gen, expected ("0,1,2"), created_ms, deadline_ms, tokens, key ttl ms,
--       stream maxlen, lookup id (the caller's, kept readable: the key may hold a digest),
--       insights ("1": stamp submitted_us, the server's epoch µs, so report.lua can time
--       each rank on the server's clock; "0": no stamp), the stream's ttl ms (the
--       engine's: it may create the stream), then the stream entry's field/value pairs.
-- ARGV is built by submit_args (protocol/scripts.py); the hash's fields are named in
-- protocol/lookup_hash.py, the stream entry's in protocol/messages.py.
-- Idempotent per generation: a batch re-sent after its reply was lost finds its own
-- generation and changes nothing (no second entry, and the reports fast ranks already
-- recorded stay). The DEL drops an older generation's hash: its late reports then find
-- another gen and change nothing.
-- Four commands a submit (HGET, HSET, PEXPIRE, XADD): each costs the server several times
-- the same command sent plainly, so none is spent where nothing needs it.
-- A batch (ARGV[1] 'batch'): one call for every submit the client's sender sends in one
-- round trip, and ONE stream entry for the lookups it registers (a batch entry:
-- protocol/messages.py), so the server pays one script call, one XADD, one delivery to
-- each rank's group and one XACK a rank per batch, not per lookup. Each lookup is still
-- idempotent per its own generation: a duplicate is left out of the entry, and a batch
-- re-sent whole after a lost reply writes no entry at all. The stream's TTL is set at
-- most once.
--   KEYS: the request stream, then one lookup hash per submit
-- Its entry counts as one against the stream's cap (MAXLEN, in entries, as a lone
-- submit's), and it trims the entries older than the horizon (ARGV[5], ms: the longest
-- a lookup hash lives; 0: none): no rank can serve them any more (their hashes are gone,
-- their budgets spent), and without it a stream of batch entries would hold up to 64
-- times the lookups a stream of lone ones holds. Only the server's clock judges age.
--   ARGV: 'batch', expected, stream maxlen, the stream's ttl ms, horizon ms, then per submit: gen,
--         created_ms, deadline_ms, tokens, key ttl ms, lookup id, insights, the msgpack
--         of its LookupRequest (the batch entry's part)
--   Returns one answer per submit, in order (the batch entry's id or 'duplicate').
local time_stamp = nil
local function stamp()
  if not time_stamp then
    -- Seconds and micros as TIME gives them, joined as text: a double of ~1.7e15 would
    -- print as 1.7e+15 and lose its digits. One TIME per call: a batch's lookups were
    -- all submitted at this instant of the server's clock.
    local t = redis.call('TIME')
    time_stamp = t[1] .. string.format('%06d', tonumber(t[2]))
  end
  return time_stamp
end

-- owed and lowest let report.lua complete the lookup from its one read: the reports still
-- owed, and the fewest hits reported so far (the prompt's tokens before any).
local function count(expected)
  local owed = 0
  for _ in string.gmatch(expected, '[^,]+') do owed = owed + 1 end
  return owed
end

-- Register one generation of a lookup in the hash KEYS[h]: true, or false where the hash
-- already holds this generation (a submit sent again). Keys go by index, so every command
-- names KEYS[n].
local function register(h, gen, expected, owed, created, deadline, tokens, ttl, id, insights)
  local held = redis.call('HGET', KEYS[h], 'gen')
  if held == gen then
    return false
  end
  if held then  -- the usual first submit finds no key: nothing to delete
    redis.call('DEL', KEYS[h])
  end
  if insights == '1' then
    redis.call('HSET', KEYS[h], 'state', 'pending', 'gen', gen, 'expected', expected,
               'created_ms', created, 'deadline_ms', deadline, 'tokens', tokens, 'id', id,
               'owed', owed, 'lowest', tokens, 'submitted_us', stamp())
  else
    redis.call('HSET', KEYS[h], 'state', 'pending', 'gen', gen, 'expected', expected,
               'created_ms', created, 'deadline_ms', deadline, 'tokens', tokens, 'id', id,
               'owed', owed, 'lowest', tokens)
  end
  redis.call('PEXPIRE', KEYS[h], ttl)
  return true
end

-- Append one entry (its field/value pairs in the table fields) to the stream KEYS[s].
-- The stream's TTL is the engine's, refreshed by every live process's beat (lifetime.py):
-- only an XADD that creates the stream must set it, here, so nothing is left without one.
local function append(s, maxlen, stream_ttl, fields)
  local entry = redis.call('XADD', KEYS[s], 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*',
                           unpack(fields))
  if not entry then
    entry = redis.call('XADD', KEYS[s], 'MAXLEN', '~', maxlen, '*', unpack(fields))
    redis.call('PEXPIRE', KEYS[s], stream_ttl)
  end
  return entry
end

if ARGV[1] ~= 'batch' then
  if not register(1, ARGV[1], ARGV[2], count(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6],
                  ARGV[8], ARGV[9]) then
    return 'duplicate'
  end
  return append(2, ARGV[7], ARGV[10], {unpack(ARGV, 11, #ARGV)})
end
local expected, maxlen, stream_ttl, horizon = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local owed = count(expected)
local answers = {}
local fields = {'type', 'batch', 'n', 0}
local n = 0
local a = 6
for k = 2, #KEYS do
  if register(k, ARGV[a], expected, owed, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
              ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]) then
    fields[5 + 2 * n] = 'm' .. n
    fields[6 + 2 * n] = ARGV[a + 7]
    n = n + 1
  else
    answers[k - 1] = 'duplicate'
  end
  a = a + 8
end
if n > 0 then
  fields[4] = n
  local entry = append(1, maxlen, stream_ttl, fields)
  if horizon and horizon > 0 then
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('XTRIM', KEYS[1], 'MINID', '~', string.format('%.0f', now_ms - horizon) .. '-0')
  end
  for k = 1, #KEYS - 1 do
    if not answers[k] then answers[k] = entry end
  end
end
return answers
