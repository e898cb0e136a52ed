-- tollgate: one batch of a slice (issue 51 point 7): commit the usage admitted from it since
-- the last batch, shrink its hold by what that usage consumed, and renew its lease — or, when
-- final, give the whole rest back. Idempotent by batch: the old member's id
-- ("<slice id>.<batch>") goes into the settled-ids ZSET, so a retried batch never counts twice.
--
-- KEYS[1] counter hash, KEYS[2] holds ZSET, KEYS[3] settled-ids ZSET, KEYS[4] epoch marker.
-- ARGV[1] old member "<slice>.<b>:t:r:u"; ARGV[2] new member "<slice>.<b+1>:t:r:u" ('' =
--   final: give the rest back); ARGV[3..5] usage to commit t r u; ARGV[6] lease ms;
--   ARGV[7] key expiry (unix ms); ARGV[8] how long settled ids are kept (ms); ARGV[9] the
--   slice's epoch.
-- Returns {1, committed t r u}: written (or written before: a retry); {2, committed t r u}:
--   the usage is committed but the slice's hold is gone (its lease ran out and was purged):
--   the caller must stop admitting from it; {-1}: epoch marker not the slice's (nothing
--   written; the replica's rebuild carries the usage); {-2}: the new member would hold more
--   than the old (refused: only lease.lua may grow a hold, after checking the limit).
-- Amounts saturate at 2^53 - 1.
local MAX = 9007199254740991
local function sat(x) if x > MAX then return MAX end return x end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('GET', KEYS[4]) ~= ARGV[9] then return {-1} end
local k, l, s = KEYS[1], KEYS[2], KEYS[3]
local bid = string.match(ARGV[1], '^(.*):%d+:%d+:%d+$')
local function totals(code)
  local v = redis.call('HMGET', k, 'ct', 'cr', 'cu')
  return {code, tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0}
end
if redis.call('ZSCORE', s, bid) then return totals(1) end
local oa, ob, oc = string.match(ARGV[1], ':(%d+):(%d+):(%d+)$')
local old = {tonumber(oa), tonumber(ob), tonumber(oc)}
local new = {0, 0, 0}
local final = ARGV[2] == ''
if not final then
  local na, nb, nc = string.match(ARGV[2], ':(%d+):(%d+):(%d+)$')
  new = {tonumber(na), tonumber(nb), tonumber(nc)}
  for d = 1, 3 do if new[d] > old[d] then return {-2} end end
end
local used = {sat(tonumber(ARGV[3])), sat(tonumber(ARGV[4])), sat(tonumber(ARGV[5]))}
local was_held = redis.call('ZREM', l, ARGV[1]) == 1
local v = redis.call('HMGET', k, 'ct', 'cr', 'cu', 'ht', 'hr', 'hu')
local x = {}
for j = 1, 6 do x[j] = tonumber(v[j]) or 0 end
for d = 1, 3 do
  x[d] = sat(x[d] + used[d])
  if was_held then x[d + 3] = math.max(0, x[d + 3] - old[d] + new[d]) end
end
redis.call('HSET', k, 'ct', x[1], 'cr', x[2], 'cu', x[3], 'ht', x[4], 'hr', x[5], 'hu', x[6])
if was_held and not final then redis.call('ZADD', l, now + tonumber(ARGV[6]), ARGV[2]) end
redis.call('ZADD', s, now, bid)
redis.call('ZREMRANGEBYSCORE', s, '-inf', now - tonumber(ARGV[8]))
local exp = ARGV[7]
redis.call('PEXPIREAT', k, exp)
redis.call('PEXPIREAT', l, exp)
redis.call('PEXPIREAT', s, exp)
if was_held or final then return {1, x[1], x[2], x[3]} end
return {2, x[1], x[2], x[3]}
