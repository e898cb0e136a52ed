//! Faults of the shared Redis, each met by a real `tollgate serve` and a private
//! `redis-server` (issue 51): a Redis restarted empty does not hand out a fresh budget, an
//! evicting `maxmemory-policy` is warned about, readiness follows what reservations meet (and
//! names Redis' error), a settle that cannot reach Redis is journaled and written once it
//! answers, implicit job counters stay local, and the reserve script holds a reservation id
//! once.

mod common;

use common::mock::{Answer, MockUpstream};
use common::process::{free_port, Serve};
use common::try_post_json;
use serde_json::json as j;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tollgate::estimate::{self, Endpoint, Tokenizer};

const MAX_TOKENS: u64 = 50;

fn body() -> serde_json::Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "count this once"}], "max_tokens": MAX_TOKENS})
}

/// The worst case of `body()` (the mocks report exactly this as usage).
fn worst() -> u64 {
    estimate::estimate(Endpoint::Chat, &body(), Tokenizer::O200k)
        .unwrap()
        .input_tokens
        + MAX_TOKENS
}

fn ok_answer() -> Answer {
    Answer::ok_chat("ok", worst() - MAX_TOKENS, MAX_TOKENS)
}

/// A private redis-server, killed (SIGKILL) when dropped, also when a test fails midway.
struct RedisServer(Child);

impl RedisServer {
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.0.id().to_string())
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill -{sig}");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.0.id().to_string())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A private, non-persistent redis-server on `port` with `extra` arguments.
async fn redis_server(port: u16, dir: &Path, extra: &[&str]) -> RedisServer {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--bind", "127.0.0.1", "--dir"])
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is installed");
    let server = RedisServer(child);
    // Up when the port takes connections (a password may be required: no PING).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server
}

async fn redis_cmd<T: redis::FromRedisValue>(url: &str, args: &[&str]) -> T {
    let mut c = common::redis_keys::conn(url).await;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut c).await.unwrap()
}

/// The hash fields `fields` summed over the namespace's counters of `scope`.
async fn sums<const N: usize>(
    url: &str,
    namespace: &str,
    scope: &str,
    fields: [&str; N],
) -> [i64; N] {
    let mut c = common::redis_keys::conn(url).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{{tollgate:{namespace}}}:c:{scope}:*"))
        .query_async(&mut c)
        .await
        .unwrap();
    let mut total = [0i64; N];
    for k in keys
        .iter()
        .filter(|k| !k.ends_with(":l") && !k.ends_with(":s"))
    {
        let v: Vec<Option<i64>> = redis::cmd("HMGET")
            .arg(k)
            .arg(&fields[..])
            .query_async(&mut c)
            .await
            .unwrap();
        for (t, x) in total.iter_mut().zip(v) {
            *t += x.unwrap_or(0);
        }
    }
    total
}

