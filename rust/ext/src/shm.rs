//! Binding of the shared-memory transport (`ferrobatch_core::shm`).
//!
//! Server side: [`SharedServer`] makes a model's segment and starts the
//! core's pull thread; the model's `LoopRegistry` holds a [`SharedSink`]
//! (see `shm_sink.rs`), to which its batches' `Sink::SharedMemory` rows go.
//!
//! Client side: [`SharedClient`] claims a client slot; `submit` (event
//! loops) and `infer_blocking` (threads) copy a request into its cells, and
//! a collector thread of the client's own sleeps on the slot's futex (GIL
//! released), takes what each wake-up finished, builds the results with
//! the GIL once per wake-up, and hands each event loop its share with one
//! `call_soon_threadsafe` (a thread waiter its own condvar). It also fails
//! every waiter with `ServerClosedError` once the server stops or dies.
//!
//! One owner per request: whoever removes its waiter from `waiters`
//! answers it (the collector, its deadline, its cancellation, `close`).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferrobatch_core::shm::{
    code, CellLayout, ClientCore, Completed, Segment, SegmentConfig, ServerGone, ShmError,
    Withdraw, POLL,
};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PySlice, PyTuple, PyType};

use crate::batcher::input_specs;
use crate::batcher::Batcher;
use crate::codec::V2Codec;
use crate::errors::{ferrobatch_error, invalid_input};
use crate::inputs::Converter;
use crate::loops::LoopRegistry;
use crate::results::outcome_of_error;
use crate::shm_sink::{output_specs, OutputSpec, SharedSink, SpecTuple};
use crate::without_gil;

/// How often a blocked thread comes back for the GIL to see signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

fn shm_error(py: Python<'_>, err: ShmError) -> PyErr {
    let message = err.to_string();
    match err {
        ShmError::NotFound(_) | ShmError::Closed(_) => {
            ferrobatch_error(py, "ServerClosedError", message)
        }
        ShmError::Full(_) => ferrobatch_error(py, "QueueFullError", message),
        ShmError::Invalid(_) => invalid_input(py, message),
        ShmError::Version(_) | ShmError::Owner(_) => {
            ferrobatch_error(py, "FerrobatchError", message)
        }
        ShmError::Config(_) => PyValueError::new_err(message),
        ShmError::Io(..) => PyOSError::new_err(message),
    }
}

fn row_u32(n: usize, what: &str) -> PyResult<u32> {
    u32::try_from(n).map_err(|_| PyValueError::new_err(format!("{what} is too large")))
}

// -- server -------------------------------------------------------------------

/// A model shared under a name, until `close`.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct SharedServer {
    server: Arc<ferrobatch_core::shm::SharedServer>,
    /// What replacing a stale segment of the name said (for the log).
    #[pyo3(get)]
    replaced: Option<String>,
}

