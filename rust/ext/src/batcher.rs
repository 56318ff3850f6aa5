//! The Python classes: `Batcher` (submit side), `Worker` (batch side) and
//! `Batch` (what a worker got). A request from an event loop waits in the
//! pending table of its loop's mailbox.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ferrobatch_core as core;
use ferrobatch_core::bytes::BytesLimits;
use ferrobatch_core::{
    BatcherConfig, Collated, DType, DispatchReason, DispatchRule, InputBytes, Layout, Padded,
    Ragged, RaggedBytes, Readiness, Route, Sink, SlotBuffer,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyType};

use crate::cache::{self, CachedResult, ResponseCache};
use crate::errors::{ferrobatch_error, invalid_input, to_pyerr};
use crate::inputs::{Converter, InputSpec, Keep};
use crate::loops::{LoopRegistry, Wakeups};
use crate::mailbox::{doorbells, ring_fd, LoopAnswer, LoopHeld, LoopMailbox};
use crate::results::{failed_alone, FailedRows};
use crate::threads::{ThreadWaiters, Waiter};
use crate::without_gil;

/// `Batcher(response_cache=)`: the cache, the server's namespace there, its
/// `CachedRows`, and what the model is told of a request besides its
/// inputs (its priority; the parameters it is never shown).
type CacheSettings<'py> = (Bound<'py, ResponseCache>, u64, Py<PyAny>, bool, Vec<String>);

/// The submit side of one model's batcher. Shared by every event loop and
/// thread that submits, and by the model's workers.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Batcher {
    core: Arc<core::Batcher>,
    converter: Converter,
    /// The staging tensors whose memory the core writes; kept alive here.
    _slot_tensors: Vec<Py<PyAny>>,
    /// With a response cache: the object that cuts a request's rows out of
    /// a batch's outputs to keep (`cut(outputs, spans)`) and joins kept
    /// rows into a batch's outputs to answer hits with (`join(parts, rows)`).
    cache_rows: Option<Py<PyAny>>,
}

#[pymethods]
impl Batcher {
    #[new]
    #[pyo3(signature = (
        inputs, slots, *, tensor_type, coerce, max_batch_size, max_delay,
        min_batch_size, preferred_batch_sizes, max_queue_size, workers, adaptive=false,
        layouts=Vec::new(), max_batch_elements=None, padded_dims=Vec::new(),
        priority_levels=0, default_priority=None, max_priority_wait=None, keep_parameters=false,
        optional=Vec::new(), delay_from_free_worker=false, default_timeout=None, first_id=1,
        queue_timeout=None, response_cache=None,
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
        adaptive: bool,
        layouts: Vec<(String, Option<Vec<u8>>)>,
        max_batch_elements: Option<usize>,
        padded_dims: Vec<Option<Vec<Option<usize>>>>,
        priority_levels: u8,
        default_priority: Option<u32>,
        max_priority_wait: Option<f64>,
        keep_parameters: bool,
        optional: Vec<bool>,
        delay_from_free_worker: bool,
        default_timeout: Option<f64>,
        first_id: u64,
        queue_timeout: Option<f64>,
        response_cache: Option<CacheSettings<'_>>,
    ) -> PyResult<Batcher> {
        let default_timeout = positive_seconds("default_timeout", default_timeout)?;
        let queue_timeout = positive_seconds("queue_timeout", queue_timeout)?;
        let max_wait = match max_priority_wait {
            None => None,
            Some(w) if w.is_nan() || w < 0.0 => {
                return Err(PyValueError::new_err(format!(
                    "max_priority_wait must be >= 0 seconds, got {w}"
                )))
            }
            // Longer than a Duration holds: strict priority.
            Some(w) => Duration::try_from_secs_f64(w).ok(),
        };
        let priorities = ferrobatch_core::Priorities {
            levels: priority_levels.max(1),
            max_wait,
        };
        if max_delay.is_nan() || max_delay < 0.0 {
            return Err(PyValueError::new_err(format!(
                "max_delay must be >= 0 seconds, got {max_delay}"
            )));
        }
        // Longer than a Duration holds: batches wait for size, as with no limit.
        let max_delay_duration = Duration::try_from_secs_f64(max_delay).unwrap_or(Duration::MAX);
        let specs = input_specs(py, inputs, &layouts, &padded_dims, &optional)?;
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
        let mut rule = DispatchRule::new(
            max_batch_size,
            max_delay_duration,
            min_batch_size,
            preferred_batch_sizes,
        )
        .map_err(|e| to_pyerr(py, e))?;
        if adaptive {
            // `max_delay` is then the cap of the adaptive window.
            rule = rule.adaptive();
        }
        if delay_from_free_worker {
            rule = rule.delay_from_free_worker();
        }
        let config = BatcherConfig {
            rule,
            row_nbytes: specs
                .iter()
                .map(|s| match s.layout {
                    Layout::Fixed => s.row_nbytes,
                    _ => 0,
                })
                .collect(),
            layouts: specs.iter().map(|s| s.layout.clone()).collect(),
            max_batch_elements,
            bytes_limits: BytesLimits::default(),
            max_queue_size,
            workers,
            // Greedy (and the adaptive window, which starts where greedy
            // does): a batch takes what an event loop submitted in a whole
            // iteration (it flushes at the end), not just its first request.
            readiness: if max_delay == 0.0 || adaptive {
                Readiness::OnFlush
            } else {
                Readiness::OnPush
            },
            priorities,
            default_priority,
        };
        let core = core::Batcher::new(config, slot_buffers)
            .map_err(|e| to_pyerr(py, e))?
            .keeping_parameters(keep_parameters)
            .with_default_timeout(default_timeout)
            .with_queue_timeout(queue_timeout)
            .naming_inputs(specs.iter().map(|s| Arc::from(s.name.as_str())).collect())
            .numbering_from(first_id)
            .with_response_cache(response_cache.as_ref().map(
                |(cache, namespace, _, priority, unseen)| {
                    let rules = core::KeyRules {
                        priority: *priority,
                        unseen_parameters: unseen.clone(),
                    };
                    (cache.get().core.clone(), *namespace, rules)
                },
            ));
        Ok(Batcher {
            core: Arc::new(core),
            converter: Converter {
                specs,
                tensor_type,
                coerce,
                max_rows: max_batch_size,
                max_elements: max_batch_elements,
                bytes_limits: BytesLimits::default(),
            },
            _slot_tensors: slot_tensors,
            cache_rows: response_cache.map(|(_, _, rows, _, _)| rows),
        })
    }

    /// Looks requests up in the response cache under `namespace` from now
    /// on (see the core's `Batcher::set_cache_namespace`).
    fn set_cache_namespace(&self, namespace: u64) {
        self.core.set_cache_namespace(namespace)
    }

    /// Refuses new requests; workers dispatch what they hold, then stop.
    fn close(&self) {
        self.core.close()
    }

    /// The id its next request will get: where a batcher of the same
    /// server's next run numbers on from (`first_id`).
    #[getter]
    fn next_id(&self) -> u64 {
        self.core.next_id()
    }

    /// Counters since start: batches, rows, requests, skipped_withdrawn,
    /// skipped_expired, queue_ns, release_age_ns (the oldest request's age
    /// when its batch was released, summed over batches), cache_hits and
    /// cache_misses (requests answered from the response cache, which are
    /// not in `requests`, and requests looked up there and run),
    /// dispatch_reasons (`{reason: batches}`).
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
        d.set_item("succeeded_queue_ns", s.succeeded_queue_ns.load(Relaxed))?;
        d.set_item("release_age_ns", s.release_age_ns.load(Relaxed))?;
        d.set_item("cache_hits", s.cache_hits.load(Relaxed))?;
        d.set_item("cache_misses", s.cache_misses.load(Relaxed))?;
        let reasons = PyDict::new(py);
        for (reason, n) in DispatchReason::ALL.iter().zip(&s.dispatch_reasons) {
            reasons.set_item(reason.name(), n.load(Relaxed))?;
        }
        d.set_item("dispatch_reasons", reasons)?;
        d.set_item("queue_len", self.core.queue_len())?;
        d.set_item("queue_lens", self.core.queue_lens())?;
        Ok(d)
    }
}

