//! A TCP proxy the test controls, to cut a connection (to Redis) and restore it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A TCP proxy to a local port that the test can cut: every open connection is dropped and
/// new ones are closed at once until it is restored.
pub struct Cuttable {
    pub port: u16,
    cut: tokio::sync::watch::Sender<bool>,
    /// Connections being piped now.
    open: Arc<AtomicUsize>,
}

/// Counts a piped connection while it lives.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Cuttable {
    pub async fn start(target: u16) -> Cuttable {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, rx) = tokio::sync::watch::channel(false);
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if *rx.borrow() {
                    continue;
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let guard = Open(counted.clone());
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    let _guard = guard;
                    let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = rx.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Cuttable { port, cut, open }
    }

    /// Cuts (`true`) or restores (`false`). A cut returns once every piped connection is
    /// closed, so the outage has begun when it returns.
    pub async fn set_cut(&self, cut: bool) {
        let _ = self.cut.send(cut);
        if !cut {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.open.load(Ordering::SeqCst) > 0 {
            assert!(
                Instant::now() < deadline,
                "the cut connections did not close"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