#[pymethods]
impl SharedServer {
    /// Makes the segment `name` (mode `mode`) for the running `batcher`,
    /// with `meta` (JSON for clients) and `outputs` (`(name, dtype, shape,
    /// torch dtype)` each), and starts taking requests from it; its rows
    /// are delivered through `registry`. A model with BYTES or
    /// variable-length tensors passes `codec` (its outputs are read by it)
    /// and `cell_bytes` (the input and output bytes of each cell). Raises
    /// `ValueError` if a live server shares the name, `OSError` if the
    /// segment cannot be made.
    #[new]
    #[pyo3(signature = (name, batcher, registry, outputs, meta, *, model_name, max_clients, rows_per_client, ring_size, mode, codec=None, cell_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        batcher: &Bound<'_, Batcher>,
        registry: &Bound<'_, LoopRegistry>,
        outputs: Vec<SpecTuple>,
        meta: &str,
        model_name: &str,
        max_clients: u32,
        rows_per_client: u32,
        ring_size: u32,
        mode: u32,
        codec: Option<Py<V2Codec>>,
        cell_bytes: usize,
    ) -> PyResult<SharedServer> {
        let outputs = output_specs(py, outputs)?;
        let specs = batcher.get().input_specs();
        // Optional inputs are among the first 64 (the Server checks it).
        let optional = specs
            .iter()
            .take(64)
            .enumerate()
            .filter(|(_, s)| s.optional)
            .fold(0u64, |mask, (i, _)| mask | (1u64 << i));
        let layout = if codec.is_some() {
            if cell_bytes == 0 || cell_bytes % 8 != 0 {
                return Err(PyValueError::new_err(format!(
                    "cell_bytes must be a multiple of 8 and at least 8, got {cell_bytes}"
                )));
            }
            CellLayout::Varying {
                inputs: cell_bytes,
                outputs: cell_bytes,
            }
        } else {
            CellLayout::Rows {
                inputs: specs.iter().map(|s| s.row_nbytes).collect(),
                outputs: outputs.iter().map(|o| o.row_nbytes).collect(),
            }
        };
        let counts = (specs.len(), outputs.len());
        let (in_row, out_row) = layout.cell_bytes();
        let max_rows = batcher.get().core().rule().max_batch_size;
        let config = SegmentConfig {
            clients: max_clients,
            cells: rows_per_client,
            ring_capacity: ring_size,
            in_row: row_u32(in_row, "a row of the inputs")?,
            out_row: row_u32(out_row, "a row of the outputs")?,
            max_rows: row_u32(max_rows, "max_batch_size")?,
            meta_len: 0,
        };
        let core = batcher.get().core().clone();
        let meta = meta.as_bytes().to_vec();
        let name = name.to_owned();
        let made = without_gil(py, move || -> Result<_, ShmError> {
            let (segment, replaced) = Segment::create(&name, config, &meta, mode)?;
            let server = ferrobatch_core::shm::SharedServer::start(
                Arc::new(segment),
                core,
                layout,
                counts,
                optional,
                Box::new(log_warning),
            )
            .map_err(|e| ShmError::Io("cannot start the shared-memory thread".into(), e))?;
            Ok((server, replaced))
        });
        let (server, replaced) = made.map_err(|e| shm_error(py, e))?;
        registry.get().attach_shared(Arc::new(SharedSink::new(
            server.clone(),
            model_name.into(),
            outputs,
            codec,
        )));
        Ok(SharedServer { server, replaced })
    }

    /// Stops taking requests (accepted ones still run; clients refuse new
    /// ones at once). Blocks (without the GIL) until the pull thread ended.
    fn stop_accepting(&self, py: Python<'_>) {
        without_gil(py, || self.server.stop_accepting());
    }

    /// Answers what is still pending with `ServerClosedError(message)`,
    /// tells the clients the server stopped and removes the segment.
    fn close(&self, py: Python<'_>, message: &str) {
        without_gil(py, || self.server.close(message));
    }

    /// Requests accepted and not answered yet.
    #[getter]
    fn in_flight(&self) -> usize {
        self.server.in_flight()
    }

    /// Client slots reclaimed so far (closed, or their process died).
    #[getter]
    fn reclaimed(&self) -> u64 {
        self.server.reclaimed()
    }

    /// `[(slot, pid)]` of the connected clients.
    fn clients(&self) -> Vec<(u32, u32)> {
        self.server.clients()
    }

    /// Faults handled so far: resets of a corrupt request ring, clients
    /// closed for malformed memory (each logged when it happens).
    #[getter]
    fn faults(&self) -> u64 {
        self.server.faults()
    }
}

/// A line on the `ferrobatch` logger, from any thread (none once the
/// interpreter is finalizing).
fn log_warning(message: &str) {
    let _ = Python::try_attach(|py| -> PyResult<()> {
        py.import("logging")?
            .call_method1("getLogger", ("ferrobatch",))?
            .call_method1("warning", ("ferrobatch: %s", message))?;
        Ok(())
    });
}

// -- client -------------------------------------------------------------------

/// What a waiter gets from the collector: its finished entry, or why the
/// server will never answer. Plain data: the collector never needs the GIL.
enum Answer {
    Done(Completed),
    Closed(String),
}

/// A thread blocked in `infer_blocking`, until its answer is in.
type ThreadWaiter = crate::threads::Waiter<Answer>;

/// One event loop's answers, posted by the collector and drained on the
/// loop (its reader callback on `fd`, an eventfd rung once per post).
struct LoopInbox {
    event_loop: Py<PyAny>,
    fd: OwnedFd,
    posted: Mutex<Vec<(Py<PyAny>, bool, Answer)>>,
}

