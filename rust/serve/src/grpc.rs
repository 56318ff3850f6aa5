//! The gRPC side: the Open Inference Protocol v2
//! `inference.GRPCInferenceService` (tonic, prost), on its own port of the
//! same runtime, HTTP/2 only.
//!
//! KServe's six RPCs are answered here, none in Python: `ServerLive`,
//! `ServerReady`, `ModelReady`, `ServerMetadata` and `ModelMetadata` (from
//! the [`Catalog`](crate::Catalog) the Python side described), and `ModelInfer`, whose
//! inputs (`raw_input_contents`, by position, kept as slices of the message;
//! or typed `contents`, decoded once) go through the same
//! [`ServedModel::enqueue`] as HTTP's: the same checks, queue, deadlines and
//! counts. Its reply is each requested output's rows as raw bytes
//! (`raw_output_contents`), cut from the batch and written as the whole
//! message by the model's worker ([`response`]).
//! `ModelInfer` calls skip tonic's per-call machinery (`ModelInferCall` reads
//! and answers them; their messages are read where they lie,
//! [`request::InferRequest`]); the other RPCs go through tonic.
//!
//! Triton's `ModelConfig`, `ModelStatistics`, `RepositoryIndex`, model control
//! (`RepositoryModelLoad`, `RepositoryModelUnload`) and log settings are rare
//! and their answers change while serving (statistics, readiness): they go to
//! the [`Fallback`](crate::Fallback), as protobuf bytes both ways (the Python
//! servicer's own answers), decoded here; a cancelled call withdraws it.
//! Every model's `ModelInfer` is answered here, BYTES and variable-length
//! tensors included.
//!
//! Triton's system shared-memory extension, with a codec that has regions
//! ([`v2::Codec::regions`]): a tensor's parameters may name a
//! `shared_memory_region` (a `string_param`; `shared_memory_offset` and
//! `shared_memory_byte_size` `int64_param`s, the size required), read by
//! Triton's rules and messages. Such an input sends no contents and
//! `raw_input_contents` holds one entry per other input, in order; its
//! bytes are read from the region. Such an output's range is resolved as
//! the request is read (and, where the codec knows the output's size,
//! [`v2::Codec::with_output_row_bytes`], checked to hold it: a 400 before
//! the model runs); its bytes are written there by the worker, and the
//! answer lists it (name, datatype, shape) with an empty
//! `raw_output_contents` entry (every output has one, as tritonclient
//! expects). `ModelStreamInfer` answers the same way. Without regions, a
//! tensor naming one is refused.
//!
//! Statuses are those of the Python servicer: NOT_FOUND for an unknown model
//! or version, INVALID_ARGUMENT (HTTP 400), UNAVAILABLE (503: queue full,
//! not running), DEADLINE_EXCEEDED (504: the `timeout` parameter in
//! microseconds or the call's `grpc-timeout`, the smaller), INTERNAL (500:
//! the model failed), RESOURCE_EXHAUSTED for a message over `max_body_size`
//! (as sent, or inflated: gzip or deflate), and on a `ModelStreamInfer` stream for a
//! decoupled request whose client left `max_stream_backlog` bytes unread.

use std::sync::Arc;
use std::time::Duration;

use std::future::Future;

use bytes::Bytes;
use ferrobatch_core::v2::regions::{RegionRange, SharedRegions};
use ferrobatch_core::v2::{self, quote, Clipped, Limits, Shape, V2Error, MODEL_VERSION};
use ferrobatch_core::{DType, PerTensor};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use tokio::sync::{mpsc, Semaphore};
use tonic::codec::CompressionEncoding;
use tonic::codegen::Service;
use tonic::metadata::MetadataMap;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::encoding::Coding;
use crate::http::FallbackCall;
use crate::metadata::ModelMetadata;
use crate::model::{RequestMeta, ServedModel, Source, Submitted, Tensor};
use crate::replies::{
    part_bytes, Answer, Backlog, Failure, InputOwners, OutputClasses, OutputRegions, RawOutput,
    ResponsePlan,
};
use crate::restrict;
use crate::server::Shared;
use crate::streamed::Streamed;
use request::{InferRequest, Parameters};

/// The messages and the server trait generated from the vendored
/// `grpc_predict_v2.proto` (see `build.rs`).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("inference");
}

/// tonic's prost codec (`build.rs` names it for every method), except
/// that a request message which does not decode is the client's mistake:
/// INVALID_ARGUMENT, where prost's decoder answers INTERNAL, a server fault
/// to every client and dashboard that reads gRPC codes.
#[derive(Debug, Clone)]
pub struct ClientCodec<T, U>(tonic_prost::ProstCodec<T, U>);

impl<T, U> Default for ClientCodec<T, U> {
    fn default() -> Self {
        ClientCodec(tonic_prost::ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for ClientCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = RequestDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder(self.0.decoder())
    }
}

/// [`ClientCodec`]'s decoder: prost's, its failures INVALID_ARGUMENT.
#[derive(Debug)]
pub struct RequestDecoder<U>(tonic_prost::ProstDecoder<U>);

impl<U: prost::Message + Default> tonic::codec::Decoder for RequestDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(client_mistake)
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.0.buffer_settings()
    }
}

/// A failure to read what the client sent, as INVALID_ARGUMENT where tonic
/// says INTERNAL, and a message over the limit as RESOURCE_EXHAUSTED, gRPC's
/// status for it, where tonic says OUT_OF_RANGE (no handler answers that);
/// its other codes are kept.
fn client_mistake(status: Status) -> Status {
    match status.code() {
        Code::Internal => Status::invalid_argument(status.message().to_owned()),
        Code::OutOfRange => Status::resource_exhausted(status.message().to_owned()),
        _ => status,
    }
}

use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use pb::infer_parameter::ParameterChoice;
use pb::model_infer_response::InferOutputTensor;
use pb::model_metadata_response::TensorMetadata;
use pb::{
    CudaSharedMemoryRegisterRequest, CudaSharedMemoryRegisterResponse,
    CudaSharedMemoryStatusRequest, CudaSharedMemoryStatusResponse,
    CudaSharedMemoryUnregisterRequest, CudaSharedMemoryUnregisterResponse, InferParameter,
    InferTensorContents, LogSettingsRequest, LogSettingsResponse, ModelConfigRequest,
    ModelConfigResponse, ModelInferRequest, ModelInferResponse, ModelMetadataRequest,
    ModelMetadataResponse, ModelReadyRequest, ModelReadyResponse, ModelStatisticsRequest,
    ModelStatisticsResponse, ModelStreamInferResponse, RepositoryIndexRequest,
    RepositoryIndexResponse, RepositoryModelLoadRequest, RepositoryModelLoadResponse,
    RepositoryModelUnloadRequest, RepositoryModelUnloadResponse, ServerLiveRequest,
    ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest,
    ServerReadyResponse, SystemSharedMemoryRegisterRequest, SystemSharedMemoryRegisterResponse,
    SystemSharedMemoryStatusRequest, SystemSharedMemoryStatusResponse,
    SystemSharedMemoryUnregisterRequest, SystemSharedMemoryUnregisterResponse,
};

/// The tonic service of one front-end, as every connection serves it.
pub(crate) type Server = GrpcInferenceServiceServer<Inference>;

/// The service with the front-end's limits: messages up to
/// `max_body_size` (as sent and once inflated), gzip and deflate accepted.
pub(crate) fn server(shared: Arc<Shared>) -> Server {
    let limit = shared.config.max_body_size;
    let compressed = shared.config.grpc_response_compression != ResponseCompression::None;
    let server = GrpcInferenceServiceServer::new(Inference { shared })
        .max_decoding_message_size(limit)
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate);
    if !compressed {
        return server;
    }
    // The RPCs tonic answers (the stream's responses among them) are coded
    // as the client's `grpc-accept-encoding` lists them first.
    server
        .send_compressed(CompressionEncoding::Gzip)
        .send_compressed(CompressionEncoding::Deflate)
}

/// Triton's `--grpc-infer-response-compression-level`: whether responses
/// are compressed, and which coding comes first among those a call accepts
/// (`grpc-accept-encoding`), ranked as gRPC's own servers rank them (low:
/// gzip, then deflate; medium and high: deflate, then gzip). zlib's level
/// stays its fast one either way: the level picks the coding, as in gRPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponseCompression {
    #[default]
    None,
    Low,
    Medium,
    High,
}

impl ResponseCompression {
    /// The level Triton's flag names (`none`, `low`, `medium`, `high`).
    pub fn named(name: &str) -> Option<ResponseCompression> {
        match name {
            "none" => Some(ResponseCompression::None),
            "low" => Some(ResponseCompression::Low),
            "medium" => Some(ResponseCompression::Medium),
            "high" => Some(ResponseCompression::High),
            _ => None,
        }
    }

    /// The coding of a response to a call that accepts `accepted`
    /// (`grpc-accept-encoding`: comma-separated names); None: sent as it is.
    fn coding(self, accepted: Option<&HeaderValue>) -> Option<Coding> {
        if self == ResponseCompression::None {
            return None;
        }
        let (mut gzip, mut deflate) = (false, false);
        for name in accepted?.as_bytes().split(|&b| b == b',') {
            let name = name.trim_ascii();
            gzip |= name.eq_ignore_ascii_case(b"gzip");
            deflate |= name.eq_ignore_ascii_case(b"deflate");
        }
        let first = if self == ResponseCompression::Low {
            [(gzip, Coding::Gzip), (deflate, Coding::Deflate)]
        } else {
            [(deflate, Coding::Deflate), (gzip, Coding::Gzip)]
        };
        first
            .into_iter()
            .find(|(accepted, _)| *accepted)
            .map(|(_, coding)| coding)
    }
}

