//! Shared memory as a way in, server side: a shared model has a
//! [`SharedSink`] in its `LoopRegistry`, to which its batches'
//! `Sink::SharedMemory` rows go ([`deliver`]): outputs read once per batch
//! (with the GIL), rows copied into the clients' cells and each client woken
//! without it. The requests themselves wait in the core's
//! `SharedServer` (its pending table).

use std::sync::Arc;

use std::ops::Range;

use ferrobatch_core::shm::{Delivery, VaryingColumn};
use ferrobatch_core::{DType, Outcome, Route, Tally};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::codec::V2Codec;
use crate::results::{BatchOutcome, FailedRows, ModelFailure};
use crate::without_gil;

/// One output as the binding reads it: name, dtype, per-sample shape.
pub(crate) struct OutputSpec {
    pub(crate) key: Py<PyString>,
    pub(crate) torch_dtype: Py<PyAny>,
    pub(crate) shape: Vec<usize>,
    pub(crate) row_nbytes: usize,
}

pub(crate) type SpecTuple = (String, String, Vec<usize>, Py<PyAny>);

pub(crate) fn output_specs(py: Python<'_>, outputs: Vec<SpecTuple>) -> PyResult<Vec<OutputSpec>> {
    outputs
        .into_iter()
        .map(|(name, dtype, shape, torch_dtype)| {
            let parsed = DType::parse(&dtype).ok_or_else(|| {
                PyValueError::new_err(format!("output '{name}': unknown dtype '{dtype}'"))
            })?;
            let spec =
                ferrobatch_core::InputSpec::new(&name, parsed, shape.clone()).ok_or_else(|| {
                    PyValueError::new_err(format!("output '{name}': its shape is too large"))
                })?;
            Ok(OutputSpec {
                key: PyString::intern(py, &name).unbind(),
                torch_dtype,
                shape,
                row_nbytes: spec.row_nbytes,
            })
        })
        .collect()
}

/// Where a model's shared-memory requests are answered (in its registry).
pub(crate) struct SharedSink {
    server: Arc<ferrobatch_core::shm::SharedServer>,
    model_name: Arc<str>,
    outputs: Vec<OutputSpec>,
    /// A model with BYTES or variable-length tensors: what reads its outputs.
    codec: Option<Py<V2Codec>>,
}

impl SharedSink {
    pub(crate) fn new(
        server: Arc<ferrobatch_core::shm::SharedServer>,
        model_name: Arc<str>,
        outputs: Vec<OutputSpec>,
        codec: Option<Py<V2Codec>>,
    ) -> SharedSink {
        SharedSink {
            server,
            model_name,
            outputs,
            codec,
        }
    }

    pub(crate) fn tally(&self) -> &Tally {
        self.server.tally()
    }

    /// Requests its clients refused before queueing them, by outcome.
    pub(crate) fn refusals(&self) -> [(Outcome, u64); 3] {
        self.server.segment().refusals()
    }
}