impl LoopInbox {
    /// Posts an answer; true if the inbox was empty (its fd must ring).
    fn post(&self, future: Py<PyAny>, batched: bool, answer: Answer) -> bool {
        let mut posted = self.posted.lock().unwrap_or_else(|e| e.into_inner());
        posted.push((future, batched, answer));
        posted.len() == 1
    }

    fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd this inbox
        // owns (open while `self` lives); a full counter only loses a
        // redundant wake-up.
        unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

enum Target {
    Loop {
        future: Py<PyAny>,
        inbox: Arc<LoopInbox>,
    },
    Thread(Arc<ThreadWaiter>),
}

struct Waiting {
    tag: u32,
    batched: bool,
    target: Target,
}

impl Waiting {
    /// Hands `answer` to whoever waits; the loop inbox to ring, if any.
    fn answer(self, answer: Answer) -> Option<Arc<LoopInbox>> {
        match self.target {
            Target::Thread(waiter) => {
                waiter.set(answer);
                None
            }
            Target::Loop { future, inbox } => {
                let first = inbox.post(future, self.batched, answer);
                first.then_some(inbox)
            }
        }
    }
}

struct ClientInner {
    core: ClientCore,
    model_name: String,
    converter: Converter,
    outputs: Vec<OutputSpec>,
    /// A model with BYTES or variable-length tensors: makes a request's
    /// result from its outputs' `(bytes, row shapes, pad)` (see `new`).
    varying: Option<Py<PyAny>>,
    /// By first cell: every request not answered yet.
    waiters: Mutex<HashMap<u32, Waiting>>,
    /// The inbox of every event loop that submitted.
    loops: Mutex<Vec<Arc<LoopInbox>>>,
    /// `torch.empty`, for the result tensors.
    empty: Py<PyAny>,
    stop: AtomicBool,
    /// The collector thread, joined by `close` (never by a forked child,
    /// which has no such thread).
    collector: Mutex<Option<std::thread::JoinHandle<()>>>,
    pid: u32,
}

impl ClientInner {
    fn waiters(&self) -> MutexGuard<'_, HashMap<u32, Waiting>> {
        // Nothing under this lock panics or runs Python code.
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes the waiter of `(cell, tag)` if it is still there.
    fn take(&self, cell: u32, tag: u32) -> Option<Waiting> {
        let mut waiters = self.waiters();
        match waiters.get(&cell) {
            Some(w) if w.tag == tag => waiters.remove(&cell),
            _ => None,
        }
    }

    /// The collector thread (never holds the GIL): wait, collect, hand each
    /// answer to its waiter, ring each loop once; until closed, or the
    /// server is gone (then every waiter gets `Closed`).
    fn collect_forever(self: Arc<Self>) {
        let mut done = Vec::new();
        let mut checked = Instant::now();
        let mut to_ring: Vec<Arc<LoopInbox>> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            self.core.wait(POLL);
            self.core.retry_withdrawals();
            let sound = self.core.collect(&mut done).is_ok();
            let gone = if !sound {
                Some(ServerGone::Evicted)
            } else if checked.elapsed() >= POLL || !done.is_empty() {
                checked = Instant::now();
                self.core.server_gone()
            } else {
                None
            };
            let over = matches!(
                gone,
                Some(ServerGone::Stopped | ServerGone::Died | ServerGone::Evicted)
            );
            if over && sound {
                // What the server answered before it stopped, first.
                let _ = self.core.collect(&mut done);
            }
            for d in done.drain(..) {
                match self.take(d.cell, d.tag) {
                    Some(w) => to_ring.extend(w.answer(Answer::Done(d))),
                    None => self.core.release(&d), // its caller gave up
                }
            }
            if over {
                let why = gone.map(|g| g.to_string()).unwrap_or_default();
                to_ring.extend(self.close_waiters(&why));
            }
            for inbox in to_ring.drain(..) {
                inbox.ring();
            }
            if over {
                return;
            }
        }
    }

    /// Answers every waiter with `Closed(why)`; the inboxes to ring.
    fn close_waiters(&self, why: &str) -> Vec<Arc<LoopInbox>> {
        let waiting: Vec<Waiting> = self.waiters().drain().map(|(_, w)| w).collect();
        let message = format!("model '{}': {why}", self.model_name);
        waiting
            .into_iter()
            .filter_map(|w| w.answer(Answer::Closed(message.clone())))
            .collect()
    }

