//! The Python classes: `Batcher` (submit side), `Ticket` (one request),
//! `Worker` (batch side), `Batch` and `Routes` (what a worker got).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrobatch_core as core;
use ferrobatch_core::{BatcherConfig, DType, DispatchRule, RequestState, Route, SlotBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice, PyString, PyTuple, PyType};

use crate::errors::{invalid_input, to_pyerr};
use crate::inputs::{Converter, InputSpec, Keep};
use crate::without_gil;

/// The submit side of one model's batcher. Shared by every event loop and
/// thread that submits, and by the model's workers.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Batcher {
    core: Arc<core::Batcher>,
    converter: Converter,
    /// The staging tensors whose memory the core writes; kept alive here.
    _slot_tensors: Vec<Py<PyAny>>,
}

#[pymethods]
impl Batcher {
    #[new]
    #[pyo3(signature = (
        inputs, slots, *, tensor_type, coerce, max_batch_size, max_delay,
        min_batch_size, preferred_batch_sizes, max_queue_size, workers,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        inputs: Vec<(String, String, Vec<usize>, Py<PyAny>)>,
        slots: Vec<Vec<Bound<'_, PyAny>>>,
        tensor_type: Py<PyType>,
        coerce: Py<PyAny>,
        max_batch_size: usize,
        max_delay: f64,
        min_batch_size: usize,
        preferred_batch_sizes: Vec<usize>,
        max_queue_size: usize,
        workers: usize,
    ) -> PyResult<Batcher> {
        if !(max_delay.is_finite() && max_delay >= 0.0) {
            return Err(PyValueError::new_err(format!("max_delay must be >= 0 seconds, got {max_delay}")));
        }
        let mut specs = Vec::with_capacity(inputs.len());
        for (name, dtype, shape, torch_dtype) in inputs {
            let dtype = DType::parse(&dtype)
                .ok_or_else(|| PyValueError::new_err(format!("input '{name}': unknown dtype '{dtype}'")))?;
            let row_nbytes = shape.iter().product::<usize>() * dtype.itemsize();
            let key = PyString::intern(py, &name).unbind();
            specs.push(InputSpec { name, key, dtype, torch_dtype, shape, row_nbytes });
        }
        let mut slot_tensors = Vec::new();
        let mut slot_buffers = Vec::with_capacity(slots.len());
        for slot in &slots {
            let mut buffers = Vec::with_capacity(slot.len());
            for tensor in slot {
                let ptr: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
                let nbytes: usize = tensor.getattr(intern!(py, "nbytes"))?.extract()?;
                // SAFETY: the tensor is kept alive in `_slot_tensors` for as long as
                // this Batcher (and so its core ring) exists, and ferrobatch never
                // hands staging tensors to anyone but the worker holding the slot.
                buffers.push(unsafe { SlotBuffer::new(ptr as *mut u8, nbytes) });
                slot_tensors.push(tensor.clone().unbind());
            }
            slot_buffers.push(buffers);
        }
        let rule = DispatchRule::new(
            max_batch_size,
            Duration::from_secs_f64(max_delay),
            min_batch_size,
            preferred_batch_sizes,
        )
        .map_err(|e| to_pyerr(py, e))?;
        let config = BatcherConfig {
            rule,
            row_nbytes: specs.iter().map(|s| s.row_nbytes).collect(),
            max_queue_size,
            workers,
        };
        let core = core::Batcher::new(config, slot_buffers).map_err(|e| to_pyerr(py, e))?;
        Ok(Batcher {
            core: Arc::new(core),
            converter: Converter { specs, tensor_type, coerce },
            _slot_tensors: slot_tensors,
        })
    }

    /// Validates `inputs` against the specs and queues the request.
    #[pyo3(signature = (inputs, loop_id, timeout=None, batched=false))]
    fn submit(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        loop_id: u32,
        timeout: Option<f64>,
        batched: bool,
    ) -> PyResult<Ticket> {
        let Ok(inputs) = inputs.cast::<PyDict>() else {
            return Err(invalid_input(
                py,
                format!(
                    "inputs must be a dict of input name to tensor, got {}",
                    inputs.get_type().name()?
                ),
            ));
        };
        let specs = &self.converter.specs;
        let mut bytes = Vec::with_capacity(specs.len());
        let mut keep = Vec::with_capacity(specs.len());
        let mut rows = None;
        for (index, spec) in specs.iter().enumerate() {
            let Some(value) = inputs.get_item(spec.key.bind(py))? else {
                return Err(invalid_input(py, format!("missing input '{}'", spec.name)));
            };
            let converted = self.converter.convert(py, index, &value, batched)?;
            match rows {
                None => rows = Some(converted.rows),
                Some(n) if n != converted.rows => {
                    return Err(invalid_input(
                        py,
                        format!(
                            "input '{}' has {} rows but '{}' has {n}; all inputs must have the same",
                            spec.name, converted.rows, specs[0].name
                        ),
                    ));
                }
                Some(_) => {}
            }
            bytes.push(converted.bytes);
            keep.push(converted.keep);
        }
        if inputs.len() != specs.len() {
            let extra: Vec<String> = inputs
                .keys()
                .iter()
                .map(|k| k.str().map(|s| s.to_string()).unwrap_or_default())
                .filter(|k| !specs.iter().any(|s| &s.name == k))
                .map(|k| format!("'{k}'"))
                .collect();
            return Err(invalid_input(
                py,
                format!(
                    "unexpected input {}; the model takes {}",
                    extra.join(", "),
                    specs.iter().map(|s| format!("'{}'", s.name)).collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        let timeout = match timeout {
            Some(t) if t.is_nan() || t < 0.0 => {
                return Err(PyValueError::new_err(format!("timeout must be >= 0 seconds, got {t}")))
            }
            Some(t) => Some(Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX)),
            None => None,
        };
        let request = self
            .core
            .submit(loop_id, rows.unwrap_or(1), bytes.into_boxed_slice(), timeout)
            .map_err(|e| to_pyerr(py, e))?;
        Ok(Ticket { request, batcher: self.core.clone(), _keep: keep })
    }

    /// Gives back a batch's staging slot once its bytes have been consumed.
    fn release_slot(&self, slot: usize) -> bool {
        self.core.release_slot(slot)
    }

    /// Refuses new requests; workers dispatch what they hold, then stop.
    fn close(&self) {
        self.core.close()
    }

    /// Counters since start: batches, rows, requests, skipped_withdrawn,
    /// skipped_expired, queue_ns.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use Ordering::Relaxed;
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("batches", s.batches.load(Relaxed))?;
        d.set_item("rows", s.rows.load(Relaxed))?;
        d.set_item("requests", s.requests.load(Relaxed))?;
        d.set_item("skipped_withdrawn", s.skipped_withdrawn.load(Relaxed))?;
        d.set_item("skipped_expired", s.skipped_expired.load(Relaxed))?;
        d.set_item("queue_ns", s.queue_ns.load(Relaxed))?;
        d.set_item("queue_len", self.core.queue_len())?;
        Ok(d)
    }
}

/// One submitted request. Holds the caller's input objects alive; drop it
/// only once the request is resolved or withdrawn (`withdraw` returned True).
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Ticket {
    request: Arc<core::Request>,
    batcher: Arc<core::Batcher>,
    _keep: Vec<Keep>,
}

#[pymethods]
impl Ticket {
    #[getter]
    fn id(&self) -> u64 {
        self.request.id
    }

    /// Withdraws the request ("cancelled", "expired" or "closed"). True if it
    /// will never run; False if a batch already took it.
    fn withdraw(&self, reason: &str) -> PyResult<bool> {
        let to = match reason {
            "cancelled" => RequestState::Cancelled,
            "expired" => RequestState::Expired,
            "closed" => RequestState::Closed,
            _ => return Err(PyValueError::new_err(format!("unknown withdraw reason '{reason}'"))),
        };
        Ok(self.batcher.withdraw(&self.request, to))
    }
}

/// The batch side for one model instance; used by one thread at a time.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Worker {
    core: Arc<core::Batcher>,
    /// Keeps the Python Batcher, and so the staging tensors the core writes
    /// into during `next_batch`, alive for as long as this worker exists.
    _batcher: Py<Batcher>,
    state: Mutex<core::Worker>,
}

