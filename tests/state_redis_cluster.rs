//! A fleet of sidecars on a real Redis Cluster (issue 51): six private `redis-server`s
//! (three masters, three replicas) formed with `redis-cli --cluster create`. `state.redis_url`
//! at a node that does not own the namespace's slot governs and counts; the slot migrating to
//! another master under load and a manual failover under load need no restart, never exceed
//! the hard bound, and the counted usage is exactly what the mock upstream served.

mod common;

use common::mock::{Answer, MockUpstream};
use common::process::free_port;
use common::sidecar::Sidecar;
use common::try_post_json;
use serde_json::json as j;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate::estimate::{self, Endpoint, Tokenizer};

const MAX_TOKENS: u64 = 50;
/// Sidecars in each fleet (they share one namespace).
const FLEET: usize = 8;

fn body() -> serde_json::Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "one cluster, one budget"}], "max_tokens": MAX_TOKENS})
}

/// The worst case of `body()` (the mock reports exactly this as usage).
fn worst() -> u64 {
    estimate::estimate(Endpoint::Chat, &body(), Tokenizer::O200k)
        .unwrap()
        .input_tokens
        + MAX_TOKENS
}

fn ok_answer(delay_ms: u64) -> Answer {
    Answer::ok_chat("ok", worst() - MAX_TOKENS, MAX_TOKENS).delay(Duration::from_millis(delay_ms))
}

fn ns(name: &str) -> String {
    format!("test-{name}-{:08x}", rand::random::<u32>())
}

/// One cluster at a time: six redis-servers and a fleet per test on two cores would time
/// out failovers and slot moves that pass alone.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Six cluster-enabled redis-servers, killed (SIGKILL) when dropped, also mid-test.
struct Cluster {
    /// This test's turn, held until its servers are gone.
    _turn: tokio::sync::MutexGuard<'static, ()>,
    children: Vec<Child>,
    ports: Vec<u16>,
    /// Nodes killed by the test.
    dead: Vec<u16>,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A port whose neighbour for the cluster bus is chosen separately (`--cluster-port`).
fn ports(n: usize) -> Vec<u16> {
    let mut v: Vec<u16> = Vec::new();
    while v.len() < n {
        let p = free_port();
        if !v.contains(&p) {
            v.push(p);
        }
    }
    v
}

fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

async fn cmd<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    let mut c = redis::Client::open(url(port))?
        .get_multiplexed_async_connection()
        .await?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut c).await
}

impl Cluster {
    async fn start() -> Cluster {
        let turn = ONE_AT_A_TIME.lock().await;
        let dir = tempfile::tempdir().unwrap();
        let all = ports(12);
        let (ports, buses) = (all[..6].to_vec(), all[6..].to_vec());
        let mut children = Vec::new();
        for (p, b) in ports.iter().zip(&buses) {
            let child = Command::new("redis-server")
                .args(["--port", &p.to_string(), "--cluster-port", &b.to_string()])
                .args(["--bind", "127.0.0.1", "--cluster-enabled", "yes"])
                .args(["--cluster-config-file", &format!("nodes-{p}.conf")])
                .args([
                    "--cluster-node-timeout",
                    "2000",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                // A replica may always take over from a dead master (the default refuses
                // one whose link was down "too long", which the test's quick kill can trip).
                .args(["--cluster-replica-validity-factor", "0"])
                .args(["--daemonize", "no", "--dir"])
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            children.push(child);
        }
        let cluster = Cluster {
            _turn: turn,
            children,
            ports,
            dead: Vec::new(),
            _dir: dir,
        };
        for p in &cluster.ports {
            let deadline = Instant::now() + Duration::from_secs(10);
            while cmd::<String>(*p, &["PING"]).await.is_err() {
                assert!(Instant::now() < deadline, "redis-server {p} did not start");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli is installed");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_ok().await;
        cluster
    }

    /// Until every node says `cluster_state:ok`, all slots served, sees three replicas, and
    /// every replica has synced with its master.
    async fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        'outer: loop {
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            for p in &self.ports {
                let info: String = cmd(*p, &["CLUSTER", "INFO"]).await.unwrap_or_default();
                let nodes: String = cmd(*p, &["CLUSTER", "NODES"]).await.unwrap_or_default();
                let replicas = nodes
                    .lines()
                    .filter_map(Node::parse)
                    .filter(|n| !n.master)
                    .count();
                if !info.contains("cluster_state:ok")
                    || !info.contains("cluster_slots_ok:16384")
                    || replicas != 3
                    || !self.synced(*p).await
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue 'outer;
                }
            }
            return;
        }
    }

    /// A master, or a replica whose link to its master is up (its initial sync is done).
    async fn synced(&self, port: u16) -> bool {
        let info: String = cmd(port, &["INFO", "replication"])
            .await
            .unwrap_or_default();
        info.contains("role:master") || info.contains("master_link_status:up")
    }

    /// SIGKILL the node on `port`.
    fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        let _ = self.children[i].kill();
        let _ = self.children[i].wait();
        self.dead.push(port);
    }

