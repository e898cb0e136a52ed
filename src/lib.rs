//! tollgate: a transparent reverse-proxy sidecar that governs what AI calls cost.
//!
//! Module graph (imports point down): `cli` → `sidecar` → `admin` → `proxy` → `telemetry`
//! → `audit` → `replay` → `scenario` → `dialect` → `providers` → `governor` → `state` → `stream` → `policy`
//! → `ledger` → `estimate` → `units` → `wire`, `tls`, `body`, `jscan`. The governor is pure: no sockets, files or wall
//! clock. `layering.rs` checks the order.
#![forbid(unsafe_code)]

/// `Box::pin(future)` for a large future, built in its allocation: the room is allocated
/// first and the future written into it, so its state (kilobytes for a request's future) is
/// not laid out on the stack and then copied whole, as `Box::pin` of a value is; only the
/// future's arguments are written.
macro_rules! pin_in_place {
    ($future:expr) => {{
        let room = Box::new_uninit();
        let placed = Box::write(room, $future);
        Box::into_pin(placed)
    }};
}

pub mod admin;
pub mod audit;
pub mod body;
pub mod cli;
pub mod dialect;
pub mod estimate;
pub mod governor;
pub(crate) mod jscan;
pub mod ledger;
pub mod policy;
pub mod providers;
pub mod proxy;
pub mod replay;
pub mod scenario;
pub mod sidecar;
pub mod state;
pub mod stream;
pub mod telemetry;
pub mod tls;
pub mod units;
pub mod wire;

#[cfg(test)]
mod layering;
