//! A TCP proxy the test controls, to cut a connection (to Redis) and restore it.

/// A TCP proxy to a local port that the test can cut: every open connection is dropped and
/// new ones are closed at once until it is restored.
pub struct Cuttable {
    pub port: u16,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Cuttable {
    pub async fn start(target: u16) -> Cuttable {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if *rx.borrow() {
                    continue;
                }
                let mut rx = rx.clone();
                tokio::spawn(async move {
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
        Cuttable { port, cut }
    }

    pub fn set_cut(&self, cut: bool) {
        let _ = self.cut.send(cut);
    }
}
