-- tollgate: lease slices (issue 51 point 7). For every counter given, all or nothing: check the
-- request's worst case against what is left (hard - committed - held, after purging holds
-- whose lease ended) and hold a slice of it, a hold like reserve.lua's (same hash, same holds
-- ZSET, member "<slice id>.0:t:r:u", score = lease end), so every other check counts it and a
-- dead replica's slice ends with its lease.
--
-- KEYS: per counter i (0-based) 3 keys as in reserve.lua (hash, holds ZSET, settled ZSET);
--   then KEYS[3n+1] the epoch marker and KEYS[3n+2] the rebuilding flag.
-- ARGV[1] lease ms; ARGV[2] n; ARGV[3..5] worst case t r u; ARGV[6] target (slice = at most
--   target x worst case); ARGV[7] share (slice = at most remaining / share);
--   then per counter 5 values: slice id, hard t, hard r, hard u (-1 = none), key expiry (ms);
--   then the caller's epoch.
-- Per hard dimension with a non-zero worst case: slice = min(target x worst, floor(left /
--   share)); dimensions without a hard limit or with a zero worst case hold 0.
-- Returns {1, per counter: slice t r u, committed t r u}; {0, part, dim, used, hard,
--   committed t r u per counter} refused (the worst case itself does not fit: nothing held);
--   {2} epoch marker not the caller's; {3} rebuilding and a hard limit is involved;
--   {5, part} near the limit (a slice would be below the worst case): nothing held, the
--   caller uses the per-request path.
local MAX = 9007199254740991
local function sat(x) if x > MAX then return MAX end return x end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local amt = {sat(tonumber(ARGV[3])), sat(tonumber(ARGV[4])), sat(tonumber(ARGV[5]))}
local target = tonumber(ARGV[6])
local share = tonumber(ARGV[7])
local held_f = {'ht', 'hr', 'hu'}
local function arg(i, j) return ARGV[7 + 5 * i + j] end
if redis.call('GET', KEYS[3 * n + 1]) ~= ARGV[7 + 5 * n + 1] then return {2} end
if redis.call('EXISTS', KEYS[3 * n + 2]) == 1 then
  for i = 0, n - 1 do
    for d = 1, 3 do
      if tonumber(arg(i, d + 1)) >= 0 then return {3} end
    end
  end
end

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

local cur, committed = {}, {}
for i = 0, n - 1 do
  purge(KEYS[3 * i + 1], KEYS[3 * i + 2])
  local v = redis.call('HMGET', KEYS[3 * i + 1], 'ct', 'cr', 'cu', 'ht', 'hr', 'hu')
  local c = {}
  for j = 1, 6 do c[j] = sat(tonumber(v[j]) or 0) end
  cur[i + 1] = c
  for d = 1, 3 do committed[#committed + 1] = c[d] end
end

local slices = {}
local small = nil
for i = 0, n - 1 do
  local c = cur[i + 1]
  local s = {0, 0, 0}
  for d = 1, 3 do
    local hard = tonumber(arg(i, d + 1))
    if hard >= 0 and amt[d] > 0 then
      local used = c[d] + c[d + 3]
      if used + amt[d] > hard then
        local r = {0, i, d - 1, used, hard}
        for _, x in ipairs(committed) do r[#r + 1] = x end
        return r
      end
      local left = hard - used
      local size = math.min(sat(target * amt[d]), math.floor(left / share))
      if size < amt[d] and small == nil then small = i end
      s[d] = size
    end
  end
  slices[i + 1] = s
end
if small ~= nil then return {5, small} end

local r = {1}
for i = 0, n - 1 do
  local k, l = KEYS[3 * i + 1], KEYS[3 * i + 2]
  local c, s = cur[i + 1], slices[i + 1]
  redis.call('HSET', k, 'ht', sat(c[4] + s[1]), 'hr', sat(c[5] + s[2]), 'hu', sat(c[6] + s[3]))
  redis.call('ZADD', l, now + lease, arg(i, 1) .. '.0:' .. s[1] .. ':' .. s[2] .. ':' .. s[3])
  local exp = arg(i, 5)
  redis.call('PEXPIREAT', k, exp)
  redis.call('PEXPIREAT', l, exp)
  for d = 1, 3 do r[#r + 1] = s[d] end
  for d = 1, 3 do r[#r + 1] = c[d] end
end
return r
