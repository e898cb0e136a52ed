//! Counters shared by replicas in Redis, through two server-side Lua scripts:
//! `reserve.lua` (one round trip: purge expired leases, check every counter's hard limits in
//! every dimension, hold the worst case on all of them or none) and `settle.lua` (one round
//! trip: release the hold, commit the actual, idempotent by reservation id).
//!
//! Key layout (with `state.shards: 1`, all under ONE hash tag, so a script's keys share a
//! Redis Cluster slot):
//!
//! ```text
//! {tollgate:<namespace>}:c:<scope>:<window>:<start>:<id>      HASH  ct cr cu (committed) ht hr hu (held)
//! {tollgate:<namespace>}:c:<scope>:<window>:<start>:<id>:l    ZSET  "rid:t:r:u" -> lease end (ms)
//! {tollgate:<namespace>}:c:<scope>:<window>:<start>:<id>:s    ZSET  settled rid -> settle time (ms)
//! ```
//!
//! `<window>` is `minute|hour|day|month` with its start in Unix seconds, or `-:0` for a job
//! counter. Keys expire by themselves (`PEXPIREAT` window end + lease + 60 s; job counters
//! `job_idle_ttl` + lease after their last use). The single tag puts a namespace's counters
//! on one cluster node: one namespace's traffic is one node's (unless `state.shards` > 1).
//!
//! With `state.shards: N > 1` a counter goes to shard `FNV-1a(<scope>:<window>:<start>:<id>)
//! mod N`, whose tag is `{tollgate:<namespace>:<s>}` (shard 0 keeps `{tollgate:<namespace>}`).
//! Each shard is a full store of its own (epoch marker, flag, record, journal) over the shared
//! connection; a reservation spanning shards is taken shard by shard and the holds already
//! taken are released when a later shard refuses (`RedisStore::reserve_sharded`).
//!
//! Besides the counters: `{tollgate:<namespace>}:epoch` (STRING, no TTL) marks the counters
//! as whole, `...:rebuilding` (STRING, a few seconds' TTL) says they are being rebuilt, and
//! `...:probe` is the readiness probe's write.
//!
//! **Journal.** A settle or release that cannot reach Redis is queued (at most `MAX_DEBTS`)
//! and replayed, oldest first, once Redis answers: `settle.lua` is idempotent by reservation
//! id, and commits the actual even when the hold's lease ran out. A reserve whose reply was
//! lost is retried once with the same reservation id (`reserve.lua` holds a reservation id
//! once); if that fails too, its release is queued like a settle.
//!
//! **Epoch.** Every replica keeps a bounded record of what it committed per counter in the
//! windows in force (`Book::committed`). The scripts compare the epoch marker with the one
//! the replica adopted; when Redis comes back without it (restart without persistence,
//! FLUSHALL, eviction), the replica that notices writes a new marker, sets the rebuilding
//! flag (hard-bounded reservations are refused, `STATE_REBUILDING`, while it lasts) and
//! re-applies its record (idempotent per replica and epoch); every other live replica does
//! the same when it notices (its next call, or the monitor's check each second). A write
//! made in an older epoch is refused by the script and is never replayed: its usage is in
//! the record the rebuild applied. See docs/scale-out.md for the argument.
//!
//! **Cluster.** At connect the first seed that answers (`state.redis_url`, then
//! `state.redis_urls`) is asked `INFO cluster`; on `cluster_enabled:1` every call goes through
//! the `redis` crate's cluster client (`Conn::Cluster`), which follows `MOVED`/`ASK`, waits
//! out `TRYAGAIN`/`CLUSTERDOWN` (retries 20–250 ms apart, at most [`CLUSTER_CALL_TIMEOUT`] per
//! call) and refreshes its slot map after a failover. Both scripts are idempotent by
//! reservation id, so the client's retries never hold or count twice. `CONFIG GET
//! maxmemory-policy` goes to every master.
//!
//! When Redis does not answer (connect or response timeout: 500 ms), the store reports
//! [`StoreUnavailable`] and stops trying for one second; the governor then follows
//! `state.on_unavailable`. The next attempt after that second reconnects. In `local` mode the
//! usage a replica commits alone meanwhile is queued and written back once Redis answers
//! (`settle.lua` on a hold that held nothing: idempotent by reservation id, so a retried
//! write never counts twice).

use crate::ledger::shared::ReserveFuture;
use crate::ledger::{
    CounterKey, DimRefusal, SharedCounters, SharedHold, SharedPart, SharedReply, StoreUnavailable,
};
use crate::policy::{OnUnavailable, StateCfg};
use crate::units::{Amount, Dim, Millis};
use arc_swap::ArcSwapOption;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{AsyncConnectionConfig, Script};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const RESERVE_LUA: &str = include_str!("reserve.lua");
const SETTLE_LUA: &str = include_str!("settle.lua");
/// Reads the epoch marker; writes a new one (and the rebuilding flag when asked) if absent.
/// KEYS[1] marker, KEYS[2] rebuilding flag; ARGV[1] new epoch, ARGV[2] flag ms (0 = none).
/// Returns {epoch, 1 if written now else 0}.
const EPOCH_LUA: &str = r"
local e = redis.call('GET', KEYS[1])
if e then return {e, 0} end
redis.call('SET', KEYS[1], ARGV[1])
if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2]) end
return {ARGV[1], 1}
";
/// The readiness probe: a write under the namespace's tag (what a reservation needs: the
/// right node, memory, auth, a server that is not paused), then the epoch marker and the
/// rebuilding flag's time left. KEYS[1] probe, KEYS[2] marker, KEYS[3] flag.
const PROBE_LUA: &str = r"
redis.call('SET', KEYS[1], '1', 'PX', 60000)
return {redis.call('GET', KEYS[2]) or '', redis.call('PTTL', KEYS[3])}
";
/// Gauge: 1 when Redis' `maxmemory-policy` may evict tollgate's keys (anything but
/// `noeviction`), else 0 (also while unknown).
pub const TOLLGATE_STATE_EVICTION_UNSAFE: &str = "tollgate_state_eviction_unsafe";
/// Gauge: 1 while this replica refuses hard-bounded requests because the shared counters are
/// being rebuilt (`STATE_REBUILDING`).
pub const TOLLGATE_STATE_REBUILDING: &str = "tollgate_state_rebuilding";
/// Gauge: settlements waiting in the local journal to be written to Redis.
pub const TOLLGATE_STATE_JOURNAL_PENDING: &str = "tollgate_state_journal_pending";
/// How long the rebuilding flag refuses hard-bounded reservations after Redis lost the
/// counters: every live replica notices within `EPOCH_EVERY` and re-applies its journal.
pub const REBUILD_GRACE_MS: i64 = 3_000;
/// How often the monitor compares the epoch marker (and replays what is pending).
pub const EPOCH_EVERY: Duration = Duration::from_secs(1);
/// How often `maxmemory-policy` is read (`TOLLGATE_STATE_CHECK_INTERVAL_MS` overrides).
pub const POLICY_EVERY: Duration = Duration::from_secs(60);
/// Most counters in the record of what this replica committed in the windows in force.
const MAX_BOOK: usize = 100_000;

/// Most shards a namespace's counters are spread over (`state.shards`).
pub const MAX_SHARDS: usize = 64;
/// Connect and response timeout for every Redis call (in a cluster: for each node's answer).
pub const REDIS_TIMEOUT: Duration = Duration::from_millis(500);
/// In a Redis Cluster: the most one call may take, redirections (`MOVED`, `ASK`) and waits
/// on `TRYAGAIN` / `CLUSTERDOWN` (slot migration, failover) included.
pub const CLUSTER_CALL_TIMEOUT: Duration = Duration::from_millis(2_000);
/// In a Redis Cluster: how often one call is tried again (redirections included), and the
/// wait before a retry after `TRYAGAIN`, `CLUSTERDOWN` or a lost node (ms, jittered).
const CLUSTER_RETRIES: u32 = 12;
/// In a Redis Cluster: after failing this long without an answer, the cluster connection is
/// dropped and built again from the seeds (`state.redis_url`, `state.redis_urls`).
const CLUSTER_RECONNECT_AFTER_MS: i64 = 30_000;
const CLUSTER_RETRY_MIN_MS: u64 = 20;
const CLUSTER_RETRY_MAX_MS: u64 = 250;

