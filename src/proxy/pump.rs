//! Drives a governed stream in a task of its own, so that how the client behaves can never
//! keep a reservation open or skip the settlement:
//!
//! - the client reads: frames go through a small bounded channel as they arrive;
//! - the client hung up (before the first byte or mid-stream): the upstream answer is still
//!   read to its end, bounded by the backend's total timeout and the mid-stream guard, so that
//!   its actual usage is committed (and the record notes the disconnect);
//! - the client stopped reading (TCP window or h2 window at zero): the channel fills, and at
//!   the total timeout the call ends and is settled with the reserved worst case.

use super::redact;
use super::respond::{Body, BoxError};
use super::snapshot::Snapshot;
use super::stream::{End, Metered};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use http_body_util::BodyExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::mpsc;

/// Frames buffered between the upstream and a slow client: a bound, not a stream buffer.
const DEPTH: usize = 8;

/// Starts pumping `m` and returns the body the client reads.
/// Every frame is searched for configured secrets on the way out (see [`super::redact`]).
pub fn spawn(mut m: Metered, deadline: Instant, snap: Option<Arc<Snapshot>>) -> Body {
    let (tx, rx) = mpsc::channel::<Bytes>(DEPTH);
    let deadline = tokio::time::Instant::from_std(deadline);
    tokio::spawn(async move {
        let mut tx = Some(tx);
        let mut pieces = redact::Pieces::default();
        loop {
            let (data, last) = match m.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(d) => (d, false),
                    Err(_) => continue,
                },
                // The end: what redaction held back (no secret after all) goes out last.
                Some(Err(_)) | None => match pieces.finish() {
                    Some(rest) => (rest, true),
                    None => break,
                },
            };
            let Some(t) = &tx else {
                if last {
                    break;
                }
                continue;
            };
            let data = match &snap {
                Some(s) if !last => pieces.next(s, data),
                _ => data,
            };
            if !data.is_empty() {
                match tokio::time::timeout_at(deadline, t.send(data)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => {
                        // The client is gone: keep reading the upstream for its usage.
                        tx = None;
                        m.client_gone();
                    }
                    Err(_) => {
                        m.stop(End::ClientStalled);
                        break;
                    }
                }
            }
            if last {
                break;
            }
        }
        // `m` drops here: an unsettled stream (only if the loop broke early) settles in Drop.
    });
    Channel(rx).boxed()
}

/// The client's side of the pump.
struct Channel(mpsc::Receiver<Bytes>);

impl HttpBody for Channel {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}