impl Batcher {
    pub(crate) fn core(&self) -> &Arc<core::Batcher> {
        &self.core
    }

    /// The model's inputs, in collation order.
    pub(crate) fn input_specs(&self) -> Vec<ferrobatch_core::InputSpec> {
        self.converter
            .specs
            .iter()
            .map(|s| s.core.clone())
            .collect()
    }

    /// Validates `inputs` against the specs, registers the request in the
    /// mailbox's pending table (answered through a new future of its loop)
    /// and queues it: the future and the queued request. Call on the
    /// mailbox's loop thread. A greedy batcher (`max_delay=0`) lets workers
    /// take the request once the loop runs the `mailbox.flush` the first
    /// submit of its iteration schedules.
    pub(crate) fn submit(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        mailbox: &Bound<'_, LoopMailbox>,
        submission: core::Submission,
        batched: bool,
        stream: Option<Py<PyAny>>,
    ) -> PyResult<(Py<PyAny>, Arc<core::Request>)> {
        let (rows, bytes, keep, absent) = self.converter.convert_dict(py, inputs, batched)?;
        let submission = core::Submission {
            absent,
            ..submission
        };
        // Made before the request is queued: once queued, nothing may fail.
        let future = mailbox.get().new_future(py)?;
        LoopMailbox::schedule_flush(mailbox, &self.core)?;
        let mailbox = mailbox.get();
        let answer = LoopAnswer::new(future.clone_ref(py), batched, stream);
        let mut entry = Some((answer, LoopHeld::new(self.core.clone(), keep)));
        let mut registered = None;
        let submitted = self.core.submit_held(
            mailbox.unflushed(),
            Sink::EventLoop(mailbox.loop_id()),
            rows,
            bytes,
            submission,
            |r| {
                if let Some((answer, held)) = entry.take() {
                    mailbox.register(r, answer, held);
                    registered = Some(r.id);
                }
            },
        );
        let request = match submitted {
            Ok(request) => request,
            Err(err) => {
                if let Some(id) = registered {
                    mailbox.unregister(id);
                }
                return Err(to_pyerr(py, err));
            }
        };
        Ok((future, request))
    }

