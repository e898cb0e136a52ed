use crate::policy::{from_str, KeySource, Match, PolicyError};
use crate::units::Scope;

const BASE: &str = "version: id-1
backends: [{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}]
routes: [{model: chat, chain: [{backend: primary, model: small}]}]
";

fn errors(extra: &str) -> Vec<PolicyError> {
    match from_str(&format!("{BASE}{extra}"), "p.yaml") {
        Ok(_) => panic!("policy unexpectedly valid:\n{extra}"),
        Err(e) => e.0,
    }
}

fn has(errs: &[PolicyError], path: &str, text: &str) -> bool {
    errs.iter()
        .any(|e| e.path == path && e.message.contains(text))
}

const DIGEST: &str = "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08";

#[test]
fn keys_carry_consumer_team_and_one_secret_source() {
    let p = from_str(
        &format!(
            "{BASE}identity:
  virtual_keys:
    - {{consumer: web, team: storefront, key_env: TOLLGATE_KEY_WEB}}
    - {{consumer: batch, key_sha256: '{DIGEST}'}}
"
        ),
        "p.yaml",
    )
    .expect("valid");
    let k = &p.identity.virtual_keys;
    assert_eq!(&*k[0].consumer, "web");
    assert_eq!(k[0].team.as_deref(), Some("storefront"));
    assert_eq!(k[0].secret, KeySource::Env("TOLLGATE_KEY_WEB".into()));
    assert_eq!(k[1].team, None);
    let KeySource::Sha256(d) = k[1].secret else {
        panic!("a digest")
    };
    assert_eq!(d[0], 0x9f);
    assert_eq!(d[31], 0x08);
    assert!(p.identity.require_key, "keys configured: a key is required");
}

#[test]
fn require_key_defaults_off_without_keys_and_can_be_turned_off() {
    let p = from_str(BASE, "p.yaml").unwrap();
    assert!(!p.identity.require_key);
    let p = from_str(
        &format!(
            "{BASE}identity:\n  require_key: false\n  virtual_keys: [{{consumer: w, key_env: K_W}}]\n"
        ),
        "p.yaml",
    )
    .unwrap();
    assert!(!p.identity.require_key);
}

#[test]
fn exactly_one_of_key_env_and_key_sha256() {
    let both = errors(&format!(
        "identity:\n  virtual_keys: [{{consumer: w, key_env: K, key_sha256: '{DIGEST}'}}]\n"
    ));
    assert!(
        has(&both, "identity.virtual_keys[0].key_sha256", "not both"),
        "{both:?}"
    );
    let none = errors("identity:\n  virtual_keys: [{consumer: w}]\n");
    assert!(
        has(&none, "identity.virtual_keys[0].key_env", "key_sha256"),
        "{none:?}"
    );
    for bad in ["abc", &DIGEST[..63], &format!("{}g", &DIGEST[..63])] {
        let e = errors(&format!(
            "identity:\n  virtual_keys: [{{consumer: w, key_sha256: '{bad}'}}]\n"
        ));
        assert!(
            has(&e, "identity.virtual_keys[0].key_sha256", "64 hex"),
            "{e:?}"
        );
    }
    let dup = errors(&format!(
        "identity:\n  virtual_keys:\n    - {{consumer: a, key_sha256: '{DIGEST}'}}\n    - {{consumer: b, key_sha256: '{}'}}\n",
        DIGEST.to_ascii_lowercase()
    ));
    assert!(
        has(&dup, "identity.virtual_keys[1].key_sha256", ""),
        "{dup:?}"
    );
}

#[test]
fn key_consumer_and_team_must_be_ids() {
    let e = errors("identity:\n  virtual_keys: [{consumer: 'a b', team: 't#1', key_env: K}]\n");
    assert!(
        has(&e, "identity.virtual_keys[0].consumer", "not a valid id"),
        "{e:?}"
    );
    assert!(
        has(&e, "identity.virtual_keys[0].team", "not a valid id"),
        "{e:?}"
    );
}

#[test]
fn team_scope_and_glob_matches() {
    let p = from_str(
        &format!(
            "{BASE}budgets:\n  - {{name: t, scope: team, match: 'team-*', window: month, hard_usd: 50}}\n  - {{name: m, scope: model, match: 'gpt-*', window: day, hard_tokens: 5}}\n"
        )
        .replace("base_url: 'http://127.0.0.1:9/v1'}", "base_url: 'http://127.0.0.1:9/v1', price_per_1k: {input: 0.001, output: 0.001}}"),
        "p.yaml",
    )
    .unwrap();
    assert_eq!(p.bounds[0].scope, Scope::Team);
    assert_eq!(p.bounds[0].matcher, Match::Glob("team-*".into()));
    assert!(p.bounds[0].matcher.matches("team-a"));
    assert!(p.bounds[0].matcher.matches("team-"));
    assert!(!p.bounds[0].matcher.matches("ops"));
    assert!(!p.bounds[0].matcher.matches("my-team-a"));
    // A glob for a model need not name a model of the chain (it may match none yet).
    assert_eq!(p.bounds[1].matcher, Match::Glob("gpt-*".into()));
}

#[test]
fn other_pattern_syntax_is_an_error_not_a_literal() {
    for pat in [
        "team-?",
        "team-[ab]",
        "team-{a,b}",
        "team-.+",
        "^team$",
        "a|b",
        "(x)",
    ] {
        let e = errors(&format!(
            "quotas:\n  - {{name: q, scope: consumer, match: '{pat}', window: day, limit_tokens: 5}}\n"
        ));
        assert!(
            has(&e, "quotas[0].match", "only `*` is a wildcard"),
            "{pat}: {e:?}"
        );
    }
}
