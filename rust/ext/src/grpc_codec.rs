//! The Python gRPC servicer's `ModelInfer` and `ModelStreamInfer` on
//! protobuf bytes: each request is read by the native front-end's gRPC
//! infer rules ([`ferrobatch_serve::grpc::read_infer_call`], the one copy of
//! them) and each answer encoded by its encoder; Python only submits.
//!
//! Shared memory (Triton's system shared-memory extension): `read` reads
//! the inputs that name a region from it and keeps the ranges of the
//! outputs that name one on the request; `grpc_response(..., request=)`
//! writes those outputs there, answering them with empty raw contents.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use ferrobatch_core::v2::regions::RegionRange;
use ferrobatch_core::v2::Shape;
use ferrobatch_serve::grpc::response::{InferResponse, OutputRows};
use ferrobatch_serve::grpc::{self, InferCall};
use ferrobatch_serve::model::Source;
use ferrobatch_serve::replies::RawOutput;
use ferrobatch_serve::Failure;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use crate::codec::{status_error, V2Codec, V2Tensor};
use crate::without_gil;

fn failure_error(py: Python<'_>, failure: Failure) -> PyErr {
    status_error(py, failure.status, failure.message)
}

/// One `ModelInferRequest`, decoded from its message.
#[pyclass(frozen, module = "ferrobatch._core")]
pub(crate) struct GrpcInferRequest {
    /// Read again by `read`: its raw contents are slices of it, and it is
    /// the Python `bytes` object's memory, not a copy.
    message: Bytes,
    model_name: String,
    model_version: String,
    id: String,
    empty_final: bool,
    /// The outputs its last `read` found in shared memory: `(index in the
    /// codec's outputs, range)`.
    regions: Mutex<Vec<(usize, RegionRange)>>,
    /// Its last `read` found a tensor naming a region.
    shared_memory: AtomicBool,
    /// The outputs its last `read` found asked for as classes: `(index in
    /// the codec's outputs, how many)`.
    classes: Mutex<Vec<(usize, u32)>>,
    /// Its last `read` found an output asked for as classes.
    classified: AtomicBool,
}

#[pymethods]
impl GrpcInferRequest {
    /// Decodes `message`; a `CodecError` (400) for bytes that are not one.
    #[new]
    fn new(py: Python<'_>, message: PyBackedBytes) -> PyResult<GrpcInferRequest> {
        let message = Bytes::from_owner(message);
        let request = grpc::decode_infer_request(&message).map_err(|f| failure_error(py, f))?;
        let (model_name, model_version, id) = (
            request.model_name.to_owned(),
            request.model_version.to_owned(),
            request.id.to_owned(),
        );
        let empty_final = grpc::asks_empty_final(&request.parameters);
        drop(request);
        Ok(GrpcInferRequest {
            message,
            model_name,
            model_version,
            id,
            empty_final,
            regions: Mutex::new(Vec::new()),
            shared_memory: AtomicBool::new(false),
            classes: Mutex::new(Vec::new()),
            classified: AtomicBool::new(false),
        })
    }

    /// Whether the last `read` found a tensor naming a shared-memory
    /// region: submit it `uncached`, and answer it with
    /// `grpc_response(..., request=self)`.
    #[getter]
    fn shared_memory(&self) -> bool {
        self.shared_memory.load(Ordering::Relaxed)
    }

    /// Whether the last `read` found an output asked for as classes
    /// (Triton's classification extension): answer it with
    /// `grpc_response(..., request=self)`.
    #[getter]
    fn classified(&self) -> bool {
        self.classified.load(Ordering::Relaxed)
    }

    #[getter]
    fn model_name(&self) -> &str {
        &self.model_name
    }

    #[getter]
    fn model_version(&self) -> &str {
        &self.model_version
    }

    #[getter]
    fn id(&self) -> &str {
        &self.id
    }

    /// Whether a streamed request asks for an empty final response.
    #[getter]
    fn empty_final(&self) -> bool {
        self.empty_final
    }