#[pymethods]
impl Worker {
    #[new]
    fn new(batcher: Bound<'_, Batcher>) -> Worker {
        Worker {
            core: batcher.get().core.clone(),
            _batcher: batcher.unbind(),
            state: Mutex::new(core::Worker::new()),
        }
    }

    /// Blocks (GIL released) until a batch is gathered and collated into a
    /// staging slot; None once the batcher is closed and drained.
    fn next_batch(&self, py: Python<'_>) -> PyResult<Option<Batch>> {
        let batch = without_gil(py, || {
            let mut state = self.state.lock().map_err(|_| "worker state poisoned")?;
            Ok::<_, &str>(self.core.next_batch(&mut state))
        })
        .map_err(PyTypeError::new_err)?;
        Ok(batch.map(|b| Batch {
            slot: b.slot,
            rows: b.rows,
            groups: b.routes.groups.into_iter().map(|(l, r)| (l, Arc::new(r))).collect(),
        }))
    }
}

/// A collated batch: `rows` rows of every input sit in staging slot `slot`.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Batch {
    #[pyo3(get)]
    slot: usize,
    #[pyo3(get)]
    rows: usize,
    groups: Vec<(u32, Arc<Vec<Route>>)>,
}

#[pymethods]
impl Batch {
    #[getter]
    fn n_requests(&self) -> usize {
        self.groups.iter().map(|(_, r)| r.len()).sum()
    }

