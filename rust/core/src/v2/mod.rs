//! The Open Inference Protocol v2 (KServe v2) codec: infer requests in, infer
//! responses out, over JSON and the binary tensor data extension.
//!
//! # Requests
//!
//! [`Codec::decode`] takes one request body and, for the binary extension,
//! the value of `Inference-Header-Content-Length` (the body is then a JSON
//! header of that many bytes followed by the tensors' raw bytes). Each input
//! comes out as one contiguous little-endian, row-major byte buffer in its
//! datatype: a JSON `data` array (flat or nested) is parsed element by
//! element straight into that buffer ([`json`] is a pull parser: no tree of
//! values, no intermediate `Vec<f64>`); binary data is a range of the body,
//! validated ([`Data::Body`]), so the caller may use it without copying.
//! [`Codec::decode_remembered`] answers a binary request whose JSON header a
//! [`HeaderMemo`] holds (the same bytes, the same body length) without
//! reading it again: clients send one header per shape.
//!
//! A codec [`Codec::with_regions`] serves Triton's system shared-memory
//! extension ([`regions`]): an input whose parameters name a
//! `shared_memory_region` (with `shared_memory_offset`, default 0, and
//! `shared_memory_byte_size`) is read from that range of the region into a
//! buffer of its own ([`Data::Owned`]; checked as binary data is, its size
//! against its shape's before anything is allocated). An input sets exactly
//! one of `data`, `binary_data_size` and `shared_memory_region` (Triton's
//! rule and words). An output that names a region has its range resolved
//! as the request is decoded ([`RequestedOutput::shared`]: an unknown
//! region or a range past it is refused before the model runs, and so is a
//! range too small for an output whose size the codec knows from the
//! request, [`Codec::with_output_row_bytes`]). A request
//! naming a region is flagged ([`InferRequest::shared_memory`]): never
//! remembered by a memo nor answered from a response cache. Without
//! regions, a tensor naming one is refused ([`shared_memory_refused`]).
//!
//! # Limits
//!
//! [`Limits`] bounds the body (`max_body_size`) and the elements all inputs
//! may declare together (`max_elements`). Both are checked before anything
//! is allocated for the data: a shape of `[1, 10**12]` is refused from the
//! shape alone, and a JSON input is refused when its shape needs more values
//! than the rest of the header could hold. All size arithmetic is checked;
//! no input makes the codec panic (the property tests and the fuzz target in
//! `rust/fuzz` feed it arbitrary bytes).
//!
//! # Responses
//!
//! [`Codec::encode`] writes a response straight from each output's bytes,
//! datatype and shape: JSON `data` (floats printed shortest-round-trip in
//! their own precision, integers exactly) or, per output, the binary
//! extension (`binary_data_size`, the raw bytes after the JSON header, and
//! the header's length to send as `Inference-Header-Content-Length`).
//! [`Codec::encode_with_regions`] writes each output the request put in a
//! region ([`InferRequest::output_regions`]) there, in its wire form (BYTES:
//! each element's 4-byte little-endian length and bytes), and answers it
//! with its `name`, `datatype` and `shape` only, as Triton does; an output
//! larger than its range is the client's mistake (a 400), refused before
//! any output is written.
//!
//! The messages of [`V2Error`] are those of the Python front-ends this codec
//! replaced, naming the input, the field and what was expected.

pub mod classify;
mod decode;
mod elements;
mod encode;
mod error;
pub mod generate;
pub mod json;
mod memo;
pub mod regions;

pub use decode::{Data, HeaderCheck, InferRequest, Input, RequestedOutput, Shape};
pub use elements::Elements;
pub use encode::{write_json_string, Encoded, Output};
pub use error::{quote, shape_text, short, Clipped, V2Error};

/// The tensor parameter of Triton's system shared-memory extension: the
/// region holding an input's bytes, or to receive an output's. A codec
/// without [`Codec::regions`] refuses a tensor that names one
/// ([`shared_memory_refused`]), never answering from (or into) the
/// request's own bytes, which a client of that extension would not read.
pub const SHARED_MEMORY_REGION: &str = "shared_memory_region";
/// Where the tensor starts within its region (default 0).
pub const SHARED_MEMORY_OFFSET: &str = "shared_memory_offset";
/// The tensor's bytes in its region.
pub const SHARED_MEMORY_BYTE_SIZE: &str = "shared_memory_byte_size";

/// The outputs a request asked for, as bits of their indices
/// ([`crate::Request::requested_outputs`], what a model built with its
/// requests is told); 0 (not said) when one is past bit 63.
pub fn output_bits(indices: impl IntoIterator<Item = usize>) -> u64 {
    let mut bits = 0u64;
    for i in indices {
        match u32::try_from(i).ok().and_then(|i| 1u64.checked_shl(i)) {
            Some(bit) => bits |= bit,
            None => return 0,
        }
    }
    bits
}

