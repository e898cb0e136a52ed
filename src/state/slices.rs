//! Slices (issue 51 point 7; docs/scale-out-slices.md): Redis off the per-request path.
//!
//! Each replica leases a slice of a counter's remaining amount (`lease.lua`: a hold like a
//! per-request one, with its own id and lease) and admits requests against it locally; usage
//! is written back in batches every [`FLUSH_EVERY`] (`give_back.lua`: idempotent by slice id
//! and batch number), which also renews the lease; an idle slice goes back. Near a limit
//! (a slice would be below the request's worst case) the request takes the per-request path
//! of [`RedisStore`]. Only requests whose every shared counter has a window use slices.
//!
//! Exactness: Redis' `committed + held ≤ hard` is checked by every script that grows a hold;
//! a slice admits only while `inflight + used + worst ≤ granted`, and a batch moves usage
//! from held to committed without growing the sum. See the design page for the argument.

use super::RedisStore;
use crate::ledger::shared::ReserveFuture;
use crate::ledger::{
    CounterKey, DimRefusal, SharedCounters, SharedHold, SharedPart, SharedReply, StoreUnavailable,
};
use crate::policy::OnUnavailable;
use crate::units::{Amount, Dim, Millis};
use dashmap::DashMap;
use redis::Script;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

const LEASE_LUA: &str = include_str!("lease.lua");
const GIVE_BACK_LUA: &str = include_str!("give_back.lua");
/// A slice is at most this many times the worst case of the request that leased it.
pub const TARGET: u64 = 64;
/// A slice is at most this share of what is left (`left / SHARE`).
pub const SHARE: u64 = 8;
/// How often usage is written back (and leases renewed, idle slices given back).
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A slice with nothing in flight and unused for this long is given back.
pub const IDLE: Duration = Duration::from_secs(2);
/// After the lease script answered "near the limit" for a counter, requests on it take the
/// per-request path without asking again for this long.
const SMALL_FOR: Duration = Duration::from_millis(250);
/// How long settled batch ids are remembered (retries within it are no-ops).
const SETTLED_KEEP_MS: i64 = 3_600_000;

/// A [`SharedCounters`] store that admits from slices leased from a [`RedisStore`].
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct SlicedStore {
    s: Arc<S>,
}

#[derive(Debug)]
struct S {
    redis: RedisStore,
    lease: Duration,
    lease_lua: Script,
    give_lua: Script,
    current: DashMap<CounterKey, Arc<Slice>, foldhash::quality::RandomState>,
    /// Slices replaced by a newer one: no admissions, given back once nothing is in flight.
    draining: Mutex<Vec<Arc<Slice>>>,
    small: DashMap<CounterKey, Instant, foldhash::quality::RandomState>,
    /// One lease call at a time (a burst on an empty slice leases once).
    leasing: tokio::sync::Mutex<()>,
    ids: AtomicU64,
    id_prefix: String,
    flusher: AtomicBool,
    halted: AtomicBool,
}

/// One slice: a hold on one counter in Redis, and what was admitted from it locally.
#[derive(Debug)]
struct Slice {
    key: CounterKey,
    rkey: String,
    expiry: i64,
    hard: [Option<u64>; 3],
    epoch: Option<Arc<str>>,
    id: String,
    st: Mutex<St>,
}

#[derive(Debug)]
struct St {
    /// What Redis holds for this slice now.
    granted: Amount,
    /// Worst cases of admitted requests not settled yet.
    inflight: Amount,
    /// Actual usage of settled requests not yet in a batch.
    used: Amount,
    /// The batch number of the member Redis holds (`<id>.<batch>:t:r:u`).
    batch: u64,
    /// A batch sent and not acknowledged: resent as is.
    pending: Option<Batch>,
    /// Admissions stop here: half a lease after the last write Redis took was sent.
    valid_until: Instant,
    last_write: Instant,
    last_use: Instant,
    draining: bool,
    /// The hold is gone (lease ran out, or the epoch changed): no admissions.
    dead: bool,
    /// The epoch is gone: usage goes through the store's fresh-commit path.
    epoch_gone: bool,
    committed_seen: Amount,
}