    /// `[(loop_id, Routes)]`: one entry per event loop to wake.
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .groups
            .iter()
            .map(|(loop_id, routes)| {
                let routes = Bound::new(py, Routes { routes: routes.clone() })?;
                PyTuple::new(py, [loop_id.into_pyobject(py)?.into_any(), routes.into_any()])
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }
}

/// The rows of a batch that belong to the requests of one event loop.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Routes {
    routes: Arc<Vec<Route>>,
}

#[pymethods]
impl Routes {
    /// `[(request_id, first_row, rows)]` in batch order.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .routes
            .iter()
            .map(|r| (r.id, r.start, r.rows).into_pyobject(py))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Resolves this loop's requests of a successful batch, on the loop's thread.
    ///
    /// `pending` maps request id to `(future, ticket, timer | None, batched)`;
    /// each entry found is removed, its timer cancelled and, unless its future
    /// is already done (cancelled, past its deadline), its future gets
    /// `{name: row}` (one-sample requests: `rows[name][first_row]`) or
    /// `{name: outputs[name][first:first + n]}` (multi-row requests).
    fn resolve(
        &self,
        py: Python<'_>,
        pending: &Bound<'_, PyDict>,
        rows: &Bound<'_, PyDict>,
        outputs: &Bound<'_, PyDict>,
        counters: &LoopCounters,
    ) -> PyResult<()> {
        let columns = rows
            .iter()
            .map(|(name, per_row)| {
                let whole = outputs.get_item(&name)?.ok_or_else(|| {
                    PyValueError::new_err(format!("output {name} has rows but no batch tensor"))
                })?;
                Ok((name, per_row.cast_into::<PyTuple>()?, whole))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let (mut succeeded, mut request_ns) = (0u64, 0u64);
        for route in self.routes.iter() {
            let key = route.id.into_pyobject(py)?;
            let Some(entry) = pending.get_item(&key)? else { continue };
            pending.del_item(&key)?;
            let entry = entry.cast_into::<PyTuple>()?;
            let future = entry.get_item(0)?;
            let timer = entry.get_item(2)?;
            if !timer.is_none() {
                timer.call_method0(intern!(py, "cancel"))?;
            }
            if future.call_method0(intern!(py, "done"))?.is_truthy()? {
                continue;
            }
            let batched = entry.get_item(3)?.is_truthy()?;
            let result = PyDict::new(py);
            let built = columns.iter().try_for_each(|(name, per_row, whole)| {
                let value = if batched {
                    let end = (route.start + route.rows) as isize;
                    whole.get_item(PySlice::new(py, route.start as isize, end, 1))?
                } else {
                    per_row.get_item(route.start as usize)?
                };
                result.set_item(name, value)
            });
            match built {
                Ok(()) => {
                    future.call_method1(intern!(py, "set_result"), (result,))?;
                    succeeded += 1;
                    if let Ok(ticket) = entry.get_item(1)?.cast::<Ticket>() {
                        request_ns += ticket.get().request.enqueued_at.elapsed().as_nanos() as u64;
                    }
                }
                // Never leave a caller hanging: hand it the error instead.
                Err(err) => {
                    future.call_method1(intern!(py, "set_exception"), (err.value(py),))?;
                }
            }
        }
        counters.succeeded.fetch_add(succeeded, Ordering::Relaxed);
        counters.request_ns.fetch_add(request_ns, Ordering::Relaxed);
        Ok(())
    }
}

/// Per-loop counters the Rust fan-out updates (read from any thread).
#[pyclass(frozen, module = "ferrobatch._core")]
#[derive(Default)]
pub struct LoopCounters {
    succeeded: AtomicU64,
    request_ns: AtomicU64,
}

#[pymethods]
impl LoopCounters {
    #[new]
    fn new() -> LoopCounters {
        LoopCounters::default()
    }

    /// Requests resolved with a result.
    #[getter]
    fn succeeded(&self) -> u64 {
        self.succeeded.load(Ordering::Relaxed)
    }

    /// Sum over those requests of the time from submit to result, in nanoseconds.
    #[getter]
    fn request_ns(&self) -> u64 {
        self.request_ns.load(Ordering::Relaxed)
    }
}