/// A compressed reply at least this long is compressed off the runtime's threads.
const COMPRESS_OFF_RUNTIME: usize = 64 << 10;

/// `framed` (one prefixed message) with its message compressed as
/// `coding`; as it was if the encoder fails (its flag says so).
async fn compressed(shared: &Arc<Shared>, framed: Bytes, coding: Coding) -> Bytes {
    // A clone of `Bytes` is a count: what is sent if the work is refused
    // (flag 0, a message as it is, is valid whatever `grpc-encoding` says).
    let plain = framed.clone();
    let compress = move || {
        let message = framed.get(PREFIX..).unwrap_or_default();
        let Some(coded) = crate::encoding::compress(message, coding) else {
            return framed;
        };
        let Ok(length) = u32::try_from(coded.len()) else {
            return framed;
        };
        let mut out = Vec::with_capacity(PREFIX.saturating_add(coded.len()));
        out.push(1);
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(&coded);
        Bytes::from(out)
    };
    if plain.len() < COMPRESS_OFF_RUNTIME {
        return compress();
    }
    shared.offload(compress).await.unwrap_or(plain)
}

/// The RPCs a connection beyond `max_connections` (the
/// [`HEADROOM`](crate::server::HEADROOM)) answers: health checks.
const PROBES: [&str; 2] = [
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
];

/// The RPC answered without tonic (`ModelInferCall`): the one every client
/// sends many of.
const INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// The one RPC whose request is a stream of messages (read by tonic as they
/// come, each within `max_body_size`).
const STREAM_INFER: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

/// Triton's request parameter asking for an empty response that flags the
/// end of each request's responses, and the response parameter flagging it.
const ENABLE_EMPTY_FINAL: &str = "triton_enable_empty_final_response";
/// Requests of one `ModelStreamInfer` stream answered at once, at most: each
/// holds a queued request and its answers' buffer.
const STREAM_IN_FLIGHT: usize = 1024;
const FINAL_RESPONSE: &str = "triton_final_response";

/// The length of a gRPC message's prefix: a compressed flag and a
/// big-endian u32 length.
const PREFIX: usize = 5;

/// Whether `content_type` is gRPC's: `application/grpc`, alone or followed
/// by `+format` or `;parameters`.
fn is_grpc(content_type: Option<&HeaderValue>) -> bool {
    content_type.is_some_and(|value| {
        let value = value.as_bytes();
        value.len() >= 16
            && value[..16].eq_ignore_ascii_case(b"application/grpc")
            && matches!(value.get(16), None | Some(b'+' | b';'))
    })
}

/// The most metadata (headers, as HPACK counts them) a call may carry, as
/// gRPC's own servers (Triton's among them) allow by default; past it the
/// call alone gets RESOURCE_EXHAUSTED. HTTP/2 itself lets a header block
/// grow to [`MAX_HEADER_BLOCK`], so that such a call reaches this check
/// instead of costing its connection (a 431 the client cannot map, or a
/// GOAWAY that fails every call on it).
pub const MAX_METADATA: usize = 16 * 1024;
/// The largest header block a gRPC connection decodes (one at a time).
pub const MAX_HEADER_BLOCK: u32 = 256 * 1024;

/// A call's metadata size as HPACK counts it: each header's name and value
/// plus 32 bytes.
fn metadata_size(headers: &hyper::HeaderMap) -> usize {
    headers.iter().fold(0usize, |n, (name, value)| {
        n.saturating_add(name.as_str().len() + value.len() + 32)
    })
}

/// The answer to one HTTP/2 request of a gRPC connection (`pooled`: false
/// for a connection in the headroom beyond `max_connections`, which answers
/// health checks only). Refused before tonic reads it: a content-type that
/// is not gRPC's (HTTP 415, as the gRPC protocol asks), a call of a
/// restricted protocol without its header ([`restricted`]), a second message
/// (every RPC here is unary: INTERNAL, as gRPC's libraries answer it), a
/// message that does not arrive within the body timeout. A compressed message is
/// inflated here, off the runtime's threads ([`Shared::offload`]).
///
/// hyper moves each stream's future several times as it spawns it, so a
/// `ModelInfer` call's future holds only what its read and its reply need
/// ([`ModelInferCall`], under 1 KiB; at 2.9 KiB, with the request's head
/// and tonic's call beside it, `memmove` was 7 % of a call's samples); the
/// other RPCs go to tonic, boxed.
pub(crate) fn handle(
    server: &Server,
    shared: &Arc<Shared>,
    pooled: bool,
    request: hyper::Request<Incoming>,
) -> impl Future<Output = hyper::Response<tonic::body::Body>> + Send + 'static {
    let call = route(server, shared, pooled, request);
    async move {
        match call {
            Call::Answered(answer) => answer,
            Call::Infer(infer) => infer.answer().await,
            Call::Tonic(answer) => answer.await,
        }
    }
}

/// What answers one request of a gRPC connection.
enum Call {
    /// Refused before its body is read.
    Answered(hyper::Response<tonic::body::Body>),
    Infer(ModelInferCall),
    /// Any other RPC, or `ModelStreamInfer`: tonic's.
    Tonic(std::pin::Pin<Box<dyn Future<Output = hyper::Response<tonic::body::Body>> + Send>>),
}

fn route(
    server: &Server,
    shared: &Arc<Shared>,
    pooled: bool,
    request: hyper::Request<Incoming>,
) -> Call {
    if !is_grpc(request.headers().get(hyper::header::CONTENT_TYPE)) {
        let given = request
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .map_or_else(
                || "none".to_owned(),
                |v| quote(&String::from_utf8_lossy(v.as_bytes())),
            );
        let mut refused = Status::internal(format!(
            "a gRPC request's content-type must begin with application/grpc, got {given}"
        ))
        .into_http();
        *refused.status_mut() = hyper::StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return Call::Answered(refused);
    }
    let metadata = metadata_size(request.headers());
    if metadata > MAX_METADATA {
        let refused = Status::resource_exhausted(format!(
            "received metadata size exceeds hard limit ({metadata} vs. {MAX_METADATA})"
        ));
        return Call::Answered(refused.into_http());
    }
    if let Some(refused) = restricted(shared, &request) {
        return Call::Answered(refused);
    }
    if !pooled && !PROBES.contains(&request.uri().path()) {
        return Call::Answered(
            Status::unavailable(
                "the server is at its connection limit (max_connections); \
                 only ServerLive and ServerReady are answered on this connection",
            )
            .into_http(),
        );
    }
    if request.uri().path() == INFER {
        return match ModelInferCall::new(shared, request) {
            Ok(call) => Call::Infer(call),
            Err(status) => Call::Answered(status.into_http()),
        };
    }
    Call::Tonic(Box::pin(tonic_call(
        server.clone(),
        shared.clone(),
        request,
    )))
}

/// UNAVAILABLE to a call of a restricted protocol without its header and
/// value (Triton's `--grpc-restricted-protocol`; see [`crate::restrict`]):
/// every RPC, tonic's and the stream included, and on a connection beyond
/// `max_connections` too.
#[inline]
fn restricted(
    shared: &Shared,
    request: &hyper::Request<Incoming>,
) -> Option<hyper::Response<tonic::body::Body>> {
    let path = request.uri().path();
    let refusal = (shared.config.grpc_restricted_protocol)
        .refused(|| restrict::grpc_api(path), request.headers())?;
    Some(Status::unavailable(refusal).into_http())
}

/// An RPC answered by tonic: a unary call's body refused past one message,
/// `max_body_size` or the body timeout ([`unary`]).
async fn tonic_call(
    mut server: Server,
    shared: Arc<Shared>,
    request: hyper::Request<Incoming>,
) -> hyper::Response<tonic::body::Body> {
    let limit = shared.config.max_body_size;
    let request = if request.uri().path() == STREAM_INFER {
        request.map(tonic::body::Body::new)
    } else {
        match unary(&shared, request).await {
            Ok(request) => request,
            Err(status) => return status.into_http(),
        }
    };
    let mut response = match server.call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    // tonic refuses a message over the limit with OUT_OF_RANGE, before any
    // handler runs (and no handler answers OUT_OF_RANGE): gRPC's status for
    // it, and grpcio's, is RESOURCE_EXHAUSTED.
    let headers = response.headers_mut();
    let out_of_range = HeaderValue::from(Code::OutOfRange as i32);
    if headers.get("grpc-status") == Some(&out_of_range) {
        headers.insert(
            "grpc-status",
            HeaderValue::from(Code::ResourceExhausted as i32),
        );
        if let Ok(message) = HeaderValue::from_str(&too_large(limit)) {
            headers.insert("grpc-message", message);
        }
    }
    response
}

fn too_large(limit: usize) -> String {
    format!("the request message is over the limit of {limit} bytes")
}

fn second_message() -> Status {
    Status::invalid_argument("a unary call carries one request message; this one has more")
}

