//! The real upstream: pooled keep-alive hyper clients (rustls, HTTP/2 by ALPN), per-backend
//! timeouts, the request rewritten for the chosen chain entry, and the answer classified into
//! what the governor understands. The upstream URL comes only from the policy.

use super::respond::is_hop_by_hop;
use super::retry_after;
use super::snapshot::Snapshot;
use crate::estimate::Endpoint;
use crate::governor::{CallResult, CallSpec, Failure, FailureClass, Upstream};
use crate::policy::Backend;
use bytes::Bytes;
use dashmap::DashMap;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;
use std::future::Future;
use std::time::{Duration, Instant};

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Largest upstream body the sidecar buffers (a buffered completion, an error body).
const MAX_UPSTREAM_BODY: usize = 64 * 1024 * 1024;
/// Largest error body read to find a retry delay.
const MAX_ERROR_BODY: usize = 256 * 1024;

/// Pooled clients, one per connect timeout (the connector carries it). Survives reloads.
#[derive(Default)]
pub struct Transport {
    clients: DashMap<u64, HttpClient>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("clients", &self.clients.len())
            .finish()
    }
}

impl Transport {
    pub fn new() -> Self {
        Self::default()
    }

    fn client(&self, connect: Duration) -> HttpClient {
        let key = connect.as_millis() as u64;
        if let Some(c) = self.clients.get(&key) {
            return c.clone();
        }
        self.clients
            .entry(key)
            .or_insert_with(|| {
                let mut http = HttpConnector::new();
                http.enforce_http(false);
                http.set_nodelay(true);
                http.set_connect_timeout(Some(connect));
                http.set_keepalive(Some(Duration::from_secs(60)));
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_webpki_roots()
                    .https_or_http()
                    .enable_http1()
                    .enable_http2()
                    .wrap_connector(http);
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(90))
                    .pool_max_idle_per_host(256)
                    .build(https)
            })
            .clone()
    }
}

/// An upstream answer the governor accepted or passed through.
#[derive(Debug)]
pub struct UpstreamResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: UpBody,
    /// When the total timeout runs out.
    pub deadline: Instant,
}

#[derive(Debug)]
pub enum UpBody {
    Buffered(Bytes),
    Stream(Incoming),
}

/// One request's view of the transport: what to send for each attempt.
pub struct Call<'a> {
    pub transport: &'a Transport,
    pub snap: &'a Snapshot,
    pub endpoint: Endpoint,
    pub body: &'a serde_json::Map<String, Value>,
    pub client_headers: &'a HeaderMap,
    pub stream: bool,
    /// Ask the upstream for the usage chunk (the client did not).
    pub add_include_usage: bool,
}

/// The client's body with this attempt's model, output cap and stream options, serialized
/// without copying the (possibly large) rest of it.
struct Rewritten<'a> {
    body: &'a serde_json::Map<String, Value>,
    model: &'a str,
    cap: Option<(&'static str, u64)>,
    include_usage: bool,
}

impl Serialize for Rewritten<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        let cap_key = self.cap.map(|(k, _)| k);
        for (k, v) in self.body {
            match k.as_str() {
                "model" => continue,
                "max_tokens" | "max_completion_tokens" if cap_key.is_some() => continue,
                "stream_options" if self.include_usage => continue,
                _ => m.serialize_entry(k, v)?,
            }
        }
        m.serialize_entry("model", self.model)?;
        if let Some((k, v)) = self.cap {
            m.serialize_entry(k, &v)?;
        }
        if self.include_usage {
            let mut opts = self
                .body
                .get("stream_options")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            opts.insert("include_usage".into(), Value::Bool(true));
            m.serialize_entry("stream_options", &opts)?;
        }
        m.end()
    }
}

fn path_of(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Chat => "/chat/completions",
        Endpoint::Completions => "/completions",
        Endpoint::Embeddings => "/embeddings",
    }
}

/// Client headers that never go upstream: hop-by-hop, credentials, our own.
fn forwardable(name: &http::HeaderName) -> bool {
    let n = name.as_str();
    !(is_hop_by_hop(name)
        || matches!(
            n,
            "authorization"
                | "api-key"
                | "x-api-key"
                | "x-goog-api-key"
                | "cookie"
                | "accept-encoding"
        )
        || n.starts_with("x-tollgate-")
        || n == "content-type")
}

fn failure(
    class: FailureClass,
    status: Option<u16>,
    retry_after_ms: Option<i64>,
) -> CallResult<UpstreamResponse> {
    CallResult::Failed(Failure {
        class,
        status,
        retry_after_ms,
    })
}

