//! The refusals built from errors of other modules keep their exact messages, codes,
//! statuses and reason classes: clients and SDKs match on them.

use super::*;
use std::sync::Arc;
use std::time::Duration;

fn rec() -> Record {
    let id: Arc<str> = Arc::from("req-1");
    Record::new(
        Arc::from("v1"),
        id.clone(),
        id,
        Arc::from("none"),
        Arc::from(""),
    )
}

/// (status, type, code, message) of a refusal, and the early record's reason and status.
fn seen(r: Refusal) -> (u16, &'static str, String, String, ReasonClass, u16) {
    let rec = r.record_early(rec());
    let (ty, code, _, message) = r.parts(&rec);
    (
        r.status(&rec).as_u16(),
        ty,
        code,
        message,
        rec.reason_class,
        rec.http_status,
    )
}

#[test]
fn body_errors_keep_their_messages_codes_and_statuses() {
    let bad = ReasonClass::BadRequest;
    assert_eq!(
        seen(BodyError::TooLarge { limit: 1024 }.into()),
        (
            413,
            "invalid_request_error",
            "request_too_large".into(),
            "request body is larger than the sidecar's limit of 1024 bytes".into(),
            bad,
            413
        )
    );
    assert_eq!(
        seen(BodyError::Timeout(Duration::from_secs(30)).into()),
        (
            400,
            "invalid_request_error",
            "body_timeout".into(),
            "the request body was not received within 30 s".into(),
            bad,
            400
        )
    );
    assert_eq!(
        seen(BodyError::Corrupt("invalid gzip header".into()).into()),
        (
            400,
            "invalid_request_error",
            "bad_content_encoding".into(),
            "the request body is not valid for its Content-Encoding: invalid gzip header".into(),
            bad,
            400
        )
    );
    assert_eq!(
        seen(BodyError::Encoding("br".into()).into()),
        (
            415,
            "invalid_request_error",
            "unsupported_content_encoding".into(),
            "request Content-Encoding `br` is not supported: send gzip, deflate or identity".into(),
            bad,
            415
        )
    );
}

#[test]
fn identity_errors_are_unauthenticated_or_bad_headers() {
    let (status, ty, code, message, reason, _) = seen(IdentityError::UnknownKey.into());
    assert_eq!(
        (status, ty, code.as_str()),
        (401, "authentication_error", "invalid_api_key")
    );
    assert_eq!(message, IdentityError::UnknownKey.message());
    assert_eq!(reason, ReasonClass::Unauthenticated);

    let (status, _, _, _, reason, _) = seen(IdentityError::MissingKey.into());
    assert_eq!((status, reason), (401, ReasonClass::Unauthenticated));

    let e = IdentityError::BadHeader("job header");
    let (status, ty, code, message, reason, _) = seen(e.clone().into());
    assert_eq!(
        (status, ty, code.as_str()),
        (400, "invalid_request_error", "invalid_header")
    );
    assert_eq!(message, e.message());
    assert_eq!(reason, ReasonClass::BadRequest);
}

#[test]
fn bodies_that_do_not_parse_or_estimate_are_bad_requests() {
    let e = serde_json::from_slice::<serde_json::Value>(b"{").unwrap_err();
    let (status, _, code, message, _, _) = seen(Refusal::not_json_object(&e));
    assert_eq!((status, code.as_str()), (400, "invalid_json"));
    assert_eq!(
        message,
        format!("the request body is not a JSON object: {e}")
    );

    let e = EstimateError::missing("input");
    let r = Refusal::from(e.clone());
    let rec = rec();
    let (_, code, param, message) = r.parts(&rec);
    assert_eq!(code, e.code());
    assert_eq!(param.as_deref(), Some("input"));
    assert_eq!(message, e.to_string());
}

#[test]
fn an_early_record_is_a_hard_stop_naming_the_refusal() {
    let rec = Refusal::UnknownModel("gpt-x".into()).record_early(rec());
    assert_eq!(rec.final_action, FinalAction::HardStop);
    assert_eq!(rec.http_status, 404);
    assert_eq!(rec.reason_class, ReasonClass::BadRequest);
    assert_eq!(rec.error.as_deref(), Some("UnknownModel(\"gpt-x\")"));
}