fn body_late() -> Status {
    Status::deadline_exceeded("the request message did not arrive within the body timeout")
}

/// How a call's messages are compressed (`grpc-encoding`; `None`: not),
/// gzip or deflate (a zlib stream, as gRPC's own servers read it); another
/// encoding is refused as tonic refuses it: UNIMPLEMENTED, naming those it
/// accepts.
fn message_encoding(headers: &hyper::HeaderMap) -> Result<Option<Coding>, Status> {
    let Some(encoding) = headers.get("grpc-encoding") else {
        return Ok(None);
    };
    let encoding_is = |name: &[u8]| encoding.as_bytes().eq_ignore_ascii_case(name);
    if encoding_is(b"identity") {
        return Ok(None);
    }
    if encoding_is(b"gzip") {
        return Ok(Some(Coding::Gzip));
    }
    if encoding_is(b"deflate") {
        return Ok(Some(Coding::Deflate));
    }
    let mut refused = Status::unimplemented(format!(
        "Content is compressed with `{}` which isn't supported",
        Clipped(&String::from_utf8_lossy(encoding.as_bytes()))
    ));
    refused.metadata_mut().insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("gzip,deflate,identity"),
    );
    Err(refused)
}

/// The request as tonic reads it: its body refused past one message, past
/// `max_body_size` or the body timeout ([`Unary`]); a compressed message
/// read whole, inflated off the runtime within `max_body_size` and handed
/// on uncompressed.
async fn unary(
    shared: &Shared,
    request: hyper::Request<Incoming>,
) -> Result<hyper::Request<tonic::body::Body>, Status> {
    let config = &shared.config;
    // Another encoding goes on to tonic, which refuses it in the same words.
    let Ok(Some(coding)) = message_encoding(request.headers()) else {
        return Ok(request.map(|body| {
            tonic::body::Body::new(Unary::new(
                body,
                Some(config.body_timeout),
                config.max_body_size,
            ))
        }));
    };
    let (mut parts, body) = request.into_parts();
    let message = read_message(shared, body, Some(coding)).await?;
    parts.headers.remove("grpc-encoding");
    let mut framed = Vec::with_capacity(PREFIX.saturating_add(message.len()));
    framed.push(0);
    framed.extend_from_slice(&prefix_length(message.len(), config.max_body_size)?);
    framed.extend_from_slice(&message);
    Ok(hyper::Request::from_parts(
        parts,
        tonic::body::Body::new(http_body_util::Full::new(Bytes::from(framed))),
    ))
}

/// A message's length as its prefix writes it.
fn prefix_length(length: usize, limit: usize) -> Result<[u8; 4], Status> {
    u32::try_from(length)
        .map(u32::to_be_bytes)
        .map_err(|_| Status::resource_exhausted(too_large(limit)))
}

/// The one message of a unary call's `body`, without its prefix: refused
/// past one message, past `max_body_size` (as sent and, compressed as
/// `coding` says, once inflated, off the runtime's threads) or the body
/// timeout.
async fn read_message(
    shared: &Shared,
    body: Incoming,
    coding: Option<Coding>,
) -> Result<Bytes, Status> {
    let limit = shared.config.max_body_size;
    // Timed here, not by the body: its clock would be a second allocation.
    let read = crate::http::concatenated(Unary::new(body, None, limit));
    let message = tokio::time::timeout(shared.config.body_timeout, read)
        .await
        .map_err(|_| body_late())??;
    let (compressed, length) = match message.get(..PREFIX) {
        Some(&[flag, a, b, c, d]) => (flag == 1, u32::from_be_bytes([a, b, c, d]) as usize),
        _ => {
            return Err(Status::invalid_argument(
                "the request message is incomplete",
            ))
        }
    };
    if message.len() < PREFIX.saturating_add(length) {
        return Err(Status::invalid_argument(
            "the request message is incomplete",
        ));
    }
    let message = message.slice(PREFIX..);
    if !compressed {
        return Ok(message);
    }
    let Some(coding) = coding else {
        // tonic's words for it (its code is INTERNAL: see `ClientCodec`).
        return Err(Status::invalid_argument(
            "protocol error: received message with compressed-flag but no grpc-encoding was specified",
        ));
    };
    // Inflated off the runtime's threads.
    let inflated = shared
        .offload(move || {
            crate::encoding::inflate(&message, coding, limit).map_err(|failure| {
                match failure.status {
                    413 => Status::resource_exhausted(too_large(limit)),
                    _ => status(failure),
                }
            })
        })
        .await
        .ok_or_else(|| Status::internal("internal error inflating the request"))??;
    Ok(Bytes::from(inflated))
}

/// A `ModelInfer` call, answered without tonic's per-call machinery (its
/// request and response wrappers, codec buffers and body encoder were a
/// fifth of a call's time on the runtime's thread): its message read whole
/// ([`read_message`]), decoded in place ([`InferRequest::decode`]), queued
/// as tonic's handler queues it ([`Inference::queue`]), and the reply sent
/// as one DATA frame and the trailers. A failure is a trailers-only
/// response, as tonic sends it. It keeps of its request's head only what
/// it needs.
struct ModelInferCall {
    inference: Inference,
    body: Incoming,
    coding: Option<Coding>,
    /// How its reply is compressed ([`ResponseCompression`]); None: not.
    reply_coding: Option<Coding>,
    /// `grpc-timeout`.
    call_timeout: Option<Duration>,
    forwarded: Vec<(String, String)>,
}

impl ModelInferCall {
    fn new(
        shared: &Arc<Shared>,
        request: hyper::Request<Incoming>,
    ) -> Result<ModelInferCall, Status> {
        let (parts, body) = request.into_parts();
        let coding = message_encoding(&parts.headers)?;
        let reply_coding = shared
            .config
            .grpc_response_compression
            .coding(parts.headers.get("grpc-accept-encoding"));
        let inference = Inference {
            shared: shared.clone(),
        };
        let (call_timeout, forwarded) =
            inference.call_metadata(&MetadataMap::from_headers(parts.headers));
        Ok(ModelInferCall {
            inference,
            body,
            coding,
            reply_coding,
            call_timeout,
            forwarded,
        })
    }

    async fn answer(self) -> hyper::Response<tonic::body::Body> {
        let reply_coding = self.reply_coding;
        let shared = reply_coding.map(|_| self.inference.shared.clone());
        match self.answered().await {
            Ok(framed) => {
                let framed = match (reply_coding, &shared) {
                    (Some(coding), Some(shared)) => compressed(shared, framed, coding).await,
                    _ => framed,
                };
                let mut response = hyper::Response::new(tonic::body::Body::new(OneMessage {
                    framed: Some(framed),
                    ended: false,
                }));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/grpc"),
                );
                if let Some(coding) = reply_coding {
                    let name = HeaderValue::from_static(coding.name());
                    response.headers_mut().insert(GRPC_ENCODING.clone(), name);
                }
                response
            }
            Err(status) => status.into_http(),
        }
    }

    async fn answered(self) -> Result<Bytes, Status> {
        let ModelInferCall {
            inference,
            body,
            coding,
            reply_coding: _,
            call_timeout,
            forwarded,
        } = self;
        // The message and its view end here: the submission holds its raw contents.
        let (model, submitted) = {
            let message = read_message(&inference.shared, body, coding).await?;
            let request = decode_infer_request(&message).map_err(status)?;
            inference.queue(request, call_timeout, &forwarded)?
        };
        drop(forwarded);
        Inference::answer(&model, submitted).await
    }
}

/// The trailer every answer ends with, named without an allocation (a
/// `&str` name not among HTTP's standard headers is copied per response).
static GRPC_STATUS: hyper::header::HeaderName =
    hyper::header::HeaderName::from_static("grpc-status");
static GRPC_ENCODING: hyper::header::HeaderName =
    hyper::header::HeaderName::from_static("grpc-encoding");

/// A unary call's response body: its one message (prefixed), then the
/// trailers of an OK status.
struct OneMessage {
    framed: Option<Bytes>,
    ended: bool,
}

