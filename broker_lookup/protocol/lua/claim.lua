-- claim.lua: claim, renew or release the lease of one role of an engine (a rank, or the
-- scheduler): one owner per role.
-- KEYS[1] lease key (owner:<role>)   KEYS[2] epochs hash   KEYS[3] contender key
-- KEYS[4] (optional) the rank's heartbeat key, written with each claim or renewal
-- ARGV: mode (claim | release), role (the epochs field), identity (compact JSON), nonce,
--       lease ms, epochs ttl ms, then with KEYS[4]: heartbeat body, heartbeat ttl ms.
-- Built by claim_call / release_call (protocol/scripts.py); the value's format is
-- described in protocol/ownership.py: '<epoch>.<nonce> <identity>'.
-- Returns {status, value}:
--   claimed  <token>     the lease was free: a new, larger epoch (fencing token)
--   renewed  <token>     the caller holds it (same identity): PX reset, same token; a
--                        claim retried after a lost reply lands here and keeps its token
--   held     <value>     another process holds it: nothing of the caller's is written but
--                        the contender key, so the conflict is visible (inspect)
--   released <token>     (release) the caller held it: lease, heartbeat deleted
--   absent   ''          (release) nobody holds it
-- Only the holder writes the heartbeat, so a newcomer never passes for the live rank.
local cur = redis.call('GET', KEYS[1])
local token, who = nil, nil
if cur then
  local sp = string.find(cur, ' ', 1, true)
  if sp then
    token = string.sub(cur, 1, sp - 1)
    who = string.sub(cur, sp + 1)
  end
end
if ARGV[1] == 'release' then
  if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
  if not cur then return {'absent', ''} end
  if who ~= ARGV[3] then return {'held', cur} end
  redis.call('DEL', KEYS[1])
  if KEYS[4] then redis.call('DEL', KEYS[4]) end
  return {'released', token}
end
local status = 'renewed'
if cur and who ~= ARGV[3] then
  redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[5])
  return {'held', cur}
end
if cur then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
else
  status = 'claimed'
  token = redis.call('HINCRBY', KEYS[2], ARGV[2], 1) .. '.' .. ARGV[4]
  redis.call('SET', KEYS[1], token .. ' ' .. ARGV[3], 'PX', ARGV[5])
  if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
end
redis.call('PEXPIRE', KEYS[2], ARGV[6])
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[7], 'PX', ARGV[8]) end
return {status, token}