/// Polls `sums` until `want` (or `secs`), returning the last value.
async fn sums_until<const N: usize>(
    url: &str,
    namespace: &str,
    scope: &str,
    fields: [&str; N],
    want: [i64; N],
    secs: u64,
) -> [i64; N] {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let v = sums(url, namespace, scope, fields).await;
        if v == want || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Replica {
    serve: Serve,
    dir: tempfile::TempDir,
}

impl Replica {
    async fn start(
        mock: &str,
        redis_url: &str,
        namespace: &str,
        extra_state: &str,
        bounds: &str,
        env: &[(&str, &str)],
    ) -> Replica {
        let dir = tempfile::tempdir().unwrap();
        let (port, admin) = (free_port(), free_port());
        let yaml = format!(
            r#"
version: faults-1
server: {{listen: "127.0.0.1:{port}", admin_listen: "127.0.0.1:{admin}"}}
backends:
  - {{id: primary, kind: openai, base_url: "{mock}", timeouts: {{total: 3s}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
{bounds}
state: {{backend: redis, redis_url: "{redis_url}", namespace: "{namespace}"{extra_state}}}
audit: {{sink: "off"}}
"#
        );
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, yaml).unwrap();
        let serve = Serve::start_env(&path, port, admin, &dir.path().join("serve.log"), env).await;
        Replica { serve, dir }
    }

    fn admin(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.serve.admin_port)
    }

    async fn readyz(&self) -> (u16, String) {
        let (s, _, b) = common::get(&self.admin("/readyz")).await;
        (s, String::from_utf8_lossy(&b).into_owned())
    }

    async fn status(&self) -> serde_json::Value {
        let (s, _, b) = common::get(&self.admin("/admin/status")).await;
        assert_eq!(s, 200);
        common::json(&b)
    }

    async fn metrics(&self) -> String {
        let (_, _, b) = common::get(&self.admin("/metrics")).await;
        String::from_utf8_lossy(&b).into_owned()
    }

    async fn chat(&self) -> (u16, String) {
        self.chat_with(&[]).await
    }

    /// Settlements waiting in the replica's journal (`/admin/status`, which reads no Redis).
    async fn journaled(&self) -> u64 {
        self.status().await["state"]["journal"]["pending_settlements"]
            .as_u64()
            .unwrap()
    }

    /// Polls until `n` settlements wait in the journal (or fails after 15 s).
    async fn until_journaled(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.journaled().await != n {
            assert!(
                Instant::now() < deadline,
                "never {n} journaled: {}\n{}",
                self.status().await,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn chat_with(&self, headers: &[(&str, &str)]) -> (u16, String) {
        match try_post_json(&self.serve.chat_url(), &body(), headers).await {
            Ok((status, h, _)) => (
                status,
                h.get("x-tollgate-reason")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned(),
            ),
            Err(e) => (0, e),
        }
    }

    fn log(&self) -> String {
        let _ = &self.dir;
        self.serve.log_text()
    }
}

fn ns(name: &str) -> String {
    format!("test-{name}-{:08x}", rand::random::<u32>())
}

/// (a) Redis killed (`kill -9`) and restarted empty: the next hard-bounded request is never
/// granted a fresh budget. It gets 503 `STATE_REBUILDING` while the replica writes back what
/// it committed in the windows in force, then the bound refuses as before the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_empty_does_not_grant_a_fresh_budget() {
    let w = worst() as i64;
    let up = MockUpstream::start_with_default(vec![], ok_answer()).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let server = redis_server(port, dir.path(), &[]).await;
    let n = ns("restart");
    let bounds = format!(
        "budgets:\n  - {{name: cap, scope: global, window: month, hard_tokens: {}}}",
        2 * w
    );
    let r = Replica::start(&up.base_url(), &url, &n, "", &bounds, &[]).await;
    assert_eq!(r.chat().await, (200, "OK".into()));
    assert_eq!(r.chat().await, (200, "OK".into()));
    assert_eq!(r.chat().await, (403, "HARD_BUDGET_EXCEEDED".into()));
    let [ct, ht] = sums_until(&url, &n, "global", ["ct", "ht"], [2 * w, 0], 10).await;
    assert_eq!((ct, ht), (2 * w, 0), "both calls committed in Redis");

    // kill -9 and restart empty (no persistence).
    drop(server);
    let _server = redis_server(port, dir.path(), &[]).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    loop {
        let (status, reason) = r.chat().await;
        assert_ne!(
            status,
            200,
            "a fresh budget was granted after the loss: {seen:?}\n{}",
            r.log()
        );
        if seen.last() != Some(&(status, reason.clone())) {
            seen.push((status, reason.clone()));
        }
        if status == 403 {
            assert_eq!(reason, "HARD_BUDGET_EXCEEDED");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never refused as over budget: {seen:?}\n{}",
            r.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen.iter()
            .any(|(s, why)| *s == 503 && why == "STATE_REBUILDING"),
        "requests were refused while the counters were rebuilt: {seen:?}"
    );
    // The rebuild wrote exactly what was committed before the loss, once.
    let [ct, ht] = sums(&url, &n, "global", ["ct", "ht"]).await;
    assert_eq!((ct, ht), (2 * w, 0));
    let log = r.log();
    assert!(log.contains("REDIS LOST THE SHARED COUNTERS"), "{log}");
    let st = r.status().await;
    assert_eq!(st["state"]["last_rebuild"]["tokens"], 2 * w, "{st}");
    assert!(
        st["state"]["warnings"]
            .to_string()
            .contains("may be missing"),
        "{st}"
    );
    assert_eq!(r.readyz().await.0, 200, "ready once rebuilt");
}

/// (b) `maxmemory-policy allkeys-lru` (set while running): /admin/status, the metric and the
/// log say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_maxmemory_policy_is_warned_in_status_metrics_and_log() {
    let up = MockUpstream::start_with_default(vec![], ok_answer()).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let _server = redis_server(port, dir.path(), &["--maxmemory-policy", "noeviction"]).await;
    let bounds =
        "quotas:\n  - {name: q, scope: consumer, match: \"*\", window: day, limit_requests: 1000}";
    let r = Replica::start(
        &up.base_url(),
        &url,
        &ns("evict"),
        "",
        bounds,
        &[("TOLLGATE_STATE_CHECK_INTERVAL_MS", "200")],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.status().await["state"]["maxmemory_policy"] != "noeviction" {
        assert!(Instant::now() < deadline, "{}", r.status().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(r.status().await["state"]["eviction_unsafe"], false);
    assert!(r
        .metrics()
        .await
        .contains("tollgate_state_eviction_unsafe 0"));

    let _: () = redis_cmd(&url, &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = r.status().await;
        if st["state"]["eviction_unsafe"] == true {
            break st;
        }
        assert!(Instant::now() < deadline, "no warning: {st}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(st["state"]["maxmemory_policy"], "allkeys-lru");
    assert!(
        st["state"]["warnings"].to_string().contains("allkeys-lru"),
        "{st}"
    );
    let m = r.metrics().await;
    assert!(m.contains("tollgate_state_eviction_unsafe 1"), "{m}");
    let log = r.log();
    assert!(log.contains("maxmemory-policy is allkeys-lru"), "{log}");
}

/// (c) A Redis that answers PING but refuses reservations (out of memory): /readyz is 503
/// and names `OOM`, requests get 503 `STATE_UNAVAILABLE`, the log says `OOM`; ready again
/// once Redis takes writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_and_names_the_error_when_redis_refuses_reservations() {
    let up = MockUpstream::start_with_default(vec![], ok_answer()).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let _server = redis_server(port, dir.path(), &[]).await;
    let bounds =
        "quotas:\n  - {name: q, scope: consumer, match: \"*\", window: day, limit_requests: 1000}";
    let r = Replica::start(&up.base_url(), &url, &ns("oom"), "", bounds, &[]).await;
    assert_eq!(r.chat().await, (200, "OK".into()));
    assert_eq!(r.readyz().await.0, 200);

    let _: () = redis_cmd(&url, &["CONFIG", "SET", "maxmemory", "1"]).await;
    let pong: String = redis_cmd(&url, &["PING"]).await;
    assert_eq!(pong, "PONG", "PING still answers");
    let (status, body) = r.readyz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("OOM"), "{body}");
    assert!(!body.contains("does not answer"), "{body}");
    assert_eq!(r.chat().await, (503, "STATE_UNAVAILABLE".into()));
    assert!(r.log().contains("OOM"), "{}", r.log());

    let _: () = redis_cmd(&url, &["CONFIG", "SET", "maxmemory", "0"]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.readyz().await.0 != 200 {
        assert!(Instant::now() < deadline, "not ready again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.chat().await.0 != 200 {
        assert!(Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// (c') A Redis that wants a password tollgate was not given: /readyz names `NOAUTH`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_noauth() {
    let up = MockUpstream::start_with_default(vec![], ok_answer()).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let _server = redis_server(port, dir.path(), &["--requirepass", "s3cret-pw"]).await;
    let bounds =
        "quotas:\n  - {name: q, scope: consumer, match: \"*\", window: day, limit_requests: 1000}";
    let r = Replica::start(&up.base_url(), &url, &ns("auth"), "", bounds, &[]).await;
    let (status, body) = r.readyz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("NOAUTH"), "{body}");
    assert_eq!(r.chat().await, (503, "STATE_UNAVAILABLE".into()));
    assert!(!r.log().contains("s3cret-pw"));
}

/// (d) A call in flight while Redis is stopped (SIGSTOP) for longer than any retry the old
/// code made: its settle is journaled and written once Redis resumes, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_while_redis_is_stopped_is_written_after_it_resumes() {
    let w = worst() as i64;
    let up =
        MockUpstream::start_with_default(vec![], ok_answer().delay(Duration::from_millis(800)))
            .await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let server = redis_server(port, dir.path(), &[]).await;
    let n = ns("stop");
    let bounds = "budgets:\n  - {name: cap, scope: global, window: month, hard_tokens: 1000000}";
    let r = Replica::start(&up.base_url(), &url, &n, "", bounds, &[]).await;
    let r = std::sync::Arc::new(r);
    let calls: Vec<_> = (0..2)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.chat().await })
        })
        .collect();
    assert_eq!(up.wait_for_hits(2, Duration::from_secs(10)).await, 2);
    let [_, ht] = sums(&url, &n, "global", ["ct", "ht"]).await;
    assert_eq!(ht, 2 * w, "both calls hold their worst case");
    server.signal("STOP");
    for c in calls {
        assert_eq!(c.await.unwrap(), (200, "OK".into()));
    }
    // Held until both settles gave up on Redis and wait in the journal: from there on only
    // the replay can write them, which is what this test is about.
    r.until_journaled(2).await;
    server.signal("CONT");
    let [ct, ht] = sums_until(&url, &n, "global", ["ct", "ht"], [2 * w, 0], 15).await;
    assert_eq!(
        (ct, ht),
        (2 * w, 0),
        "settled once, holds released\n{}",
        r.log()
    );
    // Written once: the journal is empty, and the tries Redis buffered while stopped (it
    // runs them on resuming) and the replay's own writes counted once between them.
    r.until_journaled(0).await;
    assert!(r.log().contains("written back"), "{}", r.log());
    assert_eq!(sums(&url, &n, "global", ["ct"]).await, [2 * w]);
}

/// (7) A request without a job header leaves no job counter in Redis (its job is itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn implicit_job_counters_stay_local() {
    let up = MockUpstream::start_with_default(vec![], ok_answer()).await;
    let url = "redis://127.0.0.1:6379/";
    let n = ns("job");
    let bounds = "budgets:\n  - {name: per-job, scope: job, hard_tokens: 100000}\nquotas:\n  - {name: q, scope: consumer, match: \"*\", window: day, limit_requests: 1000}";
    let r = Replica::start(&up.base_url(), url, &n, "", bounds, &[]).await;
    assert_eq!(r.chat().await, (200, "OK".into()));
    assert_eq!(
        r.chat_with(&[("x-tollgate-job", "batch-7")]).await,
        (200, "OK".into())
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while sums(url, &n, "consumer", ["cr"]).await != [2] {
        assert!(
            Instant::now() < deadline,
            "consumer counter never reached Redis"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let keys: Vec<String> = redis_cmd(url, &["KEYS", &format!("{{tollgate:{n}}}:c:job:*")]).await;
    assert!(
        !keys.is_empty() && keys.iter().all(|k| k.contains("batch-7")),
        "only the declared job's counter is shared: {keys:?}"
    );
    common::redis_keys::delete_prefix(url, &format!("{{tollgate:{n}}}")).await;
}

/// (4) `reserve.lua` holds a reservation id once: a retried reserve (its first reply lost)
/// answers as the first did and holds nothing more.
#[tokio::test]
async fn the_reserve_script_holds_a_reservation_id_once() {
    let url = "redis://127.0.0.1:6379/";
    let n = ns("rid");
    let p = format!("{{tollgate:{n}}}");
    let (k, epoch) = (format!("{p}:c:global:month:0:global"), format!("{p}:epoch"));
    let _: () = redis_cmd(url, &["SET", &epoch, "e1"]).await;
    let script = redis::Script::new(include_str!("../src/state/reserve.lua"));
    let mut c = common::redis_keys::conn(url).await;
    let far = (jiff::Timestamp::now().as_millisecond() + 3_600_000).to_string();
    let mut replies = Vec::new();
    for _ in 0..2 {
        let r: Vec<i64> = script
            .key(&k)
            .key(format!("{k}:l"))
            .key(format!("{k}:s"))
            .key(&epoch)
            .key(format!("{p}:rebuilding"))
            .arg("rid-1:40:1:0")
            .arg(40)
            .arg(1)
            .arg(0)
            .arg(60_000)
            .arg(1)
            .arg(100)
            .arg(-1)
            .arg(-1)
            .arg(&far)
            .arg("e1")
            .invoke_async(&mut c)
            .await
            .unwrap();
        replies.push(r);
    }
    assert_eq!(replies[0][0], 1, "{replies:?}");
    assert_eq!(
        replies[1], replies[0],
        "the retry answers as the first call"
    );
    let ht: i64 = redis_cmd(url, &["HGET", &k, "ht"]).await;
    assert_eq!(ht, 40, "held once");
    // Another epoch than the marker's: nothing held.
    let r: Vec<i64> = script
        .key(&k)
        .key(format!("{k}:l"))
        .key(format!("{k}:s"))
        .key(&epoch)
        .key(format!("{p}:rebuilding"))
        .arg("rid-2:40:1:0")
        .arg(40)
        .arg(1)
        .arg(0)
        .arg(60_000)
        .arg(1)
        .arg(100)
        .arg(-1)
        .arg(-1)
        .arg(&far)
        .arg("e0")
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(r, vec![2]);
    common::redis_keys::delete_prefix(url, &p).await;
}

/// (c'') A Redis Cluster node that does not own the namespace's slot answers `MOVED` to a
/// plain client; tollgate detects the cluster (`INFO cluster`) and uses the cluster client:
/// /readyz is 200, requests are served and counted on the owning node, status says
/// `topology: cluster`. (Before cluster support this was 503 naming `MOVED`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_without_the_slot_serves_through_the_cluster_client() {
    let up = MockUpstream::start_with_default(vec![], ok_answer()).await;
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (pa, pb) = (free_port(), free_port());
    let (ba, bb) = (free_port(), free_port());
    let cluster = |bus: u16| {
        [
            "--cluster-enabled".to_string(),
            "yes".to_string(),
            "--cluster-config-file".to_string(),
            "nodes.conf".to_string(),
            "--cluster-port".to_string(),
            bus.to_string(),
        ]
    };
    let (ca, cb) = (cluster(ba), cluster(bb));
    let ca: Vec<&str> = ca.iter().map(String::as_str).collect();
    let cb: Vec<&str> = cb.iter().map(String::as_str).collect();
    let _a = redis_server(pa, da.path(), &ca).await;
    let _b = redis_server(pb, db.path(), &cb).await;
    let (ua, ub) = (
        format!("redis://127.0.0.1:{pa}/"),
        format!("redis://127.0.0.1:{pb}/"),
    );
    // Every slot on b; a learns it by gossip.
    let _: () = redis_cmd(&ub, &["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]).await;
    let _: () = redis_cmd(
        &ua,
        &[
            "CLUSTER",
            "MEET",
            "127.0.0.1",
            &pb.to_string(),
            &bb.to_string(),
        ],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let nodes: String = redis_cmd(&ua, &["CLUSTER", "NODES"]).await;
        let info: String = redis_cmd(&ua, &["CLUSTER", "INFO"]).await;
        if nodes.contains("0-16383") && info.contains("cluster_state:ok") {
            break;
        }
        assert!(Instant::now() < deadline, "cluster did not form: {nodes}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let n = ns("moved");
    let mut plain = common::redis_keys::conn(&ua).await;
    let moved: Result<Option<String>, _> = redis::cmd("GET")
        .arg(format!("{{tollgate:{n}}}:epoch"))
        .query_async(&mut plain)
        .await;
    assert_eq!(
        moved.unwrap_err().code(),
        Some("MOVED"),
        "a does not own the slot"
    );
    let bounds =
        "quotas:\n  - {name: q, scope: consumer, match: \"*\", window: day, limit_requests: 1000}";
    let r = Replica::start(&up.base_url(), &ua, &n, "", bounds, &[]).await;
    let (status, body) = r.readyz().await;
    assert_eq!(status, 200, "{body}\n{}", r.log());
    assert_eq!(r.chat().await, (200, "OK".into()));
    assert_eq!(r.chat().await, (200, "OK".into()));
    let [cr] = sums_until(&ub, &n, "consumer", ["cr"], [2], 10).await;
    assert_eq!(cr, 2, "counted on the owning node");
    assert_eq!(r.status().await["state"]["topology"], "cluster");
    assert!(r.log().contains("Redis is a cluster"), "{}", r.log());
    let log = r.log();
    assert!(!log.contains("Redis refuses tollgate's calls"), "{log}");
    assert!(!log.contains("does not answer"), "{log}");
}

/// The connection to Redis cut while two calls are in flight, until both settles gave up and
/// wait in the journal: they are written once the connection comes back; nothing of
/// the usage is lost and the holds are released (not left to the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_across_a_cut_connection_is_written_once_it_is_back() {
    let w = worst() as i64;
    let up =
        MockUpstream::start_with_default(vec![], ok_answer().delay(Duration::from_millis(800)))
            .await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let _server = redis_server(port, dir.path(), &[]).await;
    let proxy = common::cuttable::Cuttable::start(port).await;
    let via = format!("redis://127.0.0.1:{}/", proxy.port);
    let n = ns("cut");
    let bounds = "budgets:\n  - {name: cap, scope: global, window: month, hard_tokens: 1000000}";
    let r = std::sync::Arc::new(Replica::start(&up.base_url(), &via, &n, "", bounds, &[]).await);
    let calls: Vec<_> = (0..2)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.chat().await })
        })
        .collect();
    assert_eq!(up.wait_for_hits(2, Duration::from_secs(10)).await, 2);
    assert_eq!(sums(&url, &n, "global", ["ht"]).await, [2 * w]);
    proxy.set_cut(true).await;
    for c in calls {
        assert_eq!(c.await.unwrap(), (200, "OK".into()));
    }
    // While cut: the replica cannot reserve (deny), and nothing reached Redis.
    assert_eq!(r.chat().await.0, 503);
    assert_eq!(sums(&url, &n, "global", ["ct"]).await, [0]);
    // Restored once both settles wait in the journal: only its replay can write them now.
    r.until_journaled(2).await;
    proxy.set_cut(false).await;
    let [ct, ht] = sums_until(&url, &n, "global", ["ct", "ht"], [2 * w, 0], 15).await;
    assert_eq!(
        (ct, ht),
        (2 * w, 0),
        "settled once, holds released\n{}",
        r.log()
    );
    // Served again once Redis answers.
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.chat().await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "not served after the cut\n{}",
            r.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
