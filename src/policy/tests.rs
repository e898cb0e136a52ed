use super::locate::{locate, parse_path};
use super::*;
use crate::units::{usd_to_micros, Scope, Window};
use std::time::Duration;

/// The example of SPEC §4, verbatim.
const SPEC_EXAMPLE: &str = include_str!("testdata/spec_example.yaml");

/// The smallest useful policy: everything else defaults.
const MINIMAL: &str = "version: lab-1
backends:
  - id: primary
    kind: openai
    base_url: http://127.0.0.1:9/v1/
routes:
  - model: chat
    chain: [{backend: primary, model: small}]
";

fn errors(src: &str) -> Vec<PolicyError> {
    match from_str(src, "p.yaml") {
        Ok(_) => panic!("policy unexpectedly valid"),
        Err(e) => e.0,
    }
}

/// Asserts that one error has this path and line and mentions `text`.
fn assert_error(src: &str, path: &str, line: usize, text: &str) {
    let errs = errors(src);
    assert!(
        errs.iter()
            .any(|e| e.path == path && e.line == Some(line) && e.message.contains(text)),
        "no error at {path} line {line} containing {text:?}; got:\n{}",
        PolicyErrors(errs.clone())
    );
}

#[test]
fn spec_example_parses() {
    let p = from_str(SPEC_EXAMPLE, "spec.yaml").expect("spec example is valid");
    assert_eq!(&*p.version, "2026-11-29.1");
    assert_eq!(p.server.listen, "127.0.0.1:8787");
    assert_eq!(p.identity.virtual_keys.len(), 1);
    assert_eq!(
        p.identity.virtual_keys[0].secret,
        KeySource::Env("TOLLGATE_KEY_WEB".into())
    );
    assert_eq!(p.estimate.tokenizer, Tokenizer::O200k);
    assert_eq!(p.backends.len(), 3);
    let gemini = p.backend("gemini").expect("gemini");
    assert_eq!(gemini.price.input_per_1k, 1000);
    assert_eq!(gemini.circuit.half_open_max_calls, 3);
    assert_eq!(gemini.circuit.recovery_timeout, Duration::from_secs(60));
    assert_eq!(gemini.timeouts.total, Duration::from_secs(120));
    assert_eq!(gemini.api_key_env.as_deref(), Some("GEMINI_API_KEY"));
    assert_eq!(p.backends[0].api_key_env, None);
    assert_eq!(p.backends[2].kind, BackendKind::Anthropic);
    let chat = p.route("chat").expect("chat route");
    assert_eq!(chat.chain.len(), 3);
    assert_eq!(chat.chain[1].backend, 1);
    assert_eq!(&*chat.chain[0].model, "llama3.1:8b");
    assert!(chat
        .static_response
        .as_deref()
        .is_some_and(|s| s.starts_with("抱歉")));
    assert_eq!(p.bounds.len(), 8);
    assert_eq!(p.bounds[0].class, BoundClass::RateLimit);
    assert_eq!(p.bounds[1].matcher, Match::Id("gemini".into()));
    assert_eq!(p.bounds[1].alert_at, vec![0.7, 0.9]);
    let spend = &p.bounds[5];
    assert_eq!(
        (spend.class, spend.scope, spend.window),
        (BoundClass::Budget, Scope::Global, Some(Window::Month))
    );
    assert_eq!(
        (spend.hard.usd, spend.soft.usd),
        (Some(10_000_000), Some(5_000_000))
    );
    assert_eq!(p.bounds[6].window, None);
    assert_eq!(p.retry.retry_on.len(), 7);
    assert_eq!(p.retry.backoff_initial, Duration::from_millis(200));
    assert_eq!(p.degrade.clamp_min_output_tokens, Some(256));
    assert_eq!(p.state.backend, StateBackend::Sqlite);
    assert_eq!(p.audit.sink, AuditSink::Jsonl);
    let s = summary(&p);
    assert!(s.contains(
        "chat: ollama/llama3.1:8b -> gemini/gemini-2.0-flash -> claude/claude-3-5-haiku-latest -> static"
    ), "{s}");
    assert!(s.contains("$GEMINI_API_KEY"), "{s}");
    assert!(
        s.contains(
            "budget monthly-spend: scope=global match=* window=month hard usd=$10 soft usd=$5"
        ),
        "{s}"
    );
}