#[derive(Debug, Clone)]
struct Batch {
    old: String,
    new: String,
    used: Amount,
    sent: Instant,
    last: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn add(a: Amount, b: Amount) -> Amount {
    Amount {
        tokens: a.tokens.saturating_add(b.tokens),
        requests: a.requests.saturating_add(b.requests),
        usd: a.usd.saturating_add(b.usd),
    }
}

fn sub(a: Amount, b: Amount) -> Amount {
    Amount {
        tokens: a.tokens.saturating_sub(b.tokens),
        requests: a.requests.saturating_sub(b.requests),
        usd: a.usd.saturating_sub(b.usd),
    }
}

fn min(a: Amount, b: Amount) -> Amount {
    Amount {
        tokens: a.tokens.min(b.tokens),
        requests: a.requests.min(b.requests),
        usd: a.usd.min(b.usd),
    }
}

use super::redis::count;

fn amount_at(v: &[i64], off: usize) -> Amount {
    let g = |d: usize| v.get(off + d).map_or(0, |x| count(*x));
    Amount {
        tokens: g(0),
        requests: g(1),
        usd: g(2),
    }
}

fn member(id: &str, batch: u64, a: Amount) -> String {
    format!("{id}.{batch}:{}:{}:{}", a.tokens, a.requests, a.usd)
}

impl Slice {
    /// Takes `amount` from this slice if it may admit and has room in every hard dimension.
    fn take(
        &self,
        hard: &[Option<u64>; 3],
        amount: Amount,
        now: Instant,
        epoch: &Option<Arc<str>>,
    ) -> bool {
        if self.hard != *hard || self.epoch != *epoch {
            return false;
        }
        let mut st = lock(&self.st);
        if st.draining || st.dead || now >= st.valid_until {
            return false;
        }
        for d in Dim::ALL {
            if self.hard[d as usize].is_some() {
                let need = st
                    .inflight
                    .get(d)
                    .saturating_add(st.used.get(d))
                    .saturating_add(amount.get(d));
                if need > st.granted.get(d) {
                    return false;
                }
            }
        }
        st.inflight = add(st.inflight, amount);
        st.last_use = now;
        true
    }

    fn untake(&self, amount: Amount) {
        let mut st = lock(&self.st);
        st.inflight = sub(st.inflight, amount);
    }

    /// Redis' committed total as last seen plus what this replica has not written yet.
    fn committed(&self) -> Amount {
        let st = lock(&self.st);
        let pending = st.pending.as_ref().map_or(Amount::ZERO, |b| b.used);
        add(add(st.committed_seen, st.used), pending)
    }
}

/// What a request admitted from slices holds: its worst case on each slice.
#[derive(Debug)]
struct SliceHold {
    slices: Vec<Arc<Slice>>,
    amount: Amount,
    done: bool,
}

impl SharedHold for SliceHold {
    fn settle(mut self: Box<Self>, actual: Amount) {
        self.done = true;
        let now = Instant::now();
        for sl in &self.slices {
            let mut st = lock(&sl.st);
            st.inflight = sub(st.inflight, self.amount);
            st.used = add(st.used, actual);
            st.last_use = now;
        }
    }
}

impl Drop for SliceHold {
    fn drop(&mut self) {
        if !self.done {
            for sl in &self.slices {
                sl.untake(self.amount);
            }
        }
    }
}

enum Admit {
    Held(SliceHold, Vec<Amount>),
    Refused(usize, DimRefusal, Vec<Amount>),
    PerRequest,
    Rebuilding,
    Unavailable,
}

impl SlicedStore {
    /// Slices over `redis` (which keeps the per-request path, the journal and the epoch).
    pub fn new(redis: RedisStore) -> SlicedStore {
        let lease = Duration::from_millis(count(redis.lease_ms()));
        SlicedStore {
            s: Arc::new(S {
                redis,
                lease,
                lease_lua: Script::new(LEASE_LUA),
                give_lua: Script::new(GIVE_BACK_LUA),
                current: DashMap::default(),
                draining: Mutex::new(Vec::new()),
                small: DashMap::default(),
                leasing: tokio::sync::Mutex::new(()),
                ids: AtomicU64::new(0),
                id_prefix: format!("sl-{:016x}", rand::random::<u64>()),
                flusher: AtomicBool::new(false),
                halted: AtomicBool::new(false),
            }),
        }
    }

