-- deadline.lua: answer a lookup at its deadline with the prefix every rank confirmed.
-- KEYS[1] lookup hash   KEYS[2] request stream
-- ARGV: gen, stream maxlen, ttl ms once answered, answer ("1": answer it; "0": the client
-- answered 0 already, only cancel), stream ttl ms, then the abort entry's field/value
-- pairs. Built by
-- deadline_call (protocol/scripts.py); the hash's fields are named in protocol/lookup_hash.py.
-- The answer is the minimum over the expected ranks of what each confirmed: its final
-- report (r<rank>), else its progress (p<rank>); 0 if any rank confirmed nothing. A
-- positive answer completes the hash (state done, result, partial 1) and the client
-- then tells the ranks to keep that prefix; 0 is a cancel: the hash of this generation
-- is deleted and every rank told to release it.
-- Returns {answer, how, missing}: how is partial (answered here, now or by an earlier
-- run), complete (every rank reported before the deadline: the done event is on its
-- way) or none (answer 0: cancelled); missing lists the expected ranks that had not
-- reported ("1,3": the stragglers, counted per rank by the client). Idempotent: run
-- again after a lost reply it finds its own answer, or no key (0, and the abort again,
-- which changes nothing). With answer "0" it is a cancel that names the stragglers.
local st = redis.call('HMGET', KEYS[1], 'state', 'gen', 'expected', 'tokens', 'result',
                      'partial')
local answer = 0
local missing = {}
if st[1] and st[2] == ARGV[1] then
  if st[1] ~= 'pending' and ARGV[4] == '1' then
    return {tonumber(st[5]) or 0, st[6] == '1' and 'partial' or 'complete', ''}
  end
  local min = nil
  for r in string.gmatch(st[3], '[^,]+') do
    local v = redis.call('HGET', KEYS[1], 'r' .. r)
    if not v then
      missing[#missing + 1] = r
      v = redis.call('HGET', KEYS[1], 'p' .. r)
    end
    v = tonumber(v)
    if v == nil then v = 0 end
    if min == nil or v < min then min = v end
  end
  if st[1] == 'pending' and ARGV[4] == '1' then answer = min or 0 end
  if answer > 0 then
    redis.call('HSET', KEYS[1], 'state', 'done', 'result', answer, 'partial', '1')
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {answer, 'partial', table.concat(missing, ',')}
  end
  redis.call('DEL', KEYS[1])
  if st[1] ~= 'pending' then missing = {} end  -- it completed: nobody was late
end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return {0, 'none', table.concat(missing, ',')}