#[test]
fn minimal_policy_gets_defaults() {
    let p = from_str(MINIMAL, "min.yaml").expect("valid");
    assert_eq!(p.source, "min.yaml");
    assert_eq!(&*p.backends[0].base_url, "http://127.0.0.1:9/v1");
    assert_eq!(p.backends[0].token_ratio, 1.0);
    assert_eq!(p.backends[0].price, Price::default());
    assert_eq!(p.backends[0].circuit.failure_threshold, 5);
    assert_eq!(
        p.backends[0].circuit.recovery_timeout,
        Duration::from_secs(30)
    );
    assert!(p.backends[0].circuit.accept_retry_after);
    assert_eq!(p.backends[0].timeouts.connect, Duration::from_secs(2));
    assert_eq!(p.backends[0].max_in_flight, None);
    assert_eq!(p.server.admin_listen, "127.0.0.1:9464");
    assert_eq!(p.server.max_body_bytes, 4_194_304);
    assert_eq!(p.server.header_read_timeout, Duration::from_secs(10));
    assert_eq!(p.server.shutdown_grace, Duration::from_secs(30));
    assert_eq!(p.identity.consumer_header, "x-tollgate-consumer");
    assert_eq!(&*p.identity.default_consumer, "default");
    assert_eq!(p.estimate.default_max_output_tokens, 1024);
    assert_eq!(p.windows.timezone_name, "UTC");
    assert_eq!(
        (p.retry.max_attempts_per_job, p.retry.same_backend_retries),
        (3, 1)
    );
    assert_eq!(p.retry.retry_on[0], RetryOn::Status(429));
    assert_eq!(p.retry.max_retry_after, Duration::from_secs(10));
    assert_eq!(
        (
            p.fallback.max_fallbacks_per_job,
            p.fallback.max_amplification
        ),
        (2, 3.0)
    );
    assert_eq!(p.degrade.clamp_min_output_tokens, None);
    assert_eq!(p.degrade.soft_max_output_tokens, None);
    assert!(p.defer.allowed);
    assert_eq!(p.defer.max_retry_after, Duration::from_secs(300));
    assert_eq!(
        (p.state.backend, p.state.path.as_str()),
        (StateBackend::Sqlite, "tollgate.db")
    );
    assert_eq!(p.state.job_idle_ttl, Duration::from_secs(3600));
    assert_eq!(
        p.state.on_unavailable,
        OnUnavailable::Deny,
        "fail closed by default"
    );
    assert_eq!(p.state.flush_interval, Duration::from_millis(50));
    assert_eq!(p.state.lease, Duration::from_secs(150));
    assert_eq!(p.state.namespace, "default");
    assert_eq!((p.audit.sink, p.audit.queue), (AuditSink::Jsonl, 8192));
    assert!(p.bounds.is_empty());
}

#[test]
fn extra_keys_and_numeric_version() {
    let src = "version: 7
server: {header_read_timeout: 5s, shutdown_grace: 1m}
identity: {consumer_header: X-Team}
backends:
  - {id: a, kind: ollama, base_url: 'https://h', max_in_flight: 4}
routes:
  - {model: chat, chain: [{backend: a, model: m}]}
rate_limits:
  - {name: rpm, scope: consumer, match: bob, window: minute, limit_requests: 60}
budgets:
  - {name: b, scope: consumer, window: day, hard_requests: 100, soft_tokens: 50}
state: {backend: redis, redis_url: 'redis://r:6379', redis_urls: ['redis://r2:6379'], job_idle_ttl: 90m, on_unavailable: local,
        lease: 200s, flush_interval: 200ms, namespace: team-a}
audit: {sink: postgres, postgres_url: 'postgres://db/x', queue: 16}
";
    let p = from_str(src, "x.yaml").expect("valid");
    assert_eq!(&*p.version, "7");
    assert_eq!(p.server.shutdown_grace, Duration::from_secs(60));
    assert_eq!(p.identity.consumer_header, "x-team");
    assert_eq!(p.backends[0].max_in_flight, Some(4));
    assert_eq!(p.bounds[0].hard.requests, Some(60));
    assert_eq!(p.bounds[1].soft.tokens, Some(50));
    assert_eq!(p.state.redis_url.as_deref(), Some("redis://r:6379"));
    assert_eq!(p.state.redis_urls, vec!["redis://r2:6379".to_string()]);
    assert_eq!(p.state.job_idle_ttl, Duration::from_secs(5400));
    assert_eq!(p.state.on_unavailable, OnUnavailable::Local);
    assert_eq!(p.state.lease, Duration::from_secs(200));
    assert_eq!(p.state.flush_interval, Duration::from_millis(200));
    assert_eq!(p.state.namespace, "team-a");
    assert_eq!((p.audit.sink, p.audit.queue), (AuditSink::Postgres, 16));
    let off = from_str(
        &MINIMAL.replace("version: lab-1", "version: v\naudit: {sink: off}"),
        "o",
    );
    assert_eq!(off.expect("valid").audit.sink, AuditSink::Off);
}

#[test]
fn unknown_key_reports_its_line() {
    let src = MINIMAL.replace("    kind: openai\n", "    kind: openai\n    colour: red\n");
    assert_error(&src, "backends[0].colour", 5, "unknown field `colour`");
    let top = format!("{MINIMAL}retries: 3\n");
    assert_error(&top, "retries", 9, "unknown field `retries`");
    let flow = MINIMAL.replace("model: small}", "model: small, weight: 2}");
    assert_error(
        &flow,
        "routes[0].chain[0].weight",
        8,
        "unknown field `weight`",
    );
    assert_eq!(
        errors(&top)[0].to_string().split(": ").next(),
        Some("p.yaml:9")
    );
}