/// A connection to a single Redis or to a Redis Cluster (`redis` crate's cluster client:
/// it follows `MOVED`/`ASK`, waits out `TRYAGAIN`, refreshes its slot map on failover).
/// Scripts run through either (`Script::invoke_async` routes by the first key's slot).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Conn::Single(_) => "Conn::Single",
            Conn::Cluster(_) => "Conn::Cluster",
        })
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
/// After a failure, calls are answered "unavailable" without trying for this long.
pub const RETRY_AFTER_FAILURE_MS: i64 = 1000;
/// Extra life of a window's keys past the window end (plus the lease).
const KEY_SLACK_MS: i64 = 60_000;
/// How long a settled reservation id is remembered (settle retries within it are no-ops).
const SETTLED_KEEP_MS: i64 = 3_600_000;
/// Most settlements journaled while Redis does not take them (also the usage a replica
/// counts alone in `state.on_unavailable: local`).
const MAX_DEBTS: usize = 100_000;

fn wall_ms() -> Millis {
    jiff::Timestamp::now().as_millisecond()
}

/// A Redis-backed shared counter store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RedisStore {
    /// The first shard (`{tollgate:<namespace>}`, the whole store when `state.shards` is 1).
    inner: Arc<Inner>,
    /// Every shard, the first included; they share one connection. Shard `s > 0` keeps its
    /// keys under `{tollgate:<namespace>:<s>}`, with its own epoch marker, rebuilding flag,
    /// record and journal (all of a shard's keys share one cluster slot).
    shards: Arc<[Arc<Inner>]>,
}

#[derive(Debug)]
struct Inner {
    /// `state.redis_url` first, then `state.redis_urls` (extra cluster seed nodes).
    clients: Arc<Vec<redis::Client>>,
    conn: Arc<ArcSwapOption<Conn>>,
    /// The Redis answered `cluster_enabled:1` at the last connect.
    cluster: Arc<AtomicBool>,
    connecting: Arc<tokio::sync::Mutex<()>>,
    /// Wall-clock ms until which calls fail fast after a failure.
    down_until: Arc<AtomicI64>,
    down: Arc<AtomicBool>,
    /// Wall-clock ms of the first failure since the last answer (0: answering).
    failing_since: Arc<AtomicI64>,
    prefix: String,
    lease_ms: i64,
    job_ttl_ms: i64,
    on_unavailable: OnUnavailable,
    rid_prefix: String,
    seq: AtomicU64,
    reserve: Script,
    settle: Script,
    /// Usage counted alone while Redis was away, oldest first, waiting to be written back.
    /// Touched only on that degraded path (never on a request served through Redis).
    debts: std::sync::Mutex<std::collections::VecDeque<Debt>>,
    /// A task is writing `debts` back.
    paying: AtomicBool,
    epoch_key: String,
    rebuild_key: String,
    probe_key: String,
    epoch_lua: Script,
    probe_lua: Script,
    /// The adopted epoch, what this replica committed per counter, a rebuild to apply.
    book: std::sync::Mutex<Book>,
    /// One epoch check at a time.
    syncing: tokio::sync::Mutex<()>,
    /// A rebuild of this replica's share is pending (mirror of `Book::pending`).
    rebuilding: AtomicBool,
    /// What the last failure was, named as Redis named it (for logs, /readyz, status).
    last_error: Arc<std::sync::Mutex<Option<String>>>,
    /// `maxmemory-policy` as last read (`unknown` when CONFIG is refused).
    eviction: std::sync::Mutex<Option<String>>,
    /// When this replica last rebuilt its share, and how much (for status).
    last_rebuild: std::sync::Mutex<Option<serde_json::Value>>,
}

/// The epoch this replica works in and its journal of committed usage.
#[derive(Debug, Default)]
struct Book {
    epoch: Option<Arc<str>>,
    /// Redis counter key -> (committed by this replica since it started, key expiry ms).
    committed: HashMap<String, (Amount, i64)>,
    full_said: bool,
    pending: Option<Rebuild>,
}

/// This replica's share of the counters, to write into a new epoch.
#[derive(Debug, Clone)]
struct Rebuild {
    epoch: Arc<str>,
    counters: Vec<(String, Amount, i64)>,
}

impl Book {
    /// Adds `actual` to every counter of `slot` (bounded: past `MAX_BOOK` counters, expired
    /// ones are dropped first; if still full, the counter is not recorded, said once).
    fn record(&mut self, slot: &Slot, actual: Amount, now: Millis) {
        if actual == Amount::ZERO {
            return;
        }
        for (i, exp) in slot.expires.iter().enumerate() {
            let Some(k) = slot.keys.get(3 * i) else {
                continue;
            };
            if !self.committed.contains_key(k) && self.committed.len() >= MAX_BOOK {
                self.committed.retain(|_, (_, e)| *e > now);
                if self.committed.len() >= MAX_BOOK {
                    if !self.full_said {
                        self.full_said = true;
                        tracing::error!(
                            "state: the journal of committed usage holds {MAX_BOOK} counters; new counters are not recorded (a Redis that loses its counters would not get their usage back from this replica)"
                        );
                    }
                    continue;
                }
            }
            let e = self
                .committed
                .entry(k.clone())
                .or_insert((Amount::ZERO, *exp));
            e.0 = sat_add(e.0, actual);
            e.1 = e.1.max(*exp);
        }
    }
}

/// Where one reservation lives in Redis: its counters' keys (3 each), their expiries, and its
/// member `rid:t:r:u` (the amount held; `rid:0:0:0` for a hold that holds nothing).
#[derive(Debug, Default)]
struct Slot {
    keys: Vec<String>,
    expires: Vec<i64>,
    member: String,
    rid_len: usize,
    /// The epoch the reservation was made in (`None`: before any epoch was known).
    epoch: Option<Arc<str>>,
}

/// A settlement owed to Redis: usage committed (or a hold to release, `actual: None`) that
/// could not be written when it happened.
#[derive(Debug)]
struct Debt {
    slot: Slot,
    actual: Option<Amount>,
}

/// What `settle.lua` answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    /// This many counters settled now (0: all before).
    Done(i64),
    /// The hold's epoch is gone: nothing written (the rebuild carries the usage).
    Lost,
}

/// What `reserve.lua` answered.
enum Reserved {
    Held(RedisHold, Vec<Amount>),
    Refused(usize, DimRefusal, Vec<Amount>),
    Rebuilding,
}

/// The name of a Redis failure as Redis gave it (`MOVED`, `OOM`, `NOAUTH`, `TRYAGAIN`, a
/// timeout, a refused connection), with what it means for tollgate. Never the URL.
pub fn describe(e: &redis::RedisError) -> String {
    if let Some(code) = e.code() {
        let detail: String = e.detail().unwrap_or("").chars().take(160).collect();
        let what = match code {
            "MOVED" | "ASK" => {
                "the namespace's slot is on another cluster node and the cluster client could not follow it (slot map changing, or the node was not a cluster node when tollgate connected)"
            }
            "OOM" => "Redis is out of memory (maxmemory reached)",
            "NOAUTH" | "WRONGPASS" => "Redis wants authentication: put the password in state.redis_url",
            "NOPERM" => "the Redis user may not run tollgate's scripts",
            "TRYAGAIN" => "the cluster is resharding this slot",
            "CLUSTERDOWN" => "the Redis cluster is down",
            "READONLY" => "this Redis is a read-only replica",
            "LOADING" => "Redis is loading its dataset",
            "MASTERDOWN" => "the replica's master is down",
            "BUSY" => "Redis is busy running a script",
            _ => "Redis refused the call",
        };
        return format!("{code} {detail} ({what})").replace("  ", " ");
    }
    if e.is_timeout() {
        format!("timeout: no answer within {} ms", REDIS_TIMEOUT.as_millis())
    } else if e.is_connection_refusal() {
        "connection refused".to_string()
    } else if e.is_connection_dropped() {
        "connection dropped".to_string()
    } else if e.kind() == redis::ErrorKind::AuthenticationFailed {
        "authentication failed".to_string()
    } else {
        e.category().to_string()
    }
}

