//! `Submitter`: the caller's entry point, one per server. `Client.infer`
//! makes one call into it per request: find the calling event loop's mailbox,
//! queue the request, arm its deadline, hand back its future.
//!
//! Finding the loop is the costly part in Python: `asyncio.get_running_loop`
//! calls `getpid()` on every call (Python 3.11), a system call. So the last
//! loop seen is cached against the marker asyncio itself keeps in the thread
//! state's dict while a loop runs: a fresh holder object per run on 3.11, the
//! loop itself on 3.12. The cache holds a reference to the marker, so an
//! identical marker means the same run of the same loop. Where the marker is
//! missing (3.13 keeps the running loop elsewhere) the loop itself is the key,
//! looked up the ordinary way. A fork bumps a generation that empties the
//! cache: in the child, asyncio no longer reports the parent's loop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use crate::batcher::Batcher;
use ferrobatch_core::Outcome;

use crate::errors::{invalid_input, is_ferrobatch_error};

use crate::loops::LoopRegistry;
use crate::mailbox::LoopMailbox;
use crate::results::outcome_of_error;

/// Bumped in a forked child, so that no loop cached in the parent is used.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Called by `os.register_at_fork(after_in_child=...)`.
#[pyfunction]
pub fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// The marker of the loop running on this thread, where asyncio keeps one in
/// the thread state's dict; None elsewhere.
fn running_loop_marker<'py>(py: Python<'py>) -> Option<Bound<'py, PyAny>> {
    // SAFETY: the GIL is held; PyThreadState_GetDict returns a borrowed
    // reference (or NULL) to this thread's dict, which lives as long as the
    // thread state, and PyDict_GetItemWithError a borrowed value (or NULL)
    // that we turn into an owned one at once.
    unsafe {
        let dict = ffi::PyThreadState_GetDict();
        if dict.is_null() {
            return None;
        }
        let key = intern!(py, "__asyncio_running_event_loop__");
        let value = ffi::PyDict_GetItemWithError(dict, key.as_ptr());
        if value.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        Some(Bound::from_borrowed_ptr(py, value))
    }
}

struct CachedLoop {
    /// The running-loop marker (or the loop) this entry was made for.
    marker: Py<PyAny>,
    generation: u64,
    mailbox: Py<LoopMailbox>,
}

/// Submits requests to one server from any event loop. The server swaps its
/// batcher in with `accept` while it runs, and out when it stops.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Submitter {
    /// The batcher, and the fork generation it was accepted in: a forked
    /// child has none of its workers, so it submits nothing there.
    batcher: Mutex<Option<(Py<Batcher>, u64)>>,
    /// Every event loop's mailbox (made on its first submit).
    registry: Py<LoopRegistry>,
    /// `not_running() -> ServerClosedError` (or why a running server takes
    /// no requests in process), raised while no batcher is in.
    not_running: Py<PyAny>,
    get_running_loop: Py<PyAny>,
    /// The last event loop seen (threads never see a torn entry).
    cached: Mutex<Option<CachedLoop>>,
    /// The model streams its responses: its requests come with a stream
    /// (`Client.stream`), every other one's without.
    decoupled: bool,
}

#[pymethods]
impl Submitter {
    #[new]
    #[pyo3(signature = (registry, not_running, decoupled=false))]
    fn new(
        py: Python<'_>,
        registry: Py<LoopRegistry>,
        not_running: Py<PyAny>,
        decoupled: bool,
    ) -> PyResult<Submitter> {
        let get_running_loop = py.import("asyncio")?.getattr("get_running_loop")?.unbind();
        Ok(Submitter {
            batcher: Mutex::new(None),
            registry,
            not_running,
            get_running_loop,
            cached: Mutex::new(None),
            decoupled,
        })
    }