#[test]
fn dangling_backend_reports_path_and_line() {
    let src = "version: v
backends:
  - {id: a, kind: openai, base_url: 'http://a'}
routes:
  - model: chat
    chain:
      - {backend: a, model: m}
      - {backend: nope, model: m}
";
    let errs = errors(src);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(
        errs[0].to_string(),
        "p.yaml:8: routes[0].chain[1].backend: no backend with id `nope` (backends: a)"
    );
}

#[test]
fn validation_errors() {
    let m = MINIMAL;
    let cases: Vec<(String, &str, usize, &str)> = vec![
        (m.replace("version: lab-1", "version: ''"), "version", 1, "non-empty"),
        (m.replace("version: lab-1\n", ""), "version", 1, "is required"),
        (m.replace("kind: openai", "kind: grpc"), "backends[0].kind", 4, "expected one of openai"),
        (m.replace("http://127.0.0.1:9/v1/", "ftp://x"), "backends[0].base_url", 5, "http:// or https://"),
        (m.replace("http://127.0.0.1:9/v1/", "http://u:hunter2-pass@127.0.0.1:9/v1"), "backends[0].base_url", 5, "must not carry credentials"),
        (m.replace("    kind: openai\n", "    kind: openai\n    token_ratio: 0\n"), "backends[0].token_ratio", 5, "greater than zero"),
        (m.replace("    kind: openai\n", "    kind: openai\n    circuit: {failure_threshold: 0}\n"), "backends[0].circuit.failure_threshold", 5, "greater than zero"),
        (m.replace("    kind: openai\n", "    kind: openai\n    timeouts:\n      total: 0s\n"), "backends[0].timeouts.total", 6, "longer than zero"),
        (m.replace("    kind: openai\n", "    kind: openai\n    price_per_1k: {input: -1}\n"), "backends[0].price_per_1k.input", 5, "not a valid amount"),
        (m.replace("chain: [{backend: primary, model: small}]", "chain: []"), "routes[0].chain", 8, "at least one"),
        (m.replace("model: small}]", "model: small}, {backend: primary, model: small}]"), "routes[0].chain[1]", 8, "duplicate chain entry primary/small"),
        (format!("{m}  - model: chat\n    chain: [{{backend: primary, model: b}}]\n"), "routes[1].model", 9, "duplicate route alias `chat`"),
        (format!("{m}windows: {{timezone: Mars/Olympus}}\n"), "windows.timezone", 9, "unknown IANA time zone"),
        (format!("{m}estimate: {{tokenizer: gpt2}}\n"), "estimate.tokenizer", 9, "expected one of o200k, cl100k, chars"),
        (format!("{m}state: {{backend: redis}}\n"), "state.redis_url", 9, "required when state.backend is redis"),
        (format!("{m}state: {{backend: redis, redis_url: 'redis://a', redis_urls: ['redis://b', 'http://c']}}\n"), "state.redis_urls[1]", 9, "redis:// or rediss://"),
        (format!("{m}state: {{redis_urls: ['redis://b']}}\n"), "state.redis_urls", 9, "needs state.redis_url"),
        (format!("{m}state: {{shards: 0}}\n"), "state.shards", 9, "greater than zero"),
        (format!("{m}state: {{shards: 65}}\n"), "state.shards", 9, "at most 64"),
        (format!("{m}state: {{backend: etcd}}\n"), "state.backend", 9, "expected one of memory, sqlite, redis"),
        (format!("{m}state: {{on_unavailable: maybe}}\n"), "state.on_unavailable", 9, "expected one of deny, local"),
        (format!("{m}state: {{flush_interval: 0s}}\n"), "state.flush_interval", 9, "longer than zero"),
        (format!("{m}state: {{flush_interval: 2m}}\n"), "state.flush_interval", 9, "at most 60s"),
        (format!("{m}state: {{lease: 500ms}}\n"), "state.lease", 9, "at least 1s"),
        (format!("{m}state: {{backend: redis, redis_url: 'redis://r', lease: 120s}}\n"), "state.lease", 9, "longer than the longest call (backends[0].timeouts.total = 120s)"),
        (format!("{m}state: {{namespace: 'a{{b}}'}}\n"), "state.namespace", 9, "hash tag"),
        (format!("{m}audit:\n  sink: postgres\n"), "audit.postgres_url", 9, "required when audit.sink is postgres"),
        (format!("{m}audit:\n  sink: kafka\n"), "audit.sink", 10, "expected one of jsonl, sqlite, postgres, off"),
        (format!("{m}audit:\n  sink: sqlite\n  table: \"x; drop\"\n"), "audit.table", 11, "not a plain SQL name"),
        (format!("{m}retry: {{max_attempts_per_job: 0}}\n"), "retry.max_attempts_per_job", 9, "greater than zero"),
        (format!("{m}fallback: {{max_amplification: 0.5}}\n"), "fallback.max_amplification", 9, "at least 1.0"),
        (format!("{m}degrade: {{clamp_max_tokens: {{}}}}\n"), "degrade.clamp_max_tokens.min_output_tokens", 9, "is required"),
        (format!("{m}budgets:\n  - {{name: j, scope: job, window: day, hard_tokens: 5}}\n"), "budgets[0].window", 10, "has no window"),
        (format!("{m}quotas:\n  - {{name: q, scope: consumer, limit_tokens: 5}}\n"), "quotas[0].window", 10, "needs a window"),
        (format!("{m}budgets:\n  - {{name: g, scope: global, hard_usd: 1}}\n"), "budgets[0].window", 10, "needs a window"),
        (format!("{m}rate_limits:\n  - {{name: r, scope: global, window: minute}}\n"), "rate_limits[0]", 10, "at least one of limit_tokens"),
        (format!("{m}rate_limits:\n  - {{name: r, scope: global, window: minute, limit_tokens: 0}}\n"), "rate_limits[0].limit_tokens", 10, "greater than zero"),
        (format!("{m}quotas:\n  - {{name: q, scope: global, window: day, limit_usd: 0}}\n"), "quotas[0].limit_usd", 10, "at least one micro-dollar"),
        (format!("{m}quotas:\n  - {{name: q, scope: global, window: day, limit_tokens: 9, alert_at: [0.5, 1.5]}}\n"), "quotas[0].alert_at", 10, "not a fraction"),
        (format!("{m}quotas:\n  - {{name: q, scope: galaxy, window: day, limit_tokens: 9}}\n"), "quotas[0].scope", 10, "expected one of request"),
        (format!("{m}quotas:\n  - {{name: q, scope: consumer, window: week, limit_tokens: 9}}\n"), "quotas[0].window", 10, "expected one of minute"),
        (format!("{m}quotas:\n  - {{name: q, scope: backend, match: gemni, window: day, limit_tokens: 9}}\n"), "quotas[0].match", 10, "no backend with id `gemni`"),
        (format!("{m}budgets:\n  - {{name: b, scope: job, soft_tokens: 5}}\n"), "budgets[0]", 10, "at least one hard limit"),
        (format!("{m}quotas:\n  - {{name: q, scope: global, window: day, limit_tokens: 9, enforce: soft}}\n"), "quotas[0].enforce", 10, "expected one of hard, shadow"),
        (format!("{m}budgets:\n  - {{name: b, scope: job, hard_tokens: 5, enforce: dry-run}}\n"), "budgets[0].enforce", 10, "expected one of hard, shadow"),
        (format!("{m}budgets:\n  - name: b\n    scope: job\n    hard_tokens: 5\n    soft_tokens: 6\n"), "budgets[0].soft_tokens", 13, "must not exceed hard_tokens"),
        (format!("{m}budgets:\n  - {{name: b, scope: job, hard_usd: 1}}\nrate_limits:\n  - {{name: b, scope: job, limit_tokens: 1}}\n"), "budgets[0].name", 10, "duplicate bound name `b`"),
        (format!("{m}identity:\n  virtual_keys:\n    - {{consumer: web}}\n"), "identity.virtual_keys[0].key_env", 11, "is required"),
        (format!("{m}identity: {{consumer_header: 'bad header'}}\n"), "identity.consumer_header", 9, "not a valid HTTP header name"),
        (format!("{m}identity: {{job_header: X-Tollgate-Consumer}}\n"), "identity.job_header", 9, "must differ"),
        (format!("{m}server: {{listen: nowhere}}\n"), "server.listen", 9, "host:port"),
        (format!("{m}server: {{max_body_bytes: 0}}\n"), "server.max_body_bytes", 9, "greater than zero"),
    ];
    for (src, path, line, text) in cases {
        assert_error(&src, path, line, text);
    }
}