impl hyper::body::Body for OneMessage {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if let Some(framed) = this.framed.take() {
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(framed))));
        }
        if this.ended {
            return std::task::Poll::Ready(None);
        }
        this.ended = true;
        let mut trailers = hyper::HeaderMap::with_capacity(1);
        trailers.insert(GRPC_STATUS.clone(), HeaderValue::from_static("0"));
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// The body of a unary call: its bytes as they come, refused with a
/// [`Status`] (which tonic answers as it is) when they go on past the first
/// message or do not all arrive within the body timeout.
struct Unary {
    body: Incoming,
    /// Bytes of the body so far.
    seen: usize,
    /// The first message's prefix, as far as it came.
    prefix: [u8; PREFIX],
    /// Where the first message ends, once its prefix came.
    end: Option<usize>,
    /// The longest message taken (`max_body_size`).
    limit: usize,
    /// The body timeout, when its reader does not time the body itself.
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl Unary {
    fn new(body: Incoming, timeout: Option<Duration>, limit: usize) -> Unary {
        Unary {
            body,
            seen: 0,
            prefix: [0; PREFIX],
            end: None,
            limit,
            deadline: timeout.map(|timeout| Box::pin(tokio::time::sleep(timeout))),
        }
    }

    /// Counts `data`; a second message's bytes are refused.
    fn count(&mut self, data: &[u8]) -> Result<(), Status> {
        let before = self.seen;
        self.seen = self.seen.saturating_add(data.len());
        if before < PREFIX {
            let take = (PREFIX - before).min(data.len());
            self.prefix[before..before + take].copy_from_slice(&data[..take]);
            if self.seen >= PREFIX {
                let [_, a, b, c, d] = self.prefix;
                let length = u32::from_be_bytes([a, b, c, d]) as usize;
                if length > self.limit {
                    return Err(Status::resource_exhausted(too_large(self.limit)));
                }
                self.end = Some(PREFIX.saturating_add(length));
            }
        }
        match self.end {
            Some(end) if self.seen > end => Err(second_message()),
            _ => Ok(()),
        }
    }
}

impl hyper::body::Body for Unary {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Status>>> {
        use std::task::Poll;
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if let Err(refused) = this.count(data) {
                        return Poll::Ready(Some(Err(refused)));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Status::from_error(Box::new(e))))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().map(|d| d.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Some(Err(body_late()))),
                _ => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The `inference.GRPCInferenceService` implementation.
pub(crate) struct Inference {
    shared: Arc<Shared>,
}

/// A served model, or the status saying why a request to it cannot run.
enum Lookup {
    Served(Arc<ServedModel>),
    /// Known, not served yet (warming up) or any more.
    NotRunning,
}

impl Inference {
    /// Model `name` at `version`: known (in the catalog or served) or the
    /// NOT_FOUND status with Triton's message.
    fn known(&self, name: &str, version: &str) -> Result<Lookup, Status> {
        let served = self.shared.model(name, "");
        if served.is_none() && !self.shared.is_catalogued(name) {
            return Err(Status::not_found(format!(
                "Request for unknown model: '{shown}' is not found",
                shown = Clipped(name)
            )));
        }
        if !(version.is_empty() || version == MODEL_VERSION) {
            return Err(Status::not_found(format!(
                "Request for unknown model: '{shown}' version {} is not found",
                Clipped(version),
                shown = Clipped(name)
            )));
        }
        Ok(served.map_or(Lookup::NotRunning, Lookup::Served))
    }

    /// Model `name` at `version`, served now: else NOT_FOUND (unknown) or
    /// UNAVAILABLE (known, not running).
    fn served(&self, name: &str, version: &str) -> Result<Arc<ServedModel>, Status> {
        match self.known(name, version)? {
            Lookup::Served(model) => Ok(model),
            Lookup::NotRunning => Err(Status::unavailable(crate::http::no_available_versions(
                name,
            ))),
        }
    }

    /// What a call's `metadata` asks of it: `grpc-timeout`, and the
    /// headers forwarded to the model (`grpc_header_forward_pattern`).
    fn call_metadata(&self, metadata: &MetadataMap) -> (Option<Duration>, Vec<(String, String)>) {
        let pattern = self.shared.config.grpc_header_forward_pattern.as_ref();
        (
            grpc_timeout(metadata),
            forwarded_metadata(metadata, pattern),
        )
    }

    /// Queues one `ModelInfer` call's request on its model: the model and
    /// the submission whose reply answers the call ([`Inference::answer`]).
    fn queue(
        &self,
        mut request: InferRequest<'_>,
        call_timeout: Option<Duration>,
        forwarded: &[(String, String)],
    ) -> Result<(Arc<ServedModel>, Submitted), Status> {
        let model = self.served(request.model_name, request.model_version)?;
        model.refuse_decoupled("ModelInfer").map_err(status)?;
        // The answer echoes them: the model's name is the one asked for.
        let model_name = model.name.clone();
        let id = request.id.to_owned();
        let submitted = submit(
            &model,
            &mut request,
            call_timeout,
            forwarded,
            |outputs, regions, classes| ResponsePlan::Message {
                model_name,
                id,
                outputs,
                regions,
                classes,
            },
        )
        .map_err(status)?;
        Ok((model, submitted))
    }

    /// A queued `ModelInfer` call's answer: one gRPC message, prefixed,
    /// written by the model's worker ([`response::InferResponse`]).
    async fn answer(model: &ServedModel, submitted: Submitted) -> Result<Bytes, Status> {
        match model.reply(submitted).await.map_err(status)? {
            Answer::Message(framed) => Ok(framed),
            _ => Err(Status::internal(
                "a ModelInfer call answered as another kind",
            )),
        }
    }

    /// One request of a `ModelStreamInfer` stream: queued now, so that a
    /// stream's requests reach the model's queue in the order it sent them
    /// (the requests of a sequence must), and answered on `out` by the
    /// future returned.
    fn stream_one(
        &self,
        mut request: ModelInferRequest,
        call_timeout: Option<Duration>,
        forwarded: &[(String, String)],
        out: &StreamOut,
    ) -> impl Future<Output = ()> + Send + 'static {
        let tag = ResponseTag {
            model_name: request.model_name.clone(),
            id: request.id.clone(),
            empty_final: asks_empty_final(&request.parameters),
        };
        let queued = self.queue_streamed(
            &mut InferRequest::of(&mut request),
            call_timeout,
            forwarded,
            &out.backlog,
        );
        let out = out.clone();
        async move {
            let answered = match queued {
                Ok(queued) => tokio::select! {
                    answered = queued.answer(&tag, &out) => answered,
                    // The client went away: dropping the answer cancels the request.
                    () = out.closed() => return,
                },
                Err(status) => Err(status),
            };
            if let Err(status) = answered {
                let response = tag.response(Vec::new(), Vec::new(), true);
                out.send(
                    Ok(ModelStreamInferResponse {
                        error_message: status.message().to_owned(),
                        infer_response: Some(response),
                    }),
                    0,
                );
            }
        }
    }

    /// Queues one streamed request: answered once, or (a decoupled model)
    /// with each response as it comes, counted against `backlog`.
    fn queue_streamed(
        &self,
        request: &mut InferRequest<'_>,
        call_timeout: Option<Duration>,
        forwarded: &[(String, String)],
        backlog: &Arc<Backlog>,
    ) -> Result<QueuedStream, Status> {
        let model = self.served(request.model_name, request.model_version)?;
        if !model.replies().codec().decoupled() {
            let submitted = submit(
                &model,
                request,
                call_timeout,
                forwarded,
                |outputs, regions, classes| ResponsePlan::Raw {
                    outputs,
                    regions,
                    classes,
                },
            )
            .map_err(status)?;
            return Ok(QueuedStream {
                model,
                submitted,
                parts: None,
            });
        }
        let (partial, parts) = mpsc::unbounded_channel();
        let submitted = submit(
            &model,
            request,
            call_timeout,
            forwarded,
            |outputs, regions, classes| ResponsePlan::Stream {
                outputs: Arc::from(outputs.as_slice()),
                regions: (!regions.is_empty()).then(|| Arc::from(regions)),
                classes: (!classes.is_empty()).then(|| Arc::from(classes)),
                partial,
                backlog: backlog.clone(),
            },
        )
        .map_err(status)?;
        Ok(QueuedStream {
            model,
            submitted,
            parts: Some(parts),
        })
    }

