//! The HTTP side: routing, bounded body reads, responses.
//!
//! Native routes, answered without Python: `GET /v2/health/live`,
//! `GET /v2/health/ready`, `GET /v2/models/{m}[/versions/{v}]/ready`,
//! Triton's `.../generate` and `.../generate_stream` (see `generate`), and
//! `POST /v2/models/{m}[/versions/{v}]/infer` (the hot path; a gzip or
//! deflate body is inflated here within `max_decompressed_size`, and the
//! response coded when `Accept-Encoding` asks for it: see
//! [`crate::encoding`]; other codings go to the fallback, which refuses
//! them). Everything else (metadata, config, statistics, `/metrics`, unknown
//! models and routes) goes to the [`Fallback`], the Python front-end's
//! handlers: one implementation of the rarely-called surface for both
//! front-ends. A blocking thread only starts that call (`ask`); its answer
//! is awaited without one, and a client that goes away withdraws it.
//!
//! A request to a restricted API (`--http-restricted-api`,
//! [`crate::restrict`]) without its header is answered 403 before anything
//! else is done with it, on every route and on a connection beyond
//! `max_connections` alike.

use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::{
    HeaderName, HeaderValue, ACCEPT_ENCODING, CONNECTION, CONTENT_ENCODING, CONTENT_TYPE, VARY,
};
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::oneshot;

use ferrobatch_core::v2::{write_json_string, Clipped};

use crate::encoding::{self, Coding};
use crate::model::ServedModel;
use crate::replies::{Answer, Failure, Reply};
use crate::restrict;
use crate::server::Shared;

mod generate;

pub const HEADER_LENGTH: &str = "inference-header-content-length";
/// [`HEADER_LENGTH`] as a header name: a static one is looked up in a
/// request and inserted in a response without parsing or allocating (a
/// `&str` name not among HTTP's standard headers is parsed each time, and
/// copied into a new buffer per response).
static HEADER_LENGTH_NAME: HeaderName = HeaderName::from_static(HEADER_LENGTH);
const JSON: &str = "application/json";
const BINARY: &str = "application/octet-stream";

/// Numbers below this are sent as a header value borrowed from [`NUMBERS`].
const SPELLED: usize = 10_000;
const NUMBERS_LEN: usize = {
    let (at, width) = spelled_at(SPELLED - 1);
    at + width
};
/// 0, 1, ..., 9999 written one after another, at compile time: a reply's
/// `Inference-Header-Content-Length` (a JSON header's length, rarely above a
/// few hundred bytes) is a slice of it, a value made with no allocation,
/// whose clones and drop touch no counter.
static NUMBERS: [u8; NUMBERS_LEN] = spell_numbers();

/// Where `n` (below [`SPELLED`]) lies in [`NUMBERS`]: its first byte and
/// its number of digits.
const fn spelled_at(n: usize) -> (usize, usize) {
    if n < 10 {
        (n, 1)
    } else if n < 100 {
        (10 + (n - 10) * 2, 2)
    } else if n < 1000 {
        (190 + (n - 100) * 3, 3)
    } else {
        (2890 + (n - 1000) * 4, 4)
    }
}

const fn spell_numbers() -> [u8; NUMBERS_LEN] {
    let mut out = [0u8; NUMBERS_LEN];
    let mut n = 0;
    while n < SPELLED {
        let (at, mut i) = spelled_at(n);
        let mut rest = n;
        while i > 0 {
            i -= 1;
            out[at + i] = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        n += 1;
    }
    out
}

/// `n` in decimal, as a header value.
fn number_value(n: usize) -> Option<HeaderValue> {
    if n >= SPELLED {
        // One copy of the digits: `From<usize>` allocates twice (a
        // buffer, then its freeze). Digits are a valid value.
        return HeaderValue::from_str(itoa::Buffer::new().format(n)).ok();
    }
    let (start, width) = spelled_at(n);
    let digits = NUMBERS.get(start..start.checked_add(width)?)?;
    HeaderValue::from_maybe_shared(Bytes::from_static(digits)).ok()
}

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

/// What withdraws a fallback call still in progress when its client goes
/// away (called on a blocking thread).
pub type Withdraw = Box<dyn FnOnce() + Send>;

/// Answers what the native routes do not. Each call starts the answer and
/// returns at once (it runs on a blocking thread, briefly): the answer is
/// sent to `answer` when ready (dropping it unsent answers "internal
/// error"), and the [`Withdraw`] returned, if any, stops it when the client
/// goes away first. No thread waits for the answer.
pub trait Fallback: Send + Sync + 'static {
    fn call(
        &self,
        request: FallbackRequest,
        answer: oneshot::Sender<FallbackResponse>,
    ) -> Option<Withdraw>;

    /// Answers a gRPC call that is not answered natively (the rare ones whose
    /// answer changes while serving, such as statistics). By default:
    /// UNIMPLEMENTED.
    fn call_grpc(
        &self,
        call: FallbackCall,
        answer: oneshot::Sender<FallbackReply>,
    ) -> Option<Withdraw> {
        let _ = answer.send(Err((
            tonic::Code::Unimplemented as i32,
            format!("{} is not implemented", call.method),
        )));
        None
    }
}

