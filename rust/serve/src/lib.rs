//! The native Open Inference Protocol v2 front-end of ferrobatch: a tokio
//! runtime with hyper (HTTP/1.1 and h2c) and tonic (gRPC, on a port of its
//! own) inside the extension, so a network request never becomes a Python
//! object.
//!
//! An HTTP infer request's body is decoded by the core's v2 codec straight
//! into the model's [`Batcher`](ferrobatch_core::Batcher) queue (binary
//! inputs are ranges of the body, not copies), with the same dispatch rule,
//! admission and deadlines as in-process callers; a gRPC `ModelInfer`
//! message's tensors take the same path ([`ServedModel::enqueue`]; raw
//! contents are slices of the message). Its sink is the model's
//! [`Replies`] table: when a worker finishes the batch, the binding hands
//! the batch's outputs to [`Replies::deliver`], which cuts each request's
//! rows from them on that worker (without the GIL), encoded into its HTTP
//! response or as gRPC's raw bytes, and wakes its handler. Python runs once
//! per batch, in the model call.
//!
//! Every request is answered once and counted once in the model's
//! [`Tally`](ferrobatch_core::Tally): a result, or a typed failure with its
//! HTTP status (see [`replies`]).

pub mod encoding;
pub mod grpc;
pub mod http;
pub mod metadata;
pub mod model;
mod outbox;
pub mod replies;
pub mod restrict;
pub mod server;
mod streamed;
pub mod tls;

pub use grpc::ResponseCompression;
pub use http::{
    Fallback, FallbackCall, FallbackReply, FallbackRequest, FallbackResponse, Withdraw,
};
pub use metadata::{Catalog, ModelMetadata, ServerMetadata, TensorMetadata};
pub use model::ServedModel;
pub use replies::{Column, Failure, Replies, VaryingRows};
pub use restrict::{Api, Restrictions};
pub use server::{header_pattern, Config, Frontend, Listen, MAX_CONNECTIONS, MAX_THREADS};
pub use tls::{Tls, TlsFiles};