    /// Queues a request from a plain thread, registered with `waiters`
    /// (ready for the workers at once, as a thread has no loop iteration
    /// to flush at): the request and the waiter its answer will come to.
    pub(crate) fn submit_from_thread(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        submission: core::Submission,
        batched: bool,
        waiters: &ThreadWaiters,
    ) -> PyResult<(Arc<core::Request>, Arc<Waiter>)> {
        let (rows, bytes, keep, absent) = self.converter.convert_dict(py, inputs, batched)?;
        let submission = core::Submission {
            absent,
            blocking_caller: thread_key(&self.core),
            ..submission
        };
        let mut waiter = None;
        let mut keep = Some(keep);
        let submitted = self
            .core
            .submit_request(Sink::Thread, rows, bytes, submission, |r| {
                let keep = keep.take().unwrap_or_default();
                waiter = Some((r.id, waiters.register(r, batched, keep)));
            });
        match (submitted, waiter) {
            (Ok(request), Some((_, waiter))) => Ok((request, waiter)),
            (Ok(_), None) => Err(pyo3::exceptions::PyRuntimeError::new_err(
                "a queued request was not registered",
            )),
            (Err(err), waiter) => {
                if let Some((id, _)) = waiter {
                    waiters.unregister(id);
                }
                Err(to_pyerr(py, err))
            }
        }
    }
}

/// This thread as a blocking caller: its key (never reused) and the
/// batchers it called, which forget it when the thread ends.
struct ThreadCaller {
    key: u64,
    called: RefCell<Vec<Weak<core::Batcher>>>,
}

impl Drop for ThreadCaller {
    fn drop(&mut self) {
        for batcher in self.called.get_mut().drain(..) {
            if let Some(batcher) = batcher.upgrade() {
                batcher.forget_caller(self.key);
            }
        }
    }
}

thread_local! {
    static THREAD_CALLER: ThreadCaller = ThreadCaller {
        key: {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            NEXT.fetch_add(1, Ordering::Relaxed)
        },
        called: RefCell::new(Vec::new()),
    };
}

/// This thread's key among `batcher`'s blocking callers (`None` while the
/// thread ends: then it counts as a caller that does not block).
fn thread_key(batcher: &Arc<core::Batcher>) -> Option<u64> {
    THREAD_CALLER
        .try_with(|caller| {
            let mut called = caller.called.try_borrow_mut().ok()?;
            if !called
                .iter()
                .any(|b| std::ptr::eq(b.as_ptr(), Arc::as_ptr(batcher)))
            {
                called.retain(|b| b.strong_count() > 0);
                called.push(Arc::downgrade(batcher));
            }
            Some(caller.key)
        })
        .ok()
        .flatten()
}