    /// `CLUSTER NODES` as (id, port, is master, master id of a replica, slot ranges).
    async fn nodes(&self) -> Vec<Node> {
        for p in self.ports.iter().filter(|p| !self.dead.contains(p)) {
            if let Ok(text) = cmd::<String>(*p, &["CLUSTER", "NODES"]).await {
                return text.lines().filter_map(Node::parse).collect();
            }
        }
        panic!("no node answers CLUSTER NODES");
    }

    /// The master that owns `slot`, as every master agrees (waits until they do).
    async fn owner(&self, slot: u16) -> Node {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut seen = Vec::new();
            let mut answering = 0;
            for p in self.ports.iter().filter(|p| !self.dead.contains(p)) {
                answering += 1;
                if let Ok(text) = cmd::<String>(*p, &["CLUSTER", "NODES"]).await {
                    let nodes: Vec<Node> = text.lines().filter_map(Node::parse).collect();
                    if let Some(n) = nodes.into_iter().find(|n| n.master && n.owns(slot)) {
                        seen.push(n);
                    }
                }
            }
            if seen.len() == answering && seen.iter().all(|n| n.id == seen[0].id) {
                return seen.swap_remove(0);
            }
            assert!(Instant::now() < deadline, "nodes disagree on slot {slot}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[derive(Debug, Clone)]
struct Node {
    id: String,
    port: u16,
    master: bool,
    of: String,
    slots: Vec<(u16, u16)>,
}

impl Node {
    fn parse(line: &str) -> Option<Node> {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            return None;
        }
        let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
        let slots = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => s.parse().ok().map(|a| (a, a)),
            })
            .collect();
        Some(Node {
            id: f[0].to_string(),
            port,
            master: f[2].contains("master"),
            of: f[3].to_string(),
            slots,
        })
    }

    fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }
}

/// How often `port` answered with error `code` (`INFO errorstats`), e.g. ASK, TRYAGAIN, MOVED.
async fn errors(port: u16, code: &str) -> u64 {
    let info: String = cmd(port, &["INFO", "errorstats"]).await.unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("errorstat_{code}:count=")))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The namespace's cluster slot (all its keys share the hash tag `{tollgate:<ns>}`).
async fn slot_of(c: &Cluster, namespace: &str) -> u16 {
    let s: i64 = cmd(
        c.ports[0],
        &["CLUSTER", "KEYSLOT", &format!("{{tollgate:{namespace}}}")],
    )
    .await
    .unwrap();
    s as u16
}

/// (committed tokens, held tokens) over the namespace's global counters, read on `port`.
async fn totals(port: u16, namespace: &str) -> (i64, i64) {
    let keys: Vec<String> = cmd(
        port,
        &["KEYS", &format!("{{tollgate:{namespace}}}:c:global:*")],
    )
    .await
    .unwrap();
    let (mut ct, mut ht) = (0, 0);
    for k in keys
        .iter()
        .filter(|k| !k.ends_with(":l") && !k.ends_with(":s"))
    {
        let v: Vec<Option<i64>> = cmd(port, &["HMGET", k, "ct", "ht"]).await.unwrap();
        ct += v[0].unwrap_or(0);
        ht += v[1].unwrap_or(0);
    }
    (ct, ht)
}