    /// The results of `answers` (in order; GIL held), their cells freed.
    fn results(&self, py: Python<'_>, answers: &[(bool, &Answer)]) -> Vec<PyResult<Py<PyAny>>> {
        if let Some(varying) = &self.varying {
            return answers
                .iter()
                .map(|(batched, answer)| {
                    let result = match answer {
                        Answer::Closed(message) => {
                            Err(ferrobatch_error(py, "ServerClosedError", message.clone()))
                        }
                        Answer::Done(d) if d.code != code::OK => Err(self.error(py, d)),
                        Answer::Done(d) => self.varying_result(py, varying.bind(py), d, *batched),
                    };
                    if let Answer::Done(d) = answer {
                        self.core.release(d);
                    }
                    result
                })
                .collect();
        }
        let ok: Vec<&Completed> = answers
            .iter()
            .filter_map(|(_, a)| match a {
                Answer::Done(d) if d.code == code::OK => Some(d),
                _ => None,
            })
            .collect();
        let rows: usize = ok.iter().map(|d| d.rows as usize).sum();
        let columns = self.columns(py, &ok, rows);
        let mut row = 0usize;
        let mut out = Vec::with_capacity(answers.len());
        for (batched, answer) in answers {
            out.push(match answer {
                Answer::Closed(message) => {
                    Err(ferrobatch_error(py, "ServerClosedError", message.clone()))
                }
                Answer::Done(d) if d.code != code::OK => Err(self.error(py, d)),
                Answer::Done(d) => {
                    let result = match &columns {
                        Ok(columns) => self.result(py, columns, row, d.rows as usize, *batched),
                        Err(e) => Err(e.clone_ref(py)),
                    };
                    row += d.rows as usize;
                    result
                }
            });
            if let Answer::Done(d) = answer {
                self.core.release(d);
            }
        }
        out
    }

