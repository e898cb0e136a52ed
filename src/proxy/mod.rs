//! The sidecar: an OpenAI-compatible HTTP front that runs every request through the governor
//! and calls the chosen upstream. The I/O shell around the pure core.

pub mod clock;
mod conn;
mod encoding;
pub mod finish;
mod front;
pub mod handler;
mod header_memo;
pub mod identity;
mod limit_headers;
pub mod limits_view;
pub mod persist;
mod pump;
pub mod redact;
pub mod respond;
pub mod server;
pub mod snapshot;
pub mod stamps;
pub mod stream;
pub mod transport;
pub mod workers;

pub use clock::{AppClock, ManualClock};
pub use handler::App;
pub use server::reload;
pub use snapshot::Snapshot;