/// Where a fallback call stands, between the handler waiting for it and
/// the blocking thread starting it.
enum Asked {
    Starting,
    Started(Option<Withdraw>),
    /// The handler went away (its client did).
    Gone,
}

/// Withdraws a fallback call whose handler is dropped before its answer came.
struct WithdrawOnDrop {
    asked: Arc<Mutex<Asked>>,
    armed: bool,
}

impl Drop for WithdrawOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        if let Asked::Started(Some(withdraw)) = std::mem::replace(&mut *asked, Asked::Gone) {
            // Withdrawing takes the interpreter's lock: not on the runtime's thread.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                drop(runtime.spawn_blocking(withdraw));
            }
        }
    }
}

/// Asks the fallback: `start` (a [`Fallback`] method) runs on a blocking
/// thread, only to start the call; its answer is awaited here without
/// holding a thread. Dropping this future before the answer came (the
/// client went away) withdraws the call. `None`: no answer (the fallback
/// dropped it, or panicked).
pub(crate) async fn ask<T: Send + 'static>(
    start: impl FnOnce(oneshot::Sender<T>) -> Option<Withdraw> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = oneshot::channel();
    let asked = Arc::new(Mutex::new(Asked::Starting));
    let mut guard = WithdrawOnDrop {
        asked: asked.clone(),
        armed: true,
    };
    let started = tokio::task::spawn_blocking(move || {
        let withdraw = start(tx);
        let mut state = asked.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*state, Asked::Gone) {
            drop(state);
            if let Some(withdraw) = withdraw {
                withdraw(); // gone while it started
            }
        } else {
            *state = Asked::Started(withdraw);
        }
    })
    .await;
    if started.is_err() {
        guard.armed = false;
        return None;
    }
    let answer = rx.await.ok();
    guard.armed = false;
    answer
}

/// A response's body: whole (every answer but one), or a decoupled
/// model's `generate_stream`, one event per response as it comes.
pub(crate) enum Body {
    Whole(Full<Bytes>),
    Events(generate::Events),
}

impl Body {
    fn whole(bytes: impl Into<Bytes>) -> Body {
        Body::Whole(Full::new(bytes.into()))
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Whole(whole) => Pin::new(whole).poll_frame(cx),
            Body::Events(events) => events.poll_event(cx).map(|c| c.map(|c| Ok(Frame::data(c)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Whole(whole) => whole.is_end_stream(),
            Body::Events(events) => events.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Whole(whole) => whole.size_hint(),
            Body::Events(_) => SizeHint::default(),
        }
    }
}

fn response(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(Body::whole(body));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    // Static: no copy of it per response.
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
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
                if let Some(value) = number_value(length) {
                    r.headers_mut().insert(HEADER_LENGTH_NAME.clone(), value);
                }
                r
            }
        },
        Ok(Answer::Raw(_) | Answer::Message(_)) => {
            error(&Failure::new(500, "a gRPC reply to an HTTP request"))
        }
        Err(failure) => error(&failure),
    }
}

/// Whether `version` names the one version models are served as (or none).
fn version_known(version: &str) -> bool {
    version.is_empty() || version == ferrobatch_core::v2::MODEL_VERSION
}

/// What a path names: `/v2/models/{m}[/versions/{v}]/{what}`, `what`
/// without a slash.
pub(crate) fn model_route(path: &str) -> Option<(&str, &str, &str)> {
    let rest = path.strip_prefix("/v2/models/")?;
    let (name, rest) = rest.split_once('/')?;
    match rest.split_once('/') {
        None => Some((name, "", rest)),
        Some(("versions", rest)) => match rest.split_once('/')? {
            // `versions//infer` names no version: not the path without one.
            (version, what) if what.contains('/') || version.is_empty() => None,
            (version, what) => Some((name, version, what)),
        },
        Some(_) => None,
    }
}

