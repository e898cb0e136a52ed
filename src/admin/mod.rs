//! The admin port: liveness, readiness, Prometheus metrics, the status JSON, the dashboard
//! page, `POST /admin/reload` and `POST /admin/circuits/{backend}/reset`. Separate from the data port; nothing here is on the
//! request path. Mutating calls need `Authorization: Bearer $TOLLGATE_ADMIN_TOKEN`
//! (compared in constant time); with no token configured they are refused.

mod reload;
mod status;

pub use reload::{fingerprint, watch, ReloadError, ReloadStatus, Trigger, WATCH_EVERY};

use crate::body::ReqBody;
use crate::proxy::respond::{full, Body};
use crate::proxy::App;
use arc_swap::ArcSwapOption;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// The environment variable holding the admin token.
pub const ADMIN_TOKEN_ENV: &str = "TOLLGATE_ADMIN_TOKEN";

/// How long `/readyz` waits for the state store's answer.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// The dashboard: one self-contained page (inline CSS and JS, nothing fetched from outside).
const DASHBOARD: &str = include_str!("dashboard.html");

/// Asks the state store whether it answers (`Err` says why not). The in-memory store has
/// none: it always answers.
pub type ReadyCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// What the state store says about itself in `/admin/status` (`state`).
pub type StatusHook = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Per-sidecar admin state: where the policy comes from, how the last reload went, the admin
/// token and the readiness hook.
pub struct Ops {
    policy_path: ArcSwapOption<PathBuf>,
    token: ArcSwapOption<String>,
    state_check: ArcSwapOption<ReadyCheck>,
    state_status: ArcSwapOption<StatusHook>,
    pub(crate) reloads: Mutex<ReloadStatus>,
    /// Serialises reloads (file watch, SIGHUP and the API may race).
    reload_lock: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Ops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ops")
            .field("policy_path", &self.policy_path.load())
            .field("token", &self.token.load().as_ref().map(|_| "***"))
            .finish()
    }
}

impl Ops {
    /// Reads the admin token from the environment.
    pub fn new(version: Arc<str>) -> Self {
        let token = std::env::var(ADMIN_TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .map(Arc::new);
        Ops {
            policy_path: ArcSwapOption::empty(),
            token: ArcSwapOption::new(token),
            state_check: ArcSwapOption::empty(),
            state_status: ArcSwapOption::empty(),
            reloads: Mutex::new(ReloadStatus::new(version)),
            reload_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Sets (or clears) the admin token, e.g. when embedding the sidecar.
    pub fn set_token(&self, token: Option<String>) {
        self.token
            .store(token.filter(|t| !t.is_empty()).map(Arc::new));
    }

    /// The state store's readiness check (filled by the store when it is not in memory).
    pub fn set_state_check(&self, check: ReadyCheck) {
        self.state_check.store(Some(Arc::new(check)));
    }

    /// The state store's part of `/admin/status` (filled by the Redis store).
    pub fn set_state_status(&self, hook: StatusHook) {
        self.state_status.store(Some(Arc::new(hook)));
    }

    /// The state store's part of `/admin/status`, if it has one.
    pub fn state_status(&self) -> Option<serde_json::Value> {
        self.state_status.load().as_ref().map(|h| (**h)())
    }

    /// The policy file or directory that reloads read.
    pub fn set_policy_path(&self, path: PathBuf) {
        self.policy_path.store(Some(Arc::new(path)));
    }

    pub fn policy_path(&self) -> Option<PathBuf> {
        self.policy_path.load().as_deref().cloned()
    }

    /// The refusal of a mutating call, or `None` when the bearer token is right.
    fn refuse(&self, req: &Request<ReqBody>) -> Option<Response<Body>> {
        let token = self.token.load();
        let Some(token) = token.as_ref() else {
            return Some(json_error(
                StatusCode::FORBIDDEN,
                "admin API disabled: set TOLLGATE_ADMIN_TOKEN to enable mutating admin calls",
            ));
        };
        let given = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| bearer(v.as_bytes()))
            .unwrap_or(b"");
        // Lengths may differ: ct_eq then says no without comparing further (only the length
        // can leak, never the content).
        if bool::from(given.ct_eq(token.as_bytes())) {
            None
        } else {
            let mut r = json_error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong bearer token for the admin API",
            );
            r.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
            Some(r)
        }
    }
}

/// The credentials of `Authorization: Bearer <token>`; the scheme word is case-insensitive
/// (RFC 9110 §11.1), as on the data port.
fn bearer(v: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let start = rest.iter().position(|&b| b != b' ')?;
    Some(&rest[start..])
}

/// `POST /admin/circuits/{backend}/reset`: closes that backend's circuit now. The
/// write-behind store persists it on its next flush; `/admin/status` shows it at once.
fn reset_circuit(app: &App, id: &str) -> Response<Body> {
    let snap = app.snap.load();
    let Some(b) = snap.policy.backend(id) else {
        return json_error(
            StatusCode::NOT_FOUND,
            "no backend with that id in the policy",
        );
    };
    let c = app.governor.circuit(&b.id);
    let before = c.state_at(jiff::Timestamp::now().as_millisecond());
    c.reset();
    tracing::warn!(backend = %b.id, before = before.as_str(), "circuit reset by the admin API");
    json(
        StatusCode::OK,
        &serde_json::json!({"result": "ok", "backend": &*b.id, "before": before.as_str(),
            "circuit": "CLOSED"}),
    )
}

/// The backend id of a `/admin/circuits/{backend}/reset` path.
fn circuit_path(path: &str) -> Option<&str> {
    path.strip_prefix("/admin/circuits/")?
        .strip_suffix("/reset")
        .filter(|id| !id.is_empty() && !id.contains('/'))
}

fn with_type(mut r: Response<Body>, status: StatusCode, ctype: &'static str) -> Response<Body> {
    *r.status_mut() = status;
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    r
}

fn text(status: StatusCode, body: impl Into<bytes::Bytes>) -> Response<Body> {
    with_type(
        Response::new(full(body)),
        status,
        "text/plain; charset=utf-8",
    )
}

fn json(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    with_type(
        Response::new(full(v.to_string())),
        status,
        "application/json",
    )
}

fn json_error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, &serde_json::json!({"error": {"message": message}}))
}