/// Why a tensor naming a shared-memory region is refused by a codec without
/// regions (clients' shared memory is off: `tensor`, how the message names
/// it, "input 'x'").
pub fn shared_memory_refused(tensor: &str) -> String {
    format!(
        "{tensor}: shared memory (shared_memory_region) is disabled on this server \
         (start it with --allow-client-shm to enable); send the tensor's data in the request \
         and read outputs from the response"
    )
}
pub use memo::{HeaderMemo, MAX_REMEMBERED_HEADER, REMEMBERED_HEADERS};

use std::sync::Arc;

use crate::DType;

/// The one version every model is served as.
pub const MODEL_VERSION: &str = "1";

/// What a request may carry at most; checked before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of a whole request body (JSON header and binary data).
    pub max_body_size: usize,
    /// Elements of all inputs of one request together.
    pub max_elements: usize,
}

impl Default for Limits {
    /// 64 MiB of body, 64 Mi elements: the front-ends' defaults.
    fn default() -> Self {
        Limits {
            max_body_size: 64 << 20,
            max_elements: 64 << 20,
        }
    }
}

/// One output of the model, as responses declare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputSpec {
    pub name: String,
    pub dtype: DType,
}

/// The codec of one served model: its name, its outputs (requests may
/// select among them) and the limits. Immutable; share it between threads.
#[derive(Debug, Clone)]
pub struct Codec {
    model: String,
    outputs: Vec<OutputSpec>,
    limits: Limits,
    /// `{"model_name":...,"model_version":"1"`: the opening of every response.
    response_prefix: Vec<u8>,
    /// `{"name":...,"datatype":"FP32","shape":[`: the opening of each output entry.
    output_prefixes: Vec<Vec<u8>>,
    /// False for a model served without batching (Triton's `max_batch_size:
    /// 0`): a request's tensors are one sample each, shaped as declared,
    /// with no batch dimension, and so are the response's.
    batching: bool,
    /// True for a decoupled model (Triton's `model_transaction_policy {
    /// decoupled: true }`): any number of responses per request, streamed
    /// over gRPC `ModelStreamInfer` only.
    decoupled: bool,
    /// The server's shared-memory regions (Triton's system shared-memory
    /// extension): tensors may name them. None: a tensor naming one is
    /// refused.
    regions: Option<regions::SharedRegions>,
    /// The bytes of one row of each output (of the whole output without
    /// batching), index-aligned with `outputs`, where known before the
    /// model runs; empty: none known (see [`Codec::with_output_row_bytes`]).
    output_row_bytes: Vec<Option<usize>>,
    /// The class labels of each output, index-aligned with `outputs`
    /// (Triton's `label_filename`): a classified output's class `k` is
    /// answered with label `k` where there is one; empty: none has labels
    /// (see [`Codec::with_output_labels`]).
    output_labels: Vec<Option<Arc<[String]>>>,
}

impl Codec {
    /// A codec for `model`, whose outputs are `outputs` (in the order
    /// responses list them by default).
    pub fn new(model: &str, outputs: Vec<OutputSpec>, limits: Limits) -> Codec {
        let mut response_prefix = b"{\"model_name\":".to_vec();
        encode::write_json_string(&mut response_prefix, model);
        response_prefix.extend_from_slice(b",\"model_version\":\"");
        response_prefix.extend_from_slice(MODEL_VERSION.as_bytes());
        response_prefix.push(b'"');
        let output_prefixes = outputs
            .iter()
            .map(|o| {
                let mut prefix = b"{\"name\":".to_vec();
                encode::write_json_string(&mut prefix, &o.name);
                prefix.extend_from_slice(b",\"datatype\":\"");
                prefix.extend_from_slice(o.dtype.v2_name().as_bytes());
                prefix.extend_from_slice(b"\",\"shape\":[");
                prefix
            })
            .collect();
        Codec {
            model: model.to_owned(),
            outputs,
            limits,
            response_prefix,
            output_prefixes,
            batching: true,
            decoupled: false,
            regions: None,
            output_labels: Vec::new(),
            output_row_bytes: Vec::new(),
        }
    }

    /// This codec, reading and writing tensors in `regions` when requests
    /// name them (see [`regions`]).
    pub fn with_regions(mut self, regions: regions::SharedRegions) -> Codec {
        self.regions = Some(regions);
        self
    }

    /// The regions requests may name, if any.
    pub fn regions(&self) -> Option<&regions::SharedRegions> {
        self.regions.as_ref()
    }