/// The least safe `maxmemory-policy` among a cluster's masters' `CONFIG GET` answers (a map
/// node -> answer); `None` when no master answered it.
fn cluster_policy(v: redis::Value) -> Option<String> {
    let redis::Value::Map(nodes) = v else {
        return None;
    };
    let mut seen: Option<String> = None;
    for (_, answer) in nodes {
        let Ok(pair) = redis::from_redis_value::<Vec<String>>(answer) else {
            continue;
        };
        let Some(p) = pair.get(1) else { continue };
        let p: String = p.chars().take(64).collect();
        if seen.as_deref().is_none_or(|s| s == "noeviction") {
            seen = Some(p);
        }
    }
    seen
}

/// Whether the call's reply may simply have been lost (the script may have run).
fn reply_lost(e: &redis::RedisError) -> bool {
    e.code().is_none() && (e.is_timeout() || e.is_io_error() || e.is_connection_dropped())
}

/// A reservation held in Redis; see [`SharedHold`]. An `owed` hold holds nothing: it was
/// made while Redis was away, and its settlement is queued to be written back.
#[derive(Debug)]
pub struct RedisHold {
    inner: Arc<Inner>,
    slot: Slot,
    owed: bool,
    settled: bool,
}

fn sat_add(a: Amount, b: Amount) -> Amount {
    Amount {
        tokens: a.tokens.saturating_add(b.tokens),
        requests: a.requests.saturating_add(b.requests),
        usd: a.usd.saturating_add(b.usd),
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A number from the network as a bounded count (negative: 0).
pub(super) fn count(v: i64) -> u64 {
    v.max(0) as u64
}

/// The refusal a script reports at `reply[2..5]`: the dimension, what was used, the hard limit.
pub(super) fn refusal_at(reply: &[i64]) -> DimRefusal {
    DimRefusal {
        dim: match reply[2] {
            0 => Dim::Tokens,
            1 => Dim::Requests,
            _ => Dim::Usd,
        },
        used: count(reply[3]),
        hard: count(reply[4]),
    }
}

impl RedisStore {
    /// A store for `cfg` (`state.redis_url`, `lease`, `namespace`, ...). Does not connect:
    /// the first reservation does, so a sidecar starts while Redis is down.
    pub fn new(cfg: &StateCfg) -> Result<RedisStore, super::StateError> {
        let url = cfg
            .redis_url
            .as_deref()
            .ok_or_else(|| super::StateError("state.redis_url is not set".into()))?;
        let mut urls = vec![url];
        urls.extend(cfg.redis_urls.iter().map(String::as_str));
        Self::with_seeds(
            &urls,
            &cfg.namespace,
            cfg.lease,
            cfg.job_idle_ttl,
            cfg.on_unavailable,
            cfg.shards as usize,
        )
    }

    pub fn with(
        url: &str,
        namespace: &str,
        lease: Duration,
        job_idle_ttl: Duration,
        on_unavailable: OnUnavailable,
    ) -> Result<RedisStore, super::StateError> {
        Self::with_seeds(&[url], namespace, lease, job_idle_ttl, on_unavailable, 1)
    }

    /// As [`RedisStore::with`], with more seed nodes: `urls[0]` is `state.redis_url`, the
    /// rest `state.redis_urls`. The first that answers says whether Redis is a cluster
    /// (`INFO cluster`); a cluster is reached through every seed, a single Redis only
    /// through `urls[0]`.
    pub fn with_seeds(
        urls: &[&str],
        namespace: &str,
        lease: Duration,
        job_idle_ttl: Duration,
        on_unavailable: OnUnavailable,
        shards: usize,
    ) -> Result<RedisStore, super::StateError> {
        if urls.is_empty() {
            return Err(super::StateError("state.redis_url is not set".into()));
        }
        // A URL may hold a password: never echo it.
        let clients = urls
            .iter()
            .enumerate()
            .map(|(i, url)| {
                redis::Client::open(*url).map_err(|e| {
                    let key = if i == 0 {
                        "state.redis_url".to_string()
                    } else {
                        format!("state.redis_urls[{}]", i - 1)
                    };
                    super::StateError(format!("{key} is not usable: {:?}", e.kind()))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (clients, conn, cluster, connecting) = (
            Arc::new(clients),
            Arc::new(ArcSwapOption::empty()),
            Arc::new(AtomicBool::new(false)),
            Arc::new(tokio::sync::Mutex::new(())),
        );
        let (down_until, down, last_error, failing_since) = (
            Arc::new(AtomicI64::new(0)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(std::sync::Mutex::new(None)),
            Arc::new(AtomicI64::new(0)),
        );
        let rid_prefix = format!("{:016x}", rand::random::<u64>());
        let shard = |s: usize| {
            let prefix = if s == 0 {
                format!("{{tollgate:{namespace}}}")
            } else {
                format!("{{tollgate:{namespace}:{s}}}")
            };
            Arc::new(Inner {
                clients: clients.clone(),
                conn: conn.clone(),
                cluster: cluster.clone(),
                connecting: connecting.clone(),
                down_until: down_until.clone(),
                down: down.clone(),
                failing_since: failing_since.clone(),
                epoch_key: format!("{prefix}:epoch"),
                rebuild_key: format!("{prefix}:rebuilding"),
                probe_key: format!("{prefix}:probe"),
                prefix,
                lease_ms: lease.as_millis().min(i64::MAX as u128) as i64,
                job_ttl_ms: job_idle_ttl.as_millis().min(i64::MAX as u128) as i64,
                on_unavailable,
                // One id space per shard (a reservation id names its shard).
                rid_prefix: if s == 0 {
                    rid_prefix.clone()
                } else {
                    format!("{rid_prefix}s{s}")
                },
                seq: AtomicU64::new(0),
                reserve: Script::new(RESERVE_LUA),
                settle: Script::new(SETTLE_LUA),
                debts: std::sync::Mutex::new(std::collections::VecDeque::new()),
                paying: AtomicBool::new(false),
                epoch_lua: Script::new(EPOCH_LUA),
                probe_lua: Script::new(PROBE_LUA),
                book: std::sync::Mutex::new(Book::default()),
                syncing: tokio::sync::Mutex::new(()),
                rebuilding: AtomicBool::new(false),
                last_error: last_error.clone(),
                eviction: std::sync::Mutex::new(None),
                last_rebuild: std::sync::Mutex::new(None),
            })
        };
        let shards: Arc<[Arc<Inner>]> = (0..shards.clamp(1, MAX_SHARDS)).map(shard).collect();
        Ok(RedisStore {
            inner: shards[0].clone(),
            shards,
        })
    }

    /// How many shards the counters are spread over (`state.shards`).
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The shard of counter `k`: a stable hash (FNV-1a) of its scope, window and id, so
    /// every replica puts it in the same shard.
    fn shard_of(&self, k: &CounterKey) -> usize {
        let n = self.shards.len();
        if n <= 1 {
            return 0;
        }
        let (w, s) = match k.window {
            Some(w) => (w.window.as_str(), w.start),
            None => ("-", 0),
        };
        let text = format!("{}:{}:{}:{}", k.scope.as_str(), w, s, k.id);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        (h % n as u64) as usize
    }

    /// The hash tag every key of this store starts with.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The Redis key of a counter's hash (its holds and settled ids add `:l` and `:s`).
    pub fn counter_key(&self, k: &CounterKey) -> String {
        self.shards[self.shard_of(k)].counter_key(k)
    }

    /// Whether the last call failed (the store answers "unavailable" for now).
    pub fn is_down(&self) -> bool {
        self.inner.down.load(Ordering::Acquire)
    }

    /// Settlements waiting in the journal to be written to Redis.
    pub fn pending(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.debts).len()).sum()
    }

    /// The readiness probe: one write under the namespace's tag, i.e. what a reservation
    /// needs (a PING answers on a wrong cluster node, out of memory, unauthenticated...).
    /// In `deny` mode a store that cannot take reservations makes the replica unready (it
    /// would refuse every request); in `local` mode it serves on its own ledger, so it stays
    /// ready and only reports the outage. While the counters are being rebuilt the replica
    /// is unready in both modes (it refuses hard-bounded requests).
    pub async fn ready(&self) -> Result<(), String> {
        for (i, shard) in self.shards.iter().enumerate() {
            Self::ready_shard(shard).await.map_err(|e| {
                if self.shards.len() > 1 {
                    format!("shard {i}: {e}")
                } else {
                    e
                }
            })?;
        }
        Ok(())
    }

    async fn ready_shard(inner: &Arc<Inner>) -> Result<(), String> {
        let probe = async {
            let mut c = inner.conn().await.map_err(|_| None)?;
            let mut inv = inner.probe_lua.prepare_invoke();
            inv.key(&inner.probe_key)
                .key(&inner.epoch_key)
                .key(&inner.rebuild_key);
            inv.invoke_async::<(String, i64)>(&mut c)
                .await
                .map_err(Some)
        };
        match probe.await {
            Ok((epoch, flag_ms)) => {
                inner.answered();
                let adopted = lock(&inner.book).epoch.clone();
                if inner.rebuilding.load(Ordering::Acquire) || flag_ms > 0 {
                    return Err(
                        "shared counters are being rebuilt after Redis lost them (STATE_REBUILDING)"
                            .into(),
                    );
                }
                if adopted.is_some_and(|a| *a != *epoch) {
                    return Err("Redis lost the shared counters (epoch marker changed or missing); rebuilding (STATE_REBUILDING)".into());
                }
                Ok(())
            }
            Err(e) => {
                let why = match &e {
                    Some(e) => {
                        inner.failed(e);
                        describe(e)
                    }
                    None => lock(&inner.last_error)
                        .clone()
                        .unwrap_or_else(|| "does not answer".into()),
                };
                match inner.on_unavailable {
                    OnUnavailable::Deny => Err(format!(
                        "redis (state.backend) cannot take reservations: {why}"
                    )),
                    OnUnavailable::Local => Ok(()),
                }
            }
        }
    }

    /// What `/admin/status` shows under `state`.
    pub fn status(&self) -> serde_json::Value {
        let i = &self.inner;
        let policy = lock(&i.eviction).clone();
        let unsafe_ = policy
            .as_deref()
            .is_some_and(|p| p != "noeviction" && p != "unknown");
        let (epoch, counters) = {
            let b = lock(&i.book);
            (b.epoch.as_deref().map(str::to_owned), b.committed.len())
        };
        let mut warnings = Vec::new();
        if unsafe_ {
            warnings.push(format!(
                "Redis maxmemory-policy is {}: it may evict tollgate's counters (they carry TTLs); set noeviction",
                policy.as_deref().unwrap_or("")
            ));
        }
        let last_rebuild = self
            .shards
            .iter()
            .filter_map(|s| lock(&s.last_rebuild).clone())
            .next_back();
        let rebuilding = self
            .shards
            .iter()
            .any(|s| s.rebuilding.load(Ordering::Acquire));
        let counters = counters
            + self.shards[1..]
                .iter()
                .map(|s| lock(&s.book).committed.len())
                .sum::<usize>();
        if last_rebuild.is_some() {
            warnings.push("Redis lost the shared counters; they were rebuilt from the live replicas' journals: usage of replicas that died since may be missing".to_string());
        }
        serde_json::json!({
            "backend": "redis",
            "topology": if i.cluster.load(Ordering::Acquire) { "cluster" } else { "single" },
            "namespace": i.prefix,
            "shards": self.shards.len(),
            "available": !i.down.load(Ordering::Acquire),
            "last_error": *lock(&i.last_error),
            "maxmemory_policy": policy.as_deref().unwrap_or("not read yet"),
            "eviction_unsafe": unsafe_,
            "epoch": epoch,
            "rebuilding": rebuilding,
            "last_rebuild": last_rebuild,
            "journal": {"pending_settlements": self.pending(), "committed_counters": counters},
            "warnings": warnings,
        })
    }

    /// Starts the monitor: checks the epoch marker each second (rebuilding this replica's
    /// share when Redis lost the counters), and reads `maxmemory-policy` at start and every
    /// minute. Needs a Tokio runtime; the task ends with it.
    pub fn start_monitor(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let every_policy = std::env::var("TOLLGATE_STATE_CHECK_INTERVAL_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(|ms| Duration::from_millis(ms.clamp(100, 86_400_000)))
            .unwrap_or(POLICY_EVERY);
        metrics::gauge!(TOLLGATE_STATE_EVICTION_UNSAFE).set(0.0);
        metrics::gauge!(TOLLGATE_STATE_REBUILDING).set(0.0);
        metrics::gauge!(TOLLGATE_STATE_JOURNAL_PENDING).set(0.0);
        let shards = self.shards.clone();
        rt.spawn(async move {
            let mut next_policy = tokio::time::Instant::now();
            loop {
                if tokio::time::Instant::now() >= next_policy {
                    shards[0].check_policy().await;
                    next_policy = tokio::time::Instant::now() + every_policy;
                }
                let (mut rebuilding, mut pending) = (false, 0usize);
                let now = wall_ms();
                for inner in shards.iter() {
                    let _ = inner.sync_epoch().await;
                    rebuilding |= inner.rebuilding.load(Ordering::Acquire);
                    pending += lock(&inner.debts).len();
                    lock(&inner.book).committed.retain(|_, (_, e)| *e > now);
                }
                metrics::gauge!(TOLLGATE_STATE_REBUILDING).set(if rebuilding { 1.0 } else { 0.0 });
                metrics::gauge!(TOLLGATE_STATE_JOURNAL_PENDING).set(pending as f64);
                tokio::time::sleep(EPOCH_EVERY).await;
            }
        });
    }

    /// Reserves and returns the concrete hold (tests and benches settle it with `await`).
    /// A store that is rebuilding its counters answers "unavailable" here. Shard 0 only: for
    /// stores with `state.shards: 1`.
    pub async fn reserve_hold(
        &self,
        parts: &[SharedPart<'_>],
        amount: Amount,
    ) -> Result<(Result<RedisHold, (usize, DimRefusal)>, Vec<Amount>), StoreUnavailable> {
        match self.inner.clone().reserve(parts, amount).await? {
            Reserved::Held(h, c) => Ok((Ok(h), c)),
            Reserved::Refused(p, r, c) => Ok((Err((p, r)), c)),
            Reserved::Rebuilding => Err(StoreUnavailable),
        }
    }
}

/// Hooks for the slices layer (`state/slices.rs`, docs/scale-out-slices.md): the connection,
/// failure reporting, the adopted epoch and the record of committed usage.
impl RedisStore {
    pub(crate) async fn slice_conn(&self) -> Result<Conn, StoreUnavailable> {
        self.inner.conn().await
    }

    pub(crate) fn slice_failed(&self, e: &redis::RedisError) {
        self.inner.failed(e);
    }

    pub(crate) fn slice_answered(&self) {
        self.inner.answered();
    }

    /// The epoch marker's and the rebuilding flag's keys.
    pub(crate) fn slice_marker_keys(&self) -> (&str, &str) {
        (&self.inner.epoch_key, &self.inner.rebuild_key)
    }

    pub(crate) fn lease_ms(&self) -> i64 {
        self.inner.lease_ms
    }

    pub(crate) fn on_unavailable(&self) -> OnUnavailable {
        self.inner.on_unavailable
    }

    /// When a counter's keys expire (ms), as for a per-request hold.
    pub(crate) fn key_expiry(&self, p: &SharedPart<'_>, now: Millis) -> i64 {
        self.inner.expiry(p, now)
    }

    pub(crate) fn epoch(&self) -> Option<Arc<str>> {
        lock(&self.inner.book).epoch.clone()
    }

    /// Makes sure an epoch is adopted and this replica's rebuild is done, as before a
    /// reservation. `Ok(false)`: rebuilding.
    pub(crate) async fn slice_epoch_ready(&self) -> Result<bool, StoreUnavailable> {
        if lock(&self.inner.book).epoch.is_none() || self.inner.rebuilding.load(Ordering::Acquire) {
            self.inner.sync_epoch().await?;
        }
        Ok(!self.inner.rebuilding.load(Ordering::Acquire))
    }

    /// Compares the epoch marker now (a script said it is not ours).
    pub(crate) async fn slice_sync(&self) {
        let _ = self.inner.sync_epoch().await;
    }

    /// Records a slice's batch of usage in the journal of committed usage, under the lock
    /// of the epoch switch. `true`: the slice's epoch is the adopted one, the caller writes
    /// the batch. `false`: it is not; the usage is written here as a fresh commit in the
    /// adopted epoch (as a settle of a hold of an old epoch), and the slice is gone.
    pub(crate) fn slice_book(
        &self,
        key: &str,
        expiry: i64,
        used: Amount,
        epoch: &Option<Arc<str>>,
    ) -> bool {
        let slot = Slot {
            keys: vec![key.to_owned(), format!("{key}:l"), format!("{key}:s")],
            expires: vec![expiry],
            member: String::new(),
            rid_len: 0,
            epoch: epoch.clone(),
        };
        {
            let mut b = lock(&self.inner.book);
            if b.epoch == *epoch {
                b.record(&slot, used, wall_ms());
                return true;
            }
        }
        if used != Amount::ZERO {
            self.inner.finish(slot, Some(used), false);
        }
        false
    }
}

impl Inner {
    fn counter_key(&self, k: &CounterKey) -> String {
        let (w, s) = match k.window {
            Some(w) => (w.window.as_str(), w.start),
            None => ("-", 0),
        };
        format!(
            "{}:c:{}:{}:{}:{}",
            self.prefix,
            k.scope.as_str(),
            w,
            s,
            k.id
        )
    }

    async fn conn(&self) -> Result<Conn, StoreUnavailable> {
        let now = wall_ms();
        if let Some(c) = self.conn.load_full() {
            // A cluster connection is kept across failures (it reconnects to the nodes by
            // itself); it fails fast for a second after a node did not answer.
            if matches!(*c, Conn::Cluster(_)) && now < self.down_until.load(Ordering::Acquire) {
                return Err(StoreUnavailable);
            }
            return Ok((*c).clone());
        }
        if now < self.down_until.load(Ordering::Acquire) {
            return Err(StoreUnavailable);
        }
        self.connect().await
    }

    /// Connects now (even inside the fail-fast second: a lost reply's one retry). The first
    /// seed that answers says, through `INFO cluster`, whether this is a Redis Cluster; then
    /// the cluster client is built over every seed. A non-cluster Redis is used only when it
    /// is `state.redis_url` (the extra seeds are for a cluster).
    async fn connect(&self) -> Result<Conn, StoreUnavailable> {
        let _g = self.connecting.lock().await;
        if let Some(c) = self.conn.load_full() {
            return Ok((*c).clone());
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(REDIS_TIMEOUT))
            .set_response_timeout(Some(REDIS_TIMEOUT));
        let mut last: Option<redis::RedisError> = None;
        for (i, client) in self.clients.iter().enumerate() {
            let mut c = match client
                .get_multiplexed_async_connection_with_config(&cfg)
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let info: Result<String, _> =
                redis::cmd("INFO").arg("cluster").query_async(&mut c).await;
            let cluster = match info {
                Ok(text) => text.lines().any(|l| l.trim() == "cluster_enabled:1"),
                // INFO refused (ACL, renamed): not a cluster as far as tollgate can tell.
                Err(e) if e.code().is_some() => false,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let conn = if cluster {
                match self.cluster_connect().await {
                    Ok(cc) => Conn::Cluster(cc),
                    Err(e) => {
                        last = Some(e);
                        break;
                    }
                }
            } else if i == 0 {
                Conn::Single(c)
            } else {
                tracing::warn!(
                    seed = i - 1,
                    "state: state.redis_urls[{}] is not a Redis Cluster node; the extra seeds are for a cluster, ignored",
                    i - 1
                );
                continue;
            };
            if cluster && !self.cluster.swap(true, Ordering::AcqRel) {
                tracing::info!(
                    seeds = self.clients.len(),
                    "state: Redis is a cluster (cluster_enabled:1): using the cluster client (MOVED, ASK, TRYAGAIN and failover are followed)"
                );
            } else if !cluster {
                self.cluster.store(false, Ordering::Release);
            }
            self.conn.store(Some(Arc::new(conn.clone())));
            return Ok(conn);
        }
        match last {
            Some(e) => self.failed(&e),
            None => self
                .down_until
                .store(wall_ms() + RETRY_AFTER_FAILURE_MS, Ordering::Release),
        }
        Err(StoreUnavailable)
    }

    /// The cluster client over every seed, with tollgate's timeouts and a short retry wait.
    async fn cluster_connect(&self) -> Result<ClusterConnection, redis::RedisError> {
        let seeds: Vec<redis::ConnectionInfo> = self
            .clients
            .iter()
            .map(|c| c.get_connection_info().clone())
            .collect();
        let client = redis::cluster::ClusterClientBuilder::new(seeds)
            .connection_timeout(REDIS_TIMEOUT)
            .response_timeout(REDIS_TIMEOUT)
            .overall_response_timeout(Some(CLUSTER_CALL_TIMEOUT))
            .retries(CLUSTER_RETRIES)
            .min_retry_wait(CLUSTER_RETRY_MIN_MS)
            .max_retry_wait(CLUSTER_RETRY_MAX_MS)
            .build()?;
        tokio::time::timeout(CLUSTER_CALL_TIMEOUT, client.get_async_connection())
            .await
            .unwrap_or_else(|_| {
                Err(redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "cluster connect",
                )))
            })
    }

    /// Marks Redis down: drop the connection, fail fast for a second, say so (once per
    /// outage, and again when the error changes), naming the error as Redis named it.
    fn failed(&self, e: &redis::RedisError) {
        let cluster = self
            .conn
            .load()
            .as_deref()
            .is_some_and(|c| matches!(c, Conn::Cluster(_)));
        let now = wall_ms();
        let since =
            match self
                .failing_since
                .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => now,
                Err(v) => v,
            };
        // A cluster connection follows the cluster by itself; one that has failed for this
        // long is rebuilt from the seeds (the whole cluster may have been replaced).
        if !cluster || now - since > CLUSTER_RECONNECT_AFTER_MS {
            self.conn.store(None);
        }
        // A cluster's refusal (TRYAGAIN, CLUSTERDOWN... after the client's own retries) is
        // not a node that does not answer: the next call tries again at once.
        if !cluster || e.code().is_none() {
            self.down_until
                .store(wall_ms() + RETRY_AFTER_FAILURE_MS, Ordering::Release);
        }
        let why = describe(e);
        let changed = {
            let mut last = lock(&self.last_error);
            let changed = last.as_deref() != Some(why.as_str());
            *last = Some(why.clone());
            changed
        };
        let what = if e.code().is_some() {
            "Redis refuses tollgate's calls"
        } else {
            "Redis does not answer"
        };
        if !self.down.swap(true, Ordering::AcqRel) || changed {
            match self.on_unavailable {
                OnUnavailable::Deny => tracing::error!(
                    error = %why,
                    "state: {what} ({why}); state.on_unavailable=deny: refusing governed requests (503) until it does"
                ),
                OnUnavailable::Local => tracing::warn!(
                    error = %why,
                    "state: {what} ({why}); state.on_unavailable=local: THIS REPLICA NOW COUNTS ALONE in its in-memory ledger (shared budgets are not enforced across replicas) until Redis answers again"
                ),
            }
        }
    }

    fn answered(&self) {
        if self.failing_since.load(Ordering::Acquire) != 0 {
            self.failing_since.store(0, Ordering::Release);
        }
        if self.down.swap(false, Ordering::AcqRel) {
            tracing::info!("state: Redis answers again; counters are shared again");
        }
    }

    fn expiry(&self, p: &SharedPart<'_>, now: Millis) -> i64 {
        if p.expires_at == i64::MAX {
            now.saturating_add(self.job_ttl_ms)
                .saturating_add(self.lease_ms)
        } else {
            p.expires_at
                .saturating_add(self.lease_ms)
                .saturating_add(KEY_SLACK_MS)
        }
    }

    fn rid(&self) -> String {
        format!(
            "{}-{:x}",
            self.rid_prefix,
            self.seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// A fresh reservation id and the keys and expiries of `parts`, holding `amount`, in
    /// the adopted epoch.
    fn slot(&self, parts: &[SharedPart<'_>], amount: Amount, now: Millis) -> Slot {
        let rid = self.rid();
        let mut keys = Vec::with_capacity(parts.len() * 3);
        for p in parts {
            let k = self.counter_key(p.key);
            let (l, s) = (format!("{k}:l"), format!("{k}:s"));
            keys.extend([k, l, s]);
        }
        Slot {
            keys,
            expires: parts.iter().map(|p| self.expiry(p, now)).collect(),
            member: format!("{rid}:{}:{}:{}", amount.tokens, amount.requests, amount.usd),
            rid_len: rid.len(),
            epoch: lock(&self.book).epoch.clone(),
        }
    }

    /// One round trip of `settle.lua` for `slot`: commits `actual` (or releases when `None`).
    async fn settle_slot(
        &self,
        slot: &Slot,
        actual: Option<Amount>,
    ) -> Result<Settled, StoreUnavailable> {
        let mut conn = self.conn().await?;
        let a = actual.unwrap_or_default();
        let mut inv = self.settle.prepare_invoke();
        for k in &slot.keys {
            inv.key(k);
        }
        inv.key(&self.epoch_key);
        inv.arg(&slot.member)
            .arg(&slot.member[..slot.rid_len])
            .arg(if actual.is_some() { 1 } else { 0 })
            .arg(a.tokens)
            .arg(a.requests)
            .arg(a.usd)
            .arg(SETTLED_KEEP_MS)
            .arg(slot.expires.len());
        for e in &slot.expires {
            inv.arg(*e);
        }
        inv.arg(slot.epoch.as_deref().unwrap_or(""));
        match inv.invoke_async::<i64>(&mut conn).await {
            Ok(n) => {
                self.answered();
                Ok(if n < 0 {
                    Settled::Lost
                } else {
                    Settled::Done(n)
                })
            }
            Err(e) => {
                self.failed(&e);
                Err(StoreUnavailable)
            }
        }
    }

    /// Ends a reservation: records committed usage in the journal, then writes the
    /// settlement to Redis (in the background; queued when Redis does not take it).
    /// A hold made in an epoch this replica has left is not written as such: its release
    /// is moot (Redis lost it), and its usage, recorded after the rebuild was taken, is
    /// written as a fresh commit in the adopted epoch.
    fn finish(self: &Arc<Self>, slot: Slot, actual: Option<Amount>, owed: bool) {
        let slot = {
            let mut book = lock(&self.book);
            if let Some(a) = actual {
                book.record(&slot, a, wall_ms());
            }
            if slot.epoch == book.epoch {
                Some(slot)
            } else if actual.is_some_and(|a| a != Amount::ZERO) {
                let rid = self.rid();
                Some(Slot {
                    member: format!("{rid}:0:0:0"),
                    rid_len: rid.len(),
                    epoch: book.epoch.clone(),
                    keys: slot.keys,
                    expires: slot.expires,
                })
            } else {
                None
            }
        };
        let Some(slot) = slot else {
            return;
        };
        if owed {
            self.owe(Debt { slot, actual });
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime (process ending): the lease releases the hold
        };
        let inner = self.clone();
        rt.spawn(async move {
            match inner.settle_slot(&slot, actual).await {
                Ok(Settled::Done(_)) => {}
                // The rebuild into the new epoch carries this usage (recorded above).
                Ok(Settled::Lost) => {
                    let _ = inner.sync_epoch().await;
                }
                Err(StoreUnavailable) => inner.owe(Debt { slot, actual }),
            }
        });
    }

    /// Queues a settlement Redis did not take, to be replayed (at most `MAX_DEBTS`; past
    /// that the oldest is dropped, said loudly).
    fn owe(self: &Arc<Self>, debt: Debt) {
        {
            let mut debts = lock(&self.debts);
            if debts.len() >= MAX_DEBTS {
                debts.pop_front();
                tracing::error!(
                    "state: more than {MAX_DEBTS} settlements wait for Redis; the oldest one is dropped (its usage stays counted only in this replica)"
                );
            }
            debts.push_back(debt);
        }
        if self.paying.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.paying.store(false, Ordering::Release);
            return;
        };
        rt.spawn(self.clone().pay_debts());
    }

    /// Replays the journal, oldest first, waiting out the outage; each write is idempotent
    /// by reservation id, so a retried write never counts twice. An entry of an epoch this
    /// replica has left is dropped: the rebuild into the adopted epoch carried its usage.
    async fn pay_debts(self: Arc<Self>) {
        let (mut paid, mut folded) = (0u64, 0u64);
        loop {
            let next = lock(&self.debts).pop_front();
            let Some(debt) = next else {
                self.paying.store(false, Ordering::Release);
                // A debt queued between the pop and the store above would have no payer.
                let empty = lock(&self.debts).is_empty();
                if empty || self.paying.swap(true, Ordering::AcqRel) {
                    if paid > 0 || folded > 0 {
                        tracing::info!(
                            written = paid,
                            in_rebuild = folded,
                            "state: settlements journaled while Redis was away were written back"
                        );
                    }
                    return;
                }
                continue;
            };
            if debt.slot.epoch != lock(&self.book).epoch {
                folded += 1;
                continue;
            }
            match self.settle_slot(&debt.slot, debt.actual).await {
                Ok(Settled::Done(_)) => paid += 1,
                Ok(Settled::Lost) => {
                    // Adopting the new epoch folds this entry into the rebuild.
                    if self.sync_epoch().await.is_err() {
                        lock(&self.debts).push_front(debt);
                        tokio::time::sleep(Duration::from_millis(RETRY_AFTER_FAILURE_MS as u64))
                            .await;
                    }
                }
                Err(StoreUnavailable) => {
                    lock(&self.debts).push_front(debt);
                    tokio::time::sleep(Duration::from_millis(RETRY_AFTER_FAILURE_MS as u64)).await;
                }
            }
        }
    }

    /// Compares the epoch marker with the adopted one. Absent: writes a new one (with the
    /// rebuilding flag when this replica has history: it was working in an epoch, or it has
    /// usage to give back). Different: adopts it, raises the flag, and writes this
    /// replica's record of committed usage into it. Then applies any pending rebuild.
    async fn sync_epoch(self: &Arc<Self>) -> Result<(), StoreUnavailable> {
        let _g = self.syncing.lock().await;
        let mut conn = self.conn().await?;
        let history = {
            let b = lock(&self.book);
            b.epoch.is_some() || !b.committed.is_empty()
        };
        let fresh = format!("{:016x}", rand::random::<u64>());
        let mut inv = self.epoch_lua.prepare_invoke();
        inv.key(&self.epoch_key)
            .key(&self.rebuild_key)
            .arg(&fresh)
            .arg(if history { REBUILD_GRACE_MS } else { 0 });
        let (epoch, created): (String, i64) = match inv.invoke_async(&mut conn).await {
            Ok(r) => r,
            Err(e) => {
                self.failed(&e);
                return Err(StoreUnavailable);
            }
        };
        self.answered();
        let epoch: Arc<str> = Arc::from(epoch);
        let adopt = {
            let mut b = lock(&self.book);
            if b.epoch.as_deref() == Some(&*epoch) {
                None
            } else {
                let now = wall_ms();
                b.committed.retain(|_, (_, e)| *e > now);
                let counters: Vec<_> = b
                    .committed
                    .iter()
                    .map(|(k, (a, e))| (k.clone(), *a, *e))
                    .collect();
                let was = b.epoch.replace(epoch.clone());
                b.pending = Some(Rebuild {
                    epoch: epoch.clone(),
                    counters,
                });
                self.rebuilding.store(true, Ordering::Release);
                Some(was)
            }
        };
        if let Some(was) = adopt {
            let n = lock(&self.book)
                .pending
                .as_ref()
                .map_or(0, |p| p.counters.len());
            if was.is_some() || n > 0 {
                if created == 0 {
                    // Another replica wrote the marker; hold the fleet until this share is in.
                    let _: Result<(), _> = redis::cmd("SET")
                        .arg(&self.rebuild_key)
                        .arg(&*epoch)
                        .arg("PX")
                        .arg(REBUILD_GRACE_MS)
                        .query_async(&mut conn)
                        .await;
                }
                tracing::error!(
                    counters = n,
                    "state: REDIS LOST THE SHARED COUNTERS (epoch marker {}: restart without persistence, FLUSHALL or eviction); rebuilding the windows in force from this replica's journal, hard-bounded requests get 503 STATE_REBUILDING until done. Usage of replicas that died since is MISSING from the rebuilt counters",
                    if created == 1 { "missing" } else { "changed" }
                );
            }
        }
        self.apply_pending(&mut conn).await
    }

    /// Writes the pending rebuild (this replica's committed usage per counter) into its
    /// epoch: one `settle.lua` commit per counter, idempotent by a reservation id made of
    /// this replica and the epoch.
    async fn apply_pending(self: &Arc<Self>, conn: &mut Conn) -> Result<(), StoreUnavailable> {
        let Some(rb) = lock(&self.book).pending.clone() else {
            return Ok(());
        };
        let rid = format!("rb-{}-{}", self.rid_prefix, rb.epoch);
        let mut total = Amount::ZERO;
        for (key, amount, exp) in &rb.counters {
            let mut inv = self.settle.prepare_invoke();
            inv.key(key)
                .key(format!("{key}:l"))
                .key(format!("{key}:s"))
                .key(&self.epoch_key);
            inv.arg(format!("{rid}:0:0:0"))
                .arg(&rid)
                .arg(1)
                .arg(amount.tokens)
                .arg(amount.requests)
                .arg(amount.usd)
                .arg(SETTLED_KEEP_MS)
                .arg(1)
                .arg(*exp)
                .arg(&*rb.epoch);
            match inv.invoke_async::<i64>(conn).await {
                Ok(n) if n < 0 => {
                    // Lost again meanwhile: the next check starts over in the new epoch.
                    return Err(StoreUnavailable);
                }
                Ok(_) => total = sat_add(total, *amount),
                Err(e) => {
                    self.failed(&e);
                    return Err(StoreUnavailable);
                }
            }
        }
        {
            let mut b = lock(&self.book);
            if b.pending.as_ref().is_some_and(|p| p.epoch == rb.epoch) {
                b.pending = None;
                self.rebuilding.store(false, Ordering::Release);
            }
        }
        if !rb.counters.is_empty() {
            tracing::warn!(
                counters = rb.counters.len(),
                tokens = total.tokens,
                requests = total.requests,
                usd_micros = total.usd,
                "state: this replica's share of the shared counters is rebuilt in Redis (usage of replicas that died since may be missing)"
            );
            *lock(&self.last_rebuild) = Some(serde_json::json!({
                "at_ms": wall_ms(),
                "epoch": &*rb.epoch,
                "counters": rb.counters.len(),
                "tokens": total.tokens,
                "requests": total.requests,
                "usd_micros": total.usd,
                "warning": "usage of replicas that died since may be missing",
            }));
        }
        Ok(())
    }

    /// Reads `maxmemory-policy`; warns when it may evict tollgate's keys; says "unknown" once
    /// when CONFIG is refused.
    async fn check_policy(&self) {
        let Ok(mut conn) = self.conn().await else {
            return;
        };
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        let policy = match &mut conn {
            Conn::Single(c) => {
                let got: Result<Vec<String>, _> = cmd.query_async(c).await;
                match got {
                    Ok(v) => v.get(1).map(|p| p.chars().take(64).collect::<String>()),
                    Err(e) if reply_lost(&e) => return,
                    Err(_) => None,
                }
            }
            // CONFIG GET answers for one node: ask every master (the namespace's slot may
            // move to any of them) and report the least safe answer.
            Conn::Cluster(c) => {
                let route = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match c.route_command(cmd, route).await {
                    Ok(v) => cluster_policy(v),
                    Err(e) if reply_lost(&e) => return,
                    Err(_) => None,
                }
            }
        };
        let policy = policy.unwrap_or_else(|| "unknown".to_string());
        let before = lock(&self.eviction).replace(policy.clone());
        let unsafe_ = policy != "noeviction" && policy != "unknown";
        metrics::gauge!(TOLLGATE_STATE_EVICTION_UNSAFE).set(if unsafe_ { 1.0 } else { 0.0 });
        if before.as_deref() == Some(policy.as_str()) {
            return;
        }
        if unsafe_ {
            tracing::warn!(
                maxmemory_policy = %policy,
                "state: Redis maxmemory-policy is {policy}, not noeviction: under memory pressure Redis may evict tollgate's counters (they carry TTLs, so volatile-* policies evict exactly them) and a budget would start over; set maxmemory-policy noeviction"
            );
        } else if policy == "unknown" {
            tracing::warn!(
                "state: cannot read Redis maxmemory-policy (CONFIG is disabled or not allowed): unknown; make sure it is noeviction"
            );
        } else if before.is_some() {
            tracing::info!("state: Redis maxmemory-policy is noeviction again");
        }
    }

    /// The hold of a reservation `reserve.lua` made (or may have made) in `slot`.
    fn hold(self: &Arc<Self>, slot: Slot) -> RedisHold {
        RedisHold {
            inner: self.clone(),
            slot,
            owed: false,
            settled: false,
        }
    }

    async fn reserve(
        self: Arc<Self>,
        parts: &[SharedPart<'_>],
        amount: Amount,
    ) -> Result<Reserved, StoreUnavailable> {
        let mut conn = self.conn().await?;
        if lock(&self.book).epoch.is_none() || self.rebuilding.load(Ordering::Acquire) {
            self.sync_epoch().await?;
            if self.rebuilding.load(Ordering::Acquire) {
                return Ok(Reserved::Rebuilding);
            }
        }
        let slot = self.slot(parts, amount, wall_ms());
        let mut inv = self.reserve.prepare_invoke();
        for k in &slot.keys {
            inv.key(k);
        }
        inv.key(&self.epoch_key).key(&self.rebuild_key);
        inv.arg(&slot.member)
            .arg(amount.tokens)
            .arg(amount.requests)
            .arg(amount.usd)
            .arg(self.lease_ms)
            .arg(parts.len());
        for (p, e) in parts.iter().zip(&slot.expires) {
            for h in p.hard {
                inv.arg(h.map_or(-1i64, |v| v.min(i64::MAX as u64) as i64));
            }
            inv.arg(*e);
        }
        inv.arg(slot.epoch.as_deref().unwrap_or(""));
        let reply: Vec<i64> = match inv.invoke_async(&mut conn).await {
            Ok(r) => r,
            Err(e) => {
                let lost = reply_lost(&e);
                self.failed(&e);
                if !lost {
                    // Redis refused the call (MOVED, OOM, NOAUTH...): the script held nothing.
                    return Err(StoreUnavailable);
                }
                // The reply may be lost with the hold made: retry once, same reservation id
                // (the script holds an id once), on a fresh connection.
                let retried = match self.connect().await {
                    Ok(mut c) => match inv.invoke_async::<Vec<i64>>(&mut c).await {
                        Ok(r) => Some(r),
                        Err(e) => {
                            self.failed(&e);
                            None
                        }
                    },
                    Err(_) => None,
                };
                match retried {
                    Some(r) => r,
                    None => {
                        // Release what it may hold once Redis answers (journaled, idempotent;
                        // a reserve that lands after its release holds nothing).
                        self.owe(Debt { slot, actual: None });
                        return Err(StoreUnavailable);
                    }
                }
            }
        };
        self.answered();
        let n = parts.len();
        let committed_from = |off: usize| -> Vec<Amount> {
            (0..n)
                .map(|i| {
                    let g = |d: usize| reply.get(off + 3 * i + d).map_or(0, |v| count(*v));
                    Amount {
                        tokens: g(0),
                        requests: g(1),
                        usd: g(2),
                    }
                })
                .collect()
        };
        match reply.first() {
            Some(1) => Ok(Reserved::Held(self.hold(slot), committed_from(1))),
            Some(0) if reply.len() >= 5 => {
                let part = (count(reply[1]) as usize).min(n.saturating_sub(1));
                Ok(Reserved::Refused(
                    part,
                    refusal_at(&reply),
                    committed_from(5),
                ))
            }
            Some(2) => {
                // The marker is not ours: Redis lost the counters (or another replica rebuilt
                // them since). Adopt the epoch and give back this replica's share first.
                let _ = self.sync_epoch().await;
                Ok(Reserved::Rebuilding)
            }
            Some(3) => Ok(Reserved::Rebuilding),
            _ => {
                tracing::error!(?reply, "state: unexpected reply from the reserve script");
                self.owe(Debt { slot, actual: None });
                Err(StoreUnavailable)
            }
        }
    }
}

impl SharedCounters for RedisStore {
    fn reserve<'a>(
        &'a self,
        parts: &'a [SharedPart<'a>],
        amount: Amount,
        _now: Millis,
    ) -> ReserveFuture<'a> {
        Box::pin(async move {
            if self.shards.len() > 1 {
                return self.reserve_sharded(parts, amount).await;
            }
            Ok(match self.inner.clone().reserve(parts, amount).await? {
                Reserved::Held(hold, committed) => SharedReply::Held {
                    hold: Box::new(hold),
                    committed,
                },
                Reserved::Refused(part, refusal, committed) => SharedReply::Refused {
                    part,
                    refusal,
                    committed: committed.into_iter().map(Some).collect(),
                },
                Reserved::Rebuilding => SharedReply::Rebuilding,
            })
        })
    }

    fn offline_hold(&self, parts: &[SharedPart<'_>], now: Millis) -> Option<Box<dyn SharedHold>> {
        let holds = self
            .by_shard(parts)
            .into_iter()
            .map(|(s, idx)| {
                let inner = &self.shards[s];
                let sub: Vec<SharedPart<'_>> = idx.iter().map(|&i| parts[i].clone()).collect();
                RedisHold {
                    inner: inner.clone(),
                    slot: inner.slot(&sub, Amount::ZERO, now),
                    owed: true,
                    settled: false,
                }
            })
            .collect();
        Some(Box::new(ShardedHold { holds }))
    }
}

/// The holds of one reservation spread over shards (one per shard it touched). Settling
/// settles each; dropping it releases each.
#[derive(Debug)]
struct ShardedHold {
    holds: Vec<RedisHold>,
}

impl SharedHold for ShardedHold {
    fn settle(self: Box<Self>, actual: Amount) {
        for h in self.holds {
            Box::new(h).settle(actual);
        }
    }
}

impl RedisStore {
    /// `parts`' indices grouped by shard, shards in ascending order.
    fn by_shard(&self, parts: &[SharedPart<'_>]) -> Vec<(usize, Vec<usize>)> {
        let mut m: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (i, p) in parts.iter().enumerate() {
            m.entry(self.shard_of(p.key)).or_default().push(i);
        }
        m.into_iter().collect()
    }

    /// A reservation over counters in several shards (several cluster slots): taken shard
    /// by shard, each one `reserve.lua` call (an atomic check-and-hold of that shard's
    /// counters). When a shard refuses (or is rebuilding, or does not answer) the holds
    /// already taken in earlier shards are released (dropped: written in the background,
    /// journaled if Redis does not take them), so nothing stays held and no counter is ever
    /// held past its hard bound. Meanwhile those short-lived holds may make another request
    /// see less room than there is (refusing more, never admitting over a bound).
    async fn reserve_sharded(
        &self,
        parts: &[SharedPart<'_>],
        amount: Amount,
    ) -> Result<SharedReply, StoreUnavailable> {
        let mut committed: Vec<Option<Amount>> = vec![None; parts.len()];
        let mut holds = Vec::new();
        for (s, idx) in self.by_shard(parts) {
            let sub: Vec<SharedPart<'_>> = idx.iter().map(|&i| parts[i].clone()).collect();
            match self.shards[s].clone().reserve(&sub, amount).await? {
                Reserved::Held(h, c) => {
                    for (&i, a) in idx.iter().zip(c) {
                        committed[i] = Some(a);
                    }
                    holds.push(h);
                }
                Reserved::Refused(part, refusal, c) => {
                    for (&i, a) in idx.iter().zip(c) {
                        committed[i] = Some(a);
                    }
                    drop(holds);
                    return Ok(SharedReply::Refused {
                        part: idx.get(part).copied().unwrap_or(0),
                        refusal,
                        committed,
                    });
                }
                Reserved::Rebuilding => return Ok(SharedReply::Rebuilding),
            }
        }
        Ok(SharedReply::Held {
            hold: Box::new(ShardedHold { holds }),
            committed: committed
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
        })
    }
}

impl RedisHold {
    /// Settles now, in one round trip: commits `actual` (or releases when `None`). Returns
    /// how many counters this call settled (0 = settled before: the call is idempotent; also
    /// 0 when Redis lost the hold's epoch). Committed usage is recorded in the journal.
    pub async fn settle_now(&mut self, actual: Option<Amount>) -> Result<i64, StoreUnavailable> {
        let n = self.inner.settle_slot(&self.slot, actual).await?;
        if let Some(a) = actual.filter(|_| !self.settled) {
            lock(&self.inner.book).record(&self.slot, a, wall_ms());
        }
        self.settled = true;
        Ok(match n {
            Settled::Done(n) => n,
            Settled::Lost => 0,
        })
    }
}

impl SharedHold for RedisHold {
    fn settle(mut self: Box<Self>, actual: Amount) {
        self.settled = true; // settled here; Drop must not release
        let slot = std::mem::take(&mut self.slot);
        self.inner.finish(slot, Some(actual), self.owed);
    }
}

impl Drop for RedisHold {
    fn drop(&mut self) {
        // An owed hold held nothing: nothing to release.
        if self.settled || self.owed {
            return;
        }
        self.settled = true;
        let slot = std::mem::take(&mut self.slot);
        self.inner.finish(slot, None, false);
    }
}
