//! The admin port: liveness and readiness. (Metrics, status and reload grow here.)

use super::handler::App;
use super::respond::{full, Body};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use std::convert::Infallible;
use std::sync::Arc;

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    r
}

pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => {
            // A policy is loaded by construction; the in-memory state always answers.
            let _ = app.snap.load();
            text(StatusCode::OK, "ready\n")
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    })
}