    /// This codec, knowing the size of outputs before the model runs:
    /// `row_bytes[i]` is the bytes of one row of output `i` (of
    /// [`Codec::outputs`]; for a codec [`Codec::without_batching`], of the
    /// whole output, which has no batch dimension), `None` where the model
    /// decides it (BYTES, variable-shape outputs). An output that a request
    /// puts in a shared-memory range smaller than it will be is then
    /// refused as the request is decoded, before the model runs
    /// ([`Codec::check_output_regions`]), rather than when its response is
    /// written. Empty (the default): nothing is checked before. Entries
    /// past the outputs are ignored; outputs past the entries are `None`.
    pub fn with_output_row_bytes(mut self, row_bytes: Vec<Option<usize>>) -> Codec {
        self.output_row_bytes = row_bytes;
        self
    }

    /// This codec, with class labels for its outputs: `labels[i]` those of
    /// output `i` (of [`Codec::outputs`]), label `k` for its class `k`
    /// (Triton's classification extension answers `"<value>:<k>:<label>"`;
    /// a class past the labels has none). Entries past the outputs are
    /// ignored.
    pub fn with_output_labels(mut self, labels: Vec<Option<Vec<String>>>) -> Codec {
        self.output_labels = labels.into_iter().map(|l| l.map(Arc::from)).collect();
        self
    }

    /// The class labels of output `index`, if it has any.
    pub fn output_labels(&self, index: usize) -> Option<&[String]> {
        self.output_labels.get(index)?.as_deref()
    }

    /// The bytes of one row of each output where known (see
    /// [`Codec::with_output_row_bytes`]); empty when none was given.
    pub fn output_row_bytes(&self) -> &[Option<usize>] {
        &self.output_row_bytes
    }

    /// Refuses (a 400, [`regions::output_too_small`]'s words) a request
    /// whose `outputs` (`(index in the outputs, its shared-memory range)`)
    /// include one of known size ([`Codec::with_output_row_bytes`]) larger
    /// than its range. `first_shape`: the shape of the request's first
    /// input, whose first dimension is the request's rows with batching
    /// (none, or an empty shape: one row). A size past `usize` is not
    /// checked here (the request is refused elsewhere or its output found
    /// too large when written).
    pub fn check_output_regions<'r>(
        &self,
        first_shape: Option<&[u64]>,
        outputs: impl IntoIterator<Item = (usize, &'r regions::RegionRange)>,
    ) -> Result<(), V2Error> {
        if self.output_row_bytes.iter().all(Option::is_none) {
            return Ok(());
        }
        let rows = match self.batching {
            true => first_shape.and_then(|s| s.first().copied()).unwrap_or(1),
            false => 1,
        };
        for (index, range) in outputs {
            let Some(&Some(row_bytes)) = self.output_row_bytes.get(index) else {
                continue;
            };
            let needed = usize::try_from(rows)
                .ok()
                .and_then(|rows| rows.checked_mul(row_bytes));
            if let Some(needed) = needed.filter(|&needed| range.len() < needed) {
                let name = self.outputs.get(index).map_or("", |o| o.name.as_str());
                return Err(V2Error::Invalid(regions::output_too_small(
                    name,
                    range.len(),
                    needed,
                )));
            }
        }
        Ok(())
    }

    /// This codec, for a model served without batching (see [`Codec::batching`]).
    pub fn without_batching(mut self) -> Codec {
        self.batching = false;
        self
    }

    /// Whether requests carry a batch dimension (false: one sample each).
    pub fn batching(&self) -> bool {
        self.batching
    }

    /// This codec, for a decoupled model (see [`Codec::decoupled`]).
    pub fn decoupled_responses(mut self) -> Codec {
        self.decoupled = true;
        self
    }