    // The callbacks refer back to the server that owns this submitter: a
    // cycle only the garbage collector can break.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.registry)?;
        visit.call(&self.not_running)?;
        visit.call(&self.get_running_loop)?;
        if let Ok(batcher) = self.batcher.try_lock() {
            if let Some((batcher, _)) = &*batcher {
                visit.call(batcher)?;
            }
        }
        if let Ok(cached) = self.cached.try_lock() {
            if let Some(c) = &*cached {
                visit.call(&c.marker)?;
                visit.call(&c.mailbox)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        *self.batcher.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.cached.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Starts (a batcher) or stops (None) accepting requests.
    fn accept(&self, batcher: Option<Py<Batcher>>) {
        let generation = FORK_GENERATION.load(Ordering::Relaxed);
        *self.batcher.lock().unwrap_or_else(|e| e.into_inner()) = batcher.map(|b| (b, generation));
    }

    /// Queues a request from the running event loop: `(future, request id)`.
    ///
    /// Bad inputs, a full queue or a stopped server raise at once (counted
    /// as failures of the loop); with `timeout`, the loop's deadline timer
    /// is armed. Call on an event loop's thread.
    ///
    /// `priority`: the level (1: most urgent; None or 0: the default);
    /// `parameters`: a JSON object's text, handed to a model that asks.
    /// `stream` (a decoupled model's request, and only then): where each
    /// response goes (`put_nowait`); the future resolves at the stream's end.
    /// `requested_outputs`: the outputs a v2 request asked for, as bits of
    /// their indices (0: not said), told to a model built with its requests.
    /// `uncached`: never looked up in nor kept in the response cache (a v2
    /// request naming a shared-memory region: `V2Request.shared_memory`).
    #[pyo3(signature = (
        inputs, timeout=None, batched=false, priority=None, parameters=None, stream=None, requested_outputs=0,
        uncached=false
    ))]
    #[allow(clippy::too_many_arguments)] // one per keyword of Client.infer / stream, and the v2 front-ends'
    fn submit<'py>(
        &self,
        py: Python<'py>,
        inputs: &Bound<'py, PyAny>,
        timeout: Option<Bound<'py, PyAny>>,
        batched: bool,
        priority: Option<Bound<'py, PyAny>>,
        parameters: Option<Bound<'py, PyAny>>,
        stream: Option<Py<PyAny>>,
        requested_outputs: u64,
        uncached: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let Some(batcher) = self.batcher(py) else {
            let refusal = self.refusal(py)?;
            // Counted like any refusal (as what it is: not running, or a
            // decoupled model's), where there is a loop to count it in.
            if let Ok(mailbox) = self.mailbox(py) {
                mailbox.get().tally().count(outcome_of_error(py, &refusal));
            }
            return Err(PyErr::from_value(refusal));
        };
        let mailbox = self.mailbox(py)?;
        if self.decoupled != stream.is_some() {
            mailbox.get().tally().count(Outcome::InvalidInput);
            return Err(self.wrong_call(py, stream.is_some()));
        }
        let mut timeout_s = None;
        let core = batcher.get().core();
        let submitted = called(py, core, &timeout, &priority, &parameters, &mut timeout_s)
            .map(|submission| ferrobatch_core::Submission {
                requested_outputs,
                uncached,
                ..submission
            })
            .and_then(|submission| {
                batcher
                    .get()
                    .submit(py, inputs, mailbox.bind(py), submission, batched, stream)
            });
        let (future, request) = match submitted {
            Ok(submitted) => submitted,
            Err(err) => {
                if is_ferrobatch_error(py, &err) {
                    mailbox
                        .get()
                        .tally()
                        .count(outcome_of_error(py, err.value(py)));
                }
                return Err(err);
            }
        };
        if let Some(timeout) = timeout_s.filter(|_| request.deadline.is_some()) {
            // Queued: arming the timer must not fail the submit now; if it
            // does, the request still resolves by its batch or by stop().
            let mailbox = mailbox.bind(py);
            if let Err(err) = LoopMailbox::arm_timer(mailbox, request.id, timeout) {
                err.write_unraisable(py, Some(mailbox.as_any()));
            }
        }
        PyTuple::new(
            py,
            [
                future.into_bound(py),
                request.id.into_pyobject(py)?.into_any(),
            ],
        )
    }

    /// Runs a request from a plain thread (not an event loop's): queues it
    /// from this thread and blocks, with the GIL released, until its batch
    /// answers; returns `{name: tensor}` or raises what `infer` would.
    /// Ctrl-C withdraws a request no batch has taken yet.
    #[pyo3(signature = (inputs, timeout=None, batched=false, priority=None, parameters=None))]
    fn infer_blocking(
        &self,
        py: Python<'_>,
        inputs: &Bound<'_, PyAny>,
        timeout: Option<Bound<'_, PyAny>>,
        batched: bool,
        priority: Option<Bound<'_, PyAny>>,
        parameters: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyDict>> {
        let waiters = &self.registry.get().threads;
        let Some(batcher) = self.batcher(py) else {
            let refusal = self.refusal(py)?;
            waiters.tally().count(outcome_of_error(py, &refusal));
            return Err(PyErr::from_value(refusal));
        };
        if self.decoupled {
            waiters.tally().count(Outcome::InvalidInput);
            return Err(self.wrong_call(py, false));
        }
        let batcher = batcher.get();
        let mut timeout_s = None;
        let submitted = called(
            py,
            batcher.core(),
            &timeout,
            &priority,
            &parameters,
            &mut timeout_s,
        )
        .and_then(|s| batcher.submit_from_thread(py, inputs, s, batched, waiters));
        let (request, waiter) = match submitted {
            Ok(submitted) => submitted,
            Err(err) => {
                if is_ferrobatch_error(py, &err) {
                    waiters.tally().count(outcome_of_error(py, err.value(py)));
                }
                return Err(err);
            }
        };
        let deadline = request.deadline.zip(timeout_s);
        waiters.wait(py, batcher.core(), request.id, &waiter, deadline)
    }

    /// The task awaiting request `id`'s `future` was cancelled (on the loop
    /// that submitted it): withdraws the request if no batch has taken it,
    /// and counts it as cancelled; or, given `error`, as that error (what
    /// its caller saw instead: a front-end that could not write an answer
    /// of a stream).
    #[pyo3(signature = (id, future, error=None))]
    fn cancel(
        &self,
        py: Python<'_>,
        id: u64,
        future: &Bound<'_, PyAny>,
        error: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let outcome = error.map_or(Outcome::Cancelled, |e| outcome_of_error(py, e));
        self.mailbox(py)?.get().cancel(py, id, future, outcome)
    }
}

