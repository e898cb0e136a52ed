//! Hot reload (issue 7 §4): a policy edited on disk takes effect without a restart, a broken
//! edit is refused while the old policy keeps serving, a Kubernetes `..data` symlink swap is
//! seen, and 50 swaps (valid and invalid alternating) under steady load fail no request and
//! stamp only valid versions.

mod common;
mod ops_support;

use common::mock::MockUpstream;
use common::sidecar::Sidecar;
use common::{post_json, try_post_json};
use ops_support::{post_reload, scrape, status};
use serde_json::{json as j, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::admin::Trigger;
use tollgate::ledger::{window_at, CounterKey};
use tollgate::units::{Scope, Window};

/// Reload counters are process-wide: tests that compare them run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn chat() -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
}

fn policy(version: &str, backend: &str, upstream: &MockUpstream) -> String {
    format!(
        "version: {version}\nbackends:\n  - {{id: {backend}, kind: openai, base_url: \"{}\"}}\nroutes:\n  - model: chat\n    chain: [{{backend: {backend}, model: m}}]\nquotas:\n  - {{name: {backend}-daily, scope: backend, match: {backend}, window: day, limit_tokens: 100000000}}\n",
        upstream.base_url()
    )
}

/// The opens of the files in a directory (inotify `IN_OPEN`): the policy watcher opens the
/// policy once per look, and a reload opens it again, so these show what it did, when.
struct Opens(rustix::fd::OwnedFd);

impl Opens {
    fn watch(dir: &Path) -> Opens {
        use rustix::fs::inotify::{add_watch, init, CreateFlags, WatchFlags};
        let fd = init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC).expect("inotify");
        add_watch(&fd, dir, WatchFlags::OPEN).expect("inotify watch");
        Opens(fd)
    }

    /// How many times `name` was opened since the last call.
    fn take(&self, name: &str) -> usize {
        let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
        let mut events = rustix::fs::inotify::Reader::new(&self.0, &mut buf);
        let mut n = 0;
        loop {
            match events.next() {
                Ok(e) => {
                    n += usize::from(
                        e.file_name()
                            .is_some_and(|f| f.to_bytes() == name.as_bytes()),
                    )
                }
                Err(rustix::io::Errno::AGAIN) => return n,
                Err(e) => panic!("inotify: {e}"),
            }
        }
    }
}

/// Replaces a file the way editors do (write a temp file, rename over).
fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn version_served(sc: &Sidecar) -> String {
    let (code, h, _) = post_json(&sc.chat_url(), &chat(), &[]).await;
    assert_eq!(code, 200);
    h["x-tollgate-policy-version"].to_str().unwrap().to_string()
}

