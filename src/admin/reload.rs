//! One reload path for all three triggers — a change on disk, SIGHUP, `POST /admin/reload`:
//! prepare the whole new snapshot fallibly, then one atomic swap (`proxy::reload`). An
//! invalid policy is logged with file, line and key, counted in
//! `tollgate_policy_reloads_total{result="error"}`, kept as the last error for
//! `/admin/status`, and the old policy stays in force.
//!
//! The watcher polls the policy's directory (every [`WATCH_EVERY`]) and compares a hash of
//! the contents of the files a load would read, rather than using inotify: Kubernetes
//! updates a ConfigMap volume by swapping the `..data` symlink, which changes neither the
//! visible file names nor their own mtimes and, for a watched file, replaces the inode under
//! the watch. Reading a few KB per second sees every such swap (and any editor's save)
//! without a new dependency or platform-specific event handling.

use super::Ops;
use crate::proxy::App;
use crate::telemetry::names::TOLLGATE_POLICY_RELOADS_TOTAL;
use jiff::Timestamp;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often the watcher looks at the policy on disk.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);
/// A change must hold still this long before it is loaded (an editor mid-write).
const SETTLE: Duration = Duration::from_millis(150);
/// Versions remembered for `tollgate_policy_info` (set to 0 once replaced).
const VERSIONS_KEPT: usize = 16;

/// What asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The watcher saw the policy change on disk.
    File,
    /// SIGHUP.
    Signal,
    /// `POST /admin/reload`.
    Api,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::File => "file",
            Trigger::Signal => "signal",
            Trigger::Api => "api",
        }
    }
}

#[derive(Debug)]
pub enum ReloadError {
    /// The sidecar was built from a policy in memory: there is no path to read.
    NoPath,
    /// The policy on disk is invalid (file, line and key in the message).
    Invalid(String),
}

/// How reloads went, for `/admin/status` and the gauges.
#[derive(Debug, Clone)]
pub struct ReloadStatus {
    pub loaded_at: Timestamp,
    /// (when, trigger, ok)
    pub last: Option<(Timestamp, Trigger, bool)>,
    /// (when, trigger, message)
    pub last_error: Option<(Timestamp, Trigger, String)>,
    pub ok: u64,
    pub errors: u64,
    /// Versions in force since start, oldest first; the last is the current one.
    pub versions: Vec<Arc<str>>,
    /// Hash of the policy files as last loaded or tried.
    fingerprint: Option<u64>,
}

impl ReloadStatus {
    pub fn new(version: Arc<str>) -> Self {
        ReloadStatus {
            versions: vec![version],
            loaded_at: Timestamp::now(),
            last: None,
            last_error: None,
            ok: 0,
            errors: 0,
            fingerprint: None,
        }
    }
}

impl Ops {
    /// Reloads the policy from its path. Reloads run one at a time.
    pub async fn reload(&self, app: &App, trigger: Trigger) -> Result<Arc<str>, ReloadError> {
        let Some(path) = self.policy_path() else {
            return Err(ReloadError::NoPath);
        };
        let _one = self.reload_lock.lock().await;
        // Reading and parsing stay off the runtime's workers: a slow disk, a FIFO or a huge
        // file must not stall requests on either port.
        let read = tokio::task::spawn_blocking(move || {
            let fp = fingerprint(&path).ok();
            (fp, crate::proxy::snapshot::load(&path))
        })
        .await;
        let (fp, res) = match read {
            Ok((fp, snap)) => (fp, snap.and_then(|s| crate::proxy::server::apply(app, s))),
            Err(e) => (None, Err(format!("policy reader failed: {e}"))),
        };
        let now = Timestamp::now();
        let mut st = self.reloads.lock().unwrap_or_else(|p| p.into_inner());
        if fp.is_some() {
            st.fingerprint = fp;
        }
        match res {
            Ok(v) => {
                metrics::counter!(TOLLGATE_POLICY_RELOADS_TOTAL, "result" => "ok").increment(1);
                st.ok += 1;
                st.last = Some((now, trigger, true));
                st.loaded_at = now;
                st.versions.retain(|x| x != &v);
                st.versions.push(v.clone());
                if st.versions.len() > VERSIONS_KEPT {
                    st.versions.remove(0);
                }
                // Teams the new keys name get their spend counters.
                crate::telemetry::global().configure_teams(&app.snap.load().policy);
                tracing::info!(version = %v, trigger = trigger.as_str(), "policy reloaded");
                Ok(v)
            }
            Err(e) => {
                metrics::counter!(TOLLGATE_POLICY_RELOADS_TOTAL, "result" => "error").increment(1);
                st.errors += 1;
                st.last = Some((now, trigger, false));
                st.last_error = Some((now, trigger, e.clone()));
                tracing::error!(
                    error = %e,
                    trigger = trigger.as_str(),
                    version = st.versions.last().map_or("", |v| &**v),
                    "policy reload rejected; the old policy stays in force"
                );
                Err(ReloadError::Invalid(e))
            }
        }
    }

