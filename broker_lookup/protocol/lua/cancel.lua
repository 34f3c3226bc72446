-- cancel.lua: forget one generation of a lookup and tell every rank to release it.
-- KEYS[1] lookup hash   KEYS[2] request stream
-- ARGV: gen, stream maxlen, stream ttl ms, then the abort entry's field/value pairs.
-- ARGV is built by cancel_args (protocol/scripts.py); the hash's fields are named in
-- protocol/lookup_hash.py, the abort entry's in protocol/messages.py.
-- The hash is deleted only if it still holds this generation: cancelling an old
-- attempt must not wipe a newer one. The abort is always sent, so ranks that
-- finished (or will finish) this generation release its pinned memory.
local deleted = 0
if redis.call('HGET', KEYS[1], 'gen') == ARGV[1] then
  deleted = redis.call('DEL', KEYS[1])
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return deleted