/// The answer to one HTTP request. Routing is decided at once, before
/// anything is awaited, so that the future returned holds only what its
/// branch needs across awaits.
///
/// Why: a request's future is as large as its largest branch, and is moved
/// whole as it starts (into hyper's slot, and each awaited future into its
/// caller's). Built as nested `async fn`s taking the request, an inference's
/// future was 2.9 KB (the request's 264 bytes held at each level, the
/// fallback's and the body timer's states beside the inference's); it is
/// 0.8 KB now. The rare branches (the fallback, coded bodies, a body slow to
/// come) are boxed.
///
/// `pooled`: false for a connection beyond `max_connections` (the
/// [`HEADROOM`](crate::server::HEADROOM)), which gets [`probe`]'s answer.
/// `in_flight` is dropped when the answer is ready (a guard of the
/// connection's count; held here rather than by a wrapping future, which
/// would hold this one twice).
pub(crate) fn handle(
    shared: Arc<Shared>,
    pooled: bool,
    request: Request<Incoming>,
    in_flight: impl Send + 'static,
) -> impl Future<Output = Result<Response<Body>, Infallible>> + Send + 'static {
    let routed = if pooled {
        route(&shared, request)
    } else {
        Routed::Answered(Box::new(probe(&shared, &request)))
    };
    async move {
        let mut answer = match routed {
            Routed::Answered(answer) => *answer,
            Routed::Infer(inference) => inference.answer(&shared).await,
            Routed::Fallback(answering) => answering.await,
        };
        drop(in_flight);
        if shared.draining.load(Ordering::Relaxed) {
            // Draining: clients should reconnect elsewhere.
            answer
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        Ok(answer)
    }
}

/// The answer to a health check (`GET /v2/health/live` or `.../ready`).
fn health(shared: &Shared, method: &Method, path: &str) -> Option<Response<Body>> {
    match (method, path) {
        (&Method::GET, "/v2/health/live") => Some(empty(200)),
        (&Method::GET, "/v2/health/ready") => {
            Some(empty(if shared.server_ready() { 200 } else { 503 }))
        }
        _ => None,
    }
}

/// Answers a request of a connection beyond `max_connections` (the
/// [`HEADROOM`](crate::server::HEADROOM)): health checks only, 503 for the
/// rest; the connection closes after it.
fn probe(shared: &Shared, request: &Request<Incoming>) -> Response<Body> {
    let mut answer = restricted(shared, request)
        .or_else(|| health(shared, request.method(), request.uri().path()))
        .unwrap_or_else(|| {
            error(&Failure::new(
                503,
                "the server is at its connection limit (max_connections); \
                 only /v2/health/live and /v2/health/ready are answered on this connection",
            ))
        });
    answer
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    answer
}

/// Where a request goes.
enum Routed {
    /// Answered at once (health and readiness, a model not served, a
    /// restricted API without its header), boxed:
    /// a response (144 bytes) would make every inference's future larger.
    Answered(Box<Response<Body>>),
    Infer(Inference),
    Fallback(Pin<Box<dyn Future<Output = Response<Body>> + Send>>),
}

/// 403 to a request to a restricted API without its header and value
/// (Triton's `--http-restricted-api`; see [`crate::restrict`]).
#[inline]
fn restricted(shared: &Shared, request: &Request<Incoming>) -> Option<Response<Body>> {
    let path = request.uri().path();
    let refusal = (shared.config.http_restricted_api)
        .refused(|| restrict::http_api(path), request.headers())?;
    Some(error(&Failure::new(403, refusal)))
}

fn route(shared: &Arc<Shared>, request: Request<Incoming>) -> Routed {
    if let Some(refused) = restricted(shared, &request) {
        return Routed::Answered(Box::new(refused));
    }
    let path = request.uri().path();
    let method = request.method();
    if let Some(answer) = health(shared, method, path) {
        return Routed::Answered(Box::new(answer));
    }
    if method == Method::GET {
        if let Some((name, version, "ready")) = model_route(path) {
            if let Some(model) = shared.model(name, version) {
                let status = if shared.model_ready(&model) { 200 } else { 503 };
                return Routed::Answered(Box::new(empty(status)));
            }
        }
    }
    if method == Method::POST {
        let asks = match model_route(path) {
            Some((name, version, "infer")) => Some((name, version, Asks::Infer)),
            Some((name, version, "generate")) => Some((name, version, Asks::Generate)),
            Some((name, version, "generate_stream")) => Some((name, version, Asks::GenerateStream)),
            _ => None,
        };
        if let Some((name, version, asks)) = asks {
            let coding = encoding::content_coding(request.headers().get(CONTENT_ENCODING));
            match (shared.model(name, version), coding) {
                (Some(model), Ok(coding)) => {
                    // Two lengths, or two codings: which one the client meant is a guess.
                    let lengths = request.headers().get_all(&HEADER_LENGTH_NAME);
                    if lengths.iter().nth(1).is_some() {
                        let message = "Inference-Header-Content-Length is given more than once";
                        return Routed::Answered(Box::new(error(&Failure::new(400, message))));
                    }
                    let codings = request.headers().get_all(CONTENT_ENCODING);
                    if codings.iter().nth(1).is_some() {
                        let message = "Content-Encoding is given more than once";
                        return Routed::Answered(Box::new(error(&Failure::new(400, message))));
                    }
                    return Routed::Infer(Inference::new(shared, model, coding, asks, request));
                }
                // Known, not served (warming up, unloaded, or stopped):
                // nothing else answers inference.
                (None, _) if version_known(version) && shared.is_catalogued(name) => {
                    let message = no_available_versions(name);
                    return Routed::Answered(Box::new(error(&Failure::new(503, message))));
                }
                _ => {}
            }
        }
    }
    Routed::Fallback(Box::pin(fallback(shared.clone(), request)))
}