    /// One tensor per output holding the rows of `ok` back to back.
    fn columns(&self, py: Python<'_>, ok: &[&Completed], rows: usize) -> PyResult<Vec<Py<PyAny>>> {
        let mut columns = Vec::with_capacity(self.outputs.len());
        if rows == 0 {
            return Ok(columns);
        }
        for (index, spec) in self.outputs.iter().enumerate() {
            let mut shape = Vec::with_capacity(spec.shape.len() + 1);
            shape.push(rows);
            shape.extend_from_slice(&spec.shape);
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "dtype"), spec.torch_dtype.bind(py))?;
            let tensor = self
                .empty
                .bind(py)
                .call((PyTuple::new(py, &shape)?,), Some(&kwargs))?;
            let ptr: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
            let mut offset = 0usize;
            for d in ok {
                let src = self.core.output(d, index);
                if ptr != 0 && !src.is_empty() {
                    // SAFETY: the tensor was just made with `rows` rows of
                    // `row_nbytes` each, contiguous; the requests' rows sum
                    // to `rows`, so `offset + src.len()` stays within it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            (ptr as *mut u8).add(offset),
                            src.len(),
                        )
                    };
                }
                offset += src.len();
            }
            columns.push(tensor.unbind());
        }
        Ok(columns)
    }

    fn result(
        &self,
        py: Python<'_>,
        columns: &[Py<PyAny>],
        start: usize,
        rows: usize,
        batched: bool,
    ) -> PyResult<Py<PyAny>> {
        let result = PyDict::new(py);
        for (spec, column) in self.outputs.iter().zip(columns) {
            let column = column.bind(py);
            let value = if batched {
                let (Ok(s), Ok(e)) = (isize::try_from(start), isize::try_from(start + rows)) else {
                    return Err(PyRuntimeError::new_err("row index out of range"));
                };
                column.get_item(PySlice::new(py, s, e, 1))?
            } else {
                column.get_item(start)?
            };
            result.set_item(spec.key.bind(py), value)?;
        }
        Ok(result.into_any().unbind())
    }

    /// The result of finished request `d` of a varying model: its outputs'
    /// `(bytes, row shapes, pad)` read from its cells, made a result by
    /// the `varying` hook.
    fn varying_result(
        &self,
        py: Python<'_>,
        varying: &Bound<'_, PyAny>,
        d: &Completed,
        batched: bool,
    ) -> PyResult<Py<PyAny>> {
        let read = self
            .core
            .varying_outputs(d, self.outputs.len())
            .map_err(|why| ferrobatch_error(py, "FerrobatchError", why))?;
        let outputs = PyList::empty(py);
        for output in read {
            let shapes = PyList::new(py, output.shapes)?;
            // A bytearray: the result's tensors are views of it (one copy
            // out of the cells, none more).
            outputs.append((
                PyByteArray::new(py, output.data),
                shapes,
                PyBytes::new(py, output.pad),
            ))?;
        }
        Ok(varying.call1((outputs, batched))?.unbind())
    }

    fn error(&self, py: Python<'_>, d: &Completed) -> PyErr {
        let class = match d.code {
            code::INVALID_INPUT => "InvalidInputError",
            code::QUEUE_FULL => "QueueFullError",
            code::DEADLINE_EXCEEDED => "DeadlineExceededError",
            code::MODEL_ERROR => "ModelError",
            _ => "ServerClosedError",
        };
        ferrobatch_error(py, class, d.message.clone())
    }

    /// Resolves what the collector posted to `inbox` (its loop's thread).
    fn drain(&self, py: Python<'_>, inbox: &LoopInbox) -> PyResult<()> {
        let mut counter = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from the
        // non-blocking eventfd this inbox owns; a failed read is harmless.
        unsafe { libc::read(inbox.fd.as_raw_fd(), counter.as_mut_ptr().cast(), 8) };
        let posted = std::mem::take(&mut *inbox.posted.lock().unwrap_or_else(|e| e.into_inner()));
        if posted.is_empty() {
            return Ok(());
        }
        let answers: Vec<(bool, &Answer)> = posted.iter().map(|(_, b, a)| (*b, a)).collect();
        let results = self.results(py, &answers);
        for ((future, _, _), result) in posted.iter().zip(results) {
            let future = future.bind(py);
            if future.call_method0(intern!(py, "done"))?.is_truthy()? {
                continue; // cancelled meanwhile
            }
            match result {
                Ok(value) => future.call_method1(intern!(py, "set_result"), (value,))?,
                Err(err) => {
                    future.call_method1(intern!(py, "set_exception"), (err.into_value(py),))?
                }
            };
        }
        Ok(())
    }

    /// The inbox of `event_loop`, made and watched on first use (from any
    /// thread: the loop starts watching it at its next iteration, and an
    /// answer posted before then waits in it, its eventfd set).
    fn inbox_for(
        self: &Arc<Self>,
        py: Python<'_>,
        event_loop: &Bound<'_, PyAny>,
    ) -> PyResult<Arc<LoopInbox>> {
        if let Some(inbox) = self
            .loops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|i| i.event_loop.is(event_loop))
        {
            return Ok(inbox.clone());
        }
        // SAFETY: eventfd makes a new fd (or -1, checked), owned from here.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(PyOSError::new_err(format!(
                "cannot make an eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `raw` is a fresh fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let inbox = Arc::new(LoopInbox {
            event_loop: event_loop.clone().unbind(),
            fd,
            posted: Mutex::new(Vec::new()),
        });
        let drain = Bound::new(
            py,
            SharedDrain {
                inner: self.clone(),
                inbox: inbox.clone(),
            },
        )?;
        let drain = drain.getattr(intern!(py, "drain"))?;
        let add_reader = event_loop.getattr(intern!(py, "add_reader"))?;
        event_loop.call_method1(
            intern!(py, "call_soon_threadsafe"),
            (add_reader, raw, drain),
        )?;
        self.loops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(inbox.clone());
        Ok(inbox)
    }

    /// `queued`, a request's queueing; a refusal (made on this side, before
    /// the server sees the request) is counted for the server's `stats()`.
    fn counted<T>(&self, py: Python<'_>, queued: PyResult<T>) -> PyResult<T> {
        if let Err(refusal) = &queued {
            let outcome = outcome_of_error(py, refusal.value(py));
            self.core.segment().count_refusal(outcome);
        }
        queued
    }

    /// Converts and queues a request, its waiter registered first (the
    /// collector may answer it at once): `(cell, tag)`.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        batched: bool,
        priority: Option<i64>,
        parameters: Option<String>,
        target: Target,
    ) -> PyResult<(u32, u32)> {
        let submission = crate::submit::submission(py, timeout, priority, parameters)?;
        // An optional input left out travels as zeros, named in `absent`.
        let (rows, views, keep, absent) = self.converter.convert_dict(py, inputs, batched)?;
        let submission = ferrobatch_core::Submission {
            absent,
            ..submission
        };
        let rows = row_u32(rows, "rows")?;
        // Held across the submit: the collector finds the waiter (it takes
        // this lock only without the GIL, so this thread never waits on it
        // while the collector waits for this thread's GIL).
        let mut waiters = self.waiters();
        let submitted = if self.varying.is_some() {
            let inputs: Vec<_> = keep
                .iter()
                .zip(views.iter())
                .map(|(k, v)| (k.bytes(), *v.extents()))
                .collect();
            self.core.submit_varying(&inputs, rows, &submission)
        } else {
            let bytes: Vec<&[u8]> = keep.iter().map(|k| k.bytes()).collect();
            self.core.submit_with(&bytes, rows, &submission)
        };
        let (cell, tag) = submitted.map_err(|e| shm_error(py, e))?;
        waiters.insert(
            cell,
            Waiting {
                tag,
                batched,
                target,
            },
        );
        Ok((cell, tag))
    }

    /// The caller gave up on `(cell, tag)`: its waiter is dropped and the
    /// request withdrawn. None if it was answered first.
    fn abandon(&self, cell: u32, tag: u32, why: Withdraw) -> Option<Waiting> {
        let waiting = self.take(cell, tag)?;
        self.core.withdraw(cell, tag, why);
        Some(waiting)
    }

    /// Stops the collector (and, with `join`, waits for it) and gives the
    /// slot back.
    fn close(&self, join: bool) {
        self.stop.store(true, Ordering::Release);
        self.core.close();
        let (word, _) = self.core.segment().client_doorbell(self.core.slot());
        word.fetch_add(1, Ordering::SeqCst);
        ferrobatch_core::shm::futex_wake(word);
        if join && ferrobatch_core::shm::current_pid() == self.pid {
            let handle = self
                .collector
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(handle) = handle {
                let _ = handle.join();
            }
        }
    }
}