impl Converter {
    /// Checks a request's `inputs` (a dict) against the specs and copies
    /// them: its rows, the byte views, what keeps the bytes alive, and the
    /// optional inputs it left out (a bit each; zeros stand in for them).
    #[allow(clippy::type_complexity)]
    pub(crate) fn convert_dict(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        batched: bool,
    ) -> PyResult<(usize, core::Inputs, Vec<Keep>, u64)> {
        let Ok(inputs) = inputs.cast::<PyDict>() else {
            return Err(invalid_input(
                py,
                format!(
                    "inputs must be a dict of input name to tensor, got {}",
                    inputs.get_type().name()?
                ),
            ));
        };
        let specs = &self.specs;
        let mut bytes = core::Inputs::with_capacity(specs.len());
        let mut keep = Vec::with_capacity(specs.len());
        let mut rows = None;
        let mut absent = 0u64;
        let mut given = 0usize;
        for (index, spec) in specs.iter().enumerate() {
            let Some(value) = inputs.get_item(spec.key.bind(py))? else {
                if !spec.optional {
                    return Err(invalid_input(py, spec.core.error("missing").0));
                }
                absent |= 1 << index; // filled below, once the rows are known
                                      // SAFETY: an empty view, replaced below before anything reads it.
                bytes.push(unsafe {
                    InputBytes::new(std::ptr::NonNull::<u8>::dangling().as_ptr(), 0)
                });
                keep.push(Keep::default());
                continue;
            };
            given += 1;
            let converted = self.convert(py, index, &value, batched)?;
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
        let rows = match rows {
            Some(rows) => rows,
            None if specs.is_empty() => 1, // a model of no inputs: one row per request
            None => {
                return Err(invalid_input(
                    py,
                    "a request must carry at least one of the model's inputs, got none".to_owned(),
                ))
            }
        };
        for (index, spec) in specs.iter().enumerate() {
            // Only an optional input (among the first 64) has a bit: test that first.
            if !spec.optional || absent & (1 << index) == 0 {
                continue;
            }
            let (zeros, extents) = spec
                .core
                .absent(&spec.layout, rows)
                .ok_or_else(|| invalid_input(py, spec.core.error("the input is too large").0))?;
            let filled = Keep::new(zeros);
            // SAFETY: the bytes are `filled`'s heap memory, kept with the
            // request (in `keep`) until it is resolved.
            let view = unsafe { InputBytes::new(filled.bytes().as_ptr(), filled.bytes().len()) };
            bytes[index] = view.with_extents(&extents).unwrap_or(view);
            keep[index] = filled;
        }
        if inputs.len() != given {
            let extra: Vec<String> = inputs
                .keys()
                .iter()
                .map(|k| k.str().map(|s| s.to_string()).unwrap_or_default())
                .filter(|k| !specs.iter().any(|s| &s.name == k))
                .map(|k| format!("'{}'", ferrobatch_core::v2::Clipped(&k)))
                .collect();
            return Err(invalid_input(
                py,
                format!(
                    "unexpected input {}; the model takes {}",
                    ferrobatch_core::v2::Clipped(&extra.join(", ")),
                    specs
                        .iter()
                        .map(|s| format!("'{}'", s.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        Ok((rows, bytes, keep, absent))
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
    /// The server's event loops, whose mailboxes the batches go to.
    registry: Py<LoopRegistry>,
    /// Mailboxes posted to and threads answered since the last
    /// `next_batch`: woken there, once the GIL is released.
    to_wake: Mutex<Wakeups>,
    /// The batcher's response cache and how its results are cut and
    /// joined, if it has one.
    cache: Option<WorkerCache>,
}

/// A worker's response cache: the cache, the server's `CachedRows` (see
/// [`Batcher`]'s `cache_rows`), and its fixed outputs' names (kept as
/// bytes; empty when some output is not a fixed-shape tensor).
struct WorkerCache {
    cache: Arc<core::SharedCache>,
    rows: Py<PyAny>,
    fixed: Vec<Py<PyAny>>,
}

#[pymethods]
impl Worker {
    #[new]
    fn new(batcher: Bound<'_, Batcher>, registry: Py<LoopRegistry>) -> Worker {
        let py = batcher.py();
        let cache = batcher.get().core.response_cache().and_then(|(cache, _)| {
            let rows = batcher.get().cache_rows.as_ref()?.bind(py);
            let fixed = rows
                .getattr(intern!(py, "fixed"))
                .and_then(|names| names.extract::<Vec<Py<PyAny>>>())
                .unwrap_or_default();
            Some(WorkerCache {
                cache: cache.clone(),
                rows: rows.clone().unbind(),
                fixed,
            })
        });
        Worker {
            cache,
            core: batcher.get().core.clone(),
            _batcher: batcher.unbind(),
            registry,
            state: Mutex::new(core::Worker::new()),
            to_wake: Mutex::new(Wakeups::default()),
        }
    }

    /// Finishes a batch with one call: hands its `outputs`
    /// (`{name: batch tensor}`) or the `error` its model call raised to the
    /// event loops its requests came from. Their doorbells ring after the
    /// GIL is released: at once with `ring_now`, else at this worker's next
    /// `next_batch` (so the woken loops never wait for this thread's GIL).
    ///
    /// With `failed` (`[(row_start, exception), ...]`, alongside `outputs`),
    /// the request whose rows start at each `row_start` fails with
    /// `ModelError` caused by that exception, through the one failure path;
    /// the others get their rows of `outputs` (which may hold anything in
    /// the failed rows).
    #[pyo3(signature = (batch, outputs, error, ring_now=false, failed=None))]
    fn finish(
        &self,
        py: Python<'_>,
        batch: &Batch,
        outputs: Option<Py<PyDict>>,
        error: Option<Py<PyAny>>,
        ring_now: bool,
        failed: Option<Vec<(u32, Py<PyAny>)>>,
    ) -> PyResult<()> {
        let outcome = match (outputs, error) {
            (_, Some(error)) => Err(error),
            (Some(outputs), None) => Ok(outputs),
            _ => return Err(PyValueError::new_err("finish needs outputs or an error")),
        };
        let failed = failed.filter(|f| !f.is_empty()).map(|mut f| {
            f.sort_by_key(|(start, _)| *start);
            Arc::new(f)
        });
        if let (Ok(outputs), None) = (&outcome, &failed) {
            self.keep_results(py, batch, outputs.bind(py));
        }
        if outcome.is_ok() {
            let queued = batch.succeeded_queue_ns(failed.as_ref());
            let stats = self.core.stats();
            stats
                .succeeded_queue_ns
                .fetch_add(queued, Ordering::Relaxed);
        }
        let posted = self
            .registry
            .get()
            .route_batch(py, &batch.groups, &outcome, failed.as_ref());
        if ring_now {
            let doorbells = posted.doorbells();
            without_gil(py, || posted.wake(&doorbells));
        } else {
            self.to_wake
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .append(posted);
        }
        Ok(())
    }

    /// Hands one partial answer of a decoupled model's batch (`outputs`,
    /// `{name: batch tensor}`, as for `finish`) to its requests at once,
    /// leaving them pending; `finish(batch, {}, None)` ends their streams.
    /// Returns how many requests still listen: 0 means every caller went
    /// away (or failed), and the model may stop. With `only` (the first rows
    /// of some of the batch's requests), only those requests get it.
    #[pyo3(signature = (batch, outputs, only=None))]
    fn stream(
        &self,
        py: Python<'_>,
        batch: &Batch,
        outputs: Bound<'_, PyDict>,
        only: Option<Vec<u32>>,
    ) -> usize {
        let (listening, posted) =
            self.registry
                .get()
                .route_partial(py, &batch.groups, &outputs, only.as_deref());
        let targets = doorbells(&posted);
        // `posted` keeps each mailbox, and so its fd, alive meanwhile.
        without_gil(py, || {
            for (fd, eventfd) in targets {
                ring_fd(fd, eventfd);
            }
        });
        listening
    }

    /// Blocks (GIL released) until requests found in the response cache
    /// as they were submitted wait, then answers them with what it kept,
    /// through each one's way in, and wakes their callers; False once the
    /// batcher is closed and none is left (at once without a cache). One
    /// thread calls it in a loop beside the workers, so a hit found at
    /// submit never waits for an instance.
    fn answer_found(&self, py: Python<'_>) -> bool {
        let core = self.core.clone();
        match without_gil(py, move || core.wait_found()) {
            Some(found) => {
                self.answer_cached(py, &found);
                true
            }
            None => false,
        }
    }

    /// Rings the doorbells of what was delivered, then blocks (GIL released)
    /// until a batch is gathered and collated into a staging slot; None once
    /// the batcher is closed and drained.
    ///
    /// Requests that waited longer than the queue timeout to be taken are
    /// answered here (`DeadlineExceededError`), never run: no caller's
    /// timer watches the queue timeout. So are requests found in the
    /// response cache, with what it kept.
    fn next_batch(&self, py: Python<'_>) -> PyResult<Option<Batch>> {
        let batch = loop {
            let to_wake =
                std::mem::take(&mut *self.to_wake.lock().unwrap_or_else(|e| e.into_inner()));
            let doorbells = to_wake.doorbells();
            let (batch, outstayed, cached) = without_gil(py, || {
                to_wake.wake(&doorbells);
                let mut state = self.state.lock().map_err(|_| "worker state poisoned")?;
                let batch = self.core.next_batch(&mut state);
                Ok::<_, &str>((batch, state.take_outstayed(), state.take_cached()))
            })
            .map_err(PyTypeError::new_err)?;
            drop(to_wake);
            let answered = !outstayed.is_empty() || !cached.is_empty();
            if !outstayed.is_empty() {
                self.answer_outstayed(py, &outstayed);
            }
            if !cached.is_empty() {
                self.answer_cached(py, &cached);
            }
            if batch.is_some() || !answered {
                break batch; // a batch, or None: closed and drained
            }
        };
        Ok(batch.map(|b| Batch {
            index: b.slot.index(),
            slot: Mutex::new(Some(b.slot)),
            collated: Mutex::new(b.collated),
            rows: b.rows,
            requests: b.requests,
            cache_keys: Mutex::new(b.cache_keys),
            taken_at: b.taken_at,
            groups: b
                .routes
                .groups
                .into_iter()
                .map(|(l, r)| (l, Arc::new(r)))
                .collect(),
        }))
    }
}

impl Worker {
    /// Fails `outstayed` (requests past the queue timeout, never run) with
    /// `DeadlineExceededError`, through each one's way in, and wakes their
    /// callers at once (not after the next model call).
    fn answer_outstayed(&self, py: Python<'_>, outstayed: &[Arc<core::Request>]) {
        let registry = self.registry.get();
        let seconds = self.core.queue_timeout().map_or(0.0, |t| t.as_secs_f64());
        let message = format!(
            "request to model '{}' waited longer than its {seconds}s queue timeout to be run; \
             it was not run",
            registry.model_name()
        );
        let error = ferrobatch_error(py, "DeadlineExceededError", message);
        let groups: Vec<(Sink, Arc<Vec<Route>>)> = core::Routes::for_batch(outstayed)
            .groups
            .into_iter()
            .map(|(sink, routes)| (sink, Arc::new(routes)))
            .collect();
        let posted = registry.route_batch(py, &groups, &Err(error.into_value(py).into_any()), None);
        let doorbells = posted.doorbells();
        without_gil(py, || posted.wake(&doorbells));
    }

    /// Answers `hits` (taken, never run) with what the response cache kept
    /// for each, through each one's way in, as one batch of their rows,
    /// and wakes their callers at once.
    fn answer_cached(&self, py: Python<'_>, hits: &[(Arc<core::Request>, Arc<core::CachedValue>)]) {
        let requests: Vec<Arc<core::Request>> = hits.iter().map(|(r, _)| r.clone()).collect();
        let groups: Vec<(Sink, Arc<Vec<Route>>)> = core::Routes::for_batch(&requests)
            .groups
            .into_iter()
            .map(|(sink, routes)| (sink, Arc::new(routes)))
            .collect();
        let outcome = self
            .join_cached(py, hits)
            .map_err(|err| err.into_value(py).into_any());
        let posted = self.registry.get().route_batch(py, &groups, &outcome, None);
        let doorbells = posted.doorbells();
        without_gil(py, || posted.wake(&doorbells));
    }

    /// The outputs of a batch made of `hits`' kept rows, back to back.
    fn join_cached(
        &self,
        py: Python<'_>,
        hits: &[(Arc<core::Request>, Arc<core::CachedValue>)],
    ) -> PyResult<Py<PyDict>> {
        let Some(cache) = &self.cache else {
            return Err(PyValueError::new_err(
                "cached results without a response cache",
            ));
        };
        let mut parts = Vec::with_capacity(hits.len());
        let mut rows = 0u32;
        for (request, value) in hits {
            let Some(kept) = value.downcast_ref::<CachedResult>() else {
                return Err(PyValueError::new_err("a cached result of another kind"));
            };
            parts.push((request.rows, kept));
            rows = rows.saturating_add(request.rows);
        }
        Ok(cache::join(cache.rows.bind(py), &parts, rows)?.unbind())
    }

    /// Keeps the results of `batch`'s requests (it succeeded, with
    /// `outputs`) in the response cache, each under its request's key.
    /// What cannot be cut out is not kept (reported as unraisable).
    fn keep_results(&self, py: Python<'_>, batch: &Batch, outputs: &Bound<'_, PyDict>) {
        let Some(cache) = &self.cache else {
            return;
        };
        let all_keys =
            std::mem::take(&mut *batch.cache_keys.lock().unwrap_or_else(|e| e.into_inner()));
        // Each cached request's key and rows; an uncached one's are skipped.
        let mut keys = Vec::with_capacity(all_keys.len());
        let mut spans = Vec::with_capacity(all_keys.len());
        let mut start = 0u32;
        for (request, key) in batch.requests.iter().zip(all_keys) {
            if let Some(key) = key {
                keys.push(key);
                spans.push((start, request.rows));
            }
            start = start.saturating_add(request.rows);
        }
        if keys.is_empty() {
            return;
        }
        match cache::FixedColumns::read(outputs, &cache.fixed, batch.rows) {
            Ok(Some(columns)) => {
                // Copied and kept without the GIL: the event loops go on
                // meanwhile. What the cache took out is dropped back here,
                // with the GIL (it may hold Python objects).
                let bytes = columns.bytes();
                let store = &cache.cache;
                let taken_out = without_gil(py, || {
                    let mut taken_out = Vec::new();
                    for (key, &(start, n)) in keys.into_iter().zip(&spans) {
                        if let Some((value, nbytes)) = bytes.rows(start as usize, n as usize) {
                            let value: Arc<core::CachedValue> = Arc::new(value);
                            taken_out.extend(store.insert(key, value, nbytes).taken_out);
                        }
                    }
                    taken_out
                });
                drop(taken_out);
            }
            Ok(None) => match self.cut(py, cache, outputs, &spans) {
                Ok(kept) => {
                    for (key, kept) in keys.into_iter().zip(kept) {
                        if let Some((value, nbytes)) = kept {
                            // Dropped here, the cache's lock let go.
                            drop(cache.cache.insert(key, Arc::new(value), nbytes).taken_out);
                        }
                    }
                }
                Err(err) => err.write_unraisable(py, Some(outputs.as_any())),
            },
            Err(err) => err.write_unraisable(py, Some(outputs.as_any())),
        }
    }

    /// Each request's (`spans`) result cut out of `outputs` by the server's
    /// `CachedRows.cut` (some output is not a fixed-shape tensor), with its
    /// bytes.
    fn cut(
        &self,
        py: Python<'_>,
        cache: &WorkerCache,
        outputs: &Bound<'_, PyDict>,
        spans: &[(u32, u32)],
    ) -> PyResult<Vec<Option<(CachedResult, usize)>>> {
        let cut = cache
            .rows
            .bind(py)
            .call_method1(intern!(py, "cut"), (outputs, spans.to_vec()))?
            .extract::<Vec<Option<(Py<PyAny>, usize)>>>()?;
        Ok(cut
            .into_iter()
            .map(|kept| kept.map(|(value, nbytes)| (CachedResult::Object(value), nbytes)))
            .collect())
    }
}

/// Seconds a timeout setting gives: `None` stays none, and so does a value
/// too long for a `Duration` (no limit); NaN, zero or below is an error.
fn positive_seconds(name: &str, seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(t) if t.is_nan() || t <= 0.0 => Err(PyValueError::new_err(format!(
            "{name} must be > 0 seconds or None, got {t}"
        ))),
        Some(t) => Ok(Duration::try_from_secs_f64(t).ok()),
    }
}

/// A collated batch: `rows` rows of every input sit in staging slot `slot`.
///
/// The batch owns that slot (the core's guard): nothing rewrites it until
/// `release_slot()` is called or the batch is dropped, whichever comes first.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Batch {
    /// The staging slot's index, to pick the tensors that view it.
    index: usize,
    /// The slot's guard until it is given back.
    slot: Mutex<Option<core::HeldSlot>>,
    #[pyo3(get)]
    rows: usize,
    /// The requests, in row order.
    requests: Vec<Arc<core::Request>>,
    /// When the batcher took them.
    taken_at: Instant,
    groups: Vec<(Sink, Arc<Vec<Route>>)>,
    /// What each input became in the slot.
    collated: Mutex<Vec<Collated>>,
    /// With a response cache, each request's key (row order; `None`: an
    /// uncached request's), taken when the batch's results are kept.
    cache_keys: Mutex<Vec<Option<core::CacheKey>>>,
}

impl Batch {
    /// The queue time, summed, of the requests not in `failed` (by first row).
    fn succeeded_queue_ns(&self, failed: Option<&FailedRows>) -> u64 {
        let mut start = 0u32;
        let mut total = 0u64;
        for request in &self.requests {
            if failed_alone(failed, start).is_none() {
                let queued = self
                    .taken_at
                    .saturating_duration_since(request.enqueued_at)
                    .as_nanos();
                total = total.saturating_add(u64::try_from(queued).unwrap_or(u64::MAX));
            }
            start = start.saturating_add(request.rows);
        }
        total
    }
}

/// A request of a batch as [`Batch::request_parameters`] gives it: `(rows,
/// parameters, priority, absent, queued ns, requested outputs)`.
type RequestEntry<'a> = (u32, Option<&'a str>, u32, u64, u64, u64);

#[pymethods]
impl Batch {
    /// Index of the staging slot the rows sit in, while the batch holds it.
    #[getter]
    fn slot(&self) -> PyResult<usize> {
        match *self.slot.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(_) => Ok(self.index),
            None => Err(PyValueError::new_err(
                "the batch's staging slot was released; it may hold another batch now",
            )),
        }
    }

    /// Gives the staging slot back to the ring, once its bytes have been
    /// consumed (the model call returned, or the host-to-device copy
    /// completed). True if this call released it; False if it was already.
    fn release_slot(&self) -> bool {
        let held = self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        held.is_some() // dropped here, outside the lock: the slot is free
    }

    /// Per input, its length in the slot: a padded input's longest row, a
    /// jagged input's total positions; 0 for the others.
    fn extents(&self) -> Vec<usize> {
        self.collated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|c| match c {
                Collated::Padded { max_len } => *max_len,
                Collated::Jagged { total } => *total,
                Collated::Fixed
                | Collated::Bytes(_)
                | Collated::RaggedBytes { .. }
                | Collated::PaddedNd { .. } => 0,
            })
            .collect()
    }

    /// Per variable dimension of input `index` (padded along several), the
    /// batch's longest; empty for other inputs.
    fn padded_extents(&self, index: usize) -> Vec<usize> {
        match self
            .collated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(index)
        {
            Some(Collated::PaddedNd { longest }) => longest.clone(),
            _ => Vec::new(),
        }
    }

    /// BYTES input `index`'s elements, in batch order, as `bytes` objects
    /// (its collated bytes are let go: call once per input).
    fn take_bytes<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyList>> {
        let data = match self
            .collated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(index)
        {
            Some(Collated::Bytes(data)) => std::mem::take(data),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "input {index} is not a BYTES input of this batch"
                )))
            }
        };
        PyList::new(
            py,
            ferrobatch_core::bytes::elements(&data).map(|e| PyBytes::new(py, e)),
        )
    }

    /// Variable-length BYTES input `index`'s elements, in batch order, as
    /// `bytes` objects, and each row's length (in positions); its collated
    /// bytes are let go: call once per input.
    #[allow(clippy::type_complexity)]
    fn take_ragged_bytes<'py>(
        &self,
        py: Python<'py>,
        index: usize,
    ) -> PyResult<(Bound<'py, PyList>, Vec<usize>)> {
        let (data, lengths) = match self
            .collated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(index)
        {
            Some(Collated::RaggedBytes { data, lengths }) => {
                (std::mem::take(data), std::mem::take(lengths))
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "input {index} is not a variable-length BYTES input of this batch"
                )))
            }
        };
        let elements = PyList::new(
            py,
            ferrobatch_core::bytes::elements(&data).map(|e| PyBytes::new(py, e)),
        )?;
        Ok((elements, lengths))
    }

    /// Whether any of the batch's requests came from an event loop: a
    /// decoupled model's responses to them are read later, on that loop
    /// (so they must not share memory the model may reuse).
    #[getter]
    fn has_loop_requests(&self) -> bool {
        self.groups
            .iter()
            .any(|(sink, _)| matches!(sink, Sink::EventLoop(_)))
    }

    /// Whether `Worker.finish` copies every answer out of this batch's
    /// outputs before it returns: all its requests came through the native
    /// front-end or shared memory (event loops and threads get views of the
    /// outputs). Outputs that view the staging slot are then safe until the
    /// slot is given back after `finish`.
    #[getter]
    fn copies_outputs(&self) -> bool {
        self.groups
            .iter()
            .all(|(sink, _)| matches!(sink, Sink::Connection(_) | Sink::SharedMemory(_)))
    }

    #[getter]
    fn n_requests(&self) -> usize {
        self.groups.iter().map(|(_, r)| r.len()).sum()
    }

    /// Each request's `(rows, parameters, priority, absent, queued_ns,
    /// requested outputs)` in row order: its parameters as a JSON object's
    /// text (None when it gave none), the priority level of the lane it
    /// waited in (1 is the most urgent; 1 for a batcher without levels), the
    /// optional inputs it left out (bit `i`: input `i`), the nanoseconds
    /// from its submit to now, and the outputs it asked for (bit `i`:
    /// output `i`; 0: it did not say).
    fn request_parameters(&self) -> Vec<RequestEntry<'_>> {
        let now = Instant::now();
        self.requests
            .iter()
            .map(|r| {
                let queued = now.saturating_duration_since(r.enqueued_at).as_nanos();
                (
                    r.rows,
                    r.parameters.as_deref(),
                    u32::from(r.lane) + 1,
                    r.absent,
                    u64::try_from(queued).unwrap_or(u64::MAX),
                    r.requested_outputs,
                )
            })
            .collect()
    }

    /// Each request's rows as `(start, rows)`, in batch order: a request's
    /// rows are contiguous, and the requests lie back to back.
    fn request_rows(&self) -> Vec<(u32, u32)> {
        let mut rows: Vec<(u32, u32)> = self
            .groups
            .iter()
            .flat_map(|(_, routes)| routes.iter().map(|r| (r.start, r.rows)))
            .collect();
        rows.sort_unstable();
        rows
    }
}

