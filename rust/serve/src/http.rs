//! The HTTP side: routing, bounded body reads, responses.
//!
//! Native routes, answered without Python: `GET /v2/health/live`,
//! `GET /v2/health/ready`, `GET /v2/models/{m}[/versions/{v}]/ready` and
//! `POST /v2/models/{m}[/versions/{v}]/infer` (the hot path; a gzip or
//! deflate body is inflated here within `max_decompressed_size`, and the
//! response coded when `Accept-Encoding` asks for it: see
//! [`crate::encoding`]; other codings go to the fallback, which refuses
//! them). Everything else (metadata, config, statistics, `/metrics`, unknown
//! models and routes) goes to the [`Fallback`], the Python front-end's
//! handlers, on a blocking thread: one implementation of the rarely-called
//! surface for both front-ends.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{
    HeaderValue, ACCEPT_ENCODING, CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, VARY,
};
use hyper::{Method, Request, Response, StatusCode};

use ferrobatch_core::v2::write_json_string;

use crate::encoding::{self, Coding};
use crate::model::ServedModel;
use crate::replies::{Answer, Failure, Reply};
use crate::server::Shared;

pub const HEADER_LENGTH: &str = "inference-header-content-length";
const JSON: &str = "application/json";
const BINARY: &str = "application/octet-stream";

/// A request the native routes do not answer, for the Python handlers.
#[derive(Debug, Clone)]
pub struct FallbackRequest {
    pub method: String,
    /// The path and query, as sent.
    pub path: String,
    /// Headers the handlers read, lower-case names.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

/// The Python handlers' answer.
#[derive(Debug, Clone)]
pub struct FallbackResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A gRPC call the native handlers leave to Python: the RPC's name
/// (`"ModelConfig"`) and the request message, protobuf-encoded.
#[derive(Debug, Clone)]
pub struct FallbackCall {
    pub method: &'static str,
    pub request: Vec<u8>,
}

/// The answer to a [`FallbackCall`]: the response message, protobuf-encoded,
/// or the call's gRPC status code and message.
pub type FallbackReply = Result<Vec<u8>, (i32, String)>;

/// Answers what the native routes do not (blocking: called on a blocking thread).
pub trait Fallback: Send + Sync + 'static {
    fn call(&self, request: FallbackRequest) -> FallbackResponse;

    /// Answers a gRPC call that is not answered natively (the rare ones whose
    /// answer changes while serving, such as statistics). By default:
    /// UNIMPLEMENTED.
    fn call_grpc(&self, call: FallbackCall) -> FallbackReply {
        Err((
            tonic::Code::Unimplemented as i32,
            format!("{} is not implemented", call.method),
        ))
    }
}

type Body = Full<Bytes>;

fn response(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(value) = HeaderValue::from_str(content_type) {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
    response
}

fn empty(status: u16) -> Response<Body> {
    response(status, "text/plain", Bytes::new())
}

/// `{"error": message}` with `status`, as Triton answers.
fn error(failure: &Failure) -> Response<Body> {
    let mut body = b"{\"error\":".to_vec();
    write_json_string(&mut body, &failure.message);
    body.push(b'}');
    response(failure.status, JSON, body)
}

fn reply(reply: Reply) -> Response<Body> {
    match reply {
        Ok(Answer::Encoded(encoded)) => match encoded.header_length {
            None => response(200, JSON, encoded.body),
            Some(length) => {
                let mut r = response(200, BINARY, encoded.body);
                r.headers_mut()
                    .insert(HEADER_LENGTH, HeaderValue::from(length));
                r
            }
        },
        Ok(Answer::Raw(_)) => error(&Failure::new(500, "a gRPC reply to an HTTP request")),
        Err(failure) => error(&failure),
    }
}

/// What a path names: `/v2/models/{m}[/versions/{v}]/{what}`.
fn model_route(path: &str) -> Option<(&str, &str, &str)> {
    let rest = path.strip_prefix("/v2/models/")?;
    let mut parts = rest.split('/');
    let name = parts.next()?;
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(what), None, _, _) => Some((name, "", what)),
        (Some("versions"), Some(version), Some(what), None) => Some((name, version, what)),
        _ => None,
    }
}