/// Triton's words for a request to a model it knows but serves no version
/// of now (warming up, unloaded, or stopped): 503, gRPC UNAVAILABLE.
pub(crate) fn no_available_versions(name: &str) -> String {
    format!(
        "Request for unknown model: '{}' has no available versions",
        Clipped(name)
    )
}

/// A body's declared length (`Content-Length`, as hyper read it).
fn declared_length(body: &Incoming) -> Option<u64> {
    hyper::body::Body::size_hint(body).exact()
}

/// 413 for a body over `limit` bytes, with `Connection: close` (the rest
/// is unread).
fn too_large(limit: usize, size: Option<u64>) -> Response<Body> {
    let told = size.map(|s| format!("of {s} bytes ")).unwrap_or_default();
    let failure = Failure::new(
        413,
        format!("request body {told}is over the limit of {limit} bytes"),
    );
    let mut r = error(&failure);
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The body, read within the size limit and the body timeout; or the
/// response refusing it.
async fn read_body(
    shared: &Shared,
    declared: Option<u64>,
    body: Incoming,
) -> Result<Bytes, Response<Body>> {
    let limit = shared.config.max_body_size;
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit, declared));
    }
    let mut reading = pin!(concatenated(Limited::new(body, limit)));
    // A small body usually came with its head: it is read without a timer
    // (setting one reads the clock and the runtime's handle).
    let read = match poll_fn(|cx| Poll::Ready(reading.as_mut().poll(cx))).await {
        Poll::Ready(read) => Ok(read),
        Poll::Pending => Box::pin(tokio::time::timeout(shared.config.body_timeout, reading)).await,
    };
    match read {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large(limit, None))
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

/// A body's data, whole: its one data frame as it came (no copy and no
/// allocation, the usual case), or its frames joined. Trailers are skipped.
pub(crate) async fn concatenated<B>(mut body: B) -> Result<Bytes, B::Error>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    let mut first: Option<Bytes> = None;
    let mut joined: Option<bytes::BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if let Some(joined) = joined.as_mut() {
            joined.extend_from_slice(&data);
        } else if let Some(before) = first.take() {
            let mut both = bytes::BytesMut::with_capacity(before.len().saturating_add(data.len()));
            both.extend_from_slice(&before);
            both.extend_from_slice(&data);
            joined = Some(both);
        } else {
            first = Some(data);
        }
    }
    Ok(joined.map_or_else(|| first.unwrap_or_default(), bytes::BytesMut::freeze))
}

/// Responses at most this large are compressed on the runtime's thread;
/// larger ones off it ([`Shared::offload`]). Request bodies are always
/// inflated off it: a small body may inflate to a large one.
const INLINE_CODING: usize = 16 << 10;

/// What an inference request asks for: `.../infer`, or Triton's generate
/// extension (`.../generate`, `.../generate_stream`: see [`generate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asks {
    Infer,
    Generate,
    GenerateStream,
}

/// An inference request with its headers read: what its answer needs of
/// it across awaits (the head's other parts are dropped at once).
struct Inference {
    model: Arc<ServedModel>,
    asks: Asks,
    /// The body's coding (`Content-Encoding`).
    coding: Option<Coding>,
    /// The coding to answer in (`Accept-Encoding`).
    respond_coded: Option<Coding>,
    declared: Option<u64>,
    header_length: Option<HeaderValue>,
    forwarded: Vec<(String, String)>,
    body: Incoming,
}