/// What a caller of `submit` or `infer_blocking` said besides its inputs,
/// read where a refusal is counted; `timeout_s` gets the timeout in seconds
/// (`batcher`'s default when the caller gave none).
fn called(
    py: Python<'_>,
    batcher: &ferrobatch_core::Batcher,
    timeout: &Option<Bound<'_, PyAny>>,
    priority: &Option<Bound<'_, PyAny>>,
    parameters: &Option<Bound<'_, PyAny>>,
    timeout_s: &mut Option<f64>,
) -> PyResult<ferrobatch_core::Submission> {
    let (seconds, priority) = call_numbers(py, timeout.as_ref(), priority.as_ref())?;
    let seconds = seconds.or(batcher.default_timeout().map(|d| d.as_secs_f64()));
    *timeout_s = seconds;
    let parameters = crate::codec::parameters_text(py, parameters.as_ref())?;
    submission(py, seconds, priority, parameters)
}

/// A caller's `timeout` and `priority` as numbers, read here rather than by
/// pyo3's signature so that one past f64 or i64 is the caller's
/// `InvalidInputError` (and counted as one): an int timeout too large for a
/// float is no deadline if positive, as infinity is.
pub(crate) fn call_numbers(
    py: Python<'_>,
    timeout: Option<&Bound<'_, PyAny>>,
    priority: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Option<f64>, Option<i64>)> {
    let seconds = match timeout {
        None => None,
        Some(t) => match t.extract::<f64>() {
            Ok(seconds) => Some(seconds),
            Err(_) if t.is_instance_of::<pyo3::types::PyInt>() && t.gt(0).unwrap_or(false) => {
                Some(f64::INFINITY)
            }
            Err(_) => {
                return Err(invalid_input(
                    py,
                    format!("timeout must be a number of seconds >= 0, got {t}"),
                ))
            }
        },
    };
    let level = match priority {
        None => None,
        Some(p) => Some(p.extract::<i64>().map_err(|_| {
            invalid_input(
                py,
                format!(
                    "priority must be an integer >= 1 (1: most urgent; 0: the default), got {p}"
                ),
            )
        })?),
    };
    Ok((seconds, level))
}