/// Polls `totals` on the slot's current owner until nothing is held (or 15 s).
async fn settled_totals(c: &Cluster, namespace: &str, slot: u16) -> (i64, i64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let owner = c.owner(slot).await;
        let t = totals(owner.port, namespace).await;
        if t.1 == 0 || Instant::now() > deadline {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn policy(mock: &str, namespace: &str, redis_url: &str, extra: &str, hard_tokens: u64) -> String {
    format!(
        r#"
version: cluster-1
backends:
  - {{id: primary, kind: openai, base_url: "{mock}", timeouts: {{total: 3s}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
budgets:
  - {{name: cap, scope: global, window: month, hard_tokens: {hard_tokens}}}
state: {{backend: redis, redis_url: "{redis_url}", namespace: "{namespace}"{extra}}}
audit: {{sink: "off"}}
"#
    )
}

async fn chat(sc: &Sidecar) -> (u16, String) {
    match try_post_json(&sc.chat_url(), &body(), &[]).await {
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

async fn fleet(yaml: &str) -> Vec<Arc<Sidecar>> {
    let mut v = Vec::new();
    for _ in 0..FLEET {
        v.push(Arc::new(Sidecar::start_shared(yaml).await));
    }
    v
}

/// What the load saw: 200s, 403 HARD_BUDGET_EXCEEDED, and every other answer with when.
#[derive(Default)]
struct Seen {
    ok: AtomicUsize,
    over: AtomicUsize,
    other: Mutex<Vec<(Instant, u16, String)>>,
}

/// One worker per sidecar, sending one request after another until each has seen the hard
/// bound refuse (or `deadline`).
fn load(
    sidecars: &[Arc<Sidecar>],
    seen: &Arc<Seen>,
    deadline: Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    sidecars
        .iter()
        .map(|sc| {
            let (sc, seen) = (sc.clone(), seen.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let (status, reason) = chat(&sc).await;
                    match (status, reason.as_str()) {
                        (200, _) => {
                            seen.ok.fetch_add(1, Ordering::Relaxed);
                        }
                        (403, "HARD_BUDGET_EXCEEDED") => {
                            seen.over.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                        _ => {
                            seen.other
                                .lock()
                                .unwrap()
                                .push((Instant::now(), status, reason));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            })
        })
        .collect()
}

async fn wait_ok_count(seen: &Seen, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.ok.load(Ordering::Relaxed) < n {
        assert!(Instant::now() < deadline, "load did not reach {n} answers");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The fleet's final accounting: every worker met the bound, nothing over it, and Redis
/// counted exactly what the mock served.
async fn check_books(
    c: &Cluster,
    namespace: &str,
    slot: u16,
    up: &MockUpstream,
    seen: &Seen,
    budget_requests: u64,
    after: Instant,
) {
    let w = worst() as i64;
    let late: Vec<_> = seen
        .other
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _, _)| *t > after)
        .map(|(_, s, r)| (*s, r.clone()))
        .collect();
    assert!(late.is_empty(), "requests failed after the grace: {late:?}");
    assert_eq!(
        seen.over.load(Ordering::Relaxed),
        FLEET,
        "every worker met the hard bound"
    );
    let served = up.hits() as i64;
    assert_eq!(served, seen.ok.load(Ordering::Relaxed) as i64);
    assert!(
        served as u64 <= budget_requests,
        "the hard bound was exceeded: {served} served, {budget_requests} allowed"
    );
    let (ct, ht) = settled_totals(c, namespace, slot).await;
    assert_eq!((ct, ht), (served * w, 0), "counted = served, nothing held");
}

/// (a) `redis_url` at a master that does not own the namespace's slot (the old code got 503
/// `MOVED`): the fleet is ready, governs and counts; one sidecar reaches the cluster only
/// through `state.redis_urls` (its `redis_url` does not answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_url_at_a_node_without_the_slot_governs_and_counts() {
    let c = Cluster::start().await;
    let n = ns("cl-any");
    let slot = slot_of(&c, &n).await;
    let owner = c.owner(slot).await;
    let other = c
        .nodes()
        .await
        .into_iter()
        .find(|x| x.master && !x.slots.is_empty() && x.id != owner.id)
        .expect("another master");
    // The node we point at really answers MOVED for the namespace.
    let e = cmd::<Option<String>>(other.port, &["GET", &format!("{{tollgate:{n}}}:epoch")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some("MOVED"), "{e}");

    // A master other than the slot's owner may evict: the check asks every master.
    let _: () = cmd(
        other.port,
        &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"],
    )
    .await
    .unwrap();
    let w = worst();
    let k = 24u64;
    let up = MockUpstream::start_with_default(vec![], ok_answer(0)).await;
    let yaml = policy(&up.base_url(), &n, &url(other.port), "", k * w);
    let mut sidecars = fleet(&yaml).await;
    sidecars.pop();
    let dead = free_port();
    let seeds = policy(
        &up.base_url(),
        &n,
        &url(dead),
        &format!(", redis_urls: [\"{}\"]", url(other.port)),
        k * w,
    );
    sidecars.push(Arc::new(Sidecar::start_shared(&seeds).await));
    for sc in &sidecars {
        let (s, _, b) = common::get(&format!("http://{}/readyz", sc.running.admin_addr)).await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    }
    let (s, _, b) = common::get(&format!(
        "http://{}/admin/status",
        sidecars[0].running.admin_addr
    ))
    .await;
    assert_eq!(s, 200);
    let st = common::json(&b);
    assert_eq!(st["state"]["topology"], "cluster", "{st}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, _, b) = common::get(&format!(
            "http://{}/admin/status",
            sidecars[0].running.admin_addr
        ))
        .await;
        let st = common::json(&b);
        if st["state"]["maxmemory_policy"] == "allkeys-lru" {
            assert_eq!(st["state"]["eviction_unsafe"], true, "{st}");
            break;
        }
        assert!(Instant::now() < deadline, "{st}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The epoch marker lives on the slot's owner.
    let epoch: Option<String> = cmd(owner.port, &["GET", &format!("{{tollgate:{n}}}:epoch")])
        .await
        .unwrap();
    assert!(epoch.is_some(), "epoch marker on the owner");

    let seen = Arc::new(Seen::default());
    for h in load(&sidecars, &seen, Instant::now() + Duration::from_secs(30)) {
        h.await.unwrap();
    }
    let others = seen.other.lock().unwrap().clone();
    assert!(others.is_empty(), "{others:?}");
    assert_eq!(
        seen.ok.load(Ordering::Relaxed) as u64,
        k,
        "exactly the budget was served"
    );
    check_books(&c, &n, slot, &up, &seen, k, Instant::now()).await;
    // The seed-only sidecar served through the cluster too: its own request refused as over.
    assert_eq!(
        chat(&sidecars[FLEET - 1]).await,
        (403, "HARD_BUDGET_EXCEEDED".into())
    );
}

/// Moves `slot` from master `from` to master `to` the way `redis-cli --cluster reshard`
/// does: IMPORTING / MIGRATING, MIGRATE the keys in batches, then SETSLOT NODE everywhere.
async fn migrate_slot(c: &Cluster, slot: u16, from: &Node, to: &Node) {
    let s = slot.to_string();
    let _: () = cmd(to.port, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &from.id])
        .await
        .unwrap();
    let _: () = cmd(from.port, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &to.id])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // One key at a time, 100 ms apart, so the fleet's requests meet the slot half-moved
        // (the old owner answers ASK or TRYAGAIN, the new one TRYAGAIN) for most of a second.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let keys: Vec<String> = cmd(from.port, &["CLUSTER", "GETKEYSINSLOT", &s, "1"])
            .await
            .unwrap();
        if keys.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "MIGRATE did not finish");
        let port = to.port.to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().map(String::as_str));
        let _: redis::Value = cmd(from.port, &args).await.unwrap();
    }
    let _: () = cmd(to.port, &["CLUSTER", "SETSLOT", &s, "NODE", &to.id])
        .await
        .unwrap();
    let _: () = cmd(from.port, &["CLUSTER", "SETSLOT", &s, "NODE", &to.id])
        .await
        .unwrap();
    for n in c
        .nodes()
        .await
        .iter()
        .filter(|n| n.master && n.id != to.id && n.id != from.id)
    {
        let _: () = cmd(n.port, &["CLUSTER", "SETSLOT", &s, "NODE", &to.id])
            .await
            .unwrap();
    }
}

/// (b) The namespace's slot migrates to another master while eight sidecars run requests:
/// no request fails after a short grace, the hard bound holds, the count is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_under_load_needs_no_restart_and_keeps_the_bound() {
    let c = Cluster::start().await;
    let n = ns("cl-move");
    let slot = slot_of(&c, &n).await;
    let from = c.owner(slot).await;
    let to = c
        .nodes()
        .await
        .into_iter()
        .find(|x| x.master && !x.slots.is_empty() && x.id != from.id)
        .expect("another master");
    let w = worst();
    let k = 160u64;
    let up = MockUpstream::start_with_default(vec![], ok_answer(30)).await;
    let sidecars = fleet(&policy(&up.base_url(), &n, &url(from.port), "", k * w)).await;
    let seen = Arc::new(Seen::default());
    let workers = load(&sidecars, &seen, Instant::now() + Duration::from_secs(40));
    wait_ok_count(&seen, (k / 4) as usize).await;
    assert_eq!(
        seen.over.load(Ordering::Relaxed),
        0,
        "migrated while under the bound"
    );
    migrate_slot(&c, slot, &from, &to).await;
    let moved = Instant::now();
    assert_eq!(c.owner(slot).await.id, to.id, "the slot moved");
    let at_move = seen.ok.load(Ordering::Relaxed);
    for h in workers {
        h.await.unwrap();
    }
    assert!(
        seen.ok.load(Ordering::Relaxed) > at_move,
        "requests were served after the move"
    );
    // The move met the fleet's traffic: redirections and retries were answered and followed.
    let (ask, again) = (
        errors(from.port, "ASK").await,
        errors(from.port, "TRYAGAIN").await,
    );
    let moved_err = errors(from.port, "MOVED").await;
    let again_new = errors(to.port, "TRYAGAIN").await;
    let early = seen.other.lock().unwrap().len();
    eprintln!("migration: ASK {ask}, TRYAGAIN {again}, MOVED {moved_err} on the old owner, TRYAGAIN {again_new} on the new one; {early} requests refused during the move");
    assert!(ask + again + again_new > 0, "the migration met no request");
    check_books(&c, &n, slot, &up, &seen, k, moved + Duration::from_secs(2)).await;
    assert_eq!(
        totals(from.port, &n).await,
        (0, 0),
        "nothing left on the old owner"
    );
}

/// (c) `CLUSTER FAILOVER` on the replica of the slot's master while eight sidecars run
/// requests: they go on without a restart, the hard bound holds, the count is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_failover_under_load_needs_no_restart_and_keeps_the_bound() {
    let c = Cluster::start().await;
    let n = ns("cl-failover");
    let slot = slot_of(&c, &n).await;
    let master = c.owner(slot).await;
    let replica = c
        .nodes()
        .await
        .into_iter()
        .find(|x| !x.master && x.of == master.id)
        .expect("the master's replica");
    let w = worst();
    let k = 160u64;
    let up = MockUpstream::start_with_default(vec![], ok_answer(30)).await;
    let sidecars = fleet(&policy(&up.base_url(), &n, &url(master.port), "", k * w)).await;
    let seen = Arc::new(Seen::default());
    let workers = load(&sidecars, &seen, Instant::now() + Duration::from_secs(40));
    wait_ok_count(&seen, (k / 4) as usize).await;
    assert_eq!(
        seen.over.load(Ordering::Relaxed),
        0,
        "failed over while under the bound"
    );
    let _: () = cmd(replica.port, &["CLUSTER", "FAILOVER"]).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while c.owner(slot).await.id != replica.id {
        assert!(Instant::now() < deadline, "the replica did not take over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let promoted = Instant::now();
    let at_failover = seen.ok.load(Ordering::Relaxed);
    for h in workers {
        h.await.unwrap();
    }
    assert!(
        seen.ok.load(Ordering::Relaxed) > at_failover,
        "requests were served after the failover"
    );
    let moved_err = errors(master.port, "MOVED").await;
    let early = seen.other.lock().unwrap().len();
    eprintln!("failover: MOVED {moved_err} on the old master; {early} requests refused around the failover");
    assert!(moved_err > 0, "the failover met no request");
    check_books(
        &c,
        &n,
        slot,
        &up,
        &seen,
        k,
        promoted + Duration::from_secs(3),
    )
    .await;
}

/// (d) The slot's master stops answering (`CLIENT PAUSE`) while calls are in flight: their
/// settles cannot be written, are journaled, and are replayed through the cluster client once
/// it answers: nothing held, the count exact, the journal empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_journaled_while_the_master_is_paused_are_replayed() {
    let c = Cluster::start().await;
    let n = ns("cl-journal");
    let slot = slot_of(&c, &n).await;
    let master = c.owner(slot).await;
    let w = worst();
    let up = MockUpstream::start_with_default(vec![], ok_answer(600)).await;
    let yaml = policy(&up.base_url(), &n, &url(master.port), "", 1000 * w);
    let sc = Arc::new(Sidecar::start_shared(&yaml).await);
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let sc = sc.clone();
            tokio::spawn(async move { chat(&sc).await })
        })
        .collect();
    // All four reserved and reached the upstream; their settles come after the pause starts.
    assert_eq!(up.wait_for_hits(4, Duration::from_secs(10)).await, 4);
    let _: () = cmd(master.port, &["CLIENT", "PAUSE", "3500", "ALL"])
        .await
        .unwrap();
    for h in calls {
        assert_eq!(h.await.unwrap(), (200, "OK".into()));
    }
    let status = format!("http://{}/admin/status", sc.running.admin_addr);
    let pending = |st: &serde_json::Value| st["state"]["journal"]["pending_settlements"].as_u64();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut journaled = false;
    loop {
        let st = common::json(&common::get(&status).await.2);
        journaled |= pending(&st).unwrap_or(0) > 0;
        if journaled && pending(&st) == Some(0) {
            break;
        }
        assert!(Instant::now() < deadline, "journal not replayed: {st}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ct, ht) = settled_totals(&c, &n, slot).await;
    assert_eq!(
        (ct, ht),
        (4 * w as i64, 0),
        "replayed once each, nothing held"
    );
}

/// The shard of a counter (`state.shards`): FNV-1a of `<scope>:<window>:<start>:<id>`, the
/// text after `}:c:` in its key (the store's layout, checked below against real keys).
fn shard_of(text: &str, n: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h % n
}

/// Every counter hash of `namespace` on every master: (shard, text after `}:c:`).
async fn counters(c: &Cluster, namespace: &str) -> Vec<(u64, String, u16)> {
    let mut out = Vec::new();
    for n in c.nodes().await.iter().filter(|n| n.master) {
        let keys: Vec<String> = cmd(n.port, &["KEYS", &format!("{{tollgate:{namespace}*")])
            .await
            .unwrap();
        for k in keys {
            let Some((tag, rest)) = k.split_once("}:c:") else {
                continue;
            };
            if rest.ends_with(":l") || rest.ends_with(":s") {
                continue;
            }
            let shard = tag
                .strip_prefix(&format!("{{tollgate:{namespace}"))
                .and_then(|t| t.strip_prefix(':'))
                .map_or(0, |s| s.parse().unwrap());
            out.push((shard, rest.to_string(), n.port));
        }
    }
    out
}

fn sharded_policy(mock: &str, namespace: &str, redis_url: &str, global: u64, per: u64) -> String {
    format!(
        r#"
version: cluster-shards
backends:
  - {{id: primary, kind: openai, base_url: "{mock}", timeouts: {{total: 3s}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
budgets:
  - {{name: all, scope: global, window: month, hard_tokens: {global}}}
  - {{name: each, scope: consumer, window: day, hard_tokens: {per}}}
state: {{backend: redis, redis_url: "{redis_url}", namespace: "{namespace}", shards: 8}}
audit: {{sink: "off"}}
"#
    )
}

/// (e) `state.shards: 8`: each counter under its own tag, spread over the masters; a
/// reservation spanning shards is taken shard by shard and, when a later shard refuses, the
/// holds already taken are released: the consumers' hard bounds refuse exactly, the global
/// counter counts exactly what was served, and nothing stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_counters_span_slots_and_release_taken_holds_on_refusal() {
    let c = Cluster::start().await;
    let w = worst();
    let up = MockUpstream::start_with_default(vec![], ok_answer(0)).await;
    let seed = c.ports[0];
    // Learn the layout (window starts, the global counter's id) on a scratch namespace.
    let scratch = ns("cl-shard-scratch");
    let sc = Sidecar::start_shared(&sharded_policy(
        &up.base_url(),
        &scratch,
        &url(seed),
        1000 * w,
        1000 * w,
    ))
    .await;
    let hdr = [("x-tollgate-consumer", "warm")];
    assert_eq!(
        try_post_json(&sc.chat_url(), &body(), &hdr)
            .await
            .unwrap()
            .0,
        200
    );
    let seen = counters(&c, &scratch).await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (shard, text, _) in &seen {
        assert_eq!(*shard, shard_of(text, 8), "the shard layout: {text}");
    }
    let global = seen
        .iter()
        .find(|(_, t, _)| t.starts_with("global:"))
        .unwrap()
        .clone();
    let day = seen
        .iter()
        .find(|(_, t, _)| t.starts_with("consumer:"))
        .unwrap()
        .1
        .clone();
    let day_prefix = day.strip_suffix("warm").unwrap().to_string();
    sc.stop().await;

    // Consumers whose counter's shard comes after the global counter's: their reservation
    // holds the global counter first, so a refusal must release that hold. (If the global
    // counter is in the last shard, the global bound is the one that refuses instead, and
    // consumer holds taken first are released.)
    let per = 3u64;
    let consumers: Vec<String> = if global.0 < 7 {
        (0..10_000)
            .map(|i| format!("c{i}"))
            .filter(|id| shard_of(&format!("{day_prefix}{id}"), 8) > global.0)
            .take(4)
            .collect()
    } else {
        (0..4).map(|i| format!("c{i}")).collect()
    };
    assert_eq!(consumers.len(), 4);
    let (global_cap, per_cap) = if global.0 < 7 {
        (1000 * w, per * w)
    } else {
        (per * w, 1000 * w)
    };
    let n = ns("cl-shard");
    let yaml = sharded_policy(&up.base_url(), &n, &url(seed), global_cap, per_cap);
    let sidecars = fleet(&yaml).await;
    let served = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = sidecars
        .iter()
        .enumerate()
        .map(|(i, sc)| {
            let (sc, served, who) = (sc.clone(), served.clone(), consumers[i % 4].clone());
            tokio::spawn(async move {
                let hdr = [("x-tollgate-consumer", who.as_str())];
                let mut refused = 0;
                for _ in 0..8 {
                    let (s, h, _) = try_post_json(&sc.chat_url(), &body(), &hdr).await.unwrap();
                    let reason = h
                        .get("x-tollgate-reason")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    match s {
                        200 => {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        403 => {
                            assert_eq!(reason, "HARD_BUDGET_EXCEEDED");
                            refused += 1;
                        }
                        _ => panic!("{s} {reason}"),
                    }
                }
                refused
            })
        })
        .collect();
    let mut refused = 0;
    for t in tasks {
        refused += t.await.unwrap();
    }
    let served = served.load(Ordering::Relaxed) as u64;
    let hits = up.hits() as u64 - 1; // the scratch request
    assert_eq!(served, hits);
    if global.0 < 7 {
        assert_eq!(served, 4 * per, "each consumer got exactly its bound");
    } else {
        assert_eq!(served, per, "the global bound held exactly");
    }
    assert_eq!(served + refused, 64);
    // Counters live in several shards on more than one master; nothing is held (the holds
    // taken before a refusal were released, not left to the lease), counts are exact.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all = counters(&c, &n).await;
        let mut held = 0i64;
        let mut ct_global = 0i64;
        let mut ct_consumers = 0i64;
        for (_, text, port) in &all {
            let key = all_key(&n, text);
            let v: Vec<Option<i64>> = cmd(*port, &["HMGET", &key, "ct", "ht"]).await.unwrap();
            held += v[1].unwrap_or(0);
            if text.starts_with("global:") {
                ct_global += v[0].unwrap_or(0);
            } else {
                ct_consumers += v[0].unwrap_or(0);
            }
        }
        let shards: std::collections::HashSet<u64> = all.iter().map(|x| x.0).collect();
        let ports: std::collections::HashSet<u16> = all.iter().map(|x| x.2).collect();
        if held == 0 {
            // Released holds are settled ids too: more settled ids than served requests on
            // the counters taken first proves holds were taken and then given back.
            let mut settled = 0i64;
            for (_, text, port) in &all {
                if text.starts_with("global:") == (global.0 < 7) {
                    let k = format!("{}:s", all_key(&n, text));
                    settled += cmd::<i64>(*port, &["ZCARD", &k]).await.unwrap();
                }
            }
            eprintln!("settled ids on the counters taken first: {settled}, served {served}");
            assert!(settled > served as i64, "no hold was taken and released");
            assert_eq!(ct_global, (served * w) as i64);
            assert_eq!(ct_consumers, (served * w) as i64);
            assert!(shards.len() >= 2, "{all:?}");
            eprintln!("shards: {} counters in shards {shards:?} on {} masters; {served} served, {refused} refused", all.len(), ports.len());
            break;
        }
        assert!(Instant::now() < deadline, "holds left: {held} ({all:?})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A counter's key from its shard layout (the test recomputes the shard).
fn all_key(namespace: &str, text: &str) -> String {
    match shard_of(text, 8) {
        0 => format!("{{tollgate:{namespace}}}:c:{text}"),
        s => format!("{{tollgate:{namespace}:{s}}}:c:{text}"),
    }
}

/// (f) The slot's master is killed (`kill -9`) under load: after `cluster-node-timeout` its
/// replica takes over, and the fleet goes on through the new master without a restart (calls
/// in between are refused as "unavailable", 503, as `on_unavailable: deny` says). Counts are
/// not compared: replication is asynchronous, so a write the dead master acknowledged may not
/// have reached the replica (Redis' guarantee, said in docs/scale-out.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_replaced_and_the_fleet_goes_on_without_a_restart() {
    let mut c = Cluster::start().await;
    let n = ns("cl-kill");
    let slot = slot_of(&c, &n).await;
    let master = c.owner(slot).await;
    let replica = c
        .nodes()
        .await
        .into_iter()
        .find(|x| !x.master && x.of == master.id)
        .expect("the master's replica");
    let w = worst();
    let up = MockUpstream::start_with_default(vec![], ok_answer(20)).await;
    let yaml = policy(&up.base_url(), &n, &url(master.port), "", 1_000_000 * w);
    let sidecars = fleet(&yaml).await;
    let seen = Arc::new(Seen::default());
    let workers = load(&sidecars, &seen, Instant::now() + Duration::from_secs(45));
    wait_ok_count(&seen, 40).await;
    c.kill(master.port);
    let killed = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.owner(slot).await.id != replica.id {
        if Instant::now() > deadline {
            let view: String = cmd(replica.port, &["CLUSTER", "NODES"])
                .await
                .unwrap_or_default();
            let info: String = cmd(replica.port, &["CLUSTER", "INFO"])
                .await
                .unwrap_or_default();
            panic!("the replica did not take over:\n{view}\n{info}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let promoted = Instant::now();
    let at = seen.ok.load(Ordering::Relaxed);
    // Served again through the new master, and nothing refused once the grace is over.
    let deadline = Instant::now() + Duration::from_secs(15);
    while seen.ok.load(Ordering::Relaxed) < at + 200 {
        assert!(Instant::now() < deadline, "the fleet did not resume");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resumed = Instant::now();
    for sc in &sidecars {
        let (s, _, b) = common::get(&format!("http://{}/readyz", sc.running.admin_addr)).await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    }
    for h in workers {
        h.abort();
    }
    let others = seen.other.lock().unwrap().clone();
    let late: Vec<_> = others
        .iter()
        .filter(|(t, _, _)| *t > promoted + Duration::from_secs(3))
        .map(|(_, s, r)| (*s, r.clone()))
        .collect();
    eprintln!(
        "kill: promoted {:?} after the kill, resumed {:?} after; {} refused meanwhile ({:?})",
        promoted - killed,
        resumed - promoted,
        others.len(),
        others
            .iter()
            .map(|(_, s, r)| format!("{s} {r}"))
            .collect::<std::collections::BTreeSet<_>>()
    );
    let (_, _, b) = common::get(&format!(
        "http://{}/admin/status",
        sidecars[0].running.admin_addr
    ))
    .await;
    let st = common::json(&b);
    // Replication is asynchronous: the promoted replica may lack the epoch marker (seen in
    // runs on a loaded machine). Then the loss is noticed and the counters rebuilt, and the
    // status says so; never a silent fresh budget.
    if !st["state"]["last_rebuild"].is_null() {
        let warnings = st["state"]["warnings"].to_string();
        assert!(warnings.contains("rebuilt"), "{st}");
    }
    assert!(
        late.is_empty(),
        "refused after the grace: {} ({:?})",
        late.len(),
        late.first()
    );
}
