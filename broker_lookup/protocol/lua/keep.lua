-- keep.lua: tell every rank to keep exactly the prefix of a partial answer pinned.
-- KEYS[1] lookup hash   KEYS[2] request stream
-- ARGV: gen, stream maxlen, stream ttl ms, then the keep entry's field/value pairs. Built by
-- keep_call (protocol/scripts.py); the hash's fields are named in protocol/lookup_hash.py.
-- Sent only while the hash still holds that generation's partial answer: after a
-- cancel (its abort is on the stream already) a keep would only be read and dropped.
-- Returns 1 if the entry was added, else 0.
local st = redis.call('HMGET', KEYS[1], 'gen', 'partial')
if st[1] ~= ARGV[1] or st[2] ~= '1' then return 0 end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