/// Answers client `client`'s requests (`routes`) of one finished batch.
pub(crate) fn deliver(
    py: Python<'_>,
    sink: &SharedSink,
    client: u32,
    routes: &[Route],
    outcome: &BatchOutcome,
    failed: Option<&FailedRows>,
) {
    let server = &sink.server;
    let fail = |outcome: Outcome, message: &str| {
        without_gil(py, || {
            server.deliver(client, routes, Delivery::Failed(outcome, message))
        })
    };
    let outputs = match outcome {
        Ok(outputs) => outputs.bind(py),
        Err(error) => {
            let failure = ModelFailure::raised(py, &sink.model_name, error.bind(py));
            return fail(failure.outcome(), failure.message());
        }
    };
    let failed: Vec<(u32, Outcome, String)> = failed
        .map(|rows| {
            rows.iter()
                .map(|(start, error)| {
                    let failure = ModelFailure::raised(py, &sink.model_name, error.bind(py));
                    (*start, failure.outcome(), failure.message().to_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    if let Some(codec) = &sink.codec {
        return deliver_varying(py, sink, codec.get(), client, routes, outputs, &failed);
    }
    let read: PyResult<Vec<(Bound<'_, PyAny>, usize, usize)>> = sink
        .outputs
        .iter()
        .map(|spec| read_output(py, outputs, spec))
        .collect();
    let read = match read {
        Ok(read) => read,
        Err(err) => {
            let what = "returned outputs its rows could not be taken from:";
            let failure = ModelFailure::new(py, &sink.model_name, err.value(py), what);
            return fail(Outcome::ModelError, failure.message());
        }
    };
    let columns: Vec<(usize, usize)> = read.iter().map(|(_, ptr, len)| (*ptr, *len)).collect();
    without_gil(py, || {
        let columns: Vec<&[u8]> = columns
            .iter()
            .map(|&(ptr, len)| {
                if len == 0 {
                    return &[][..];
                }
                // SAFETY: each (ptr, len) is a contiguous CPU tensor's bytes,
                // kept alive by `read` (outside this closure, which it outlives).
                unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
            })
            .collect();
        server.deliver(
            client,
            routes,
            Delivery::Outputs {
                columns: &columns,
                failed: &failed,
            },
        );
    });
    drop(read);
}

/// [`deliver`] for a model with BYTES or variable-length tensors: each
/// output read by the model's codec (every batch row's bytes and shape),
/// then each request's rows written with their shapes.
fn deliver_varying(
    py: Python<'_>,
    sink: &SharedSink,
    codec: &V2Codec,
    client: u32,
    routes: &[Route],
    outputs: &Bound<'_, PyDict>,
    failed: &[(u32, Outcome, String)],
) {
    let server = &sink.server;
    let mut read = match codec.read_outputs(py, outputs) {
        Ok(read) => read,
        Err(err) => {
            let what = "returned outputs its rows could not be taken from:";
            let failure = ModelFailure::new(py, &sink.model_name, err.value(py), what);
            let message = failure.message();
            return without_gil(py, || {
                server.deliver(
                    client,
                    routes,
                    Delivery::Failed(Outcome::ModelError, message),
                )
            });
        }
    };
    // Per output: its bytes, each batch row's range and shape, its pad.
    type Rows = (Vec<Range<usize>>, Vec<Vec<u64>>, Vec<u8>);
    let columns: Vec<(usize, usize, Rows)> = read
        .iter_mut()
        .map(|r| {
            let rows = match r.rows.take() {
                Some(v) => (v.ranges, v.shapes, v.pad),
                // Fixed-shape rows: `shape[0]` of `len / shape[0]` bytes each.
                None => {
                    let batch = r.shape.first().copied().unwrap_or(0) as usize;
                    let row = r.len.checked_div(batch).unwrap_or(0);
                    let shape = r.shape.get(1..).unwrap_or(&[]).to_vec();
                    let ranges = (0..batch).map(|i| i * row..(i + 1) * row).collect();
                    (ranges, vec![shape; batch], Vec::new())
                }
            };
            (r.ptr, r.len, rows)
        })
        .collect();
    without_gil(py, || {
        let columns: Vec<VaryingColumn<'_>> = columns
            .iter()
            .map(|(ptr, len, (ranges, shapes, pad))| VaryingColumn {
                // SAFETY: each (ptr, len) is a contiguous CPU tensor's bytes
                // (or serialized BYTES), kept alive by `read` (outside this
                // closure, which it outlives).
                data: unsafe { crate::codec::bytes_at(*ptr, *len) },
                rows: ranges,
                shapes,
                pad,
            })
            .collect();
        server.deliver(
            client,
            routes,
            Delivery::Varying {
                columns: &columns,
                failed,
            },
        );
    });
    drop(read);
}

/// One output of a batch as contiguous CPU bytes of its declared dtype:
/// the tensor (kept alive by the caller), its data pointer and length.
pub(crate) fn read_output<'py>(
    py: Python<'py>,
    outputs: &Bound<'py, PyDict>,
    spec: &OutputSpec,
) -> PyResult<(Bound<'py, PyAny>, usize, usize)> {
    let key = spec.key.bind(py);
    let tensor = outputs
        .get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("the model returned no output '{key}'")))?;
    let tensor = crate::codec::host_contiguous(py, tensor, spec.torch_dtype.bind(py))?;
    let shape: Vec<usize> = tensor.getattr(intern!(py, "shape"))?.extract()?;
    if shape.get(1..) != Some(&spec.shape[..]) {
        return Err(PyValueError::new_err(format!(
            "output '{key}' has shape {shape:?}, expected [rows, {}]",
            spec.shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let len = shape[0]
        .checked_mul(spec.row_nbytes)
        .ok_or_else(|| PyValueError::new_err(format!("output '{key}' is too large")))?;
    let ptr: usize = if len == 0 {
        0
    } else {
        tensor.call_method0(intern!(py, "data_ptr"))?.extract()?
    };
    Ok((tensor, ptr, len))
}
