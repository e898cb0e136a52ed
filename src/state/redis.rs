//! Counters shared by replicas in Redis, through two server-side Lua scripts:
//! `reserve.lua` (one round trip: purge expired leases, check every counter's hard limits in
//! every dimension, hold the worst case on all of them or none) and `settle.lua` (one round
//! trip: release the hold, commit the actual, idempotent by reservation id).
//!
//! Key layout (all under ONE hash tag, so a script's keys share a Redis Cluster slot):
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
//! on one cluster node: Cluster-safe, not sharded — one namespace's traffic is one node's.
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
use redis::{AsyncConnectionConfig, Script};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const RESERVE_LUA: &str = include_str!("reserve.lua");
const SETTLE_LUA: &str = include_str!("settle.lua");

/// Connect and response timeout for every Redis call.
pub const REDIS_TIMEOUT: Duration = Duration::from_millis(500);
/// After a failure, calls are answered "unavailable" without trying for this long.
pub const RETRY_AFTER_FAILURE_MS: i64 = 1000;
/// Extra life of a window's keys past the window end (plus the lease).
const KEY_SLACK_MS: i64 = 60_000;
/// How long a settled reservation id is remembered (settle retries within it are no-ops).
const SETTLED_KEEP_MS: i64 = 3_600_000;
/// Background settle attempts before the hold is left to its lease.
const SETTLE_TRIES: u32 = 4;
/// Most requests' usage queued for write-back after an outage (`state.on_unavailable: local`).
const MAX_DEBTS: usize = 100_000;

fn wall_ms() -> Millis {
    jiff::Timestamp::now().as_millisecond()
}

/// A Redis-backed shared counter store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: redis::Client,
    conn: ArcSwapOption<MultiplexedConnection>,
    connecting: tokio::sync::Mutex<()>,
    /// Wall-clock ms until which calls fail fast after a failure.
    down_until: AtomicI64,
    down: AtomicBool,
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
}

/// Where one reservation lives in Redis: its counters' keys (3 each), their expiries, and its
/// member `rid:t:r:u` (the amount held; `rid:0:0:0` for a hold that holds nothing).
#[derive(Debug, Default)]
struct Slot {
    keys: Vec<String>,
    expires: Vec<i64>,
    member: String,
    rid_len: usize,
}

/// A settlement owed to Redis: usage committed by this replica alone during an outage.
#[derive(Debug)]
struct Debt {
    slot: Slot,
    actual: Amount,
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

impl RedisStore {
    /// A store for `cfg` (`state.redis_url`, `lease`, `namespace`, ...). Does not connect:
    /// the first reservation does, so a sidecar starts while Redis is down.
    pub fn new(cfg: &StateCfg) -> Result<RedisStore, super::StateError> {
        let url = cfg
            .redis_url
            .as_deref()
            .ok_or_else(|| super::StateError("state.redis_url is not set".into()))?;
        Self::with(
            url,
            &cfg.namespace,
            cfg.lease,
            cfg.job_idle_ttl,
            cfg.on_unavailable,
        )
    }