#[test]
fn a_credential_in_base_url_is_refused_and_never_echoed() {
    let src = MINIMAL.replace(
        "http://127.0.0.1:9/v1/",
        "https://user:hunter2-pass@h.example/v1",
    );
    let all: String = errors(&src)
        .iter()
        .map(|e| format!("{e:?} {}", e.message))
        .collect();
    assert!(all.contains("must not carry credentials"), "{all}");
    assert!(!all.contains("hunter2"), "{all}");
    // An `@` past the authority (in a path) is no credential.
    assert!(crate::policy::from_str(
        &MINIMAL.replace("http://127.0.0.1:9/v1/", "http://127.0.0.1:9/v1/@x"),
        "p.yaml"
    )
    .is_ok());
}

#[test]
fn duplicate_backend_ids_and_collected_errors() {
    let src = "version: v
backends:
  - {id: a, kind: openai, base_url: 'http://a'}
  - {id: a, kind: nope, base_url: 'http://b'}
routes:
  - {model: chat, chain: [{backend: z, model: m}]}
";
    let errs = errors(src);
    let shown: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    assert!(shown.contains(&"p.yaml:4: backends[1].kind: unknown value `nope`: expected one of openai, anthropic, gemini, ollama".to_owned()), "{shown:#?}");
    assert!(
        shown.contains(
            &"p.yaml:4: backends[1].id: duplicate backend id `a` (first at p.yaml:3)".to_owned()
        ),
        "{shown:#?}"
    );
    assert!(
        shown.contains(
            &"p.yaml:6: routes[0].chain[0].backend: no backend with id `z` (backends: a)"
                .to_owned()
        ),
        "{shown:#?}"
    );
    assert_eq!(errs.len(), 3);
}

