//! tollgate: a transparent reverse-proxy sidecar that governs what AI calls cost.
//!
//! Module graph (imports point down): `cli` → `proxy`/`scenario` → `governor` → `ledger`,
//! `policy`, `estimate` → `units`. The governor is pure: no sockets, files or wall clock.
#![forbid(unsafe_code)]

pub mod admin;
pub mod audit;
pub mod cli;
pub mod dialect;
pub mod estimate;
pub mod governor;
pub mod ledger;
pub mod policy;
pub mod providers;
pub mod proxy;
pub mod scenario;
pub mod state;
pub mod stream;
pub mod telemetry;
pub mod units;
