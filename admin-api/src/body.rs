//! The request bodies of the admin API: one JSON object, nothing else.
//!
//! axum's `Json` extractor deserializes a struct from a JSON array too (by
//! position: `[]` or `[null, true]` would be a failover request), so every
//! mutating endpoint reads its body with [`ObjectJson`] instead: the
//! content type must be JSON, the body within the size limit, its first
//! token `{`, and it must deserialize into the endpoint's type from those
//! same bytes (so unknown fields, duplicate keys and wrong types are
//! refused by the type's own rules). A refused body is a 4xx with a JSON
//! error naming the problem, and changes nothing.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use crate::models::ApiError;

/// A request body that is one JSON object of type `T`.
#[derive(Debug)]
pub struct ObjectJson<T>(pub T);

impl<T, S> FromRequest<S> for ObjectJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "the body must be JSON: send Content-Type: application/json",
            ));
        }
        let _ = state;
        let bytes = read_limited(req).await?;
        parse(&bytes).map(ObjectJson)
    }
}

/// The most of an oversized body read (and dropped) before answering 413,
/// so that a client still sending it reads the answer instead of a reset
/// connection; a body larger still gets the connection closed under it.
pub const MAX_DRAINED_BYTES: usize = 64 << 20;

/// Reads the body, up to [`crate::MAX_BODY_BYTES`]; over it, drains the
/// rest (up to [`MAX_DRAINED_BYTES`]) and refuses with 413.
async fn read_limited(req: Request) -> Result<Bytes, ApiError> {
    use futures::StreamExt;
    let mut body = req.into_body().into_data_stream();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = body.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", format!("reading the body: {e}")))?;
        seen += chunk.len();
        if seen <= crate::MAX_BODY_BYTES {
            kept.extend_from_slice(&chunk);
        } else if seen > MAX_DRAINED_BYTES {
            break;
        }
    }
    if seen > crate::MAX_BODY_BYTES {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!(
                "the request body ({seen} bytes or more) is over the {} KiB limit of admin requests",
                crate::MAX_BODY_BYTES >> 10
            ),
        ));
    }
    Ok(Bytes::from(kept))
}

/// Parses `bytes` as one JSON object of type `T`.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bad = |what: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", what);
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        Some(_) => {
            return Err(bad("the body must be a JSON object ({...}), not an array, string, number or null".into()));
        }
        None => return Err(bad("the body is empty: send a JSON object ({} for the defaults)".into())),
    }
    let mut json = serde_json::Deserializer::from_slice(bytes);
    let request = serde_path_to_error::deserialize(&mut json).map_err(|e| match e.path().to_string() {
        path if path == "." => bad(format!("the body is not a valid request: {}", e.inner())),
        path => bad(format!("the body is not a valid request: {path}: {}", e.inner())),
    })?;
    json.end().map_err(|e| bad(format!("the body holds more than one JSON value: {e}")))?;
    Ok(request)
}

fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else { return false };
    let essence = value.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use walship_shipping::control::FailoverRequest;
    use walship_shipping::control::drills::CatchupDrillRequest;

    #[test]
    fn only_an_object_with_known_fields_and_no_duplicates_is_a_request() {
        assert_eq!(parse::<FailoverRequest>(b" {} ").unwrap(), FailoverRequest::default());
        assert!(parse::<FailoverRequest>(br#"{"allow_loss": true}"#).unwrap().allow_loss);
        for body in [
            &b"[]"[..],
            b"[null, true]",
            b"[1]",
            b"null",
            b"true",
            b"1",
            b"\"x\"",
            b"",
            b"   ",
            br#"{"allow_loss": true, "allow_loss": false}"#,
            br#"{"bogus": 1}"#,
            br#"{"allow_loss": "yes"}"#,
            b"{",
            br#"{} []"#,
        ] {
            let err = parse::<FailoverRequest>(body).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{:?}", String::from_utf8_lossy(body));
            assert_eq!(err.body.error.code, "bad_request");
        }
        let err = parse::<CatchupDrillRequest>(b"[1]").unwrap_err();
        assert!(err.body.error.message.contains("must be a JSON object"), "{:?}", err.body);
    }

    #[test]
    fn json_content_types() {
        let with = |value: &str| {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, value.parse().unwrap());
            is_json(&headers)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/problem+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/x-www-form-urlencoded"));
        assert!(!is_json(&axum::http::HeaderMap::new()));
    }
}

/// The one path parameter of a route (`/v1/shards/{id}`, `/v1/tasks/{id}`),
/// as a string; a segment that does not percent-decode to UTF-8 (`%FF`) is
/// refused with the API's JSON error, not axum's plain-text one.
#[derive(Debug)]
pub struct PathId(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(id)) => Ok(PathId(id)),
            Err(rejection) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_path",
                format!("the path's id is not valid: {}", rejection.body_text()),
            )),
        }
    }
}