#[test]
fn parse_errors_carry_path_and_line() {
    let src = format!("{MINIMAL}retry:\n  backoff: {{initial: soon}}\n");
    assert_error(&src, "retry.backoff.initial", 10, "invalid duration `soon`");
    let src = format!("{MINIMAL}retry:\n  retry_on: [429, teapot]\n");
    assert_error(
        &src,
        "retry.retry_on[1]",
        10,
        "unknown retry_on entry `teapot`",
    );
    let src = format!("{MINIMAL}retry:\n  retry_on: [200]\n");
    assert_error(&src, "retry.retry_on[0]", 10, "not an HTTP error status");
    let src = MINIMAL.replace(
        "    kind: openai\n",
        "    kind: openai\n    token_ratio: lots\n",
    );
    assert_error(&src, "backends[0].token_ratio", 5, "invalid type");
    let bad_yaml = "version: v\nbackends: [\n";
    let e = &errors(bad_yaml)[0];
    assert_eq!(e.file, "p.yaml");
    assert!(e.line.is_some(), "{e}");
    assert!(errors("- a\n- b\n")[0]
        .message
        .contains("mapping of policy sections"));
}

#[test]
fn duration_parsing() {
    let ok = [
        ("250ms", Duration::from_millis(250)),
        ("30s", Duration::from_secs(30)),
        ("5m", Duration::from_secs(300)),
        ("24h", Duration::from_secs(86_400)),
        ("1h30m", Duration::from_secs(5400)),
        ("1.5s", Duration::from_millis(1500)),
        ("0s", Duration::ZERO),
        ("2d", Duration::from_secs(172_800)),
    ];
    for (s, d) in ok {
        assert_eq!(parse_duration(s), Ok(d), "{s}");
    }
    for bad in ["", "30", "s", "5 m", "1w", "-5s", "1.2.3s", "abc", "1h30"] {
        let e = parse_duration(bad).expect_err(bad);
        assert!(e.contains("invalid duration"), "{e}");
    }
}

#[test]
fn money_conversion() {
    assert_eq!(usd_to_micros(0.001), 1000);
    assert_eq!(usd_to_micros(10.0), 10_000_000);
    let src = MINIMAL.replace(
        "    kind: openai\n",
        "    kind: openai\n    price_per_1k: {input: 0.0015, output: 0.002}\n",
    );
    let p = from_str(&src, "m.yaml").expect("valid");
    let b = &p.backends[0];
    assert_eq!((b.price.input_per_1k, b.price.output_per_1k), (1500, 2000));
    assert_eq!(b.worst_cost(2000, 1000), 3000 + 2000);
    let src = format!(
        "{MINIMAL}budgets:\n  - {{name: j, scope: job, hard_usd: 0.03, soft_usd: 0.024}}\n"
    )
    .replace(
        "base_url: http://127.0.0.1:9/v1/\n",
        "base_url: http://127.0.0.1:9/v1/\n    price_per_1k: {input: 0.001, output: 0.001}\n",
    );
    let p = from_str(&src, "m.yaml").expect("valid");
    assert_eq!(
        (p.bounds[0].hard.usd, p.bounds[0].soft.usd),
        (Some(30_000), Some(24_000))
    );
}

#[test]
fn scenario_inline_policy_via_value() {
    let scenario = "name: x
now: \"2026-11-29T10:00:00Z\"
policy:
  version: lab-3
  backends:
    - id: primary
      kind: openai
      base_url: http://127.0.0.1:9/v1
  routes:
    - model: chat
      chain: [{backend: primary, model: small}]
  retry: {max_attempts_per_job: 2, max_retry_after: 30s}
state:
  usage:
    - {scope: job, id: J3, tokens: 22000}
";
    let doc: serde_norway::Value = serde_norway::from_str(scenario).expect("yaml");
    let policy = doc.get("policy").cloned().expect("policy key");
    let p = from_value(policy.clone(), "s.yaml", Some(scenario)).expect("valid");
    assert_eq!(p.retry.max_attempts_per_job, 2);
    assert_eq!(p.retry.max_retry_after, Duration::from_secs(30));
    assert_eq!(p.state.backend, StateBackend::Sqlite);

    let broken = scenario
        .replace("model: small}", "model: smal, x: 1}")
        .replace("kind: openai", "kind: openia");
    let doc: serde_norway::Value = serde_norway::from_str(&broken).expect("yaml");
    let policy = doc.get("policy").cloned().expect("policy key");
    let e = from_value(policy, "s.yaml", Some(&broken)).expect_err("invalid");
    assert_eq!(e.0[0].path, "policy.routes[0].chain[0].x");
    assert_eq!(e.0[0].line, Some(11));
    let bad_kind = scenario.replace("kind: openai", "kind: openia");
    let doc: serde_norway::Value = serde_norway::from_str(&bad_kind).expect("yaml");
    let v = doc.get("policy").cloned().expect("policy key");
    let e = from_value(v.clone(), "s.yaml", Some(&bad_kind)).expect_err("invalid");
    assert_eq!(e.to_string(), "s.yaml:7: policy.backends[0].kind: unknown value `openia`: expected one of openai, anthropic, gemini, ollama");
    let e = from_value(v, "s.yaml", None).expect_err("invalid");
    assert_eq!(
        e.to_string(),
        "s.yaml: backends[0].kind: unknown value `openia`: expected one of openai, anthropic, gemini, ollama"
    );
}

