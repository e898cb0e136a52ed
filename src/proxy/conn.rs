//! Admission of connections, before hyper sees them: a cap on open connections per port
//! (`server.max_connections`, refused with a 503 in the client's error shape) and a deadline
//! for the first byte (`server.header_read_timeout`: hyper's header timer only starts once a
//! request has begun, so a socket that never sends anything would otherwise stay open
//! forever and, under a file-descriptor limit, starve real clients).

use crate::telemetry::names::TOLLGATE_CONNECTIONS_REFUSED_TOTAL;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a refused connection may take to receive its 503.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// The body of the refusal past the connection cap (OpenAI's error shape).
const REFUSAL_BODY: &str = concat!(
    r#"{"error":{"message":"too many open connections to this sidecar "#,
    r#"(server.max_connections); retry shortly","type":"server_error","param":null,"#,
    r#""code":"too_many_connections"}}"#
);

/// Open connections of one port.
#[derive(Debug, Default)]
pub struct Gate {
    open: Arc<AtomicUsize>,
}

/// One admitted connection; the count goes down when it drops.
#[derive(Debug)]
pub struct Slot {
    open: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// A slot, or `None` when `max` connections are already open.
    pub fn enter(&self, max: usize) -> Option<Slot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot {
                open: self.open.clone(),
            })
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// Answers a connection past the cap with a 503 and `Connection: close`, then closes it.
/// Runs in its own task: the accept loop never waits on a client.
pub async fn refuse(mut stream: TcpStream, port: &'static str) {
    metrics::counter!(TOLLGATE_CONNECTIONS_REFUSED_TOTAL, "port" => port, "reason" => "limit")
        .increment(1);
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n",
        REFUSAL_BODY.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(REFUSAL_BODY.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent until it closes: closing with unread data would reset
        // the connection and could lose the 503 before the client reads it.
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, write).await;
}

/// Waits until the client sends its first byte (true), or closes, or `within` passes
/// (false: the caller drops the connection).
pub async fn first_byte(stream: &TcpStream, within: Duration, port: &'static str) -> bool {
    let mut one = [0u8; 1];
    match tokio::time::timeout(within, stream.peek(&mut one)).await {
        Ok(Ok(n)) => n > 0,
        Ok(Err(_)) => false,
        Err(_) => {
            metrics::counter!(TOLLGATE_CONNECTIONS_REFUSED_TOTAL, "port" => port, "reason" => "idle")
                .increment(1);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_counts_and_refuses_past_max() {
        let g = Gate::default();
        let a = g.enter(2).unwrap();
        let _b = g.enter(2).unwrap();
        assert!(g.enter(2).is_none());
        drop(a);
        assert_eq!(g.open(), 1);
        assert!(g.enter(2).is_some());
    }

    #[test]
    fn the_refusal_body_is_openai_shaped_json() {
        let v: serde_json::Value = serde_json::from_str(REFUSAL_BODY).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert_eq!(v["error"]["type"], "server_error");
    }
}