/// Polls until the served version is `want` (the watcher looks once a second).
async fn wait_for_version(sc: &Sidecar, want: &str) -> Duration {
    let t0 = Instant::now();
    loop {
        if version_served(sc).await == want {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{want} never took effect"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_edited_on_disk_takes_effect_and_a_broken_edit_is_refused() {
    let _serial = SERIAL.lock().await;
    let up = MockUpstream::start(vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let v1 = policy("disk-1", "rl-a", &up);
    std::fs::write(&path, &v1).unwrap();
    let mut sc = Sidecar::start(&v1).await;
    sc.running.watch_policy(path.clone());
    let admin = sc.running.admin_addr;
    assert_eq!(version_served(&sc).await, "disk-1");

    // An edit on disk takes effect without a restart.
    write_atomic(&path, &policy("disk-2", "rl-a", &up));
    let took = wait_for_version(&sc, "disk-2").await;
    eprintln!("edit on disk took effect after {took:?}");
    let before = scrape(admin).await;

    // A broken edit (a chain entry naming no backend) is refused; disk-2 keeps serving.
    let broken = policy("disk-3", "rl-a", &up)
        .replace("{backend: rl-a, model: m}", "{backend: nope, model: m}");
    std::fs::write(&path, &broken).unwrap();
    let t0 = Instant::now();
    let st = loop {
        let st = status(admin).await;
        if st["policy"]["reloads"]["error"] == 1 {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "broken edit not noticed: {st}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let err = st["policy"]["last_error"]["message"].as_str().unwrap();
    assert!(
        err.contains("policy.yaml:6")
            && err.contains("routes[0].chain[0].backend")
            && err.contains("nope"),
        "error should name file, line and key: {err}"
    );
    assert_eq!(st["policy"]["last_error"]["trigger"], "file");
    assert_eq!(st["policy"]["last_reload"]["result"], "error");
    assert_eq!(st["policy"]["version"], "disk-2");
    assert_eq!(version_served(&sc).await, "disk-2");
    let after = scrape(admin).await;
    let d = |r: &str| {
        after.get("tollgate_policy_reloads_total", &[("result", r)])
            - before.get("tollgate_policy_reloads_total", &[("result", r)])
    };
    assert_eq!((d("ok"), d("error")), (0.0, 1.0));
    // The same broken content is not retried: the watcher's next look opens the file once,
    // and nothing follows it (a retry would look again after its 150 ms settle, then load).
    let opens = Opens::watch(dir.path());
    let t0 = Instant::now();
    while opens.take("policy.yaml") == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the watcher stopped looking"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let quiet = Instant::now() + Duration::from_millis(400);
    let mut more = 0;
    while Instant::now() < quiet {
        more += opens.take("policy.yaml");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        more, 0,
        "the unchanged broken policy was read again to be reloaded"
    );
    assert_eq!(status(admin).await["policy"]["reloads"]["error"], 1);

    // Fixing the file is picked up again; SIGHUP's path (Trigger::Signal) is the same one.
    std::fs::write(&path, policy("disk-4", "rl-a", &up)).unwrap();
    wait_for_version(&sc, "disk-4").await;
    std::fs::write(&path, policy("disk-5", "rl-a", &up)).unwrap();
    let v = sc.running.reload(Trigger::Signal).await.unwrap();
    assert_eq!(&*v, "disk-5");
    assert_eq!(version_served(&sc).await, "disk-5");
    assert_eq!(
        status(admin).await["policy"]["last_reload"]["trigger"],
        "signal"
    );
    sc.stop().await;
}

/// A ConfigMap volume: `policy.yaml -> ..data/policy.yaml`, `..data -> ..<timestamp>`;
/// an update writes a new timestamped directory and renames a new `..data` link over the old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmap_symlink_swap_is_picked_up() {
    let _serial = SERIAL.lock().await;
    let up = MockUpstream::start(vec![]).await;
    let mount = tempfile::tempdir().unwrap();
    let m = mount.path();
    let v1 = policy("cm-1", "rl-cm", &up);
    std::fs::create_dir(m.join("..2026_x")).unwrap();
    std::fs::write(m.join("..2026_x/policy.yaml"), &v1).unwrap();
    std::os::unix::fs::symlink("..2026_x", m.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/policy.yaml", m.join("policy.yaml")).unwrap();
    assert_eq!(tollgate::policy::load(m).unwrap().version.as_ref(), "cm-1");

    let mut sc = Sidecar::start(&v1).await;
    sc.running.watch_policy(m.to_path_buf());
    assert_eq!(version_served(&sc).await, "cm-1");

    std::fs::create_dir(m.join("..2026_y")).unwrap();
    std::fs::write(m.join("..2026_y/policy.yaml"), policy("cm-2", "rl-cm", &up)).unwrap();
    std::os::unix::fs::symlink("..2026_y", m.join("..data_tmp")).unwrap();
    std::fs::rename(m.join("..data_tmp"), m.join("..data")).unwrap();
    std::fs::remove_dir_all(m.join("..2026_x")).unwrap();
    let took = wait_for_version(&sc, "cm-2").await;
    eprintln!("..data swap took effect after {took:?}");
    let st = status(sc.running.admin_addr).await;
    assert_eq!(st["policy"]["last_reload"]["trigger"], "file");
    sc.stop().await;
}

/// An edit made as the watcher is being set up, before its task first runs, is loaded: the
/// watcher compares against what the file held when watching began. (On this single-threaded
/// test runtime the watcher's task cannot run before the edit; it once took its first look
/// only then, took the edited file as the starting point, and never loaded it.)
#[tokio::test]
async fn an_edit_before_the_watchers_first_look_is_loaded() {
    let _serial = SERIAL.lock().await;
    let up = MockUpstream::start(vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let v1 = policy("early-1", "rl-early", &up);
    std::fs::write(&path, &v1).unwrap();
    let mut sc = Sidecar::start(&v1).await;
    sc.running.watch_policy(path.clone());
    // No await between setting the watcher up and the edit.
    write_atomic(&path, &policy("early-2", "rl-early", &up));
    let took = wait_for_version(&sc, "early-2").await;
    eprintln!("the early edit took effect after {took:?}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_swaps_under_load_fail_no_request_and_stamp_only_valid_versions() {
    let _serial = SERIAL.lock().await;
    let up = MockUpstream::start(vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let v0 = policy("swap-0", "rl-load", &up);
    std::fs::write(&path, &v0).unwrap();
    let sc = Arc::new(Sidecar::start(&v0).await);
    // The API path only (no watcher): every reload below is one POST.
    sc.running.ops.set_policy_path(path.clone());
    sc.running.ops.set_token(Some("reload-token".into()));
    let admin = sc.running.admin_addr;
    let before = scrape(admin).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (sc, stop) = (sc.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut seen: Vec<(u16, String)> = Vec::new();
            let mut failures = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match try_post_json(&sc.chat_url(), &chat(), &[]).await {
                    Ok((code, h, body)) => {
                        let v = h
                            .get("x-tollgate-policy-version")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("<none>")
                            .to_string();
                        if code != 200 {
                            failures.push(format!("{code}: {}", String::from_utf8_lossy(&body)));
                        }
                        seen.push((code, v));
                    }
                    Err(e) => failures.push(e),
                }
            }
            (seen, failures)
        }));
    }

    let mut valid: BTreeSet<String> = BTreeSet::from(["swap-0".to_string()]);
    for i in 1..=50 {
        if i % 2 == 0 {
            let v = format!("swap-{i}");
            std::fs::write(&path, policy(&v, "rl-load", &up)).unwrap();
            let (code, body) = post_reload(admin, Some("reload-token")).await;
            assert_eq!(
                (code, body["version"].as_str()),
                (200, Some(v.as_str())),
                "{body}"
            );
            valid.insert(v);
        } else {
            // Alternate a validation error and a YAML syntax error.
            let bad = if i % 4 == 1 {
                policy(&format!("bad-{i}"), "rl-load", &up)
                    .replace("window: day", "window: fortnight")
            } else {
                format!("version: bad-{i}\nbackends: [{{id: x\n")
            };
            std::fs::write(&path, bad).unwrap();
            let (code, body) = post_reload(admin, Some("reload-token")).await;
            assert_eq!(code, 422, "{body}");
            assert!(
                body["version"].as_str().unwrap().starts_with("swap-"),
                "{body}"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for c in clients {
        let (seen, failures) = c.await.unwrap();
        assert!(
            failures.is_empty(),
            "requests failed during reloads: {failures:?}"
        );
        all.extend(seen);
    }
    assert!(all.len() >= 100, "too little load: {} requests", all.len());
    let versions: BTreeMap<&str, usize> = all.iter().fold(BTreeMap::new(), |mut m, (_, v)| {
        *m.entry(v.as_str()).or_default() += 1;
        m
    });
    for v in versions.keys() {
        assert!(
            valid.contains(*v),
            "a response stamped {v}, not a valid version"
        );
    }
    eprintln!(
        "{} requests during 50 reloads, {} distinct versions served",
        all.len(),
        versions.len()
    );
    // The audit agrees: every decision carries a valid version.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sc.audit_text().lines().count() < all.len() {
        assert!(Instant::now() < deadline, "audit lagging");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for line in sc.audit_text().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert!(
            valid.contains(v["policy_version"].as_str().unwrap()),
            "{line}"
        );
    }
    // Counters survived every swap: the day's quota holds every request's usage (12 + 7).
    let key = CounterKey {
        scope: Scope::Backend,
        id: Arc::from("rl-load"),
        window: Some(window_at(
            &jiff::tz::TimeZone::UTC,
            Window::Day,
            jiff::Timestamp::now().as_millisecond(),
        )),
    };
    assert_eq!(sc.committed(&key).tokens, 19 * all.len() as u64);
    let after = scrape(admin).await;
    let d = |r: &str| {
        after.get("tollgate_policy_reloads_total", &[("result", r)])
            - before.get("tollgate_policy_reloads_total", &[("result", r)])
    };
    assert_eq!((d("ok"), d("error")), (25.0, 25.0));
    assert_eq!(
        after.get("tollgate_policy_info", &[("version", "swap-50")]),
        1.0
    );
    assert_eq!(
        after.get("tollgate_policy_info", &[("version", "swap-48")]),
        0.0
    );
    let st = status(admin).await;
    assert_eq!(st["policy"]["reloads"], j!({"ok": 25, "error": 25}));
    assert_eq!(st["policy"]["version"], "swap-50");
    match Arc::try_unwrap(sc) {
        Ok(sc) => sc.stop().await,
        Err(_) => panic!("sidecar still shared"),
    }
}