    /// Reads the request for the model of `codec`: `(inputs, outputs,
    /// priority, parameters, timeout, requested_outputs)`, the inputs
    /// `{name: V2Tensor}`, the outputs' names, the priority level (None: the
    /// default), the parameters as a JSON object's text (only when
    /// `keeps_parameters`), the deadline in seconds (its `timeout` parameter
    /// or `call_timeout`, the smaller), and the outputs as bits of their
    /// indices (what a model built with its requests is told). A
    /// `CodecError` with its HTTP status for a request the rules refuse.
    #[allow(clippy::type_complexity)]
    fn read<'py>(
        &self,
        py: Python<'py>,
        codec: &V2Codec,
        call_timeout: Option<f64>,
        keeps_parameters: bool,
    ) -> PyResult<(
        Bound<'py, PyDict>,
        Vec<String>,
        Option<u32>,
        Option<String>,
        Option<f64>,
        u64,
    )> {
        let call_timeout = call_timeout.and_then(|t| Duration::try_from_secs_f64(t.max(0.0)).ok());
        // Decoded again, borrowing: this allocates nothing for its strings.
        let mut request =
            grpc::decode_infer_request(&self.message).map_err(|f| failure_error(py, f))?;
        // Every header is checked by the model's submit, as in process.
        let read = |request: &mut grpc::request::InferRequest<'_>| {
            let mut accept = |_: &str, _, _: &[u64]| Ok(());
            grpc::read_infer_call(
                request,
                codec.core(),
                call_timeout,
                &[],
                keeps_parameters,
                &mut accept,
            )
        };
        // Regions may hold megabytes to copy: read without the GIL then.
        let read = if codec.core().regions().is_some_and(|r| !r.is_empty()) {
            without_gil(py, || read(&mut request))
        } else {
            read(&mut request)
        };
        let InferCall {
            tensors,
            mut owners,
            outputs,
            regions,
            classes,
            meta,
        } = read.map_err(|f| failure_error(py, f))?;
        let inputs = PyDict::new(py);
        for (input, (dtype, shape, source)) in request.inputs.iter().zip(tensors) {
            // `read_infer_call` checked each source against its shape; a
            // source it did not make is refused, never read short.
            let data = match source {
                Source::Shared { buffer, range } => owners
                    .shared
                    .get(buffer)
                    .filter(|b| b.get(range.clone()).is_some())
                    .map(|b| b.slice(range)),
                Source::Decoded(i) => owners
                    .decoded
                    .get_mut(i)
                    .map(|d| Bytes::from(std::mem::take(d))),
            };
            let Some(data) = data else {
                let message = format!("input '{}': its bytes are missing", input.name);
                return Err(status_error(py, 500, message));
            };
            inputs.set_item(input.name, V2Tensor::from_bytes(py, dtype, &shape, data)?)?;
        }
        let in_regions: Vec<(usize, RegionRange)> = outputs
            .iter()
            .zip(regions)
            .filter_map(|(&index, range)| Some((index, range?)))
            .collect();
        // Locked only for a request that names a region (or one read after it).
        let named_before = self.shared_memory.swap(meta.uncached, Ordering::Relaxed);
        if named_before || !in_regions.is_empty() {
            *self.regions.lock().unwrap_or_else(|e| e.into_inner()) = in_regions;
        }
        let in_classes: Vec<(usize, u32)> = outputs
            .iter()
            .zip(classes)
            .filter_map(|(&index, count)| Some((index, count?)))
            .collect();
        let classified_before = self
            .classified
            .swap(!in_classes.is_empty(), Ordering::Relaxed);
        if classified_before || !in_classes.is_empty() {
            *self.classes.lock().unwrap_or_else(|e| e.into_inner()) = in_classes;
        }
        let names = codec.core().outputs();
        let requested = ferrobatch_core::v2::output_bits(outputs.iter().copied());
        let outputs = outputs
            .into_iter()
            .filter_map(|i| names.get(i).map(|o| o.name.clone()))
            .collect();
        Ok((
            inputs,
            outputs,
            meta.priority,
            meta.parameters,
            meta.timeout,
            requested,
        ))
    }
}

