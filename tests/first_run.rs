//! The first hour: the built binary, started from an empty directory with no policy and no
//! keys, answers the README's curl; says which backends it skips and why; logs without ANSI
//! escapes into a pipe and as JSON lines when asked; writes its state and audit in the
//! current directory; and `tollgate usage` then reads that audit.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A `tollgate serve` child with its stdout lines collected by a thread.
struct Sidecar {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    addr: String,
    admin: String,
}

/// The environment a user who just cloned the repository would not have set.
const CLEARED: &[&str] = &[
    "TOLLGATE_POLICY",
    "TOLLGATE_LISTEN",
    "TOLLGATE_ADMIN_LISTEN",
    "TOLLGATE_LOG_FORMAT",
    "TOLLGATE_ADMIN_TOKEN",
    "GEMINI_API_KEY",
    "ANTHROPIC_API_KEY",
    "RUST_LOG",
    "SSL_CERT_FILE",
];

fn tollgate(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    c.current_dir(dir);
    for v in CLEARED {
        c.env_remove(v);
    }
    c
}

impl Sidecar {
    /// `tollgate serve` in `dir` on ephemeral ports (the README's 8787 may be taken on a
    /// shared machine); `extra` env on top. Waits for the "tollgate serving" line.
    fn start(dir: &Path, extra: &[(&str, &str)]) -> Sidecar {
        let mut cmd = tollgate(dir);
        cmd.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env("TOLLGATE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tollgate");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut s = Sidecar {
            child,
            lines,
            seen: Vec::new(),
            addr: String::new(),
            admin: String::new(),
        };
        let line = s.wait_for("tollgate serving");
        s.addr = field(&line, "addr").unwrap_or_else(|| panic!("no addr in {line}"));
        s.admin = field(&line, "admin").unwrap_or_else(|| panic!("no admin in {line}"));
        s
    }