    pub fn redis(&self) -> &RedisStore {
        &self.s.redis
    }

    /// Slices this replica holds (current and draining).
    pub fn slices(&self) -> usize {
        self.s.current.len() + lock(&self.s.draining).len()
    }

    /// What this replica's slices hold in Redis in total (tests, status).
    pub fn granted(&self) -> Amount {
        self.s
            .all()
            .iter()
            .fold(Amount::ZERO, |a, sl| add(a, lock(&sl.st).granted))
    }

    /// Stops the background writer without giving anything back: the replica behaves as a
    /// dead one towards Redis (tests).
    pub fn halt(&self) {
        self.s.halted.store(true, Ordering::Release);
    }

    /// Writes every batch and gives every slice back (requests in flight settle first),
    /// polling for at most `within`. Returns whether nothing is left.
    pub async fn give_back_all(&self, within: Duration) -> bool {
        let end = Instant::now() + within;
        for sl in self.s.all() {
            lock(&sl.st).draining = true;
        }
        loop {
            self.s.flush_all().await;
            if self.slices() == 0 {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl S {
    fn all(&self) -> Vec<Arc<Slice>> {
        let mut v: Vec<_> = self.current.iter().map(|e| e.value().clone()).collect();
        v.extend(lock(&self.draining).iter().cloned());
        v
    }

    fn start_flusher(self: &Arc<Self>) {
        if self.flusher.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.flusher.store(false, Ordering::Release);
            return;
        };
        let weak: Weak<S> = Arc::downgrade(self);
        rt.spawn(async move {
            loop {
                tokio::time::sleep(FLUSH_EVERY).await;
                let Some(s) = weak.upgrade() else { return };
                if s.halted.load(Ordering::Acquire) {
                    return;
                }
                s.flush_all().await;
            }
        });
    }

    fn take_missing(
        &self,
        parts: &[SharedPart<'_>],
        amount: Amount,
        now: Instant,
        epoch: &Option<Arc<str>>,
        taken: &mut [Option<Arc<Slice>>],
    ) {
        for (p, t) in parts.iter().zip(taken.iter_mut()) {
            if t.is_some() {
                continue;
            }
            let Some(sl) = self.current.get(p.key).map(|e| e.value().clone()) else {
                continue;
            };
            if sl.take(&p.hard, amount, now, epoch) {
                *t = Some(sl);
            }
        }
    }

    fn rollback(taken: &mut [Option<Arc<Slice>>], amount: Amount) {
        for sl in taken.iter_mut().filter_map(Option::take) {
            sl.untake(amount);
        }
    }

    fn committed_of(&self, parts: &[SharedPart<'_>]) -> Vec<Amount> {
        parts
            .iter()
            .map(|p| {
                self.current
                    .get(p.key)
                    .map_or(Amount::ZERO, |e| e.value().committed())
            })
            .collect()
    }

    async fn admit(self: &Arc<Self>, parts: &[SharedPart<'_>], amount: Amount) -> Admit {
        self.start_flusher();
        let n = parts.len();
        let mut taken: Vec<Option<Arc<Slice>>> = vec![None; n];
        let epoch = self.redis.epoch();
        if epoch.is_some() {
            self.take_missing(parts, amount, Instant::now(), &epoch, &mut taken);
            if taken.iter().all(Option::is_some) {
                return self.held(taken, amount);
            }
        }
        let _g = self.leasing.lock().await;
        match self.redis.slice_epoch_ready().await {
            Err(StoreUnavailable) => {
                // Redis is away: admit from what is held (within the slices' validity).
                Self::rollback(&mut taken, amount);
                let epoch = self.redis.epoch();
                self.take_missing(parts, amount, Instant::now(), &epoch, &mut taken);
                if taken.iter().all(Option::is_some) {
                    return self.held(taken, amount);
                }
                Self::rollback(&mut taken, amount);
                return Admit::Unavailable;
            }
            Ok(false) => {
                Self::rollback(&mut taken, amount);
                return Admit::Rebuilding;
            }
            Ok(true) => {}
        }
        let epoch2 = self.redis.epoch();
        if epoch2 != epoch {
            Self::rollback(&mut taken, amount);
        }
        let epoch = epoch2;
        let now = Instant::now();
        self.take_missing(parts, amount, now, &epoch, &mut taken);
        if taken.iter().all(Option::is_some) {
            return self.held(taken, amount);
        }
        let missing: Vec<usize> = (0..n).filter(|&i| taken[i].is_none()).collect();
        if missing.iter().any(|&i| {
            self.small
                .get(parts[i].key)
                .is_some_and(|until| *until.value() > now)
        }) {
            Self::rollback(&mut taken, amount);
            return Admit::PerRequest;
        }
        let Ok(mut conn) = self.redis.slice_conn().await else {
            Self::rollback(&mut taken, amount);
            return Admit::Unavailable;
        };
        let now_ms = jiff::Timestamp::now().as_millisecond();
        let mut fresh = Vec::with_capacity(missing.len());
        let mut inv = self.lease_lua.prepare_invoke();
        for &i in &missing {
            let k = self.redis.counter_key(parts[i].key);
            inv.key(&k).key(format!("{k}:l")).key(format!("{k}:s"));
            let id = format!(
                "{}-{:x}",
                self.id_prefix,
                self.ids.fetch_add(1, Ordering::Relaxed)
            );
            fresh.push((i, k, id, self.redis.key_expiry(&parts[i], now_ms)));
        }
        let (ek, rk) = self.redis.slice_marker_keys();
        inv.key(ek).key(rk);
        inv.arg(self.redis.lease_ms())
            .arg(missing.len())
            .arg(amount.tokens)
            .arg(amount.requests)
            .arg(amount.usd)
            .arg(TARGET)
            .arg(SHARE);
        for (i, _, id, exp) in &fresh {
            inv.arg(id);
            for h in parts[*i].hard {
                inv.arg(h.map_or(-1i64, |v| v.min(i64::MAX as u64) as i64));
            }
            inv.arg(*exp);
        }
        inv.arg(epoch.as_deref().unwrap_or(""));
        let sent = Instant::now();
        let reply: Vec<i64> = match inv.invoke_async(&mut conn).await {
            Ok(r) => r,
            Err(e) => {
                // A lost reply is not retried: a slice it may have made is held until its
                // lease ends (over-holding, never overspending).
                self.redis.slice_failed(&e);
                Self::rollback(&mut taken, amount);
                return Admit::Unavailable;
            }
        };
        self.redis.slice_answered();
        match reply.first() {
            Some(1) if reply.len() > 6 * missing.len() => {
                let mut seen = Vec::with_capacity(n);
                for (j, (i, rkey, id, expiry)) in fresh.into_iter().enumerate() {
                    let granted = amount_at(&reply, 1 + 6 * j);
                    let committed = amount_at(&reply, 4 + 6 * j);
                    seen.push((i, committed));
                    let sl = Arc::new(Slice {
                        key: parts[i].key.clone(),
                        rkey,
                        expiry,
                        hard: parts[i].hard,
                        epoch: epoch.clone(),
                        id,
                        st: Mutex::new(St {
                            granted,
                            inflight: amount,
                            used: Amount::ZERO,
                            batch: 0,
                            pending: None,
                            valid_until: sent + self.lease / 2,
                            last_write: sent,
                            last_use: sent,
                            draining: false,
                            dead: false,
                            epoch_gone: false,
                            committed_seen: committed,
                        }),
                    });
                    if let Some(old) = self.current.insert(parts[i].key.clone(), sl.clone()) {
                        lock(&old.st).draining = true;
                        lock(&self.draining).push(old);
                    }
                    taken[i] = Some(sl);
                }
                self.held(taken, amount)
            }
            Some(0) if reply.len() >= 5 + 3 * missing.len() => {
                Self::rollback(&mut taken, amount);
                let j = (count(reply[1]) as usize).min(missing.len() - 1);
                let refusal = super::redis::refusal_at(&reply);
                let mut committed = self.committed_of(parts);
                for (jj, &i) in missing.iter().enumerate() {
                    committed[i] = amount_at(&reply, 5 + 3 * jj);
                }
                Admit::Refused(missing[j], refusal, committed)
            }
            Some(5) => {
                Self::rollback(&mut taken, amount);
                let j = reply.get(1).map_or(0, |v| count(*v) as usize);
                if let Some(&i) = missing.get(j) {
                    self.small.insert(parts[i].key.clone(), now + SMALL_FOR);
                }
                Admit::PerRequest
            }
            Some(2) => {
                Self::rollback(&mut taken, amount);
                self.redis.slice_sync().await;
                Admit::Rebuilding
            }
            Some(3) => {
                Self::rollback(&mut taken, amount);
                Admit::Rebuilding
            }
            _ => {
                tracing::error!(?reply, "state: unexpected reply from the lease script");
                Self::rollback(&mut taken, amount);
                Admit::Unavailable
            }
        }
    }

    fn held(&self, taken: Vec<Option<Arc<Slice>>>, amount: Amount) -> Admit {
        let slices: Vec<Arc<Slice>> = taken.into_iter().flatten().collect();
        let committed = slices.iter().map(|s| s.committed()).collect();
        Admit::Held(
            SliceHold {
                slices,
                amount,
                done: false,
            },
            committed,
        )
    }

    fn remove(&self, sl: &Arc<Slice>) {
        self.current.remove_if(&sl.key, |_, v| Arc::ptr_eq(v, sl));
        lock(&self.draining).retain(|v| !Arc::ptr_eq(v, sl));
    }

    async fn flush_all(self: &Arc<Self>) {
        for sl in self.all() {
            self.flush_one(&sl).await;
        }
    }

    /// Writes one batch of `sl` if it has usage, needs its lease renewed, or should go back.
    async fn flush_one(self: &Arc<Self>, sl: &Arc<Slice>) {
        let now = Instant::now();
        let is_current = self
            .current
            .get(&sl.key)
            .is_some_and(|e| Arc::ptr_eq(e.value(), sl));
        let batch = {
            let mut st = lock(&sl.st);
            if st.epoch_gone {
                // Its hold went with the old data: usage is a fresh commit in the new epoch.
                let used = std::mem::replace(&mut st.used, Amount::ZERO);
                self.redis.slice_book(&sl.rkey, sl.expiry, used, &None);
                let done = st.inflight == Amount::ZERO;
                drop(st);
                if done {
                    self.remove(sl);
                }
                return;
            }
            match &st.pending {
                Some(b) => b.clone(),
                None => {
                    let idle = now.saturating_duration_since(st.last_use) >= IDLE;
                    let last = st.inflight == Amount::ZERO
                        && (st.draining || st.dead || idle || !is_current);
                    let renew = now.saturating_duration_since(st.last_write) >= self.lease / 4;
                    // A draining slice keeps only what its requests in flight may use: the
                    // rest goes back at once (no replica starves itself or others of crumbs).
                    let shrink = st.draining && !st.dead && st.granted != st.inflight;
                    if st.used == Amount::ZERO && !last && !shrink && (!renew || st.dead) {
                        return;
                    }
                    if last {
                        st.draining = true;
                    }
                    let used = std::mem::replace(&mut st.used, Amount::ZERO);
                    let consumed = min(used, sub(st.granted, st.inflight));
                    let new = if last {
                        Amount::ZERO
                    } else if st.draining {
                        min(sub(st.granted, consumed), st.inflight)
                    } else {
                        sub(st.granted, consumed)
                    };
                    if !self.redis.slice_book(&sl.rkey, sl.expiry, used, &sl.epoch) {
                        // The epoch changed before this batch: written as a fresh commit.
                        st.epoch_gone = true;
                        st.dead = true;
                        return;
                    }
                    let b = Batch {
                        old: member(&sl.id, st.batch, st.granted),
                        new: if last {
                            String::new()
                        } else {
                            member(&sl.id, st.batch + 1, new)
                        },
                        used,
                        sent: now,
                        last,
                    };
                    st.granted = new;
                    st.pending = Some(b.clone());
                    b
                }
            }
        };
        let reply = self.give(sl, &batch).await;
        let (gone, epoch_gone) = self.after_give(sl, &batch, reply);
        if gone {
            self.remove(sl);
        }
        if epoch_gone {
            self.redis.slice_sync().await;
        }
    }

    /// Applies what `give_back.lua` answered to the slice: (remove it, its epoch is gone).
    fn after_give(
        &self,
        sl: &Slice,
        batch: &Batch,
        reply: Result<Vec<i64>, StoreUnavailable>,
    ) -> (bool, bool) {
        let mut st = lock(&sl.st);
        let gone = match reply.as_deref() {
            Err(StoreUnavailable) => return (false, false), // resent as is next time
            Ok([1, ..]) | Ok([2, ..]) => {
                let lost = reply.as_deref().is_ok_and(|r| r[0] == 2);
                st.pending = None;
                st.batch += 1;
                if let Ok(r) = reply.as_deref() {
                    st.committed_seen = amount_at(r, 1);
                }
                if lost {
                    st.dead = true;
                } else {
                    st.last_write = batch.sent;
                    st.valid_until = batch.sent + self.lease / 2;
                }
                batch.last || (lost && st.inflight == Amount::ZERO && st.used == Amount::ZERO)
            }
            Ok([-1, ..]) => {
                // The epoch is gone: this batch is in the rebuild (recorded before the
                // switch); later usage is a fresh commit.
                st.pending = None;
                st.dead = true;
                st.epoch_gone = true;
                false
            }
            Ok(r) => {
                tracing::error!(reply = ?r, "state: unexpected reply from the give-back script");
                st.pending = None;
                st.dead = true;
                false
            }
        };
        (gone, st.epoch_gone)
    }

    async fn give(&self, sl: &Slice, b: &Batch) -> Result<Vec<i64>, StoreUnavailable> {
        let mut conn = self.redis.slice_conn().await?;
        let mut inv = self.give_lua.prepare_invoke();
        inv.key(&sl.rkey)
            .key(format!("{}:l", sl.rkey))
            .key(format!("{}:s", sl.rkey))
            .key(self.redis.slice_marker_keys().0);
        inv.arg(&b.old)
            .arg(&b.new)
            .arg(b.used.tokens)
            .arg(b.used.requests)
            .arg(b.used.usd)
            .arg(self.redis.lease_ms())
            .arg(sl.expiry)
            .arg(SETTLED_KEEP_MS)
            .arg(sl.epoch.as_deref().unwrap_or(""));
        match inv.invoke_async::<Vec<i64>>(&mut conn).await {
            Ok(r) => {
                self.redis.slice_answered();
                Ok(r)
            }
            Err(e) => {
                self.redis.slice_failed(&e);
                Err(StoreUnavailable)
            }
        }
    }
}

impl SharedCounters for SlicedStore {
    fn reserve<'a>(
        &'a self,
        parts: &'a [SharedPart<'a>],
        amount: Amount,
        now: Millis,
    ) -> ReserveFuture<'a> {
        Box::pin(async move {
            // Counters without a window (declared jobs) keep the per-request path.
            if parts.iter().any(|p| p.expires_at == i64::MAX) {
                return self.s.redis.reserve(parts, amount, now).await;
            }
            match self.s.admit(parts, amount).await {
                Admit::Held(hold, committed) => Ok(SharedReply::Held {
                    hold: Box::new(hold),
                    committed,
                }),
                Admit::Refused(part, refusal, committed) => Ok(SharedReply::Refused {
                    part,
                    refusal,
                    committed: committed.into_iter().map(Some).collect(),
                }),
                Admit::PerRequest => self.s.redis.reserve(parts, amount, now).await,
                Admit::Rebuilding => Ok(SharedReply::Rebuilding),
                Admit::Unavailable => Err(StoreUnavailable),
            }
        })
    }

    fn offline_hold(&self, parts: &[SharedPart<'_>], now: Millis) -> Option<Box<dyn SharedHold>> {
        match self.s.redis.on_unavailable() {
            OnUnavailable::Local => self.s.redis.offline_hold(parts, now),
            OnUnavailable::Deny => None,
        }
    }

    fn bounded_offline(&self) -> bool {
        true
    }
}