impl Inference {
    fn new(
        shared: &Shared,
        model: Arc<ServedModel>,
        coding: Option<Coding>,
        asks: Asks,
        request: Request<Incoming>,
    ) -> Inference {
        let (parts, body) = request.into_parts();
        let headers = &parts.headers;
        // A generate answer is never coded (nor is Triton's).
        let respond_coded = match asks {
            Asks::Infer => encoding::accepted(headers.get(ACCEPT_ENCODING)),
            Asks::Generate | Asks::GenerateStream => None,
        };
        Inference {
            model,
            asks,
            coding,
            respond_coded,
            declared: declared_length(&body),
            forwarded: forwarded_headers(
                headers,
                shared.config.http_header_forward_pattern.as_ref(),
            ),
            header_length: headers.get(&HEADER_LENGTH_NAME).cloned(),
            body,
        }
    }

    async fn answer(self, shared: &Shared) -> Response<Body> {
        let Inference {
            model,
            asks,
            coding,
            respond_coded,
            declared,
            header_length,
            forwarded,
            body,
        } = self;
        let mut body = match read_body(shared, declared, body).await {
            Ok(body) => body,
            Err(refused) => return refused,
        };
        if let Some(coding) = coding {
            let limit = shared.config.max_decompressed_size;
            let coded = body.clone();
            let inflated =
                Box::pin(shared.offload(move || encoding::inflate(&coded, coding, limit))).await;
            body = match inflated {
                Some(Ok(inflated)) => Bytes::from(inflated),
                Some(Err(failure)) => return error(&failure),
                None => return error(&Failure::new(500, "internal error inflating the request")),
            };
        }
        if asks != Asks::Infer {
            let stream = asks == Asks::GenerateStream;
            return Box::pin(generate::generate(
                shared, &model, stream, &body, &forwarded,
            ))
            .await;
        }
        // A value that is not text is refused as a bad length, not taken for none.
        let header_length = header_length
            .as_ref()
            .map(|v| String::from_utf8_lossy(v.as_bytes()));
        let answer = match model.submit(body, header_length.as_deref(), &forwarded) {
            Ok(submitted) => reply(model.reply(submitted).await),
            Err(failure) => return error(&failure),
        };
        match respond_coded {
            Some(coding) if answer.status() == StatusCode::OK => {
                Box::pin(compressed(shared, answer, coding)).await
            }
            _ => answer,
        }
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
async fn compressed(shared: &Shared, answer: Response<Body>, coding: Coding) -> Response<Body> {
    let (mut parts, body) = answer.into_parts();
    let plain = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let input = plain.clone();
    let coded = if plain.len() <= INLINE_CODING {
        Some(encoding::compress(&input, coding))
    } else {
        shared
            .offload(move || encoding::compress(&input, coding))
            .await
    };
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
    Response::from_parts(parts, Body::whole(body))
}

async fn fallback(shared: Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let body = match read_body(&shared, declared_length(&body), body).await {
        Ok(body) => body,
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
    match ask(move |answer| handler.call(forwarded, answer)).await {
        Some(answer) => {
            let mut r = Response::new(Body::whole(answer.body));
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
        None => error(&Failure::new(500, "internal error answering the request")),
    }
}

#[cfg(test)]
mod tests {
    use super::{model_route, number_value};

    #[test]
    fn header_lengths_are_spelled_in_decimal_below_and_above_the_table() {
        for n in (0..20_000).chain([usize::MAX]) {
            let value = number_value(n).expect("digits are a valid value");
            assert_eq!(value.to_str().unwrap(), n.to_string());
        }
    }

    #[test]
    fn model_paths_name_the_model_its_version_and_what_is_asked() {
        let cases = [
            ("/v2/models/m/infer", Some(("m", "", "infer"))),
            ("/v2/models/m/ready", Some(("m", "", "ready"))),
            ("/v2/models/m/versions/1/infer", Some(("m", "1", "infer"))),
            ("/v2/models/m/", Some(("m", "", ""))),
            ("/v2/models//infer", Some(("", "", "infer"))),
            ("/v2/models/m/versions//infer", None),
            ("/v2/models/m", None),
            ("/v2/models/m/versions/1", None),
            ("/v2/models/m/versions/1/infer/", None),
            ("/v2/models/m/versions/1/infer/x", None),
            ("/v2/models/m/other/infer", None),
            ("/v2/models/m/infer/x", None),
            ("/v2/model/m/infer", None),
            ("/v2/health/ready", None),
        ];
        for (path, expected) in cases {
            assert_eq!(model_route(path), expected, "{path}");
        }
    }
}