    /// Answers RPC `method` with the fallback (Python; see
    /// [`crate::http::ask`]: a client that goes away withdraws it):
    /// `request` encoded, the response decoded.
    async fn fallback<Q, R>(
        &self,
        method: &'static str,
        request: Request<Q>,
    ) -> Result<Response<R>, Status>
    where
        Q: prost::Message,
        R: prost::Message + Default,
    {
        let call = FallbackCall {
            method,
            request: request.into_inner().encode_to_vec(),
        };
        let handler = self.shared.fallback.clone();
        let reply = crate::http::ask(move |answer| handler.call_grpc(call, answer))
            .await
            .ok_or_else(|| Status::internal(format!("internal error answering {method}")))?;
        match reply {
            Ok(body) => R::decode(&body[..]).map(Response::new).map_err(|e| {
                Status::internal(format!(
                    "{method}: the answer is not its response message: {e}"
                ))
            }),
            Err((code, message)) => Err(Status::new(Code::from(code), message)),
        }
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Inference {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        let ready = self.shared.server_ready();
        Ok(Response::new(ServerReadyResponse { ready }))
    }

    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let known = self.known(&request.get_ref().name, &request.get_ref().version)?;
        match known {
            Lookup::Served(model) => Ok(Response::new(ModelReadyResponse {
                ready: self.shared.model_ready(&model),
            })),
            Lookup::NotRunning => Ok(Response::new(ModelReadyResponse { ready: false })),
        }
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        let server = self.shared.server_metadata();
        Ok(Response::new(ServerMetadataResponse {
            name: server.name,
            version: server.version,
            extensions: server.extensions,
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let request = request.into_inner();
        self.known(&request.name, &request.version)?;
        let model = self.shared.catalogued(&request.name).ok_or_else(|| {
            Status::not_found(format!(
                "model '{}' has no metadata",
                Clipped(&request.name)
            ))
        })?;
        Ok(Response::new(model_metadata(&model)))
    }

    /// Answered by `ModelInferCall` on the native front-end; kept for a
    /// server built from [`server`] alone.
    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let (metadata, _, mut request) = request.into_parts();
        let (call_timeout, forwarded) = self.call_metadata(&metadata);
        let (model, submitted) =
            self.queue(InferRequest::of(&mut request), call_timeout, &forwarded)?;
        let framed = Inference::answer(&model, submitted).await?;
        <ModelInferResponse as prost::Message>::decode(framed.slice(PREFIX..))
            .map(Response::new)
            .map_err(|e| Status::internal(format!("decoding the answer: {e}")))
    }

    type ModelStreamInferStream = StreamResponses;

    /// Reads the stream's requests as they come and answers each on the
    /// stream as soon as it can (in any order; `id` tells them apart): a
    /// decoupled model's responses one by one as its model yields them, any
    /// other model's one response. A request's failure is an
    /// `error_message` on the stream, which goes on; the stream ends once
    /// the client has closed its side (or the front-end stops) and every
    /// request is answered. A client that goes away cancels what it left
    /// pending.
    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let call_timeout = grpc_timeout(request.metadata());
        let forwarded: Arc<[(String, String)]> = forwarded_metadata(
            request.metadata(),
            self.shared.config.grpc_header_forward_pattern.as_ref(),
        )
        .into();
        let mut incoming = request.into_inner();
        let backlog = Backlog::new(self.shared.config.max_stream_backlog);
        let (out, responses) = mpsc::unbounded_channel();
        let out = StreamOut {
            messages: out,
            backlog: backlog.clone(),
        };
        let inference = Inference {
            shared: self.shared.clone(),
        };
        let mut stopped = self.shared.stopped.clone();
        let in_flight = Arc::new(Semaphore::new(STREAM_IN_FLIGHT));
        tokio::spawn(async move {
            loop {
                if stopped.borrow_and_update().is_some() {
                    // The front-end stops: what is in flight is answered,
                    // then the stream ends UNAVAILABLE, so that a client
                    // waiting on a request sent meanwhile (never read) is
                    // told, not left waiting.
                    let all = u32::try_from(STREAM_IN_FLIGHT).unwrap_or(u32::MAX);
                    let answered = in_flight.acquire_many(all).await;
                    let message = "the server is shutting down: this stream takes no more requests";
                    out.send(Err(Status::unavailable(message)), 0);
                    drop(answered);
                    break;
                }
                // The next message is read once a request of this stream is
                // answered, past STREAM_IN_FLIGHT (HTTP/2 flow control holds
                // the client back meanwhile).
                let (message, permit) = tokio::select! {
                    read = async {
                        // A client that does not read its responses is sent
                        // no more until it does (HTTP/2 flow control holds it).
                        out.backlog.under_limit().await;
                        let permit = in_flight.clone().acquire_owned().await;
                        (incoming.message().await, permit)
                    } => read,
                    () = out.closed() => break, // the client went away
                    changed = stopped.changed() => match changed {
                        Ok(()) => continue,
                        Err(_) => break, // the front-end is gone
                    },
                };
                match message {
                    Ok(Some(request)) => {
                        // Queued here, in the stream's order; answered apart.
                        let answered =
                            inference.stream_one(request, call_timeout, &forwarded, &out);
                        tokio::spawn(async move {
                            answered.await;
                            drop(permit);
                        });
                    }
                    Ok(None) => break,
                    Err(status) => {
                        // tonic's reading of the stream: what the client sent was malformed.
                        out.send(Err(client_mistake(status)), 0);
                        break;
                    }
                }
            }
        });
        Ok(Response::new(StreamResponses { responses, backlog }))
    }

    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        self.fallback("ModelConfig", request).await
    }

    async fn model_statistics(
        &self,
        request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        self.fallback("ModelStatistics", request).await
    }

    async fn repository_index(
        &self,
        request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        self.fallback("RepositoryIndex", request).await
    }

    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        self.fallback("RepositoryModelLoad", request).await
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        self.fallback("RepositoryModelUnload", request).await
    }

    async fn log_settings(
        &self,
        request: Request<LogSettingsRequest>,
    ) -> Result<Response<LogSettingsResponse>, Status> {
        self.fallback("LogSettings", request).await
    }

    async fn system_shared_memory_status(
        &self,
        request: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        self.fallback("SystemSharedMemoryStatus", request).await
    }

    async fn system_shared_memory_register(
        &self,
        request: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        self.fallback("SystemSharedMemoryRegister", request).await
    }

    async fn system_shared_memory_unregister(
        &self,
        request: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        self.fallback("SystemSharedMemoryUnregister", request).await
    }