/// The admin port's router.
pub async fn handle(
    app: Arc<App>,
    ops: Arc<Ops>,
    req: Request<ReqBody>,
) -> Result<Response<Body>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => readyz(&app, &ops).await,
        (&Method::GET, "/metrics") => {
            status::set_gauges(&app, &ops);
            with_type(
                Response::new(full(crate::telemetry::global().render())),
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
            )
        }
        (&Method::GET, "/admin/status") => json(StatusCode::OK, &status::status(&app, &ops)),
        (&Method::GET, "/" | "/index.html") => with_type(
            Response::new(full(DASHBOARD)),
            StatusCode::OK,
            "text/html; charset=utf-8",
        ),
        (&Method::POST, "/admin/reload") => match ops.refuse(&req) {
            Some(r) => r,
            None => match ops.reload(&app, Trigger::Api).await {
                Ok(v) => json(
                    StatusCode::OK,
                    &serde_json::json!({"result": "ok", "version": &*v}),
                ),
                Err(reload::ReloadError::NoPath) => json_error(
                    StatusCode::CONFLICT,
                    "this sidecar was not started from a policy path: nothing to reload",
                ),
                Err(reload::ReloadError::Invalid(msg)) => json(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &serde_json::json!({"result": "error", "error": {"message": msg},
                        "version": &*app.snap.load().policy.version}),
                ),
            },
        },
        (m, p) if circuit_path(p).is_some() => match (m, ops.refuse(&req)) {
            (&Method::POST, Some(r)) => r,
            (&Method::POST, None) => reset_circuit(&app, circuit_path(p).unwrap_or_default()),
            _ => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
        },
        (_, "/healthz" | "/readyz" | "/metrics" | "/admin/status" | "/" | "/admin/reload") => {
            text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    })
}

async fn readyz(app: &App, ops: &Ops) -> Response<Body> {
    // A valid policy is loaded by construction (start refuses an invalid one; a reload never
    // replaces it with one), so readiness is the state store's answer. Backends without their
    // key do not make the sidecar unready (the static answer is a valid service), but the
    // answer names them.
    let ready = || {
        let unusable = status::unusable(&app.snap.load());
        if unusable.is_empty() {
            text(StatusCode::OK, "ready\n")
        } else {
            text(
                StatusCode::OK,
                format!("ready\nunusable backends: {}\n", unusable.join("; ")),
            )
        }
    };
    let check = ops.state_check.load_full();
    let Some(check) = check else {
        return ready();
    };
    match tokio::time::timeout(READY_TIMEOUT, (*check)()).await {
        Ok(Ok(())) => ready(),
        Ok(Err(e)) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: state store: {e}\n"),
        ),
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: state store did not answer within {} s\n",
                READY_TIMEOUT.as_secs()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_word_is_case_insensitive() {
        assert_eq!(bearer(b"Bearer tok"), Some(&b"tok"[..]));
        assert_eq!(bearer(b"bearer tok"), Some(&b"tok"[..]));
        assert_eq!(bearer(b"BEARER  tok"), Some(&b"tok"[..]));
        assert_eq!(bearer(b"Basic tok"), None);
        assert_eq!(bearer(b"Bearertok"), None);
        assert_eq!(bearer(b"Bearer "), None);
    }

    #[test]
    fn circuit_paths() {
        assert_eq!(circuit_path("/admin/circuits/gemini/reset"), Some("gemini"));
        assert_eq!(circuit_path("/admin/circuits//reset"), None);
        assert_eq!(circuit_path("/admin/circuits/a/b/reset"), None);
        assert_eq!(circuit_path("/admin/circuits/a"), None);
    }
}