    /// Whether the model streams its responses (decoupled): its requests
    /// come over gRPC `ModelStreamInfer` only.
    pub fn decoupled(&self) -> bool {
        self.decoupled
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn outputs(&self) -> &[OutputSpec] {
        &self.outputs
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The index of output `name`, or the error a request naming it gets.
    pub fn output_index(&self, name: &str) -> Result<usize, V2Error> {
        self.outputs
            .iter()
            .position(|o| o.name == name)
            .ok_or_else(|| {
                let known: Vec<&str> = self.outputs.iter().map(|o| o.name.as_str()).collect();
                V2Error::Invalid(format!(
                    "unknown output {} for model '{}'; outputs: {}",
                    error::quote(name),
                    self.model,
                    known.join(", ")
                ))
            })
    }
}

/// The datatype named `datatype` for input `name`, or the error saying why not.
pub fn input_dtype(name: &str, datatype: &str) -> Result<DType, V2Error> {
    if let Some(dtype) = DType::from_v2(datatype) {
        return Ok(dtype);
    }
    let known: Vec<&str> = DType::ALL
        .iter()
        .chain([&DType::Bytes])
        .map(|d| d.v2_name())
        .collect();
    Err(V2Error::Invalid(format!(
        "input '{shown}': unknown datatype {}; expected one of {}",
        error::quote(datatype),
        known.join(", "),
        shown = Clipped(name)
    )))
}

/// Checks a tensor's name, datatype and shape as a client sent them outside
/// JSON (gRPC): the same rules and messages as the JSON decoder's.
pub fn tensor_header(name: &str, datatype: &str, shape: &[i64]) -> Result<(DType, Shape), V2Error> {
    if name.is_empty() {
        return Err(V2Error::Invalid(
            "every tensor needs a non-empty 'name', got ''".into(),
        ));
    }
    let dtype = input_dtype(name, datatype)?;
    let dims: Option<Shape> = shape.iter().map(|&d| u64::try_from(d).ok()).collect();
    let dims = dims.ok_or_else(|| {
        V2Error::Invalid(format!(
            "input '{shown}': 'shape' must be a list of non-negative integers, got {shape}",
            shown = Clipped(name),
            shape = shape_text(shape)
        ))
    })?;
    Ok((dtype, dims))
}

/// Elements in `shape` and their size in bytes as `dtype`, refused (before
/// anything is allocated) when more than `limit` elements.
pub fn checked_size(
    name: &str,
    dtype: DType,
    shape: &[u64],
    limit: usize,
) -> Result<(usize, usize), V2Error> {
    let too_many = || V2Error::TooManyElements {
        input: name.to_owned(),
        shape: shape_text(shape),
        limit,
    };
    let mut count: usize = 1;
    for &d in shape {
        let d = usize::try_from(d).map_err(|_| too_many())?;
        count = count.checked_mul(d).ok_or_else(too_many)?;
    }
    if count > limit {
        return Err(too_many());
    }
    let nbytes = count.checked_mul(dtype.itemsize()).ok_or_else(too_many)?;
    Ok((count, nbytes))
}

/// Checks raw tensor bytes (the binary extension, gRPC's `raw_input_contents`):
/// their length is the shape's, and BOOL bytes are 0 or 1; BYTES data is
/// the shape's count of elements, each a 4-byte little-endian length and
/// its bytes (within [`crate::bytes::BytesLimits::default`]).
pub fn check_raw(name: &str, dtype: DType, shape: &[u64], data: &[u8]) -> Result<(), V2Error> {
    let (count, expected) = checked_size(name, dtype, shape, usize::MAX)?;
    if dtype == DType::Bytes {
        return crate::bytes::check(data, count, crate::bytes::BytesLimits::default())
            .map_err(|e| V2Error::Invalid(format!("input '{shown}': {e}", shown = Clipped(name))));
    }
    if data.len() != expected {
        return Err(size_mismatch(name, dtype, shape, expected, data.len()));
    }
    if dtype == DType::Bool && data.iter().any(|&b| b > 1) {
        return Err(V2Error::Invalid(format!(
            "input '{shown}': BOOL bytes must be 0 or 1",
            shown = Clipped(name)
        )));
    }
    Ok(())
}

fn size_mismatch(name: &str, dtype: DType, shape: &[u64], expected: usize, got: usize) -> V2Error {
    V2Error::Invalid(format!(
        "input '{shown}': {} shape {shape} needs {expected} bytes, got {got}",
        dtype.v2_name(),
        shown = Clipped(name),
        shape = shape_text(shape)
    ))
}

/// Input `name`'s bytes, read from `range` of a shared-memory region and
/// checked as raw bytes are ([`check_raw`]). The range's size is checked
/// against the shape's (BYTES: against the per-request bound) before
/// anything is allocated.
pub fn region_input(
    name: &str,
    dtype: DType,
    shape: &[u64],
    range: &regions::RegionRange,
) -> Result<Vec<u8>, V2Error> {
    let (_, expected) = checked_size(name, dtype, shape, usize::MAX)?;
    if dtype == DType::Bytes {
        let limit = crate::bytes::BytesLimits::default().max_request;
        if range.len() > limit {
            let e = crate::bytes::BytesError::TooLarge {
                len: range.len(),
                limit,
            };
            return Err(V2Error::Invalid(format!(
                "input '{shown}': {e}",
                shown = Clipped(name)
            )));
        }
    } else if range.len() != expected {
        return Err(size_mismatch(name, dtype, shape, expected, range.len()));
    }
    let bytes = range.read().map_err(|e| V2Error::Invalid(e.to_string()))?;
    check_raw(name, dtype, shape, &bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod region_tests;
#[cfg(test)]
mod tests;