impl Call<'_> {
    fn build(
        &self,
        spec: &CallSpec<'_>,
        backend: &Backend,
    ) -> Result<Request<Full<Bytes>>, String> {
        let cap = match self.endpoint {
            Endpoint::Embeddings => None,
            // Keep the client's spelling; send the cap even when the client set none, so the
            // reserved worst case is a bound the provider enforces.
            Endpoint::Chat if self.body.contains_key("max_completion_tokens") => {
                Some(("max_completion_tokens", spec.max_output_tokens))
            }
            _ => Some(("max_tokens", spec.max_output_tokens)),
        };
        let body = serde_json::to_vec(&Rewritten {
            body: self.body,
            model: spec.model,
            cap,
            include_usage: self.add_include_usage,
        })
        .map_err(|e| e.to_string())?;
        let url = format!("{}{}", backend.base_url, path_of(self.endpoint));
        let mut req = Request::builder().method(Method::POST).uri(url);
        let h = req.headers_mut().ok_or("bad request builder")?;
        for (k, v) in self.client_headers {
            if forwardable(k) {
                h.append(k.clone(), v.clone());
            }
        }
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(auth) = &self.snap.bearer[spec.backend_index] {
            h.insert(http::header::AUTHORIZATION, auth.clone());
        }
        req.body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())
    }

    async fn attempt(&self, spec: CallSpec<'_>) -> CallResult<UpstreamResponse> {
        let backend = spec.backend;
        let t = &backend.timeouts;
        let start = Instant::now();
        let deadline = start + t.total;
        let req = match self.build(&spec, backend) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(backend = %backend.id, error = %e, "cannot build upstream request");
                return failure(FailureClass::Connect, None, None);
            }
        };
        let client = self.transport.client(t.connect);
        let first_byte = t.first_byte.min(t.total);
        let resp = match tokio::time::timeout(first_byte, client.request(req)).await {
            Err(_) => return failure(FailureClass::Timeout, None, None),
            Ok(Err(e)) if e.is_connect() => return failure(FailureClass::Connect, None, None),
            Ok(Err(_)) => return failure(FailureClass::Connect, None, None),
            Ok(Ok(r)) => r,
        };
        let (parts, incoming) = resp.into_parts();
        let status = parts.status;
        let now_ms = jiff::Timestamp::now().as_millisecond();
        let header_delay = retry_after::from_headers(&parts.headers, now_ms);
        let class = match status.as_u16() {
            200..=299 => None,
            429 => Some(FailureClass::Throttled),
            401 | 403 => Some(FailureClass::Auth),
            408 | 500..=599 => Some(FailureClass::Server),
            _ => {
                // A client error: read it whole and pass it through unchanged.
                return match read_body(incoming, deadline, MAX_UPSTREAM_BODY).await {
                    Ok(b) => CallResult::NotRetryable {
                        payload: UpstreamResponse {
                            status,
                            headers: parts.headers,
                            body: UpBody::Buffered(b),
                            deadline,
                        },
                        status: status.as_u16(),
                    },
                    Err(class) => failure(class, Some(status.as_u16()), None),
                };
            }
        };
        if let Some(class) = class {
            // Gemini puts the delay in the body (RetryInfo), not in a header.
            let body_delay = match read_body(incoming, deadline, MAX_ERROR_BODY).await {
                Ok(b) => retry_after::from_gemini_body(&b),
                Err(_) => None,
            };
            return failure(class, Some(status.as_u16()), header_delay.or(body_delay));
        }
        if self.stream {
            return CallResult::Served(UpstreamResponse {
                status,
                headers: parts.headers,
                body: UpBody::Stream(incoming),
                deadline,
            });
        }
        match read_body(incoming, deadline, MAX_UPSTREAM_BODY).await {
            Ok(b) => CallResult::Served(UpstreamResponse {
                status,
                headers: parts.headers,
                body: UpBody::Buffered(b),
                deadline,
            }),
            // Headers came but the body broke: nothing reached the client, so fail over.
            Err(class) => failure(class, Some(status.as_u16()), None),
        }
    }
}

async fn read_body(body: Incoming, deadline: Instant, limit: usize) -> Result<Bytes, FailureClass> {
    let left = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, Limited::new(body, limit).collect()).await {
        Err(_) => Err(FailureClass::Timeout),
        Ok(Err(_)) => Err(FailureClass::Server),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

impl Upstream for Call<'_> {
    type Payload = UpstreamResponse;

    fn eligible(&self, index: usize, _backend: &Backend) -> bool {
        self.snap.eligible(index)
    }

    fn call(
        &self,
        spec: CallSpec<'_>,
    ) -> impl Future<Output = CallResult<UpstreamResponse>> + Send {
        self.attempt(spec)
    }
}
