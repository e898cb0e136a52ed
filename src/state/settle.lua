-- tollgate: settle one reservation on every counter: release its hold and (when ARGV[3] is
-- 1) commit the actual usage. Idempotent by reservation id: a counter that already settled
-- this id is left alone, so a retried settle never counts twice.
--
-- KEYS: as in reserve.lua, 3 per counter (hash, holds ZSET, settled-ids ZSET).
-- ARGV[1] member "rid:t:r:u" (the hold); ARGV[2] rid; ARGV[3] 1 commit / 0 release;
--   ARGV[4..6] actual t r u; ARGV[7] how long settled ids are remembered (ms);
--   ARGV[8] n counters; then per counter its key expiry (unix ms).
-- Returns the number of counters settled by this call (0 = all were settled before).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[2]
local commit = ARGV[3] == '1'
local keep = tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local a, b, c = string.match(ARGV[1], ':(%d+):(%d+):(%d+)$')
local held = {tonumber(a), tonumber(b), tonumber(c)}
local held_f = {'ht', 'hr', 'hu'}
local comm_f = {'ct', 'cr', 'cu'}
local done = 0
for i = 0, n - 1 do
  local k, l, s = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  if not redis.call('ZSCORE', s, rid) then
    -- Still held: give the hold back. Not held: its lease ran out and a reserve purged it.
    if redis.call('ZREM', l, ARGV[1]) == 1 then
      for d = 1, 3 do
        if held[d] > 0 then
          local left = redis.call('HINCRBY', k, held_f[d], -held[d])
          if left < 0 then redis.call('HSET', k, held_f[d], 0) end
        end
      end
    end
    if commit then
      for d = 1, 3 do
        if ARGV[3 + d] ~= '0' then redis.call('HINCRBY', k, comm_f[d], ARGV[3 + d]) end
      end
    end
    redis.call('ZADD', s, now, rid)
    redis.call('ZREMRANGEBYSCORE', s, '-inf', now - keep)
    local exp = ARGV[8 + i + 1]
    if redis.call('EXISTS', k) == 1 then redis.call('PEXPIREAT', k, exp) end
    if redis.call('EXISTS', l) == 1 then redis.call('PEXPIREAT', l, exp) end
    redis.call('PEXPIREAT', s, exp)
    done = done + 1
  end
end
return done