/// An event loop's reader callback for its inbox's eventfd.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct SharedDrain {
    inner: Arc<ClientInner>,
    inbox: Arc<LoopInbox>,
}

#[pymethods]
impl SharedDrain {
    /// Resolves what the collector posted since the last call.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.drain(py, &self.inbox)
    }
}

fn key(cell: u32, tag: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(cell)
}

fn unkey(key: u64) -> (u32, u32) {
    (key as u32, (key >> 32) as u32)
}

/// The segment's metadata (JSON), after checking its owner (`owner`, or
/// this user) and version: what `connect` builds the client's specs from.
#[pyfunction]
#[pyo3(signature = (name, owner=None))]
pub fn shared_meta(py: Python<'_>, name: &str, owner: Option<u32>) -> PyResult<String> {
    let name = name.to_owned();
    let meta = without_gil(py, move || Segment::open(&name, owner).map(|s| s.meta()))
        .map_err(|e| shm_error(py, e))?;
    String::from_utf8(meta)
        .map_err(|_| PyValueError::new_err("the segment's metadata is not UTF-8"))
}

/// A client of a shared model, in this process (see the module docs).
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct SharedClient {
    inner: Arc<ClientInner>,
}

#[pymethods]
impl SharedClient {
    /// Connects to the segment `name`: `inputs` as the batcher takes them
    /// (with `layouts`, `padded_dims`, `optional`) and `outputs` as `(name,
    /// dtype, shape, torch dtype)`, read from its metadata. A model with
    /// BYTES or variable-length tensors passes `cell_bytes` (its cells'
    /// size), `max_batch_elements`, and `varying(outputs, batched)`, which
    /// makes a request's result from its outputs' `(bytes, row shapes,
    /// pad)`.
    #[new]
    #[pyo3(signature = (name, inputs, outputs, *, model_name, max_batch_size, tensor_type, coerce, empty, owner=None, optional=Vec::new(), layouts=Vec::new(), padded_dims=Vec::new(), max_batch_elements=None, cell_bytes=0, varying=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        inputs: Vec<SpecTuple>,
        outputs: Vec<SpecTuple>,
        model_name: String,
        max_batch_size: usize,
        tensor_type: Py<PyType>,
        coerce: Py<PyAny>,
        empty: Py<PyAny>,
        owner: Option<u32>,
        optional: Vec<bool>,
        layouts: Vec<(String, Option<Vec<u8>>)>,
        padded_dims: Vec<Option<Vec<Option<usize>>>>,
        max_batch_elements: Option<usize>,
        cell_bytes: usize,
        varying: Option<Py<PyAny>>,
    ) -> PyResult<SharedClient> {
        let specs = input_specs(py, inputs, &layouts, &padded_dims, &optional)?;
        let outputs = output_specs(py, outputs)?;
        let layout = match varying {
            Some(_) => CellLayout::Varying {
                inputs: cell_bytes,
                outputs: cell_bytes,
            },
            None => CellLayout::Rows {
                inputs: specs.iter().map(|s| s.row_nbytes).collect(),
                outputs: outputs.iter().map(|o| o.row_nbytes).collect(),
            },
        };
        let name = name.to_owned();
        let core = without_gil(py, move || {
            let segment = Arc::new(Segment::open(&name, owner)?);
            ClientCore::connect(segment, layout)
        })
        .map_err(|e| shm_error(py, e))?;
        let inner = Arc::new(ClientInner {
            core,
            model_name,
            converter: Converter {
                specs,
                tensor_type,
                coerce,
                max_rows: max_batch_size,
                max_elements: max_batch_elements,
                bytes_limits: ferrobatch_core::bytes::BytesLimits::default(),
            },
            outputs,
            varying,
            waiters: Mutex::new(HashMap::new()),
            loops: Mutex::new(Vec::new()),
            empty,
            stop: AtomicBool::new(false),
            collector: Mutex::new(None),
            pid: ferrobatch_core::shm::current_pid(),
        });
        let collector = inner.clone();
        let handle = std::thread::Builder::new()
            .name("ferrobatch-shm-client".into())
            .spawn(move || collector.collect_forever())
            .map_err(|e| PyOSError::new_err(format!("cannot start the collector thread: {e}")))?;
        *inner.collector.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(SharedClient { inner })
    }

    /// Queues a request answered on `event_loop`'s thread through `future`
    /// (anything with `done()`, `set_result` and `set_exception`; from that
    /// loop, or from any thread with a `concurrent.futures.Future`): its key,
    /// for `cancel`/`expire` (on the loop).
    #[pyo3(signature = (inputs, timeout, batched, future, event_loop, priority=None, parameters=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        timeout: Option<Bound<'_, PyAny>>,
        batched: bool,
        future: Py<PyAny>,
        event_loop: &Bound<'_, PyAny>,
        priority: Option<Bound<'_, PyAny>>,
        parameters: Option<String>,
    ) -> PyResult<u64> {
        let inbox = self.inner.inbox_for(py, event_loop)?;
        let queued = crate::submit::call_numbers(py, timeout.as_ref(), priority.as_ref()).and_then(
            |(timeout, priority)| {
                let target = Target::Loop { future, inbox };
                self.inner
                    .submit(py, inputs, timeout, batched, priority, parameters, target)
            },
        );
        let (cell, tag) = self.inner.counted(py, queued)?;
        Ok(key(cell, tag))
    }

    /// The task awaiting request `key` was cancelled: withdraws it where
    /// no batch has taken it yet (loop thread).
    fn cancel(&self, key: u64) {
        let (cell, tag) = unkey(key);
        self.inner.abandon(cell, tag, Withdraw::Cancelled);
    }

    /// Request `key`'s deadline passed (loop thread): fails its future with
    /// `DeadlineExceededError` unless it was answered first.
    fn expire(&self, py: Python<'_>, key: u64, timeout: f64) -> PyResult<()> {
        let (cell, tag) = unkey(key);
        let Some(waiting) = self.inner.abandon(cell, tag, Withdraw::Expired) else {
            return Ok(());
        };
        if let Target::Loop { future, .. } = waiting.target {
            let future = future.bind(py);
            if !future.call_method0(intern!(py, "done"))?.is_truthy()? {
                let message = format!(
                    "request to model '{}' exceeded its {timeout}s timeout",
                    self.inner.model_name
                );
                let err = ferrobatch_error(py, "DeadlineExceededError", message);
                future.call_method1(intern!(py, "set_exception"), (err.into_value(py),))?;
            }
        }
        Ok(())
    }

    /// Runs a request from a plain thread, blocking (GIL released) until
    /// its answer; Ctrl-C withdraws it where it is still queued.
    #[pyo3(signature = (inputs, timeout=None, batched=false, priority=None, parameters=None))]
    fn infer_blocking(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        timeout: Option<Bound<'_, PyAny>>,
        batched: bool,
        priority: Option<Bound<'_, PyAny>>,
        parameters: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let waiter = Arc::new(ThreadWaiter::default());
        let queued = crate::submit::call_numbers(py, timeout.as_ref(), priority.as_ref()).and_then(
            |(timeout, priority)| {
                let target = Target::Thread(waiter.clone());
                self.inner
                    .submit(py, inputs, timeout, batched, priority, parameters, target)
                    .map(|queued| (queued, timeout))
            },
        );
        let ((cell, tag), timeout) = self.inner.counted(py, queued)?;
        // Checked by `submit` above: an invalid timeout never gets here.
        let deadline = timeout
            .and_then(|t| ferrobatch_core::timeout_from_secs(t).ok().flatten())
            .and_then(|t| Instant::now().checked_add(t));
        loop {
            let slice = Instant::now() + SIGNAL_CHECK;
            let until = deadline.map_or(slice, |d| d.min(slice));
            if let Some(answer) = without_gil(py, || waiter.wait_until(until)) {
                let mut results = self.inner.results(py, &[(batched, &answer)]);
                return results
                    .pop()
                    .unwrap_or_else(|| Err(PyRuntimeError::new_err("no result")));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                if self.inner.abandon(cell, tag, Withdraw::Expired).is_some() {
                    let message = format!(
                        "request to model '{}' exceeded its {}s timeout",
                        self.inner.model_name,
                        timeout.unwrap_or_default()
                    );
                    return Err(ferrobatch_error(py, "DeadlineExceededError", message));
                }
                continue; // answered meanwhile
            }
            if let Err(interrupted) = py.check_signals() {
                if self.inner.abandon(cell, tag, Withdraw::Cancelled).is_some() {
                    return Err(interrupted);
                }
            }
        }
    }

    /// Gives the client slot back; requests still waiting fail with
    /// `ServerClosedError`. Idempotent.
    fn close(&self, py: Python<'_>) {
        without_gil(py, || self.inner.close(true));
        for inbox in self.inner.close_waiters("the client was closed") {
            inbox.ring();
        }
    }

    /// Requests of this client not answered yet.
    #[getter]
    fn pending(&self) -> usize {
        self.inner.waiters().len()
    }

    /// The client slot this process holds.
    #[getter]
    fn slot(&self) -> u32 {
        self.inner.core.slot()
    }

    /// Rows whose cells are in use (answered requests free theirs).
    #[getter]
    fn cells_in_use(&self) -> usize {
        self.inner.core.in_flight()
    }
}

impl Drop for SharedClient {
    fn drop(&mut self) {
        // The collector holds the rest of `inner`: it ends, and the slot is
        // given back when the last reference goes.
        // Not joined: this thread may hold the GIL the collector waits for.
        self.inner.close(false);
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SharedServer>()?;
    m.add_class::<SharedClient>()?;
    m.add_class::<SharedDrain>()?;
    m.add_function(wrap_pyfunction!(shared_meta, m)?)?;
    m.add_function(wrap_pyfunction!(remove_stale_segments, m)?)?;
    Ok(())
}

/// Removes the segments of this user's servers that were killed before
/// their stop could (their memory stays in `/dev/shm` otherwise); the names.
#[pyfunction]
pub fn remove_stale_segments(py: Python<'_>) -> Vec<String> {
    without_gil(py, ferrobatch_core::shm::remove_stale_segments)
}