    async fn cuda_shared_memory_status(
        &self,
        request: Request<CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<CudaSharedMemoryStatusResponse>, Status> {
        self.fallback("CudaSharedMemoryStatus", request).await
    }

    async fn cuda_shared_memory_register(
        &self,
        request: Request<CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<CudaSharedMemoryRegisterResponse>, Status> {
        self.fallback("CudaSharedMemoryRegister", request).await
    }

    async fn cuda_shared_memory_unregister(
        &self,
        request: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<CudaSharedMemoryUnregisterResponse>, Status> {
        self.fallback("CudaSharedMemoryUnregister", request).await
    }
}

fn model_metadata(model: &ModelMetadata) -> ModelMetadataResponse {
    let tensors = |tensors: &[crate::metadata::TensorMetadata]| {
        tensors
            .iter()
            .map(|t| TensorMetadata {
                name: t.name.clone(),
                datatype: t.datatype.clone(),
                shape: t.shape.clone(),
            })
            .collect()
    };
    ModelMetadataResponse {
        name: model.name.clone(),
        versions: vec![MODEL_VERSION.to_owned()],
        platform: model.platform.clone(),
        inputs: tensors(&model.inputs),
        outputs: tensors(&model.outputs),
    }
}

/// The gRPC status of a failure, by its HTTP status (as the Python servicer maps them).
fn status(failure: Failure) -> Status {
    let code = match failure.status {
        400 => Code::InvalidArgument,
        404 => Code::NotFound,
        413 | 429 => Code::ResourceExhausted,
        503 => Code::Unavailable,
        504 => Code::DeadlineExceeded,
        _ => Code::Internal,
    };
    Status::new(code, failure.message)
}

fn invalid(message: impl Into<String>) -> Failure {
    Failure::new(400, message)
}

/// Checks `request` and queues it on `model`: its inputs (raw contents
/// moved out of it, kept as they are), the outputs it asks for, and its
/// deadline, the `timeout` parameter or `call_timeout`, the smaller.
fn submit(
    model: &ServedModel,
    request: &mut InferRequest<'_>,
    call_timeout: Option<Duration>,
    forwarded: &[(String, String)],
    plan: impl FnOnce(PerTensor<usize>, OutputRegions, OutputClasses) -> ResponsePlan,
) -> Result<Submitted, Failure> {
    let mut refused_input = false;
    let mut check = |name: &str, dtype: DType, shape: &[u64]| {
        model
            .check_header(name, dtype, shape)
            .inspect_err(|_| refused_input = true)
    };
    let keeps_parameters = model.replies().batcher().keeps_parameters();
    let codec = model.replies().codec();
    let call = read_infer_call(
        request,
        codec,
        call_timeout,
        forwarded,
        keeps_parameters,
        &mut check,
    )
    .map_err(|failure| match refused_input {
        true => model.refuse_input(failure),
        false => failure,
    })?;
    let tensors: ferrobatch_core::PerTensor<Tensor<'_>> = request
        .inputs
        .iter()
        .zip(&call.tensors)
        .map(|(input, (dtype, shape, bytes))| Tensor {
            name: input.name,
            dtype: *dtype,
            shape,
            bytes: bytes.clone(),
        })
        .collect();
    model.enqueue(
        &tensors,
        call.owners,
        call.meta,
        plan(call.outputs, call.regions, call.classes),
    )
}

/// A `ModelInfer` request read by the gRPC infer rules, the one copy of
/// them (the native front-end and the Python servicer both read requests
/// here): its inputs decoded and checked (`tensors[i]` is input `i` of
/// the request: its dtype, shape and where its bytes are in `owners`; one
/// in shared memory read into `owners.decoded`), the outputs it asks for
/// (indices in the codec's outputs), the shared-memory range of each of
/// them that names one (`regions`, aligned with `outputs`; empty: none)
/// and what it says besides (`meta.uncached` when a tensor names a region).
pub struct InferCall {
    pub tensors: PerTensor<(DType, Shape, Source)>,
    pub owners: InputOwners,
    pub outputs: PerTensor<usize>,
    pub regions: OutputRegions,
    /// How many classes each output is answered with (aligned with
    /// `outputs`; empty: none asks for classes).
    pub classes: OutputClasses,
    pub meta: RequestMeta,
}

/// Reads `request` (its raw contents moved out of it) for a model whose
/// codec is `codec`: inputs (see `decode_inputs`; `check`: the model's
/// rule for each input's header), requested outputs (one in a
/// shared-memory range too small for its known size refused, see
/// [`v2::Codec::check_output_regions`]), priority, parameters
/// (only for a model that `keeps_parameters`, with the `forwarded`
/// headers) and the deadline, its `timeout` parameter or `call_timeout`,
/// the smaller.
pub fn read_infer_call(
    request: &mut InferRequest<'_>,
    codec: &v2::Codec,
    call_timeout: Option<Duration>,
    forwarded: &[(String, String)],
    keeps_parameters: bool,
    check: InputCheck<'_>,
) -> Result<InferCall, Failure> {
    if codec.regions().is_none() {
        let inputs = request
            .inputs
            .iter()
            .map(|t| ("input", t.name, &t.parameters));
        let outputs = request
            .outputs
            .iter()
            .map(|t| ("output", t.name, &t.parameters));
        let mut tensors = inputs.chain(outputs);
        if let Some((kind, name, _)) =
            tensors.find(|(_, _, parameters)| parameters.contains_key(v2::SHARED_MEMORY_REGION))
        {
            let tensor = format!("{kind} '{}'", Clipped(name));
            return Err(invalid(v2::shared_memory_refused(&tensor)));
        }
    }
    let raw = std::mem::take(&mut request.raw_input_contents);
    let decoded = decode_inputs(
        &request.inputs,
        raw,
        codec.limits(),
        codec.regions(),
        request.model_name,
        check,
    )?;
    let (outputs, regions, classes) = requested_outputs(request, codec)?;
    // An output of known size larger than its range: refused now, before
    // the model runs, not when its response is written.
    if !regions.is_empty() {
        let in_regions = outputs
            .iter()
            .zip(&regions)
            .filter_map(|(&index, range)| Some((index, range.as_ref()?)));
        let first_shape = decoded.tensors.first().map(|(_, shape, _)| &shape[..]);
        codec
            .check_output_regions(first_shape, in_regions)
            .map_err(|e| Failure::new(e.status(), e.to_string()))?;
    }
    let meta = RequestMeta {
        timeout: timeout(&request.parameters, call_timeout)?,
        priority: priority(&request.parameters)?,
        // Only a model that asks for parameters gets them: others convert nothing.
        parameters: if keeps_parameters {
            crate::model::with_headers(parameters_json(&request.parameters), forwarded)?
        } else {
            None
        },
        uncached: decoded.shared_memory || !regions.is_empty(),
    };
    Ok(InferCall {
        tensors: decoded.tensors,
        owners: decoded.owners,
        outputs,
        regions,
        classes,
        meta,
    })
}

/// A tensor's shared-memory parameters, as Triton reads them
/// (`ParseSharedMemoryParams`, its messages): `(region, offset, byte
/// size)`, `None` when it names no region; refused when a value is of
/// another kind or negative, or an offset or size comes without a region.
fn shared_memory_params<'p>(
    name: &str,
    parameters: &'p Parameters,
) -> Result<Option<(&'p str, u64, u64)>, Failure> {
    if parameters.is_empty() {
        return Ok(None);
    }
    let shown = Clipped(name);
    let region = match parameters
        .get(v2::SHARED_MEMORY_REGION)
        .map(|p| p.parameter_choice.as_ref())
    {
        None => None,
        Some(Some(ParameterChoice::StringParam(region))) => Some(region.as_str()),
        Some(_) => {
            return Err(invalid(format!(
                "invalid value type for 'shared_memory_region' parameter for tensor '{shown}', \
                 expected string_param."
            )))
        }
    };
    let int = |field: &str| -> Result<Option<u64>, Failure> {
        let Some(parameter) = parameters.get(field) else {
            return Ok(None);
        };
        if region.is_none() {
            return Err(invalid(format!(
                "'{field}' can not be specified without 'shared_memory_region' parameter \
                 for tensor '{shown}'"
            )));
        }
        match parameter.parameter_choice {
            Some(ParameterChoice::Int64Param(v)) => u64::try_from(v).map(Some).map_err(|_| {
                invalid(format!(
                    "invalid value for '{field}' parameter for tensor '{shown}', expected >= 0, \
                     got {v}"
                ))
            }),
            _ => Err(invalid(format!(
                "invalid value type for '{field}' parameter for tensor '{shown}', expected \
                 int64_param."
            ))),
        }
    };
    let offset = int(v2::SHARED_MEMORY_OFFSET)?;
    let byte_size = int(v2::SHARED_MEMORY_BYTE_SIZE)?;
    let Some(region) = region else {
        return Ok(None);
    };
    let Some(byte_size) = byte_size else {
        return Err(invalid(format!(
            "'shared_memory_byte_size' must be specified along with 'shared_memory_region' \
             parameter for tensor '{shown}'"
        )));
    };
    Ok(Some((region, offset.unwrap_or(0), byte_size)))
}

/// The range `(region, offset, byte size)` of `regions` names (a 400 when
/// the region is unknown or the range past it).
fn region_range(
    regions: &SharedRegions,
    (region, offset, byte_size): (&str, u64, u64),
) -> Result<RegionRange, Failure> {
    regions
        .range(region, offset, byte_size)
        .map_err(|e| invalid(e.to_string()))
}

/// Decodes a `ModelInferRequest` message (a 400 for bytes that are not one).
pub fn decode_infer_request(message: &Bytes) -> Result<InferRequest<'_>, Failure> {
    InferRequest::decode(message)
        .map_err(|e| invalid(format!("the message is not a ModelInferRequest: {e}")))
}

/// Whether a streamed request's `parameters` ask for an empty final response.
pub fn asks_empty_final(parameters: &Parameters) -> bool {
    matches!(
        parameters
            .get(ENABLE_EMPTY_FINAL)
            .and_then(|p| p.parameter_choice.as_ref()),
        Some(ParameterChoice::BoolParam(true))
    )
}

/// One response to streamed request `id` of `model_name` with `outputs`
/// (described by `codec`), flagged `last` as a stream's response is. (A
/// `ModelInfer` answer is written by [`response::InferResponse`].)
pub fn stream_answer(
    codec: &v2::Codec,
    model_name: &str,
    id: &str,
    outputs: Vec<RawOutput>,
    last: bool,
) -> ModelStreamInferResponse {
    let (described, raw) = described_outputs(codec, outputs);
    let tag = ResponseTag {
        model_name: model_name.to_owned(),
        id: id.to_owned(),
        empty_final: false,
    };
    ModelStreamInferResponse {
        error_message: String::new(),
        infer_response: Some(tag.response(described, raw, last)),
    }
}

/// The encoded error that ends streamed request `id` of `model_name`.
pub fn encode_stream_error(model_name: &str, id: &str, message: &str) -> Vec<u8> {
    let tag = ResponseTag {
        model_name: model_name.to_owned(),
        id: id.to_owned(),
        empty_final: false,
    };
    prost::Message::encode_to_vec(&ModelStreamInferResponse {
        error_message: message.to_owned(),
        infer_response: Some(tag.response(Vec::new(), Vec::new(), true)),
    })
}

/// The `priority` parameter: an int64 or uint64 >= 0 (0: the default level).
fn priority(
    parameters: &std::collections::HashMap<String, InferParameter>,
) -> Result<Option<u32>, Failure> {
    let Some(parameter) = parameters.get("priority") else {
        return Ok(None);
    };
    let level = match parameter.parameter_choice {
        Some(ParameterChoice::Int64Param(p)) => u32::try_from(p).ok(),
        Some(ParameterChoice::Uint64Param(p)) => u32::try_from(p).ok(),
        _ => None,
    };
    match level {
        Some(p) => Ok((p > 0).then_some(p)),
        None => Err(invalid("parameter 'priority' must be an integer >= 0")),
    }
}

/// The request's parameters as a JSON object's text (`None`: it has none).
fn parameters_json(
    parameters: &std::collections::HashMap<String, InferParameter>,
) -> Option<String> {
    if parameters.is_empty() {
        return None;
    }
    let object: serde_json::Map<String, serde_json::Value> = parameters
        .iter()
        .map(|(name, parameter)| {
            let value = match &parameter.parameter_choice {
                Some(ParameterChoice::BoolParam(b)) => serde_json::Value::from(*b),
                Some(ParameterChoice::Int64Param(i)) => serde_json::Value::from(*i),
                Some(ParameterChoice::Uint64Param(u)) => serde_json::Value::from(*u),
                Some(ParameterChoice::StringParam(s)) => serde_json::Value::from(s.as_str()),
                // NaN and infinities have no JSON number: null, as serde_json writes them.
                Some(ParameterChoice::DoubleParam(d)) => serde_json::Value::from(*d),
                None => serde_json::Value::Null,
            };
            (name.clone(), value)
        })
        .collect();
    Some(serde_json::Value::Object(object).to_string())
}

/// The metadata entries whose names `pattern` matches (Triton's
/// `--grpc-header-forward-pattern`), with text values.
fn forwarded_metadata(
    metadata: &MetadataMap,
    pattern: Option<&regex::Regex>,
) -> Vec<(String, String)> {
    let Some(pattern) = pattern else {
        return Vec::new();
    };
    metadata
        .iter()
        .filter_map(|entry| match entry {
            tonic::metadata::KeyAndValueRef::Ascii(name, value) => {
                let name = name.as_str();
                pattern
                    .is_match(name)
                    .then(|| Some((name.to_owned(), value.to_str().ok()?.to_owned())))
                    .flatten()
            }
            tonic::metadata::KeyAndValueRef::Binary(..) => None,
        })
        .collect()
}

/// A request's inputs, decoded and checked: `(dtype, shape, where its
/// bytes are)` per input, in the request's order, and their owners.
struct Decoded {
    tensors: PerTensor<(DType, Shape, Source)>,
    owners: InputOwners,
    /// An input was read from a shared-memory region.
    shared_memory: bool,
}

/// Where one input's data comes from, as the request sends it.
enum Contents<'a> {
    /// `raw_input_contents[i]`.
    Raw(usize),
    /// A range of a shared-memory region.
    Region(RegionRange),
    /// Its typed contents (none sent: empty).
    Typed(Option<&'a InferTensorContents>),
    /// A datatype that has no contents field: the header check names it.
    Unknown,
}

/// The model's rule for one input's name, datatype and shape
/// ([`ServedModel::check_header`]).
pub type InputCheck<'a> = &'a mut dyn FnMut(&str, DType, &[u64]) -> Result<(), Failure>;

/// Decodes the inputs as the Python servicer does, with the same messages:
/// every input's contents chosen first, then each input's name, datatype
/// and shape checked (the elements of all inputs together at most
/// `limits.max_elements`; then `check`, the model's rule), raw bytes
/// checked against its shape, typed contents converted element by element.
///
/// With `regions`, an input may name a shared-memory region instead
/// (Triton's rules): then it sends no contents, `raw_input_contents` holds
/// one entry per other input, in order, and its bytes are read from the
/// region once its header is checked.
fn decode_inputs(
    inputs: &[request::Input<'_>],
    raw: smallvec::SmallVec<[Bytes; 1]>,
    limits: Limits,
    regions: Option<&SharedRegions>,
    model_name: &str,
    check: InputCheck<'_>,
) -> Result<Decoded, Failure> {
    // Counted only where regions may be named: no lookup otherwise.
    let in_regions = match regions {
        Some(_) => inputs
            .iter()
            .filter(|i| i.parameters.contains_key(v2::SHARED_MEMORY_REGION))
            .count(),
        None => 0,
    };
    let sent = inputs.len() - in_regions;
    if !raw.is_empty() && raw.len() != sent {
        return Err(invalid(if in_regions == 0 {
            format!(
                "raw_input_contents has {} entries but the request has {} inputs; give one per input, in order",
                raw.len(),
                inputs.len()
            )
        } else {
            format!(
                "raw_input_contents has {} entries but the request has {sent} inputs not in \
                 shared memory; give one per such input, in order",
                raw.len()
            )
        }));
    }
    let mut contents: PerTensor<Contents<'_>> = PerTensor::with_capacity(inputs.len());
    let mut next_raw = 0;
    for input in inputs {
        let name = &input.name;
        let region = match regions {
            Some(regions) => {
                shared_memory_params(name, &input.parameters)?.map(|params| (regions, params))
            }
            None => None,
        };
        contents.push(if let Some((regions, params)) = region {
            if input.contents.is_some() {
                return Err(invalid(format!(
                    "unexpected 'content' provided when using shared memory for input tensor \
                     '{}' for model '{}'",
                    Clipped(name),
                    Clipped(model_name)
                )));
            }
            Contents::Region(region_range(regions, params)?)
        } else if !raw.is_empty() {
            if input.contents.is_some() {
                return Err(invalid(format!(
                    "input '{shown}' has both contents and raw_input_contents",
                    shown = Clipped(name)
                )));
            }
            next_raw += 1;
            Contents::Raw(next_raw - 1)
        } else if let Some(dtype) = DType::from_v2(input.datatype) {
            if matches!(dtype, DType::Float16 | DType::BFloat16) {
                return Err(invalid(format!(
                    "input '{shown}': {} data must be sent in raw_input_contents",
                    input.datatype,
                    shown = Clipped(name)
                )));
            }
            Contents::Typed(input.contents.as_deref())
        } else {
            Contents::Unknown
        });
    }
    if inputs.is_empty() {
        return Err(invalid("the request has no inputs"));
    }
    let codec_error = |e: V2Error| Failure::new(e.status(), e.to_string());
    let mut elements_left = limits.max_elements;
    let mut tensors: PerTensor<(DType, Shape, Source)> = PerTensor::with_capacity(inputs.len());
    let mut decoded = Vec::new();
    let shared_memory = in_regions > 0;
    for (i, (input, contents)) in inputs.iter().zip(contents).enumerate() {
        let name = &input.name;
        let (dtype, shape) =
            v2::tensor_header(name, input.datatype, &input.shape).map_err(codec_error)?;
        if inputs[..i].iter().any(|earlier| earlier.name == *name) {
            return Err(invalid(format!(
                "input '{shown}' is given twice",
                shown = Clipped(name)
            )));
        }
        let (count, nbytes) =
            v2::checked_size(name, dtype, &shape, elements_left).map_err(|e| match e {
                V2Error::TooManyElements { input, shape, .. } => {
                    codec_error(V2Error::TooManyElements {
                        input,
                        shape,
                        limit: limits.max_elements,
                    })
                }
                e => codec_error(e),
            })?;
        elements_left -= count;
        // Against the model's inputs before any data is converted.
        check(name, dtype, &shape)?;
        let source = match contents {
            Contents::Raw(buffer) => {
                let bytes = raw.get(buffer).map_or(&[][..], |b| &b[..]);
                v2::check_raw(name, dtype, &shape, bytes).map_err(codec_error)?;
                // All of it: `check_raw` found it the shape's size (BYTES:
                // the shape's count of serialized elements).
                let _ = nbytes;
                Source::Shared {
                    buffer,
                    range: 0..bytes.len(),
                }
            }
            Contents::Typed(typed) => {
                let bytes = typed_bytes(name, dtype, &shape, count, typed).map_err(codec_error)?;
                decoded.push(bytes);
                Source::Decoded(decoded.len() - 1)
            }
            Contents::Region(range) => {
                let bytes = v2::region_input(name, dtype, &shape, &range).map_err(codec_error)?;
                decoded.push(bytes);
                Source::Decoded(decoded.len() - 1)
            }
            // The header check above refuses what has no contents field.
            Contents::Unknown => {
                return Err(invalid(format!(
                    "input '{shown}': {} data must be sent in raw_input_contents",
                    input.datatype,
                    shown = Clipped(name)
                )))
            }
        };
        tensors.push((dtype, shape, source));
    }
    Ok(Decoded {
        tensors,
        owners: InputOwners {
            shared: raw,
            decoded,
        },
        shared_memory,
    })
}

/// The little-endian bytes of typed contents: the field of `dtype`'s kind
/// (the others are ignored), `count` elements of it, each in range.
fn typed_bytes(
    name: &str,
    dtype: DType,
    shape: &[u64],
    count: usize,
    contents: Option<&InferTensorContents>,
) -> Result<Vec<u8>, V2Error> {
    let empty = InferTensorContents::default();
    let c = contents.unwrap_or(&empty);
    let given = match dtype {
        DType::Bool => c.bool_contents.len(),
        DType::Int8 | DType::Int16 | DType::Int32 => c.int_contents.len(),
        DType::Int64 => c.int64_contents.len(),
        DType::UInt8 | DType::UInt16 | DType::UInt32 => c.uint_contents.len(),
        DType::UInt64 => c.uint64_contents.len(),
        DType::Float32 => c.fp32_contents.len(),
        DType::Float64 => c.fp64_contents.len(),
        DType::Float16 | DType::BFloat16 => 0,
        DType::Bytes => c.bytes_contents.len(),
    };
    let mut elements = v2::Elements::new(dtype, count, given.saturating_mul(dtype.itemsize()));
    // Stops one past `count`: `finish` then says how many were expected.
    let take = count.saturating_add(1);
    match dtype {
        DType::Bool => {
            for &b in c.bool_contents.iter().take(take) {
                elements.push_bool(name, b)?;
            }
        }
        DType::Int8 | DType::Int16 | DType::Int32 => {
            for &v in c.int_contents.iter().take(take) {
                elements.push_integer(name, i128::from(v))?;
            }
        }
        DType::Int64 => {
            for &v in c.int64_contents.iter().take(take) {
                elements.push_integer(name, i128::from(v))?;
            }
        }
        DType::UInt8 | DType::UInt16 | DType::UInt32 => {
            for &v in c.uint_contents.iter().take(take) {
                elements.push_integer(name, i128::from(v))?;
            }
        }
        DType::UInt64 => {
            for &v in c.uint64_contents.iter().take(take) {
                elements.push_integer(name, i128::from(v))?;
            }
        }
        DType::Float32 => {
            for &v in c.fp32_contents.iter().take(take) {
                elements.push_float(name, f64::from(v))?;
            }
        }
        DType::Float64 => {
            for &v in c.fp64_contents.iter().take(take) {
                elements.push_float(name, v)?;
            }
        }
        DType::Float16 | DType::BFloat16 => {}
        DType::Bytes => {
            let limits = ferrobatch_core::bytes::BytesLimits::default();
            let lens = c.bytes_contents.iter().take(take).map(|v| v.len());
            ferrobatch_core::bytes::serialized_size(lens, limits).map_err(|e| {
                V2Error::Invalid(format!("input '{shown}': {e}", shown = Clipped(name)))
            })?;
            for v in c.bytes_contents.iter().take(take) {
                elements.push_bytes(v)?;
            }
        }
    }
    elements.finish(name, shape)
}

/// The outputs `request` asks for (indices in the codec's outputs; none
/// named: all, in their order), the shared-memory range of each that
/// names one (resolved now, before the model runs; aligned with the
/// outputs, empty when none does) and the count of classes of each asked
/// for as classes (Triton's `classification` parameter, an int64 > 0;
/// aligned likewise, empty when none is).
fn requested_outputs(
    request: &InferRequest<'_>,
    codec: &v2::Codec,
) -> Result<(PerTensor<usize>, OutputRegions, OutputClasses), Failure> {
    if request.outputs.is_empty() {
        return Ok(((0..codec.outputs().len()).collect(), Vec::new(), Vec::new()));
    }
    let mut asked = PerTensor::with_capacity(request.outputs.len());
    let mut regions = OutputRegions::new();
    let mut classes = OutputClasses::new();
    for output in &request.outputs {
        let index = codec
            .output_index(output.name)
            .map_err(|e| invalid(e.to_string()))?;
        // Each entry would be sent in full (see `v2::decode`).
        if asked.contains(&index) {
            return Err(invalid(format!(
                "output '{shown}' is asked for twice",
                shown = Clipped(output.name)
            )));
        }
        let params = match codec.regions() {
            Some(shared) => shared_memory_params(output.name, &output.parameters)?
                .map(|params| (shared, params)),
            None => None,
        };
        let class_count =
            match output.parameters.get("classification") {
                None => None,
                Some(_) if params.is_some() => {
                    return Err(invalid(
                        "output can't set both 'shared_memory_region' and 'classification'",
                    ))
                }
                // Triton's rule and words (its HTTP side also reads 0 as none).
                Some(parameter) => match parameter.parameter_choice {
                    Some(ParameterChoice::Int64Param(count)) if count > 0 => {
                        if let Some(spec) = codec.outputs().get(index) {
                            v2::classify::check_classifiable(&spec.name, spec.dtype)
                                .map_err(|e| invalid(e.to_string()))?;
                        }
                        Some(u32::try_from(count).unwrap_or(u32::MAX))
                    }
                    Some(ParameterChoice::Int64Param(_)) => {
                        return Err(invalid(
                            "invalid value for 'classification' parameter, expected >= 0",
                        ))
                    }
                    _ => return Err(invalid(
                        "invalid value type for 'classification' parameter, expected int64_param",
                    )),
                },
            };
        if class_count.is_some() && classes.is_empty() {
            classes.resize(asked.len(), None);
        }
        if class_count.is_some() || !classes.is_empty() {
            classes.push(class_count);
        }
        let range = match params {
            Some((shared, params)) => Some(region_range(shared, params)?),
            None => None,
        };
        if range.is_some() && regions.is_empty() {
            regions.resize(asked.len(), None);
        }
        if range.is_some() || !regions.is_empty() {
            regions.push(range);
        }
        asked.push(index);
    }
    Ok((asked, regions, classes))
}

/// The request's timeout in seconds: its `timeout` parameter (an int64 of
/// microseconds; 0: none) or `call_timeout`, the smaller.
fn timeout(
    parameters: &std::collections::HashMap<String, InferParameter>,
    call_timeout: Option<Duration>,
) -> Result<Option<f64>, Failure> {
    let mut timeout = None;
    if let Some(parameter) = parameters.get("timeout") {
        match parameter.parameter_choice {
            Some(ParameterChoice::Int64Param(us)) if us >= 0 => {
                timeout = Some(us as f64 / 1e6).filter(|&t| t > 0.0);
            }
            _ => {
                return Err(invalid(
                    "parameter 'timeout' must be an int64 of microseconds >= 0",
                ))
            }
        }
    }
    Ok(match (timeout, call_timeout) {
        (None, None) => None,
        (Some(t), None) => Some(t),
        (None, Some(call)) => Some(call.as_secs_f64()),
        (Some(t), Some(call)) => Some(t.min(call.as_secs_f64())),
    })
}

/// The call's deadline as its `grpc-timeout` header says (gRPC over HTTP/2:
/// at most 8 digits and a unit, H M S m u n); None when absent or malformed.
fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    parse_grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)
}

fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    let unit = text.chars().last()?;
    let digits = text.get(..text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(value.checked_mul(3600)?),
        'M' => Duration::from_secs(value.checked_mul(60)?),
        'S' => Duration::from_secs(value),
        'm' => Duration::from_millis(value),
        'u' => Duration::from_micros(value),
        'n' => Duration::from_nanos(value),
        _ => return None,
    })
}

/// One message of a `ModelStreamInfer` call's response stream, and the
/// bytes it holds of the stream's [`Backlog`].
type Outgoing = (Result<ModelStreamInferResponse, Status>, usize);

/// The sending side of a `ModelStreamInfer` call's response stream, and the
/// bytes of decoupled responses on it that its client has not taken yet
/// (counted by the model's worker, [`crate::replies::Replies::stream`]).
#[derive(Clone)]
struct StreamOut {
    messages: mpsc::UnboundedSender<Outgoing>,
    backlog: Arc<Backlog>,
}

impl StreamOut {
    /// Queues `message`, which holds `counted` bytes of the backlog; they
    /// are let go at once if the client is gone.
    fn send(&self, message: Result<ModelStreamInferResponse, Status>, counted: usize) {
        if self.messages.send((message, counted)).is_err() {
            self.backlog.release(counted);
        }
    }

    fn closed(&self) -> impl Future<Output = ()> + '_ {
        self.messages.closed()
    }
}

