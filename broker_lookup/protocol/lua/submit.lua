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
local held = redis.call('HGET', KEYS[1], 'gen')
if held == ARGV[1] then
  return 'duplicate'
end
if held then  -- the usual first submit finds no key: nothing to delete
  redis.call('DEL', KEYS[1])
end
local stamp = nil
if ARGV[9] == '1' then
  -- Seconds and micros as TIME gives them, joined as text: a double of ~1.7e15 would
  -- print as 1.7e+15 and lose its digits.
  local t = redis.call('TIME')
  stamp = t[1] .. string.format('%06d', tonumber(t[2]))
end
-- owed and lowest let report.lua complete the lookup from its one read: the reports still
-- owed, and the fewest hits reported so far (the prompt's tokens before any).
local owed = 0
for _ in string.gmatch(ARGV[2], '[^,]+') do owed = owed + 1 end
if stamp then
  redis.call('HSET', KEYS[1], 'state', 'pending', 'gen', ARGV[1], 'expected', ARGV[2],
             'created_ms', ARGV[3], 'deadline_ms', ARGV[4], 'tokens', ARGV[5], 'id', ARGV[8],
             'owed', owed, 'lowest', ARGV[5], 'submitted_us', stamp)
else
  redis.call('HSET', KEYS[1], 'state', 'pending', 'gen', ARGV[1], 'expected', ARGV[2],
             'created_ms', ARGV[3], 'deadline_ms', ARGV[4], 'tokens', ARGV[5], 'id', ARGV[8],
             'owed', owed, 'lowest', ARGV[5])
end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
-- The stream's TTL is the engine's, refreshed by every live process's beat (lifetime.py):
-- only an XADD that creates the stream must set it, here, so nothing is left without one.
local id = redis.call('XADD', KEYS[2], 'NOMKSTREAM', 'MAXLEN', '~', ARGV[7], '*',
                      unpack(ARGV, 11))
if not id then
  id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', unpack(ARGV, 11))
  redis.call('PEXPIRE', KEYS[2], ARGV[10])
end
return id