    /// The first line containing `needle`, within the start deadline.
    fn wait_for(&mut self, needle: &str) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "no log line with {needle:?} within {START_TIMEOUT:?}; saw:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// SIGTERM, then the exit status within a deadline.
    fn stop(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(l);
                }
                return (st, std::mem::take(&mut self.seen));
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "tollgate did not stop on SIGTERM:\n{}",
                    self.seen.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` (text log) or `"key":"value"` (JSON log) from a log line.
fn field(line: &str, key: &str) -> Option<String> {
    let plain = format!("{key}=");
    let json = format!("\"{key}\":\"");
    if let Some(i) = line.find(&json) {
        let rest = &line[i + json.len()..];
        return rest.split('"').next().map(str::to_owned);
    }
    let i = line
        .match_indices(&plain)
        .find(|(i, _)| *i == 0 || line.as_bytes()[i - 1] == b' ')?
        .0;
    let rest = &line[i + plain.len()..];
    rest.split_whitespace().next().map(str::to_owned)
}

/// One HTTP/1.1 exchange on a fresh connection: (status, head, body).
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// The JSON body of the README's curl, read from the README itself.
fn readme_curl_body() -> String {
    let readme = include_str!("../README.md");
    let start = readme.find("-d '").expect("README has a curl with -d") + 4;
    let end = readme[start..].find('\'').expect("closing quote") + start;
    readme[start..end].to_owned()
}

fn ollama_listening() -> bool {
    TcpStream::connect_timeout(
        &"127.0.0.1:11434".parse().expect("addr"),
        Duration::from_millis(200),
    )
    .is_ok()
}

#[test]
fn from_an_empty_directory_serve_answers_the_readme_curl() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut s = Sidecar::start(dir.path(), &[]);

    let embedded = s.wait_for("embedded default policy");
    assert!(embedded.contains("check --print-default"), "{embedded}");
    // Item 2: one warning per backend whose key is unset, naming the variable.
    let gemini = s.wait_for("key $GEMINI_API_KEY unset");
    assert!(gemini.contains("WARN"), "{gemini}");
    s.wait_for("key $ANTHROPIC_API_KEY unset");
    // Item 7: stdout is a pipe, so no colour codes.
    assert!(
        s.seen.iter().all(|l| !l.contains('\u{1b}')),
        "ANSI escapes in piped logs:\n{}",
        s.seen.join("\n")
    );

    let (status, head, body) = http(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        Some(&readme_curl_body()),
    );
    assert_eq!(status, 200, "{head}\n{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json answer");
    assert_eq!(v["object"], "chat.completion", "{body}");
    if !ollama_listening() {
        assert!(head.contains("x-tollgate-action: degrade"), "{head}");
        assert!(head.contains("x-tollgate-backend: static"), "{head}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
        assert!(text.starts_with("Sorry, the AI service"), "English: {text}");
    }

    // Item 2: readiness stays, and names what cannot be used; so does the status.
    let (status, _, ready) = http(&s.admin, "GET", "/readyz", None);
    assert_eq!(status, 200, "{ready}");
    assert!(ready.starts_with("ready\n"), "{ready}");
    assert!(
        ready.contains("gemini (key $GEMINI_API_KEY unset)")
            && ready.contains("claude (key $ANTHROPIC_API_KEY unset)"),
        "{ready}"
    );
    let (_, _, status_body) = http(&s.admin, "GET", "/admin/status", None);
    let st: serde_json::Value = serde_json::from_str(&status_body).expect("status json");
    let backends = st["backends"].as_array().expect("backends");
    let gem = backends
        .iter()
        .find(|b| b["id"] == "gemini")
        .expect("gemini");
    assert_eq!(gem["eligible"], false);
    assert_eq!(gem["ineligible"], "key $GEMINI_API_KEY unset");
    let ollama = backends
        .iter()
        .find(|b| b["id"] == "ollama")
        .expect("ollama");
    assert_eq!(ollama["ineligible"], serde_json::Value::Null);

    // Item 9: an unknown endpoint is answered 404 and reaches the audit log.
    let (status, head, _) = http(&s.addr, "GET", "/v1/nothing-here", None);
    assert_eq!(status, 404);
    assert!(head.contains("x-tollgate-request-id: "), "{head}");

    // No reload path for the embedded default: 409, not a crash.
    let (st, lines) = s.stop();
    assert!(st.success(), "exit {st}:\n{}", lines.join("\n"));

    // State and audit in the current directory.
    assert!(dir.path().join("tollgate.db").exists());
    let audit = std::fs::read_to_string(dir.path().join("tollgate-audit.jsonl")).expect("audit");
    let records: Vec<serde_json::Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).expect("audit line"))
        .collect();
    assert_eq!(records.len(), 2, "{audit}");
    let unknown = records
        .iter()
        .find(|r| r["endpoint"] == "unknown")
        .expect("the 404 is audited");
    assert_eq!(unknown["http_status"], 404);
    assert_eq!(unknown["route"], "/v1/nothing-here");
    assert_eq!(unknown["reason_class"], "BAD_REQUEST");

    // Item 3: `tollgate usage` works after the quickstart (default JSONL audit).
    let out = tollgate(dir.path()).arg("usage").output().expect("usage");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let served_by = records
        .iter()
        .find(|r| r["endpoint"] == "chat.completions")
        .and_then(|r| r["backend"].as_str())
        .expect("chat record");
    let row = text
        .lines()
        .find(|l| l.starts_with(&format!("{served_by} ")))
        .unwrap_or_else(|| panic!("no {served_by} row:\n{text}"));
    assert_eq!(row.split_whitespace().nth(1), Some("1"), "{text}");
    let out = tollgate(dir.path())
        .args(["usage", "--json"])
        .output()
        .expect("usage --json");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("usage json");
    let consumers = v["consumers"].as_array().expect("consumers");
    let requests: i64 = consumers
        .iter()
        .filter_map(|c| c["requests_today"].as_i64())
        .sum();
    assert_eq!(requests, 2, "{v}");
}

#[test]
fn json_log_format_prints_one_object_per_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut s = Sidecar::start(dir.path(), &[("TOLLGATE_LOG_FORMAT", "json")]);
    s.wait_for("key $GEMINI_API_KEY unset");
    let (st, lines) = s.stop();
    assert!(st.success());
    assert!(lines.len() >= 4, "{lines:?}");
    for l in &lines {
        assert!(!l.contains('\u{1b}'), "{l}");
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["timestamp"].is_string(), "{l}");
    }
    let warn = lines
        .iter()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
        .find(|v| v["env"] == "GEMINI_API_KEY")
        .expect("the missing-key warning as JSON");
    assert_eq!(warn["level"], "WARN");
    assert_eq!(warn["backend"], "gemini");
}

#[test]
fn version_and_the_embedded_policy_can_be_printed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tollgate(dir.path())
        .arg("--version")
        .output()
        .expect("version");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("tollgate {}", env!("CARGO_PKG_VERSION"))
    );
    let out = tollgate(dir.path())
        .args(["check", "--print-default"])
        .output()
        .expect("print-default");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        include_str!("../policies/default.yaml")
    );
    // `check` with no policy validates the embedded one, from anywhere.
    let out = tollgate(dir.path()).arg("check").output().expect("check");
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("ok: (embedded default policy)"), "{s}");
    assert!(s.contains("(ineligible: key $GEMINI_API_KEY unset)"), "{s}");
    assert!(s.contains("\nstate: sqlite tollgate.db\n"), "{s}");
    assert!(s.contains("\naudit: jsonl tollgate-audit.jsonl\n"), "{s}");
    assert!(
        s.contains("\nidentity: consumer header x-tollgate-consumer"),
        "{s}"
    );
}

/// Pages other parts of the project write; the README links them already.
const PAGES_WRITTEN_ELSEWHERE: &[&str] = &[
    "docs/performance.md",
    "docs/security.md",
    "docs/operations-hardening.md",
    "docs/identity-and-teams.md",
    "docs/limits-and-costs.md",
    "docs/dialects.md",
    "docs/opentelemetry.md",
];

#[test]
fn readme_and_docs_link_only_inside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("page");
        let name = page
            .strip_prefix(root)
            .unwrap_or(page)
            .display()
            .to_string();
        assert!(
            !text.contains("../shared") && !text.contains("/work/"),
            "{name} points outside the repository"
        );
        if name == "README.md" {
            assert!(text.lines().count() < 200, "README is a front page");
        }
        let dir = page.parent().expect("dir");
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(rest.len())];
            assert!(
                !target.contains("://") && !target.starts_with('/'),
                "{name}: link {target} leaves the repository"
            );
            let file = target.split('#').next().unwrap_or("");
            if file.is_empty() {
                continue;
            }
            let resolved = dir.join(file);
            let canon = resolved.canonicalize().ok().filter(|c| c.starts_with(root));
            let rel = resolved
                .strip_prefix(root)
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            assert!(
                canon.is_some() || PAGES_WRITTEN_ELSEWHERE.contains(&rel.as_str()),
                "{name}: link {target} points at nothing in the repository"
            );
        }
    }
}

/// A one-answer-per-connection OpenAI mock: every request body it receives is sent back
/// over the channel; every answer is a small chat completion with usage.
fn mock_openai() -> (String, mpsc::Receiver<serde_json::Value>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { break };
            c.set_read_timeout(Some(Duration::from_secs(10))).ok();
            answer_one(&mut c, &tx);
        }
    });
    (addr, rx)
}

/// [`mock_openai`] over TLS with `cert` (its chain) and `key`: a connection whose handshake
/// fails (its client does not trust the certificate) is dropped unanswered.
fn mock_openai_tls(
    cert: Vec<rustls::pki_types::CertificateDer<'static>>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> (String, mpsc::Receiver<serde_json::Value>) {
    let config = std::sync::Arc::new(
        rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(cert, key)
            .expect("server certificate"),
    );
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(c) = conn else { break };
            c.set_read_timeout(Some(Duration::from_secs(10))).ok();
            let tls = rustls::ServerConnection::new(config.clone()).expect("tls");
            let mut s = rustls::StreamOwned::new(tls, c);
            answer_one(&mut s, &tx);
        }
    });
    (addr, rx)
}

/// Reads one request from `c`, sends its JSON body over `tx` and answers it.
fn answer_one(c: &mut (impl Read + Write), tx: &mpsc::Sender<serde_json::Value>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let body = loop {
        let n = match c.read(&mut chunk) {
            Ok(0) | Err(_) => break None,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        let Some((head, rest)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let len = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            })
            .unwrap_or(0);
        if rest.len() >= len {
            break Some(rest[..len].to_owned());
        }
    };
    let Some(body) = body else { return };
    if let Ok(v) = serde_json::from_str(&body) {
        let _ = tx.send(v);
    }
    let answer = r#"{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;
    let _ = write!(
        c,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
        answer.len()
    );
    let _ = c.flush();
}

/// Item 8: the output cap tollgate sends is announced, the route's default applies, and
/// OpenAI-kind backends get it in the field the model accepts.
#[test]
fn the_output_cap_is_announced_and_sent_in_the_field_the_model_takes() {
    let (up, bodies) = mock_openai();
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: caps
backends:
  - {{id: up, kind: openai, base_url: 'http://{up}/v1'}}
routes:
  - model: reason
    default_max_output_tokens: 300
    chain: [{{backend: up, model: o3-mini}}]
  - model: chat
    chain: [{{backend: up, model: my-model, output_cap_field: max_completion_tokens}}]
state: {{backend: memory}}
audit: {{sink: off}}
"
        ),
    )
    .expect("write policy");
    let s = Sidecar::start(
        dir.path(),
        &[("TOLLGATE_POLICY", policy.to_str().expect("utf-8 path"))],
    );
    let ask = |model: &str, cap: &str| {
        let body =
            format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]{cap}}}"#);
        let (status, head, text) = http(&s.addr, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(status, 200, "{head}\n{text}");
        let sent = bodies
            .recv_timeout(Duration::from_secs(30))
            .expect("the upstream got the call");
        let cap = head
            .lines()
            .find_map(|l| l.strip_prefix("x-tollgate-output-cap: "))
            .map(str::to_owned);
        (cap, sent)
    };

    // No cap from the client: the route's default, said to be injected; an o-series model
    // gets max_completion_tokens (it rejects max_tokens).
    let (cap, sent) = ask("reason", "");
    assert_eq!(cap.as_deref(), Some("300; injected"));
    assert_eq!(sent["max_completion_tokens"], 300, "{sent}");
    assert!(sent.get("max_tokens").is_none(), "{sent}");
    assert_eq!(sent["model"], "o3-mini");
    // The client's own cap, sent in the field the chain entry names.
    let (cap, sent) = ask("chat", r#","max_tokens":50"#);
    assert_eq!(cap.as_deref(), Some("50"));
    assert_eq!(sent["max_completion_tokens"], 50, "{sent}");
    assert!(sent.get("max_tokens").is_none(), "{sent}");
    // No route default: the policy's (1024).
    let (cap, sent) = ask("chat", "");
    assert_eq!(cap.as_deref(), Some("1024; injected"));
    assert_eq!(sent["max_completion_tokens"], 1024, "{sent}");
    let (st, _) = s.stop();
    assert!(st.success());
}

/// A private CA and a certificate it signed for `localhost` and 127.0.0.1: (the CA's PEM, the
/// server's chain, its key).
fn private_ca() -> (
    String,
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "tollgate test CA");
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate().expect("key"))
        .expect("CA");
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("server certificate");
    let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key der");
    (ca.pem(), vec![leaf.der().clone()], key)
}

/// An upstream behind a private CA: trusted when `SSL_CERT_FILE` names the CA's certificate,
/// refused (never called in clear, never answered) when it does not, and a file that cannot
/// be used stops the start with the variable named.
#[test]
fn an_upstream_behind_a_private_ca_is_trusted_through_ssl_cert_file() {
    let (ca_pem, chain, key) = private_ca();
    let (up, bodies) = mock_openai_tls(chain, key);
    let port = up.rsplit(':').next().expect("port");
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &ca_pem).expect("write CA");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: private-ca
backends:
  - {{id: internal, kind: openai, base_url: 'https://localhost:{port}/v1'}}
routes:
  - model: chat
    chain: [{{backend: internal, model: m}}]
state: {{backend: memory}}
audit: {{sink: off}}
"
        ),
    )
    .expect("write policy");
    let policy = policy.to_str().expect("utf-8 path");
    let ask = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;

    // Trusted: the call goes through TLS to the upstream and its answer comes back.
    let mut s = Sidecar::start(
        dir.path(),
        &[
            ("TOLLGATE_POLICY", policy),
            ("SSL_CERT_FILE", ca.to_str().expect("utf-8 path")),
        ],
    );
    let said = s.wait_for("SSL_CERT_FILE");
    assert!(said.contains("certificates=1"), "{said}");
    let (status, head, text) = http(&s.addr, "POST", "/v1/chat/completions", Some(ask));
    assert_eq!(status, 200, "{head}\n{text}");
    assert!(text.contains(r#""content":"ok""#), "{text}");
    assert!(head.contains("x-tollgate-backend: internal"), "{head}");
    let sent = bodies
        .recv_timeout(Duration::from_secs(30))
        .expect("the upstream got the call");
    assert_eq!(sent["model"], "m", "{sent}");
    let (st, _) = s.stop();
    assert!(st.success());

    // Not trusted (the compiled-in roots only): no answer, and nothing reached the upstream.
    let s = Sidecar::start(dir.path(), &[("TOLLGATE_POLICY", policy)]);
    let (status, head, text) = http(&s.addr, "POST", "/v1/chat/completions", Some(ask));
    assert!(status >= 500, "{status} {head}\n{text}");
    assert!(!text.contains(r#""content":"ok""#), "{text}");
    assert!(
        head.contains("x-tollgate-action:"),
        "a governed refusal: {head}"
    );
    assert!(
        bodies.recv_timeout(Duration::from_millis(300)).is_err(),
        "the upstream was called without a trusted certificate"
    );
    let (st, _) = s.stop();
    assert!(st.success());

    // A file that cannot be used: refused at start, exit 2, the variable and the path named.
    for (bad, why) in [
        (dir.path().join("missing.pem"), "cannot read it"),
        (policy.into(), "holds no certificate"),
    ] {
        let out = tollgate(dir.path())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .env("TOLLGATE_POLICY", policy)
            .env("SSL_CERT_FILE", &bad)
            .stdin(Stdio::null())
            .output()
            .expect("run tollgate");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("SSL_CERT_FILE={}", bad.display())) && err.contains(why),
            "{err}"
        );
    }
}