/// A `ModelStreamInfer` call's responses as tonic writes them: a message's
/// bytes leave the stream's backlog as tonic takes it (HTTP/2 flow control
/// stops tonic taking more while the client does not read).
pub struct StreamResponses {
    responses: mpsc::UnboundedReceiver<Outgoing>,
    backlog: Arc<Backlog>,
}

impl tokio_stream::Stream for StreamResponses {
    type Item = Result<ModelStreamInferResponse, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let next = std::task::ready!(self.responses.poll_recv(cx));
        std::task::Poll::Ready(next.map(|(message, counted)| {
            self.backlog.release(counted);
            message
        }))
    }
}

/// A streamed request in its model's queue.
struct QueuedStream {
    model: Arc<ServedModel>,
    submitted: Submitted,
    /// A decoupled model's responses, as they come; None: one answer.
    parts: Option<mpsc::UnboundedReceiver<Vec<RawOutput>>>,
}

impl QueuedStream {
    /// Sends its responses on `out` as they come; the status of its
    /// failure, if it fails.
    async fn answer(self, tag: &ResponseTag, out: &StreamOut) -> Result<(), Status> {
        let QueuedStream {
            model,
            submitted,
            parts,
        } = self;
        // `counted`: the bytes the response holds of the stream's backlog.
        let send = |outputs: Vec<RawOutput>, last: bool, counted: usize| {
            let (described, raw) = described_outputs(model.replies().codec(), outputs);
            let response = tag.response(described, raw, last);
            let message = ModelStreamInferResponse {
                error_message: String::new(),
                infer_response: Some(response),
            };
            out.send(Ok(message), counted);
        };
        let Some(parts) = parts else {
            return match model.reply(submitted).await.map_err(status)? {
                Answer::Raw(outputs) => {
                    // Made already: counted whatever its size (the reader
                    // then waits for the client to read, see Backlog).
                    let counted = part_bytes(&outputs);
                    out.backlog.add(counted);
                    send(outputs, true, counted);
                    Ok(())
                }
                _ => Err(Status::internal(
                    "a streamed request answered as another kind",
                )),
            };
        };
        let mut streamed = Streamed::new(model.clone(), submitted, parts);
        while let Some(part) = streamed.next().await {
            let part = part.map_err(status)?;
            let counted = part_bytes(&part);
            send(part, false, counted);
        }
        if tag.empty_final {
            send(Vec::new(), true, 0);
        }
        Ok(())
    }
}

/// What every response to one streamed request carries: its model, its
/// `id`, and whether the client asked for an empty final response.
struct ResponseTag {
    model_name: String,
    id: String,
    empty_final: bool,
}

impl ResponseTag {
    /// One response on the stream; `last`: the request's last
    /// (`triton_final_response`, as Triton flags it).
    fn response(
        &self,
        outputs: Vec<InferOutputTensor>,
        raw: Vec<Bytes>,
        last: bool,
    ) -> ModelInferResponse {
        let flag = InferParameter {
            parameter_choice: Some(ParameterChoice::BoolParam(last)),
        };
        ModelInferResponse {
            model_name: self.model_name.clone(),
            model_version: MODEL_VERSION.to_owned(),
            id: self.id.clone(),
            parameters: [(FINAL_RESPONSE.to_owned(), flag)].into_iter().collect(),
            outputs,
            raw_output_contents: raw,
        }
    }
}

/// Each output's description and its raw bytes, in the order given.
fn described_outputs(
    codec: &v2::Codec,
    outputs: Vec<RawOutput>,
) -> (Vec<InferOutputTensor>, Vec<Bytes>) {
    let specs = codec.outputs();
    let described = outputs
        .iter()
        .map(|o| {
            let spec = specs.get(o.index);
            let dtype = match o.classified {
                true => DType::Bytes.v2_name(),
                false => spec.map_or("", |s| s.dtype.v2_name()),
            };
            InferOutputTensor {
                name: spec.map_or_else(String::new, |s| s.name.clone()),
                datatype: dtype.to_owned(),
                shape: o
                    .shape
                    .iter()
                    .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
                    .collect(),
                parameters: Default::default(),
                contents: None,
            }
        })
        .collect();
    (described, outputs.into_iter().map(|o| o.data).collect())
}

pub mod request;
pub mod response;

#[cfg(test)]
mod region_tests;
#[cfg(test)]
mod tests;