#[test]
fn locator_follows_block_and_flow_styles() {
    let src = "a:
  list:
  - x: 1
    y:
      - {k: 1}
      - k: 2
        j: 3
  -
    x: 4
b: {c: [1, 2]}
";
    let at = |p: &str| locate(src, &[], &parse_path(p));
    assert_eq!(at("a.list[0].x"), Some(3));
    assert_eq!(at("a.list[0].y[0].k"), Some(5));
    assert_eq!(at("a.list[0].y[1].j"), Some(7));
    assert_eq!(at("a.list[1].x"), Some(9));
    assert_eq!(at("a.list[1].missing"), Some(8));
    assert_eq!(at("b.c[1]"), Some(10));
    assert_eq!(at("nothing"), Some(1));
}

fn write(dir: &std::path::Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).expect("write");
}

#[test]
fn directory_merge_with_configmap_layout() {
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("..2026_11_29_10_00_00.000");
    std::fs::create_dir(&data).expect("mkdir");
    write(
        &data,
        "00-base.yaml",
        "version: v9\nbackends:\n  - {id: a, kind: openai, base_url: 'http://a'}\n",
    );
    write(&data, "10-more.yml", "backends:\n  - {id: b, kind: gemini, base_url: 'http://b'}\nroutes:\n  - {model: chat, chain: [{backend: a, model: m}, {backend: b, model: n}]}\n");
    write(&data, "20-limits.yaml", "identity:\n  virtual_keys: [{consumer: web, key_env: K}]\nbudgets:\n  - {name: j, scope: job, hard_tokens: 10}\n");
    write(&data, "notes.txt", "not yaml");
    write(&data, "05-empty.yaml", "# nothing here yet\n");
    std::os::unix::fs::symlink("..2026_11_29_10_00_00.000", root.path().join("..data"))
        .expect("link");
    for f in [
        "00-base.yaml",
        "05-empty.yaml",
        "10-more.yml",
        "20-limits.yaml",
        "notes.txt",
    ] {
        std::os::unix::fs::symlink(format!("..data/{f}"), root.path().join(f)).expect("link");
    }
    let p = load(root.path()).expect("valid");
    assert_eq!(&*p.version, "v9");
    assert_eq!(p.backends.len(), 2);
    assert_eq!(p.routes[0].chain[1].backend, 1);
    assert_eq!(p.bounds.len(), 1);
    assert_eq!(p.identity.virtual_keys.len(), 1);
    assert_eq!(p.source, root.path().display().to_string());

    // A second `retry` section and a dangling reference, both in the later file.
    write(&data, "30-retry.yaml", "retry: {max_attempts_per_job: 2}\n");
    write(
        &data,
        "40-retry.yaml",
        "quotas: []\n\nretry:\n  max_attempts_per_job: 4\n",
    );
    for f in ["30-retry.yaml", "40-retry.yaml"] {
        std::os::unix::fs::symlink(format!("..data/{f}"), root.path().join(f)).expect("link");
    }
    let e = load(root.path()).expect_err("duplicate section");
    assert_eq!(e.len(), 1, "{e}");
    let want_file = root.path().join("40-retry.yaml").display().to_string();
    assert_eq!(e.0[0].file, want_file);
    assert_eq!((e.0[0].line, e.0[0].path.as_str()), (Some(3), "retry"));
    assert!(e.0[0].message.contains("30-retry.yaml:1"), "{e}");

    std::fs::remove_file(root.path().join("40-retry.yaml")).expect("rm");
    write(
        &data,
        "50-route.yaml",
        "routes:\n  - model: other\n    chain:\n      - {backend: zz, model: m}\n",
    );
    std::os::unix::fs::symlink("..data/50-route.yaml", root.path().join("50-route.yaml"))
        .expect("link");
    let e = load(root.path()).expect_err("dangling");
    let want = format!(
        "{}:4: routes[0].chain[0].backend: no backend with id `zz` (backends: a, b)",
        root.path().join("50-route.yaml").display()
    );
    assert_eq!(e.to_string(), want);
}

