-- tollgate: reserve one request's worst case on every counter, all or nothing.
-- Every key is under one hash tag, so the call stays in one Redis Cluster slot.
--
-- KEYS: per counter i (0-based), 3 keys: KEYS[3i+1] the counter hash (ct cr cu = committed
--   tokens/requests/usd-micros, ht hr hu = held by live reservations), KEYS[3i+2] its holds
--   ZSET (member "rid:t:r:u", score = lease end in ms of Redis' clock), KEYS[3i+3] its
--   settled-ids ZSET (written and given its expiry by settle.lua).
--   Then KEYS[3n+1] the namespace's epoch marker (no TTL) and KEYS[3n+2] its rebuilding flag.
-- ARGV[1] member "rid:t:r:u"; ARGV[2..4] amount t r u; ARGV[5] lease ms; ARGV[6] n counters;
--   then per counter 4 values: hard t, hard r, hard u (-1 = no limit), key expiry (unix ms);
--   then the epoch the caller knows.
-- Returns {1, committed t r u per counter...} or {0, part, dim, used, hard, committed...}
--   (part 0-based, dim 0 tokens / 1 requests / 2 usd; used = committed + held);
--   {2}: the epoch marker is not the caller's (Redis lost its counters, or another replica
--   rebuilt them since): nothing held; {3}: the counters are being rebuilt and a hard limit
--   is involved: nothing held; {4}: this reservation id was settled already (a reserve that
--   arrived after its own release): nothing held.
-- Idempotent by reservation id: a retried reserve whose hold exists holds nothing more.
-- Amounts saturate at 2^53 - 1, as in settle.lua.
local MAX = 9007199254740991
local function sat(x) if x > MAX then return MAX end return x end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local amt = {sat(tonumber(ARGV[2])), sat(tonumber(ARGV[3])), sat(tonumber(ARGV[4]))}
local lease = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local held_f = {'ht', 'hr', 'hu'}
if redis.call('GET', KEYS[3 * n + 1]) ~= ARGV[6 + 4 * n + 1] then return {2} end
if redis.call('EXISTS', KEYS[3 * n + 2]) == 1 then
  for i = 0, n - 1 do
    for d = 1, 3 do
      if tonumber(ARGV[6 + 4 * i + d]) >= 0 then return {3} end
    end
  end
end
local rid = string.match(ARGV[1], '^(.*):%d+:%d+:%d+$')

-- Drop holds whose lease ended (a replica died or lost its connection mid-call).
local function purge(k, l)
  local dead = redis.call('ZRANGEBYSCORE', l, '-inf', now)
  if #dead == 0 then return end
  local sub = {0, 0, 0}
  for _, m in ipairs(dead) do
    local a, b, c = string.match(m, ':(%d+):(%d+):(%d+)$')
    sub[1] = sub[1] + tonumber(a)
    sub[2] = sub[2] + tonumber(b)
    sub[3] = sub[3] + tonumber(c)
  end
  for d = 1, 3 do
    if sub[d] > 0 then
      local left = redis.call('HINCRBY', k, held_f[d], -sub[d])
      if left < 0 then redis.call('HSET', k, held_f[d], 0) end
    end
  end
  redis.call('ZREMRANGEBYSCORE', l, '-inf', now)
end

local cur = {}
local committed = {}
for i = 0, n - 1 do
  purge(KEYS[3 * i + 1], KEYS[3 * i + 2])
  local v = redis.call('HMGET', KEYS[3 * i + 1], 'ct', 'cr', 'cu', 'ht', 'hr', 'hu')
  local c = {}
  for j = 1, 6 do c[j] = sat(tonumber(v[j]) or 0) end
  cur[i + 1] = c
  committed[#committed + 1] = c[1]
  committed[#committed + 1] = c[2]
  committed[#committed + 1] = c[3]
end

-- A retry of a reserve whose reply was lost: the hold is there (on every counter, as the
-- script runs alone): answer as the first time, hold nothing twice.
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  local r = {1}
  for _, x in ipairs(committed) do r[#r + 1] = x end
  return r
end
if rid and redis.call('ZSCORE', KEYS[3], rid) then return {4} end

for i = 0, n - 1 do
  local c = cur[i + 1]
  for d = 1, 3 do
    local hard = tonumber(ARGV[6 + 4 * i + d])
    if hard >= 0 and amt[d] > 0 then
      local used = c[d] + c[d + 3]
      if used + amt[d] > hard then
        local r = {0, i, d - 1, used, hard}
        for _, x in ipairs(committed) do r[#r + 1] = x end
        return r
      end
    end
  end
end

-- The script runs alone, so the held totals read above are still current: one HSET each.
for i = 0, n - 1 do
  local k, l = KEYS[3 * i + 1], KEYS[3 * i + 2]
  local c = cur[i + 1]
  redis.call('HSET', k, 'ht', sat(c[4] + amt[1]), 'hr', sat(c[5] + amt[2]), 'hu', sat(c[6] + amt[3]))
  redis.call('ZADD', l, now + lease, ARGV[1])
  local exp = ARGV[6 + 4 * i + 4]
  redis.call('PEXPIREAT', k, exp)
  redis.call('PEXPIREAT', l, exp)
end
local r = {1}
for _, x in ipairs(committed) do r[#r + 1] = x end
return r