    pub fn with(
        url: &str,
        namespace: &str,
        lease: Duration,
        job_idle_ttl: Duration,
        on_unavailable: OnUnavailable,
    ) -> Result<RedisStore, super::StateError> {
        // The URL may hold a password: never echo it.
        let client = redis::Client::open(url).map_err(|e| {
            super::StateError(format!("state.redis_url is not usable: {:?}", e.kind()))
        })?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                client,
                conn: ArcSwapOption::empty(),
                connecting: tokio::sync::Mutex::new(()),
                down_until: AtomicI64::new(0),
                down: AtomicBool::new(false),
                prefix: format!("{{tollgate:{namespace}}}"),
                lease_ms: lease.as_millis() as i64,
                job_ttl_ms: job_idle_ttl.as_millis() as i64,
                on_unavailable,
                rid_prefix: format!("{:016x}", rand::random::<u64>()),
                seq: AtomicU64::new(0),
                reserve: Script::new(RESERVE_LUA),
                settle: Script::new(SETTLE_LUA),
                debts: std::sync::Mutex::new(std::collections::VecDeque::new()),
                paying: AtomicBool::new(false),
            }),
        })
    }

    /// The hash tag every key of this store starts with.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The Redis key of a counter's hash (its holds and settled ids add `:l` and `:s`).
    pub fn counter_key(&self, k: &CounterKey) -> String {
        self.inner.counter_key(k)
    }

    /// Whether the last call failed (the store answers "unavailable" for now).
    pub fn is_down(&self) -> bool {
        self.inner.down.load(Ordering::Acquire)
    }

    /// The readiness probe: one PING. In `deny` mode an unreachable Redis makes the replica
    /// unready (it would refuse every request); in `local` mode it serves on its own ledger, so
    /// it stays ready and only reports the outage. A failed PING marks the store down like a
    /// failed reservation; a good one lets the next reservation reconnect at once.
    pub async fn ready(&self) -> Result<(), String> {
        let ping = async {
            let mut c = self.inner.conn().await.map_err(|_| None)?;
            redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .map_err(Some)
        };
        match ping.await {
            Ok(_) => Ok(()),
            Err(e) => {
                if let Some(e) = &e {
                    self.inner.failed(e);
                }
                match self.inner.on_unavailable {
                    OnUnavailable::Deny => Err("redis (state.backend) does not answer".into()),
                    OnUnavailable::Local => Ok(()),
                }
            }
        }
    }

    /// Reserves and returns the concrete hold (tests and benches settle it with `await`).
    pub async fn reserve_hold(
        &self,
        parts: &[SharedPart<'_>],
        amount: Amount,
    ) -> Result<(Result<RedisHold, (usize, DimRefusal)>, Vec<Amount>), StoreUnavailable> {
        self.inner.clone().reserve(parts, amount).await
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

    async fn conn(&self) -> Result<MultiplexedConnection, StoreUnavailable> {
        if let Some(c) = self.conn.load_full() {
            return Ok((*c).clone());
        }
        let now = wall_ms();
        if now < self.down_until.load(Ordering::Acquire) {
            return Err(StoreUnavailable);
        }
        let _g = self.connecting.lock().await;
        if let Some(c) = self.conn.load_full() {
            return Ok((*c).clone());
        }
        // The connect this call waited behind may have just failed: do not queue another.
        if wall_ms() < self.down_until.load(Ordering::Acquire) {
            return Err(StoreUnavailable);
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(REDIS_TIMEOUT))
            .set_response_timeout(Some(REDIS_TIMEOUT));
        match self
            .client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
        {
            Ok(c) => {
                self.conn.store(Some(Arc::new(c.clone())));
                Ok(c)
            }
            Err(e) => {
                self.failed(&e);
                Err(StoreUnavailable)
            }
        }
    }

    /// Marks Redis down: drop the connection, fail fast for a second, say so once.
    fn failed(&self, e: &redis::RedisError) {
        self.conn.store(None);
        self.down_until
            .store(wall_ms() + RETRY_AFTER_FAILURE_MS, Ordering::Release);
        if !self.down.swap(true, Ordering::AcqRel) {
            match self.on_unavailable {
                OnUnavailable::Deny => tracing::error!(
                    error = %e,
                    "state: Redis does not answer; state.on_unavailable=deny: refusing governed requests (503) until it does"
                ),
                OnUnavailable::Local => tracing::warn!(
                    error = %e,
                    "state: Redis does not answer; state.on_unavailable=local: THIS REPLICA NOW COUNTS ALONE in its in-memory ledger (shared budgets are not enforced across replicas) until Redis answers again"
                ),
            }
        }
    }

    fn answered(&self) {
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

    /// A fresh reservation id and the keys and expiries of `parts`, holding `amount`.
    fn slot(&self, parts: &[SharedPart<'_>], amount: Amount, now: Millis) -> Slot {
        let rid = format!(
            "{}-{:x}",
            self.rid_prefix,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
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
        }
    }

    /// One round trip of `settle.lua` for `slot`: commits `actual` (or releases when `None`).
    async fn settle_slot(
        &self,
        slot: &Slot,
        actual: Option<Amount>,
    ) -> Result<i64, StoreUnavailable> {
        let mut conn = self.conn().await?;
        let a = actual.unwrap_or_default();
        let mut inv = self.settle.prepare_invoke();
        for k in &slot.keys {
            inv.key(k);
        }
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
        match inv.invoke_async::<i64>(&mut conn).await {
            Ok(n) => {
                self.answered();
                Ok(n)
            }
            Err(e) => {
                self.failed(&e);
                Err(StoreUnavailable)
            }
        }
    }

    /// Queues usage committed alone during an outage, to be written back (at most
    /// `MAX_DEBTS` requests' worth; past that the oldest stays local only, said loudly).
    fn owe(self: &Arc<Self>, debt: Debt) {
        {
            let mut debts = self.debts.lock().unwrap_or_else(|p| p.into_inner());
            if debts.len() >= MAX_DEBTS {
                debts.pop_front();
                tracing::error!(
                    "state: more than {MAX_DEBTS} requests counted alone during the Redis outage; the oldest one's usage will not be written back"
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

    /// Writes the owed usage back, oldest first, waiting out the outage; each write is the
    /// idempotent settle of a hold that held nothing, so a retried write never counts twice.
    async fn pay_debts(self: Arc<Self>) {
        let mut paid = 0u64;
        loop {
            let next = self
                .debts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            let Some(debt) = next else {
                self.paying.store(false, Ordering::Release);
                // A debt queued between the pop and the store above would have no payer.
                let empty = self
                    .debts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_empty();
                if empty || self.paying.swap(true, Ordering::AcqRel) {
                    if paid > 0 {
                        tracing::info!(
                            requests = paid,
                            "state: usage counted alone during the Redis outage was written back"
                        );
                    }
                    return;
                }
                continue;
            };
            if self
                .settle_slot(&debt.slot, Some(debt.actual))
                .await
                .is_ok()
            {
                paid += 1;
            } else {
                self.debts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_front(debt);
                tokio::time::sleep(Duration::from_millis(RETRY_AFTER_FAILURE_MS as u64)).await;
            }
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

    #[allow(clippy::type_complexity)]
    async fn reserve(
        self: Arc<Self>,
        parts: &[SharedPart<'_>],
        amount: Amount,
    ) -> Result<(Result<RedisHold, (usize, DimRefusal)>, Vec<Amount>), StoreUnavailable> {
        let mut conn = self.conn().await?;
        let slot = self.slot(parts, amount, wall_ms());
        let mut inv = self.reserve.prepare_invoke();
        for k in &slot.keys {
            inv.key(k);
        }
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
        let reply: Vec<i64> = match inv.invoke_async(&mut conn).await {
            Ok(r) => r,
            Err(e) => {
                self.failed(&e);
                // A timed-out reply does not mean the script did not run: release what it may
                // hold (in the background, idempotent) instead of leaving it to the lease.
                drop(self.hold(slot));
                return Err(StoreUnavailable);
            }
        };
        self.answered();
        let n = parts.len();
        let committed_from = |off: usize| -> Vec<Amount> {
            (0..n)
                .map(|i| {
                    let g = |d: usize| reply.get(off + 3 * i + d).map_or(0, |v| (*v).max(0) as u64);
                    Amount {
                        tokens: g(0),
                        requests: g(1),
                        usd: g(2),
                    }
                })
                .collect()
        };
        match reply.first() {
            Some(1) => Ok((Ok(self.hold(slot)), committed_from(1))),
            Some(0) if reply.len() >= 5 => {
                let part = (reply[1].max(0) as usize).min(n.saturating_sub(1));
                let dim = match reply[2] {
                    0 => Dim::Tokens,
                    1 => Dim::Requests,
                    _ => Dim::Usd,
                };
                let refusal = DimRefusal {
                    dim,
                    used: reply[3].max(0) as u64,
                    hard: reply[4].max(0) as u64,
                };
                Ok((Err((part, refusal)), committed_from(5)))
            }
            _ => {
                tracing::error!(?reply, "state: unexpected reply from the reserve script");
                drop(self.hold(slot));
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
            let (res, committed) = self.inner.clone().reserve(parts, amount).await?;
            Ok(match res {
                Ok(hold) => SharedReply::Held {
                    hold: Box::new(hold),
                    committed,
                },
                Err((part, refusal)) => SharedReply::Refused {
                    part,
                    refusal,
                    committed,
                },
            })
        })
    }

    fn offline_hold(&self, parts: &[SharedPart<'_>], now: Millis) -> Option<Box<dyn SharedHold>> {
        Some(Box::new(RedisHold {
            inner: self.inner.clone(),
            slot: self.inner.slot(parts, Amount::ZERO, now),
            owed: true,
            settled: false,
        }))
    }
}

impl RedisHold {
    /// Settles now, in one round trip: commits `actual` (or releases when `None`). Returns
    /// how many counters this call settled (0 = settled before: the call is idempotent).
    pub async fn settle_now(&mut self, actual: Option<Amount>) -> Result<i64, StoreUnavailable> {
        let n = self.inner.settle_slot(&self.slot, actual).await?;
        self.settled = true;
        Ok(n)
    }

    /// Settles in the background, retrying a few times (idempotent); gives up to the lease.
    fn settle_in_background(mut self, actual: Option<Amount>) {
        self.settled = true; // the task owns the settlement now; Drop must not spawn again
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime (process ending): the lease releases the hold
        };
        rt.spawn(async move {
            for i in 0..SETTLE_TRIES {
                if self.settle_now(actual).await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500 * u64::from(i + 1))).await;
            }
            tracing::warn!(
                committed = actual.is_some(),
                "state: could not settle a reservation in Redis; its hold ends with the lease{}",
                if actual.is_some() {
                    " and its usage is counted only in this replica"
                } else {
                    ""
                }
            );
        });
    }
}

impl SharedHold for RedisHold {
    fn settle(mut self: Box<Self>, actual: Amount) {
        if self.owed {
            let debt = Debt {
                slot: std::mem::take(&mut self.slot),
                actual,
            };
            self.inner.owe(debt);
            return;
        }
        (*self).settle_in_background(Some(actual));
    }
}

impl Drop for RedisHold {
    fn drop(&mut self) {
        // An owed hold held nothing: nothing to release.
        if self.settled || self.owed {
            return;
        }
        self.settled = true;
        let hold = RedisHold {
            inner: self.inner.clone(),
            slot: std::mem::take(&mut self.slot),
            owed: false,
            settled: false,
        };
        hold.settle_in_background(None);
    }
}
