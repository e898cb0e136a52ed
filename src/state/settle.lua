-- tollgate: settle one reservation on every counter: release its hold and (when ARGV[3] is
-- 1) commit the actual usage. Idempotent by reservation id: a counter that already settled
-- this id is left alone, so a retried settle never counts twice.
--
-- KEYS: as in reserve.lua, 3 per counter (hash, holds ZSET, settled-ids ZSET).
-- ARGV[1] member "rid:t:r:u" (the hold); ARGV[2] rid; ARGV[3] 1 commit / 0 release;
--   ARGV[4..6] actual t r u; ARGV[7] how long settled ids are remembered (ms);
--   ARGV[8] n counters; then per counter its key expiry (unix ms); then the epoch the hold
--   was made in. KEYS[3n+1] is the namespace's epoch marker.
-- Returns the number of counters settled by this call (0 = all were settled before), or -1
--   when the epoch marker is not the hold's: Redis lost the counters the hold was made on
--   (nothing written; the replica's journal rebuild carries this usage instead).
-- A hold whose lease ran out (purged by a reserve) still commits its actual: usage that
-- reached an upstream is never lost to a late settle.
-- Amounts saturate at 2^53 - 1 (Lua numbers are doubles; exact integers stop there): a
-- provider's absurd usage report must never wrap or turn a counter into a float.
local MAX = 9007199254740991
local function sat(x) if x > MAX then return MAX end return x end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[2]
local commit = ARGV[3] == '1'
local keep = tonumber(ARGV[7])
local n = tonumber(ARGV[8])
if redis.call('GET', KEYS[3 * n + 1]) ~= ARGV[8 + n + 1] then return -1 end
local a, b, c = string.match(ARGV[1], ':(%d+):(%d+):(%d+)$')
local held = {tonumber(a), tonumber(b), tonumber(c)}
local actual = {sat(tonumber(ARGV[4])), sat(tonumber(ARGV[5])), sat(tonumber(ARGV[6]))}
-- Old settled ids are trimmed by about one settle in 16 (rids end in a hex sequence number).
local trim = string.sub(rid, -1) == '0'
local done = 0
for i = 0, n - 1 do
  local k, l, s = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  if not redis.call('ZSCORE', s, rid) then
    -- Still held: give the hold back. Not held: its lease ran out and a reserve purged it.
    local was_held = redis.call('ZREM', l, ARGV[1]) == 1
    if was_held or commit then
      local v = redis.call('HMGET', k, 'ct', 'cr', 'cu', 'ht', 'hr', 'hu')
      local x = {}
      for j = 1, 6 do x[j] = tonumber(v[j]) or 0 end
      if was_held then
        for d = 1, 3 do x[d + 3] = math.max(0, x[d + 3] - held[d]) end
      end
      if commit then
        for d = 1, 3 do x[d] = sat(x[d] + actual[d]) end
      end
      redis.call('HSET', k, 'ct', x[1], 'cr', x[2], 'cu', x[3], 'ht', x[4], 'hr', x[5], 'hu', x[6])
    end
    redis.call('ZADD', s, now, rid)
    if trim then redis.call('ZREMRANGEBYSCORE', s, '-inf', now - keep) end
    local exp = ARGV[8 + i + 1]
    redis.call('PEXPIREAT', k, exp)
    redis.call('PEXPIREAT', s, exp)
    done = done + 1
  end
end
return done
