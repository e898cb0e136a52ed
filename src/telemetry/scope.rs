//! What a governed request's task carries for its record, in one task-local: whether its
//! client has gone away (the record says so), and its trace when OTLP export is on (the
//! transport starts attempt spans under it without new parameters).
//!
//! One task-local, not one each: a task-local is swapped in and out of its thread on every
//! poll of the request's future, which cost ~330 instructions a request for a second one.

use super::otel::RequestTrace;
use std::cell::RefCell;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

struct RequestScope {
    /// Set when the client of the request this task serves has gone away.
    gone: Arc<AtomicBool>,
    trace: RefCell<Option<Box<RequestTrace>>>,
}

tokio::task_local! {
    static SCOPE: RequestScope;
}

/// Runs `fut` (a governed request) with its client-gone flag and, when export is on, its
/// trace (boxed: the task-local is swapped on every poll, a pointer rather than the trace).
pub fn run<F: Future>(
    gone: Arc<AtomicBool>,
    trace: Option<Box<RequestTrace>>,
    fut: F,
) -> impl Future<Output = F::Output> {
    SCOPE.scope(
        RequestScope {
            gone,
            trace: RefCell::new(trace),
        },
        fut,
    )
}

/// Whether the client of the request this task serves has gone away (`false` outside a
/// request's scope).
pub fn client_gone() -> bool {
    SCOPE
        .try_with(|s| s.gone.load(Ordering::Acquire))
        .unwrap_or(false)
}

/// Runs `f` on the request's trace, if this task is in a request's scope and has one.
pub(crate) fn with_trace<R>(f: impl FnOnce(&mut RequestTrace) -> R) -> Option<R> {
    SCOPE
        .try_with(|s| s.trace.borrow_mut().as_mut().map(|t| f(t)))
        .ok()
        .flatten()
}

/// Takes the request's trace out of the scope.
pub(crate) fn take_trace() -> Option<Box<RequestTrace>> {
    SCOPE
        .try_with(|s| s.trace.borrow_mut().take())
        .ok()
        .flatten()
}