/// The encoded answer to request `id` of `model_name`: the outputs named in
/// `outputs`, read from `results` (`{name: tensor}`) by `codec`; a
/// `ModelInferResponse`, or, with `last`, a stream's
/// `ModelStreamInferResponse` flagged `triton_final_response`. With
/// `request` (the `GrpcInferRequest` read), its outputs in shared memory
/// are written to their regions and answered with empty raw contents (a
/// `CodecError` with status 400 when one does not fit its region), and
/// those asked for as classes are answered as their top classes.
#[pyfunction]
#[pyo3(signature = (codec, model_name, id, outputs, results, last=None, request=None))]
#[allow(clippy::too_many_arguments)] // Python's keywords
pub(crate) fn grpc_response<'py>(
    py: Python<'py>,
    codec: &V2Codec,
    model_name: &str,
    id: &str,
    outputs: Vec<String>,
    results: &Bound<'py, PyDict>,
    last: Option<bool>,
    request: Option<PyRef<'py, GrpcInferRequest>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut read = Vec::with_capacity(outputs.len());
    for name in &outputs {
        let index = codec
            .core()
            .output_index(name)
            .map_err(|e| status_error(py, e.status(), e.to_string()))?;
        let Some(value) = results.get_item(name)? else {
            let message = format!("the model returned no output '{name}'");
            return Err(status_error(py, 500, message));
        };
        read.push((index, codec.read_output(py, index, value)?));
    }
    // Each output in a region: written there, its raw contents empty.
    let regions: Vec<Option<RegionRange>> = match &request {
        Some(request) if request.shared_memory.load(Ordering::Relaxed) => {
            let held = request.regions.lock().unwrap_or_else(|e| e.into_inner());
            if held.is_empty() {
                Vec::new()
            } else {
                read.iter()
                    .map(|(index, _)| {
                        held.iter()
                            .find(|(i, _)| i == index)
                            .map(|(_, range)| range.clone())
                    })
                    .collect()
            }
        }
        _ => Vec::new(),
    };
    if !regions.is_empty() {
        let outputs = codec.core().outputs();
        let writes: Vec<(&str, &[u8], &RegionRange)> = read
            .iter()
            .zip(&regions)
            .filter_map(|((index, readable), range)| {
                let name = outputs.get(*index).map_or("", |o| o.name.as_str());
                Some((name, readable.data(), range.as_ref()?))
            })
            .collect();
        ferrobatch_serve::replies::write_regions(&writes).map_err(|f| failure_error(py, f))?;
    }
    // Each output asked for as classes: its top classes (BYTES).
    let mut classified: Vec<Option<(Shape, Vec<u8>)>> = Vec::new();
    if let Some(request) = request
        .as_ref()
        .filter(|r| r.classified.load(Ordering::Relaxed))
    {
        let held = request.classes.lock().unwrap_or_else(|e| e.into_inner());
        for (i, (index, readable)) in read.iter().enumerate() {
            if let Some(&(_, count)) = held.iter().find(|(asked, _)| asked == index) {
                let (shape, data) = (&readable.shape, readable.data());
                let classes = crate::codec::classify(py, codec.core(), *index, count, shape, data)
                    .map_err(|e| status_error(py, e.status(), e.to_string()))?;
                classified.resize(i, None);
                classified.push(Some(classes));
            }
        }
    }
    let classes_of = |i: usize| classified.get(i).and_then(Option::as_ref);
    let shapes: Vec<&[u64]> = read
        .iter()
        .enumerate()
        .map(|(i, (_, readable))| {
            classes_of(i).map_or(&readable.shape[..], |(shape, _)| &shape[..])
        })
        .collect();
    let in_region = |i: usize| matches!(regions.get(i), Some(Some(_)));
    let Some(last) = last else {
        // A `ModelInfer` answer: written from the results straight into the
        // bytes object Python gets.
        let rows: Vec<OutputRows<'_>> = read
            .iter()
            .enumerate()
            .map(|(i, (index, readable))| OutputRows {
                index: *index,
                shape: shapes[i],
                data: match (in_region(i), classes_of(i)) {
                    (true, _) => &[],
                    (false, Some((_, classes))) => classes,
                    (false, None) => readable.data(),
                },
                classified: classes_of(i).is_some(),
            })
            .collect();
        let answer = InferResponse::new(codec.core(), model_name, id, &rows);
        return PyBytes::new_with(py, answer.encoded_len(), |mut out| {
            answer.encode(&mut out);
            Ok(())
        });
    };
    let raw = read
        .iter()
        .enumerate()
        .map(|(i, (index, readable))| RawOutput {
            index: *index,
            shape: shapes[i].into(),
            data: match (in_region(i), classes_of(i)) {
                (true, _) => Bytes::new(),
                (false, Some((_, classes))) => Bytes::copy_from_slice(classes),
                (false, None) => Bytes::copy_from_slice(readable.data()),
            },
            classified: classes_of(i).is_some(),
        })
        .collect();
    let answer = grpc::stream_answer(codec.core(), model_name, id, raw, last);
    let length = prost::Message::encoded_len(&answer);
    PyBytes::new_with(py, length, |mut out| {
        prost::Message::encode(&answer, &mut out)
            .map_err(|e| status_error(py, 500, format!("the answer could not be encoded: {e}")))
    })
}

/// The encoded error that ends streamed request `id` of `model_name`.
#[pyfunction]
pub(crate) fn grpc_stream_error<'py>(
    py: Python<'py>,
    model_name: &str,
    id: &str,
    message: &str,
) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &grpc::encode_stream_error(model_name, id, message))
}
