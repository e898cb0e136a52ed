//! The scripted upstream and the fixed clock `tollgate test` plugs into the governor.

use super::file::Answer;
use crate::governor::{CallResult, CallSpec, Clock, Failure, FailureClass, Upstream};
use crate::policy::Backend;
use crate::units::Millis;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

/// A clock that stands still until the core waits; then it advances by exactly the wait.
#[derive(Debug)]
pub struct FixedClock {
    now: AtomicI64,
    waited: AtomicI64,
}

impl FixedClock {
    pub fn new(now: Millis) -> Self {
        FixedClock {
            now: AtomicI64::new(now),
            waited: AtomicI64::new(0),
        }
    }
    pub fn waited_ms(&self) -> i64 {
        self.waited.load(Ordering::Relaxed)
    }
}

impl Clock for FixedClock {
    fn now_ms(&self) -> Millis {
        self.now.load(Ordering::Relaxed)
    }
    fn sleep_ms(&self, ms: u64) -> impl Future<Output = ()> + Send {
        self.now.fetch_add(ms as i64, Ordering::Relaxed);
        self.waited.fetch_add(ms as i64, Ordering::Relaxed);
        std::future::ready(())
    }
}

/// Answers per backend in call order; a call past the list is a scenario error.
#[derive(Debug, Default)]
pub struct ScriptedUpstream {
    answers: Mutex<BTreeMap<String, VecDeque<Answer>>>,
    unexpected: Mutex<Vec<String>>,
}

impl ScriptedUpstream {
    pub fn new(answers: BTreeMap<String, Vec<Answer>>) -> Self {
        let answers = answers.into_iter().map(|(k, v)| (k, v.into())).collect();
        ScriptedUpstream {
            answers: Mutex::new(answers),
            unexpected: Mutex::default(),
        }
    }

    /// Backends called more often than the script allowed.
    pub fn unexpected(&self) -> Vec<String> {
        self.unexpected
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    fn next(&self, backend: &str) -> Option<Answer> {
        self.answers.lock().ok()?.get_mut(backend)?.pop_front()
    }
}

/// Classifies a scripted answer the way the proxy classifies a real one.
pub fn classify(a: &Answer) -> CallResult<Answer> {
    let retry_after_ms = a.retry_after.map(|s| (s * 1000.0).round() as i64);
    match a.error.as_deref() {
        Some("timeout") => {
            return CallResult::Failed(Failure {
                class: FailureClass::Timeout,
                status: None,
                retry_after_ms,
                long_outage: false,
                billed: false,
            })
        }
        Some(_) => {
            return CallResult::Failed(Failure {
                class: FailureClass::Connect,
                status: None,
                retry_after_ms,
                long_outage: false,
                billed: false,
            })
        }
        None => {}
    }
    let status = a.status.unwrap_or(200);
    let class = match status {
        200..=299 => return CallResult::Served(a.clone()),
        429 => FailureClass::Throttled,
        401 | 403 => FailureClass::Auth,
        408 | 500..=599 => FailureClass::Server,
        _ => {
            return CallResult::NotRetryable {
                payload: a.clone(),
                status,
            }
        }
    };
    CallResult::Failed(Failure {
        class,
        status: Some(status),
        retry_after_ms,
        long_outage: false,
        billed: false,
    })
}

impl Upstream for ScriptedUpstream {
    type Payload = Answer;

    fn eligible(&self, _index: usize, backend: &Backend) -> bool {
        crate::policy::backend_eligible(backend)
    }

    fn call(&self, spec: CallSpec<'_>) -> impl Future<Output = CallResult<Answer>> + Send {
        let r = match self.next(&spec.backend.id) {
            Some(a) => classify(&a),
            None => {
                if let Ok(mut u) = self.unexpected.lock() {
                    u.push(spec.backend.id.to_string());
                }
                CallResult::Failed(Failure {
                    class: FailureClass::Connect,
                    status: None,
                    retry_after_ms: None,
                    long_outage: false,
                    billed: false,
                })
            }
        };
        std::future::ready(r)
    }
}