    /// The hash of the policy as last loaded or tried.
    fn last_fingerprint(&self) -> Option<u64> {
        self.reloads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fingerprint
    }

    fn set_fingerprint(&self, fp: u64) {
        self.reloads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fingerprint = Some(fp);
    }

    /// Takes the policy path's fingerprint now, if none was taken yet, so that the watcher
    /// compares against what the path held when watching began, not when its task first
    /// ran (a change made in between would otherwise be taken as the starting point and
    /// never loaded). A small blocking read, once, when the watcher is set up.
    pub fn prime_fingerprint(&self) {
        if self.last_fingerprint().is_some() {
            return;
        }
        if let Some(fp) = self.policy_path().and_then(|p| fingerprint(&p).ok()) {
            self.set_fingerprint(fp);
        }
    }
}

/// A hash of what a load of `path` would read: the file's content, or every visible
/// `*.yaml`/`*.yml` file of the directory (following symlinks) with its name. Reads by the
/// loader's rules (regular files, size cap); blocking — see [`fingerprint_off_runtime`].
pub fn fingerprint(path: &Path) -> std::io::Result<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if !path.is_dir() {
        crate::policy::read_policy_file(path)?.hash(&mut h);
        return Ok(h.finish());
    }
    for (name, p) in crate::policy::policy_files(path)? {
        name.hash(&mut h);
        crate::policy::read_policy_file(&p)?.hash(&mut h);
    }
    Ok(h.finish())
}

/// [`fingerprint`] on a blocking thread.
async fn fingerprint_off_runtime(path: &Path) -> std::io::Result<u64> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || fingerprint(&path))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Polls the policy path and reloads when what it holds changes, until `stop`.
pub async fn watch(app: Arc<App>, ops: Arc<Ops>, mut stop: watch::Receiver<bool>) {
    // The starting point is taken when watching is set up ([`Ops::prime_fingerprint`]);
    // this is the fallback for when that read failed (a file mid-swap): the first readable
    // look then becomes the start.
    if let Some(path) = ops.policy_path() {
        if ops.last_fingerprint().is_none() {
            if let Ok(fp) = fingerprint_off_runtime(&path).await {
                ops.set_fingerprint(fp);
            }
        }
    }
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let Some(path) = ops.policy_path() else {
            continue;
        };
        // A read error (a file mid-swap, a directory briefly empty) is looked at again on
        // the next tick; only a readable change triggers a load.
        let Ok(fp) = fingerprint_off_runtime(&path).await else {
            continue;
        };
        if Some(fp) == ops.last_fingerprint() {
            continue;
        }
        tokio::time::sleep(SETTLE).await;
        if fingerprint_off_runtime(&path).await.ok() != Some(fp) {
            continue;
        }
        let _ = ops.reload(&app, Trigger::File).await;
    }
}