/// What a caller said besides its inputs. `timeout` in seconds becomes a
/// deadline offset: None without one, and also for one too long to represent
/// (infinity, 1e300: no deadline). A negative or NaN timeout, or a negative
/// priority, is an `InvalidInputError`.
pub(crate) fn submission(
    py: Python<'_>,
    timeout: Option<f64>,
    priority: Option<i64>,
    parameters: Option<String>,
) -> PyResult<ferrobatch_core::Submission> {
    let timeout = match timeout.map(ferrobatch_core::timeout_from_secs) {
        None => None,
        Some(Ok(deadline)) => deadline,
        Some(Err(invalid)) => return Err(invalid_input(py, invalid.to_string())),
    };
    let priority = match priority {
        None => None,
        Some(p) => Some(u32::try_from(p).map_err(|_| {
            invalid_input(
                py,
                format!(
                    "priority must be an integer >= 1 (1: most urgent; 0: the default), got {p}"
                ),
            )
        })?),
    };
    Ok(ferrobatch_core::Submission {
        timeout,
        priority,
        parameters: parameters.map(String::into_boxed_str),
        absent: 0,
        requested_outputs: 0, // every output (a v2 front-end says which: `Submitter.submit`)
        blocking_caller: None,
        uncached: false, // a v2 front-end says so: `Submitter.submit`
    })
}

impl Submitter {
    /// The batcher requests go to: None while the server does not run, and
    /// in a process forked from the one it runs in (its workers stayed there).
    fn batcher(&self, py: Python<'_>) -> Option<Py<Batcher>> {
        let batcher = self.batcher.lock().unwrap_or_else(|e| e.into_inner());
        let (batcher, generation) = batcher.as_ref()?;
        (*generation == FORK_GENERATION.load(Ordering::Relaxed)).then(|| batcher.clone_ref(py))
    }

    /// Why no request is taken now (see [`Submitter::batcher`]).
    fn refusal<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let forked = self
            .batcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if forked {
            let model = self.registry.get().model_name();
            let message = format!(
                "server '{model}' runs in the process this one was forked from (pid {}); \
                 a forked process cannot submit to it: start a server here, or connect to a shared one",
                std::os::unix::process::parent_id()
            );
            return Ok(
                crate::errors::ferrobatch_error(py, "ServerClosedError", message)
                    .into_value(py)
                    .into_bound(py)
                    .into_any(),
            );
        }
        Ok(self.not_running.call0(py)?.into_bound(py))
    }

    /// Why a request cannot be made this way: a decoupled model's (which
    /// streams) without a stream, or another model's with one.
    fn wrong_call(&self, py: Python<'_>, streamed: bool) -> PyErr {
        let model = self.registry.get().model_name();
        let message = if streamed {
            format!("model '{model}' is not decoupled: it answers once; use client.infer()")
        } else {
            format!(
                "model '{model}' is decoupled (it streams its responses): iterate \
                 `async for out in client.stream(...)` on an event loop, or call it over gRPC ModelStreamInfer \
                 or HTTP generate_stream"
            )
        };
        invalid_input(py, message)
    }
}

impl Submitter {
    /// The calling loop's mailbox; RuntimeError with no loop running.
    fn mailbox(&self, py: Python<'_>) -> PyResult<Py<LoopMailbox>> {
        // Without a marker the loop itself is the key, looked up once here.
        let (marker, looked_up) = match running_loop_marker(py) {
            Some(marker) => (marker, None),
            None => {
                let event_loop = self.get_running_loop.call0(py)?.into_bound(py);
                (event_loop.clone(), Some(event_loop))
            }
        };
        let generation = FORK_GENERATION.load(Ordering::Relaxed);
        {
            let cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = &*cached {
                if c.marker.is(&marker) && c.generation == generation {
                    return Ok(c.mailbox.clone_ref(py));
                }
            }
        }
        let event_loop = match looked_up {
            Some(event_loop) => event_loop,
            None => self.get_running_loop.call0(py)?.into_bound(py),
        };
        let mailbox = self.registry.get().mailbox_for(py, &event_loop)?;
        *self.cached.lock().unwrap_or_else(|e| e.into_inner()) = Some(CachedLoop {
            marker: marker.unbind(),
            generation,
            mailbox: mailbox.clone_ref(py),
        });
        Ok(mailbox)
    }
}