#[test]
fn empty_directory_and_missing_file() {
    let root = tempfile::tempdir().expect("tempdir");
    assert!(load(root.path())
        .expect_err("empty")
        .to_string()
        .contains("no *.yaml"));
    assert!(load(&root.path().join("nope.yaml")).is_err());
}

#[test]
fn eligibility_follows_the_key_variable() {
    let mut p = from_str(MINIMAL, "m.yaml").expect("valid");
    assert!(backend_eligible(&p.backends[0]));
    p.backends[0].api_key_env = Some("TOLLGATE_TEST_POLICY_KEY_UNSET_1".into());
    assert!(!backend_eligible(&p.backends[0]));
    // PATH is set and non-empty wherever tests run; setting variables here would race
    // with other tests reading the environment.
    p.backends[0].api_key_env = Some("PATH".into());
    assert!(backend_eligible(&p.backends[0]));
    let path_value = std::env::var("PATH").unwrap_or_default();
    assert!(summary(&p).contains("key $PATH") && !summary(&p).contains(&path_value));
}

#[test]
fn only_regular_files_within_the_size_cap_are_read() {
    let dir = tempfile::tempdir().unwrap();
    // A FIFO would block the reader forever: refused before opening.
    let fifo = dir.path().join("policy.yaml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    if made {
        let e = super::load(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }
    // A symlink to /dev/zero is followed and refused (it would never end).
    let zero = dir.path().join("zero.yaml");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let e = super::load(&zero).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    // Past the cap: refused with the limit named.
    let big = dir.path().join("big.yaml");
    let pad = "#".repeat(1024) + "\n";
    std::fs::write(&big, pad.repeat(4 * 1024 + 1)).unwrap();
    let e = super::load(&big).unwrap_err().to_string();
    assert!(e.contains("4194304-byte limit"), "{e}");
}

#[test]
fn a_tab_in_the_indentation_is_named() {
    let src = "version: v\nbackends:\n\t- {id: a, kind: openai, base_url: 'http://a'}\n";
    let errs = errors(src);
    assert!(
        errs[0].message.contains("tabs are not allowed"),
        "{}",
        PolicyErrors(errs.clone())
    );
    assert_eq!(errs[0].line, Some(3), "{errs:?}");
}

#[test]
fn output_cap_settings_per_route_and_chain_entry() {
    let src = "version: v
estimate: {default_max_output_tokens: 1024}
backends:
  - {id: oa, kind: openai, base_url: 'http://a'}
routes:
  - model: reason
    default_max_output_tokens: 4096
    chain: [{backend: oa, model: o3, output_cap_field: max_completion_tokens}]
  - model: chat
    chain: [{backend: oa, model: gpt-4o}]
";
    let p = from_str(src, "p.yaml").expect("valid");
    let reason = p.route("reason").expect("route");
    assert_eq!(reason.default_output_cap(&p.estimate), 4096);
    assert_eq!(
        reason.chain[0].output_cap_field,
        Some(OutputCapField::MaxCompletionTokens)
    );
    let chat = p.route("chat").expect("route");
    assert_eq!(chat.default_output_cap(&p.estimate), 1024);
    assert_eq!(chat.chain[0].output_cap_field, None);

    let bad = "version: v
backends:
  - {id: g, kind: gemini, base_url: 'http://g'}
  - {id: oa, kind: openai, base_url: 'http://a'}
routes:
  - model: chat
    default_max_output_tokens: 0
    chain:
      - {backend: g, model: m, output_cap_field: max_completion_tokens}
      - {backend: oa, model: m, output_cap_field: max_output}
";
    assert_error(
        bad,
        "routes[0].default_max_output_tokens",
        7,
        "greater than zero",
    );
    assert_error(
        bad,
        "routes[0].chain[0].output_cap_field",
        9,
        "kind: openai",
    );
    assert_error(
        bad,
        "routes[0].chain[1].output_cap_field",
        10,
        "max_completion_tokens",
    );
}

#[test]
fn responses_api_is_an_openai_backend_key() {
    let ok = "version: v
backends:
  - {id: oa, kind: openai, base_url: 'http://a', responses_api: true}
  - {id: plain, kind: openai, base_url: 'http://b'}
routes:
  - {model: chat, chain: [{backend: oa, model: m}, {backend: plain, model: m}]}
";
    let p = from_str(ok, "p.yaml").expect("valid");
    assert!(p.backends[0].responses_api);
    assert!(!p.backends[1].responses_api, "off by default");
    let bad = "version: v
backends:
  - {id: c, kind: anthropic, base_url: 'http://c', responses_api: true}
routes:
  - {model: chat, chain: [{backend: c, model: m}]}
";
    assert_error(bad, "backends[0].responses_api", 3, "kind: openai");
}

#[test]
fn an_unknown_backend_lists_the_ids_that_exist() {
    let src = "version: v
backends:
  - {id: ollama, kind: ollama, base_url: 'http://o'}
  - {id: gemini, kind: gemini, base_url: 'http://g'}
routes:
  - model: chat
    chain: [{backend: gemnii, model: m}]
quotas:
  - {name: q, scope: backend, match: claude, window: day, limit_tokens: 5}
";
    assert_error(
        src,
        "routes[0].chain[0].backend",
        7,
        "no backend with id `gemnii` (backends: gemini, ollama)",
    );
    assert_error(
        src,
        "quotas[0].match",
        9,
        "no backend with id `claude` (backends: gemini, ollama)",
    );
}

#[test]
fn summary_names_identity_state_audit_and_unset_keys() {
    let mut p = from_str(MINIMAL, "m.yaml").expect("valid");
    p.backends[0].api_key_env = Some("TOLLGATE_TEST_POLICY_KEY_UNSET_2".into());
    let s = summary(&p);
    assert!(
        s.contains("(ineligible: key $TOLLGATE_TEST_POLICY_KEY_UNSET_2 unset)"),
        "{s}"
    );
    assert!(
        s.contains("identity: consumer header x-tollgate-consumer"),
        "{s}"
    );
    assert!(s.contains("\nstate: "), "{s}");
    assert!(s.contains("\naudit: "), "{s}");
    assert_eq!(
        ineligible_reason(&p.backends[0]).as_deref(),
        Some("key $TOLLGATE_TEST_POLICY_KEY_UNSET_2 unset")
    );
}

#[test]
fn long_context_tiers_price_the_whole_call() {
    let src = MINIMAL.replace(
        "base_url: http://127.0.0.1:9/v1/\n",
        "base_url: http://127.0.0.1:9/v1/\n    price_per_1k: {input: 0.00125, output: 0.01, tiers: [{above_input_tokens: 200000, input: 0.0025, output: 0.015}]}\n",
    );
    let p = from_str(&src, "t.yaml").expect("valid");
    let price = p.backends[0].price;
    // At the threshold: the base rates. 200,000 × $0.00125/1k + 1,000 × $0.01/1k.
    assert_eq!(price.cost(200_000, 1_000), 250_000 + 10_000);
    // One token above: the tier's rates on every token, input and output.
    assert_eq!(price.cost(200_001, 1_000), 500_003 + 15_000);
    let billed = crate::policy::Billed {
        input: 300_000,
        output: 2_000,
        ..Default::default()
    };
    assert_eq!(price.cost_billed(billed), 750_000 + 30_000);
    // A tier's cache rates default to its own input rate.
    let t = price.tiers[0].unwrap();
    assert_eq!((t.cached_input_per_1k, t.cache_write_per_1k), (2500, 2500));
    // Tiers must ascend and name their threshold.
    for (tiers, path) in [
        (
            "[{above_input_tokens: 200000, input: 1}, {above_input_tokens: 100000, input: 2}]",
            "tiers[1].above_input_tokens",
        ),
        ("[{input: 1}]", "tiers[0].above_input_tokens"),
    ] {
        let bad = MINIMAL.replace(
            "base_url: http://127.0.0.1:9/v1/\n",
            &format!("base_url: http://127.0.0.1:9/v1/\n    price_per_1k: {{input: 0.001, tiers: {tiers}}}\n"),
        );
        let e = errors(&bad);
        assert!(e.iter().any(|e| e.to_string().contains(path)), "{e:?}");
    }
}

#[test]
fn a_dollar_bound_on_an_unpriced_entry_is_an_error_unless_local() {
    let budget = "budgets:\n  - {name: spend, scope: global, window: month, hard_usd: 10}\n";
    let e = errors(&format!("{MINIMAL}{budget}"));
    let msg = e
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        msg.contains("routes[0].chain[0]") && msg.contains("`spend`"),
        "{msg}"
    );
    assert!(msg.contains("no price for backend `primary`"), "{msg}");
    // A free price said out loud, an entry's own price, or a local kind: accepted.
    let free = MINIMAL.replace(
        "base_url: http://127.0.0.1:9/v1/\n",
        "base_url: http://127.0.0.1:9/v1/\n    price_per_1k: {input: 0, output: 0}\n",
    );
    from_str(&format!("{free}{budget}"), "p.yaml").expect("priced at zero");
    let entry = MINIMAL.replace(
        "{backend: primary, model: small}",
        "{backend: primary, model: small, price_per_1k: {input: 0.001, output: 0.001}}",
    );
    from_str(&format!("{entry}{budget}"), "p.yaml").expect("entry priced");
    let local = MINIMAL.replace("kind: openai", "kind: ollama");
    from_str(&format!("{local}{budget}"), "p.yaml").expect("ollama is free");
    // A token budget needs no price; a dollar bound on another backend does not apply.
    from_str(
        &format!(
            "{MINIMAL}budgets:\n  - {{name: t, scope: global, window: month, hard_tokens: 10}}\n"
        ),
        "p.yaml",
    )
    .expect("tokens only");
}
