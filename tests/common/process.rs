//! The real `tollgate serve` binary as a child process (restarts, `kill -9`, replicas).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound and released; the child binds it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `tollgate serve`.
pub struct Serve {
    child: Option<Child>,
    pub port: u16,
    pub admin_port: u16,
    pub log: PathBuf,
}

impl Serve {
    /// Starts `tollgate serve --policy <policy>` (whose `server.listen` must be
    /// 127.0.0.1:`port`) and waits until `/healthz` answers. Output goes to `log`.
    pub async fn start(policy: &Path, port: u16, admin_port: u16, log: &Path) -> Serve {
        Serve::start_env(policy, port, admin_port, log, &[]).await
    }

    /// As [`Serve::start`], with extra environment variables.
    pub async fn start_env(
        policy: &Path,
        port: u16,
        admin_port: u16,
        log: &Path,
        env: &[(&str, &str)],
    ) -> Serve {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("serve")
            .arg("--policy")
            .arg(policy)
            .env("TOLLGATE_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("spawn tollgate");
        let mut s = Serve {
            child: Some(child),
            port,
            admin_port,
            log: log.to_owned(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = format!("http://127.0.0.1:{admin_port}/healthz");
        loop {
            if let Some(c) = s.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("tollgate exited at start ({st}):\n{}", s.log_text());
                }
            }
            let ok = tokio::time::timeout(
                Duration::from_secs(2),
                super::try_send_with(&super::client(), http::Method::GET, &url, None, &[]),
            )
            .await;
            if matches!(ok, Ok(Ok((200, _, _)))) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "tollgate did not come up:\n{}",
                s.log_text()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    pub fn chat_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1/chat/completions", self.port)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The child's process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL (`kill -9`): no shutdown path runs.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("SIGKILL");
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn term(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok(Some(st)) = c.try_wait() {
                    assert!(st.success(), "tollgate exited with {st}");
                    return;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    panic!("tollgate did not stop on SIGTERM");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