pub(crate) async fn handle(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let mut answer = route(&shared, request).await;
    if shared.draining.load(Ordering::Relaxed) {
        // Draining: clients should reconnect elsewhere.
        answer
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    Ok(answer)
}

async fn route(shared: &Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path();
    let method = request.method();
    if method == Method::GET {
        match path {
            "/v2/health/live" => return empty(200),
            "/v2/health/ready" => return empty(if shared.is_ready() { 200 } else { 503 }),
            _ => {}
        }
        if let Some((name, version, "ready")) = model_route(path) {
            if shared.model(name, version).is_some() {
                return empty(if shared.is_ready() { 200 } else { 503 });
            }
        }
    }
    if method == Method::POST {
        if let Some((name, version, "infer")) = model_route(path) {
            let coding = encoding::content_coding(request.headers().get(CONTENT_ENCODING));
            if let (Some(model), Ok(coding)) = (shared.model(name, version), coding) {
                return infer(shared, &model, coding, request).await;
            }
        }
    }
    fallback(shared, request).await
}

/// The body, read within the size limit and the body timeout; or the
/// response refusing it (413 with `Connection: close`: the rest is unread).
async fn read_body(
    shared: &Shared,
    request: Request<Incoming>,
) -> Result<(hyper::http::request::Parts, Bytes), Response<Body>> {
    let limit = shared.config.max_body_size;
    let too_large = |size: Option<u64>| {
        let told = size.map(|s| format!("of {s} bytes ")).unwrap_or_default();
        let failure = Failure::new(
            413,
            format!("request body {told}is over the limit of {limit} bytes"),
        );
        let mut r = error(&failure);
        r.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        r
    };
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(declared));
    }
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        shared.config.body_timeout,
        Limited::new(body, limit).collect(),
    )
    .await;
    match read {
        Ok(Ok(collected)) => Ok((parts, collected.to_bytes())),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large(None))
        }
        Ok(Err(_)) => Err(error(&Failure::new(
            400,
            "the request body could not be read",
        ))),
        Err(_) => {
            let mut r = error(&Failure::new(
                408,
                "the request body did not arrive in time",
            ));
            r.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            Err(r)
        }
    }
}

/// Coded bodies at most this large are inflated or compressed on the
/// runtime's thread; larger ones on a blocking thread.
const INLINE_CODING: usize = 16 << 10;

/// Runs `work` on a blocking thread when `size` is over [`INLINE_CODING`].
async fn off_runtime<T: Send + 'static>(
    size: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if size <= INLINE_CODING {
        return Some(work());
    }
    tokio::task::spawn_blocking(work).await.ok()
}

async fn infer(
    shared: &Shared,
    model: &ServedModel,
    coding: Option<Coding>,
    request: Request<Incoming>,
) -> Response<Body> {
    let respond_coded = encoding::accepted(request.headers().get(ACCEPT_ENCODING));
    let (parts, mut body) = match read_body(shared, request).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    if let Some(coding) = coding {
        let limit = shared.config.max_decompressed_size;
        let coded = body.clone();
        let inflated = off_runtime(coded.len(), move || {
            encoding::inflate(&coded, coding, limit)
        })
        .await;
        body = match inflated {
            Some(Ok(inflated)) => Bytes::from(inflated),
            Some(Err(failure)) => return error(&failure),
            None => return error(&Failure::new(500, "internal error inflating the request")),
        };
    }
    let header_length = parts
        .headers
        .get(HEADER_LENGTH)
        .and_then(|v| v.to_str().ok());
    let forwarded = forwarded_headers(
        &parts.headers,
        shared.config.http_header_forward_pattern.as_ref(),
    );
    let answer = match model.submit(body, header_length, &forwarded) {
        Ok(submitted) => reply(model.reply(submitted).await),
        Err(failure) => return error(&failure),
    };
    match respond_coded {
        Some(coding) if answer.status() == StatusCode::OK => compressed(answer, coding).await,
        _ => answer,
    }
}

/// The headers whose names `pattern` matches, lowercased, with values that
/// are text (Triton's `--http-header-forward-pattern`).
fn forwarded_headers(
    headers: &hyper::HeaderMap,
    pattern: Option<&regex::Regex>,
) -> Vec<(String, String)> {
    let Some(pattern) = pattern else {
        return Vec::new();
    };
    headers
        .iter()
        .filter(|(name, _)| pattern.is_match(name.as_str()))
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .collect()
}

/// `answer` with its body coded as `coding` (its headers, the inference
/// header's length included, as they were: that length counts the
/// uncoded JSON, as Triton sends it).
async fn compressed(answer: Response<Body>, coding: Coding) -> Response<Body> {
    let (mut parts, body) = answer.into_parts();
    let plain = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let input = plain.clone();
    let coded = off_runtime(plain.len(), move || encoding::compress(&input, coding)).await;
    let body = match coded.flatten() {
        Some(coded) => {
            parts
                .headers
                .insert(CONTENT_ENCODING, HeaderValue::from_static(coding.name()));
            Bytes::from(coded)
        }
        None => plain,
    };
    parts
        .headers
        .insert(VARY, HeaderValue::from_static("accept-encoding"));
    Response::from_parts(parts, Full::new(body))
}

async fn fallback(shared: &Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let (parts, body) = match read_body(shared, request).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let headers = parts
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect();
    let forwarded = FallbackRequest {
        method: parts.method.as_str().to_owned(),
        path: parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
        headers,
        body,
    };
    let handler = shared.fallback.clone();
    match tokio::task::spawn_blocking(move || handler.call(forwarded)).await {
        Ok(answer) => {
            let mut r = Response::new(Full::new(Bytes::from(answer.body)));
            *r.status_mut() =
                StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            for (name, value) in answer.headers {
                if let (Ok(name), Ok(value)) = (
                    hyper::header::HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_str(&value),
                ) {
                    r.headers_mut().insert(name, value);
                }
            }
            r
        }
        Err(_) => error(&Failure::new(500, "internal error answering the request")),
    }
}