/// The model's inputs as the binding checks and copies them: `inputs` as
/// `(name, dtype, shape, torch dtype)`, each collated as `layouts` says
/// (`("fixed" | "bytes" | "pad" | "jagged", pad bytes)`; none: fixed, or
/// BYTES for that dtype), `padded_dims` the whole row shape of an input
/// padded along several dimensions, `optional` whether a request may leave
/// it out. Shared by the batcher and shared-memory clients.
pub(crate) fn input_specs(
    py: Python<'_>,
    inputs: Vec<(String, String, Vec<usize>, Py<PyAny>)>,
    layouts: &[(String, Option<Vec<u8>>)],
    padded_dims: &[Option<Vec<Option<usize>>>],
    optional: &[bool],
) -> PyResult<Vec<InputSpec>> {
    if !layouts.is_empty() && layouts.len() != inputs.len() {
        return Err(PyValueError::new_err(format!(
            "{} layouts for {} inputs",
            layouts.len(),
            inputs.len()
        )));
    }
    let mut specs = Vec::with_capacity(inputs.len());
    for (i, (name, dtype, shape, torch_dtype)) in inputs.into_iter().enumerate() {
        let dtype = DType::parse(&dtype).ok_or_else(|| {
            PyValueError::new_err(format!("input '{name}': unknown dtype '{dtype}'"))
        })?;
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let core = ferrobatch_core::InputSpec::new(&name, dtype, shape)
            .zip(elements)
            .ok_or_else(|| {
                PyValueError::new_err(format!("input '{name}': its shape is too large"))
            })?;
        let (core, elements) = core;
        let optional = optional.get(i).copied().unwrap_or(false);
        if optional && i >= ferrobatch_core::MAX_OPTIONAL_INPUTS {
            return Err(PyValueError::new_err(format!(
                "input '{name}': an optional input must be among the first {} inputs",
                ferrobatch_core::MAX_OPTIONAL_INPUTS
            )));
        }
        let core = core.optional(optional);
        let mode = layouts.get(i).map(|(mode, pad)| (mode.as_str(), pad));
        let layout = match mode {
            None | Some(("fixed" | "bytes", _)) if dtype == DType::Bytes => Layout::Bytes {
                elements_per_row: elements,
            },
            None | Some(("fixed", _)) => Layout::Fixed,
            // Padded along variable dimensions anywhere: `dims` is the
            // row's whole shape (`None`: variable), `shape` unused.
            Some(("pad", pad))
                if dtype != DType::Bytes && padded_dims.get(i).is_some_and(Option::is_some) =>
            {
                let dims = padded_dims[i].clone().unwrap_or_default();
                let itemsize = dtype.itemsize();
                let pad = pad.clone().unwrap_or_else(|| vec![0u8; itemsize]);
                Layout::Padded(Padded {
                    dims: dims.into_boxed_slice(),
                    itemsize,
                    pad: pad.into_boxed_slice(),
                })
            }
            Some((mode @ ("pad" | "jagged"), _)) if dtype == DType::Bytes => {
                // `shape` is what follows the variable dimension.
                Layout::RaggedBytes(RaggedBytes {
                    unit_elements: elements,
                    padded: mode == "pad",
                })
            }
            Some(("pad" | "jagged", pad)) if dtype != DType::Bytes => {
                // `shape` is what follows the variable dimension.
                let unit_nbytes = core.row_nbytes;
                let pad = match (mode, pad) {
                    (Some(("pad", _)), Some(pad)) => Some(pad.clone().into_boxed_slice()),
                    (Some(("pad", _)), None) => Some(vec![0u8; unit_nbytes].into_boxed_slice()),
                    _ => None,
                };
                Layout::Ragged(Ragged {
                    unit_nbytes,
                    unit_elements: elements,
                    pad,
                })
            }
            Some((other, _)) => {
                return Err(PyValueError::new_err(format!(
                    "input '{name}': layout '{other}' does not apply to dtype {}",
                    dtype.name()
                )))
            }
        };
        let key = PyString::intern(py, &name).unbind();
        specs.push(InputSpec {
            core,
            layout,
            key,
            torch_dtype,
        });
    }
    Ok(specs)
}
