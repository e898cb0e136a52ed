//! Shared helpers for integration tests: a mock OpenAI upstream (`mock`) and a tiny plain-HTTP
//! client. Each test binary uses a subset, hence the blanket `dead_code` allow.
#![allow(dead_code)]

pub mod cuttable;
pub mod mock;
pub mod native;
pub mod process;
pub mod redis_keys;
pub mod sidecar;

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Every helper request gives up (panics / returns Err) after this long.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A fresh plain-HTTP hyper-util legacy client (keep-alive pool of its own).
pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn build_request(
    method: Method,
    url: &str,
    body: Option<&serde_json::Value>,
    headers: &[(&str, &str)],
) -> Request<Full<Bytes>> {
    let bytes = body.map(|v| Bytes::from(serde_json::to_vec(v).unwrap()));
    build_raw(method, url, bytes, headers)
}

/// A request with raw body bytes; `content-type: application/json` unless a header says otherwise.
fn build_raw(
    method: Method,
    url: &str,
    body: Option<Bytes>,
    headers: &[(&str, &str)],
) -> Request<Full<Bytes>> {
    let mut b = Request::builder().method(method).uri(url);
    let has_ct = headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("content-type"));
    if body.is_some() && !has_ct {
        b = b.header("content-type", "application/json");
    }
    for (n, v) in headers {
        b = b.header(*n, *v);
    }
    b.body(Full::new(body.unwrap_or_default()))
        .expect("valid request")
}

/// Send a request with `client`; Err(description) on any transport/body error or timeout.
pub async fn try_send_with(
    client: &HttpClient,
    method: Method,
    url: &str,
    body: Option<&serde_json::Value>,
    headers: &[(&str, &str)],
) -> Result<(u16, HeaderMap, Bytes), String> {
    send(client, build_request(method, url, body, headers), url).await
}

/// POST arbitrary bytes (invalid JSON, huge bodies); Err on a transport error or timeout.
pub async fn try_post_raw(
    url: &str,
    body: Bytes,
    headers: &[(&str, &str)],
) -> Result<(u16, HeaderMap, Bytes), String> {
    send(
        &client(),
        build_raw(Method::POST, url, Some(body), headers),
        url,
    )
    .await
}

async fn send(
    client: &HttpClient,
    req: Request<Full<Bytes>>,
    url: &str,
) -> Result<(u16, HeaderMap, Bytes), String> {
    let fut = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("request error: {e:?}"))?;
        let (parts, body) = resp.into_parts();
        let bytes = body
            .collect()
            .await
            .map_err(|e| format!("body error: {e:?}"))?
            .to_bytes();
        Ok((parts.status.as_u16(), parts.headers, bytes))
    };
    match tokio::time::timeout(CLIENT_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!("timed out after {CLIENT_TIMEOUT:?}: {url}")),
    }
}

/// POST `body` as JSON; Err on a transport error (e.g. connection reset).
pub async fn try_post_json(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Result<(u16, HeaderMap, Bytes), String> {
    try_send_with(&client(), Method::POST, url, Some(body), headers).await
}

/// POST `body` as JSON (content-type application/json unless given); panics on transport error.
pub async fn post_json(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, HeaderMap, Bytes) {
    try_post_json(url, body, headers)
        .await
        .unwrap_or_else(|e| panic!("POST {url} failed: {e}"))
}

/// GET `url`; panics on transport error.
pub async fn get(url: &str) -> (u16, HeaderMap, Bytes) {
    try_send_with(&client(), Method::GET, url, None, &[])
        .await
        .unwrap_or_else(|e| panic!("GET {url} failed: {e}"))
}

/// GET `url` with headers; panics on transport error.
pub async fn get_with(url: &str, headers: &[(&str, &str)]) -> (u16, HeaderMap, Bytes) {
    try_send_with(&client(), Method::GET, url, None, headers)
        .await
        .unwrap_or_else(|e| panic!("GET {url} failed: {e}"))
}

/// Parse JSON or panic showing the text.
pub fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(b)))
}

/// A response read frame by frame, each stamped with the time since the request was sent.
#[derive(Debug)]
pub struct Streamed {
    pub status: u16,
    pub headers: HeaderMap,
    /// Data frames as they arrived.
    pub frames: Vec<(Duration, Bytes)>,
    /// Set when the body ended with an error (e.g. an interrupted stream).
    pub error: Option<String>,
}

impl Streamed {
    /// All frames concatenated.
    pub fn body(&self) -> Bytes {
        let mut b = BytesMut::new();
        for (_, f) in &self.frames {
            b.extend_from_slice(f);
        }
        b.freeze()
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body()).into_owned()
    }
    /// The `data:` payloads of the SSE body, in order (including "[DONE]").
    pub fn sse_data(&self) -> Vec<String> {
        sse_data_lines(&self.text())
    }
}

/// The `data:` payloads of an SSE text, in order.
pub fn sse_data_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d).to_string())
        .collect()
}

/// POST JSON and read the response body frame by frame with arrival times. Panics on a
/// request (head) error; body errors land in `Streamed::error`.
pub async fn post_json_frames(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Streamed {
    let req = build_request(Method::POST, url, Some(body), headers);
    let start = Instant::now();
    let fut = async {
        let resp = client()
            .request(req)
            .await
            .unwrap_or_else(|e| panic!("POST {url} failed: {e:?}"));
        let (parts, mut body) = resp.into_parts();
        let mut frames = Vec::new();
        let mut error = None;
        loop {
            match body.frame().await {
                None => break,
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        frames.push((start.elapsed(), d));
                    }
                }
                Some(Err(e)) => {
                    error = Some(format!("{e:?}"));
                    break;
                }
            }
        }
        Streamed {
            status: parts.status.as_u16(),
            headers: parts.headers,
            frames,
            error,
        }
    };
    tokio::time::timeout(CLIENT_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| panic!("POST {url} timed out after {CLIENT_TIMEOUT:?}"))
}
