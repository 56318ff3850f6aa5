//! The loop side of fan-out: `LoopMailbox` (one per event loop), `Routes` and
//! `LoopCounters`.
//!
//! A worker posts a finished batch's rows into the mailbox of each event loop
//! it has requests from, then rings that loop's doorbell (an eventfd, or a
//! pipe, the loop watches with `add_reader`) once the GIL is released, so the
//! woken loop never waits for the GIL the worker still holds. The loop drains
//! everything posted since its last drain in one callback and resolves each
//! request's future there, without a Python frame per request.
//!
//! Invariant: `armed` is true from the post that found the mailbox empty
//! until the drain that takes the posts; only that post rings. So a busy loop
//! gets one wake-up however many batches land before it drains, and no post
//! is ever left undrained (a post either finds `armed` set, and the pending
//! drain takes it, or sets it and rings).

use std::fs::File;
use std::io::{Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use ferrobatch_core::{Readiness, Route};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice, PyTuple};

use crate::batcher::Ticket;
use crate::errors::{describe, ferrobatch_error};
use crate::without_gil;

/// The rows of a batch that belong to the requests of one event loop.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Routes {
    pub(crate) routes: Arc<Vec<Route>>,
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
}

/// Per-loop counters the Rust fan-out updates (read from any thread).
#[pyclass(frozen, module = "ferrobatch._core")]
#[derive(Default)]
pub struct LoopCounters {
    succeeded: AtomicU64,
    request_ns: AtomicU64,
    failed_in_fan_out: AtomicU64,
}

#[pymethods]
impl LoopCounters {
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

    /// Requests failed with `ModelError` by the fan-out's last resort (the
    /// Python error path itself failed).
    #[getter]
    fn failed_in_fan_out(&self) -> u64 {
        self.failed_in_fan_out.load(Ordering::Relaxed)
    }
}

/// One batch's outcome for one loop, waiting to be drained.
struct Post {
    routes: Arc<Vec<Route>>,
    /// `outputs` of a successful batch, or the error it raised.
    outcome: Result<Py<PyDict>, Py<PyAny>>,
}

#[derive(Default)]
struct Inbox {
    posts: Vec<Post>,
    armed: bool,
}

/// The file descriptors a loop watches; `write` is None for an eventfd.
struct Doorbell {
    read: OwnedFd,
    write: Option<OwnedFd>,
    eventfd: bool,
}

impl Doorbell {
    fn write_fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.write.as_ref().unwrap_or(&self.read).as_raw_fd()
    }
}

/// Rings a doorbell by its raw fd. An eventfd takes an 8-byte count; a pipe
/// one byte. A full pipe or closed loop only loses a redundant wake-up.
pub(crate) fn ring_fd(fd: RawFd, eventfd: bool) {
    // SAFETY: the fd stays open while its mailbox lives, and callers hold a
    // reference to the mailbox across this call; ManuallyDrop never closes it.
    let mut file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    let _ = if eventfd {
        file.write(&1u64.to_ne_bytes())
    } else {
        file.write(&[1u8])
    };
}

/// One event loop's side of the fan-out: its pending requests, counters,
/// posted batches and doorbell. Everything but `post` and `ring` runs on the
/// loop's thread.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct LoopMailbox {
    loop_id: u32,
    /// Request id -> Ticket, for requests submitted from this loop.
    #[pyo3(get)]
    pending: Py<PyDict>,
    #[pyo3(get)]
    counters: Py<LoopCounters>,
    create_future: Py<PyAny>,
    call_soon: Py<PyAny>,
    /// Rows this loop submitted in its current iteration, and the batcher
    /// they went to: made ready at once by `flush`, which `call_soon` runs
    /// after everything else the iteration does (greedy batchers only).
    unflushed: Mutex<Option<(Arc<ferrobatch_core::Batcher>, usize)>>,
    /// `on_error(routes, error)`: fails a batch's requests (Python, rare path).
    on_error: Py<PyAny>,
    inbox: Mutex<Inbox>,
    doorbell: OnceLock<Doorbell>,
    wakeups: AtomicU64,
}

#[pymethods]
impl LoopMailbox {
    #[new]
    fn new(
        py: Python<'_>,
        loop_id: u32,
        event_loop: &Bound<'_, PyAny>,
        on_error: Py<PyAny>,
    ) -> PyResult<LoopMailbox> {
        Ok(LoopMailbox {
            loop_id,
            pending: PyDict::new(py).unbind(),
            counters: Py::new(py, LoopCounters::default())?,
            create_future: event_loop.getattr(intern!(py, "create_future"))?.unbind(),
            call_soon: event_loop.getattr(intern!(py, "call_soon"))?.unbind(),
            unflushed: Mutex::new(None),
            on_error,
            inbox: Mutex::new(Inbox::default()),
            doorbell: OnceLock::new(),
            wakeups: AtomicU64::new(0),
        })
    }

    /// Takes ownership of the doorbell's file descriptors (non-blocking): an
    /// eventfd (`read_fd == write_fd`) or a pipe. Without one, `post`'s
    /// caller wakes the loop itself (`call_soon_threadsafe(drain)`).
    fn set_doorbell(&self, read_fd: RawFd, write_fd: RawFd, eventfd: bool) -> PyResult<()> {
        if eventfd != (read_fd == write_fd) {
            return Err(PyValueError::new_err("an eventfd is one fd; a pipe is two"));
        }
        // SAFETY: the caller hands these fds over and never uses or closes them again.
        let read = unsafe { OwnedFd::from_raw_fd(read_fd) };
        let write = (!eventfd).then(|| unsafe { OwnedFd::from_raw_fd(write_fd) });
        self.doorbell
            .set(Doorbell {
                read,
                write,
                eventfd,
            })
            .map_err(|_| PyRuntimeError::new_err("this mailbox already has a doorbell"))
    }

    /// The fd the loop watches for readability, or None.
    #[getter]
    pub(crate) fn doorbell_fd(&self) -> Option<RawFd> {
        use std::os::fd::AsRawFd;
        self.doorbell.get().map(|d| d.read.as_raw_fd())
    }

    /// Times the loop was woken to drain (one per batch or fewer).
    #[getter]
    fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// Posts a batch's outcome (worker thread): its `outputs`
    /// (`{name: batch tensor}`), or the `error` it raised. True when this post
    /// must wake the loop.
    #[pyo3(signature = (routes, outputs, error))]
    pub(crate) fn post(
        &self,
        routes: &Routes,
        outputs: Option<Py<PyDict>>,
        error: Option<Py<PyAny>>,
    ) -> PyResult<bool> {
        let outcome = match (outputs, error) {
            (_, Some(error)) => Err(error),
            (Some(outputs), None) => Ok(outputs),
            _ => return Err(PyValueError::new_err("post needs outputs or an error")),
        };
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        inbox.posts.push(Post {
            routes: routes.routes.clone(),
            outcome,
        });
        let wake = !inbox.armed;
        inbox.armed = true;
        Ok(wake)
    }

    /// Rings the doorbell with the GIL released. False if there is none.
    fn ring(&self, py: Python<'_>) -> bool {
        match self.doorbell_target() {
            Some((fd, eventfd)) => {
                without_gil(py, || ring_fd(fd, eventfd));
                true
            }
            None => false,
        }
    }

    /// Readies for the workers the requests this loop submitted since the
    /// last flush (loop thread, scheduled by the first submit after it).
    fn flush(&self) {
        let unflushed = self
            .unflushed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((batcher, rows)) = unflushed {
            batcher.flush(rows);
        }
    }

    /// Resolves everything posted since the last drain (loop thread; the
    /// doorbell's reader callback).
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(d) = self.doorbell.get() {
            use std::os::fd::AsRawFd;
            // SAFETY: as in `ring_fd`; the fd is non-blocking, so this never waits.
            let mut file = ManuallyDrop::new(unsafe { File::from_raw_fd(d.read.as_raw_fd()) });
            let mut buf = [0u8; 64];
            let _ = file.read(&mut buf);
        }
        let posts = {
            let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
            inbox.armed = false;
            std::mem::take(&mut inbox.posts)
        };
        if posts.is_empty() {
            return Ok(());
        }
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        let mut first_error = None;
        for post in posts {
            let done = match post.outcome {
                Ok(outputs) => self.resolve(py, &post.routes, outputs.bind(py)),
                Err(error) => {
                    let routes = Routes {
                        routes: post.routes.clone(),
                    };
                    self.on_error.call1(py, (routes, error)).map(drop)
                }
            };
            // Whatever failed, no caller of this batch is left waiting; keep
            // resolving the other batches and report the first failure.
            if let Err(e) = done {
                self.fail_routes(py, &post.routes, &e);
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl LoopMailbox {
    /// Submit side (loop thread): a new future of this loop, for a ticket.
    pub(crate) fn new_future(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.create_future.call0(py)
    }

    /// Submit side (loop thread), before a request to `batcher` is queued:
    /// makes sure a flush of this iteration's requests is scheduled. Only
    /// for batchers that wait for it (`Readiness::OnFlush`).
    pub(crate) fn schedule_flush(
        this: &Bound<'_, LoopMailbox>,
        batcher: &Arc<ferrobatch_core::Batcher>,
    ) -> PyResult<()> {
        if batcher.readiness() != Readiness::OnFlush {
            return Ok(());
        }
        let py = this.py();
        let mut unflushed = this
            .get()
            .unflushed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if unflushed.is_none() {
            // A mailbox belongs to one server, so it only ever sees one batcher.
            this.get()
                .call_soon
                .call1(py, (this.getattr(intern!(py, "flush"))?,))?;
            *unflushed = Some((batcher.clone(), 0));
        }
        Ok(())
    }

    /// Counts `rows` more rows for the scheduled flush (`Readiness::OnFlush`
    /// batchers only, after `schedule_flush`).
    pub(crate) fn add_unflushed(&self, rows: usize) {
        if let Some((_, n)) = &mut *self.unflushed.lock().unwrap_or_else(|e| e.into_inner()) {
            *n += rows;
        }
    }

    pub(crate) fn loop_id(&self) -> u32 {
        self.loop_id
    }

    pub(crate) fn pending<'py>(&self, py: Python<'py>) -> &Bound<'py, PyDict> {
        self.pending.bind(py)
    }

    /// The last resort when failing a batch's requests itself failed: hands
    /// a `ModelError` (caused by `error`) to every still-pending request of
    /// `routes`, so that no caller is left waiting, and counts them.
    fn fail_routes(&self, py: Python<'_>, routes: &[Route], error: &PyErr) {
        let message = format!(
            "the results of this request's batch could not be delivered: {}",
            describe(py, error)
        );
        let mut failed = 0;
        let pending = self.pending.bind(py);
        for route in routes {
            let Ok(Some(entry)) = pending.get_item(route.id) else {
                continue;
            };
            let _ = pending.del_item(route.id);
            let Ok(ticket) = entry.cast_into::<Ticket>() else {
                continue;
            };
            let ticket = ticket.get();
            let _ = ticket.cancel_timer(py);
            let future = ticket.future.bind(py);
            if let Ok(false) = future
                .call_method0(intern!(py, "done"))
                .and_then(|d| d.is_truthy())
            {
                // One instance per caller: one raised in many tasks would
                // collect all their tracebacks.
                let err = ferrobatch_error(py, "ModelError", message.clone());
                err.set_cause(py, Some(error.clone_ref(py)));
                if future
                    .call_method1(intern!(py, "set_exception"), (err.value(py),))
                    .is_ok()
                {
                    failed += 1;
                }
            }
        }
        self.counters
            .get()
            .failed_in_fan_out
            .fetch_add(failed, Ordering::Relaxed);
    }

    /// `(fd, eventfd)` to ring, if the mailbox has a doorbell.
    pub(crate) fn doorbell_target(&self) -> Option<(RawFd, bool)> {
        self.doorbell.get().map(|d| (d.write_fd(), d.eventfd))
    }

    /// Resolves this loop's requests of one successful batch.
    ///
    /// Each pending ticket found is removed, its timer cancelled, and its
    /// future given `{name: row}` (one-sample requests: a row of
    /// `outputs[name].unbind(0)`, made here at most once per batch, and only
    /// if a one-sample request is in it: the loop thread runs it, so the
    /// worker never drops the GIL for it) or
    /// `{name: outputs[name][first:first + n]}` (multi-row requests). A
    /// future already done (its task was cancelled, or its deadline passed)
    /// refuses the result, and that is fine: it was resolved once already.
    fn resolve(
        &self,
        py: Python<'_>,
        routes: &[Route],
        outputs: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        // (name, batch tensor, its rows once a one-sample request needs them)
        let mut columns: Vec<_> = outputs
            .iter()
            .map(|(name, whole)| (name, whole, None))
            .collect();
        let pending = self.pending.bind(py);
        let now = Instant::now();
        let (mut succeeded, mut request_ns) = (0u64, 0u64);
        let mut unbuilt: Vec<Route> = Vec::new();
        let mut build_error = None;
        for route in routes {
            let key = route.id.into_pyobject(py)?;
            let Some(entry) = pending.get_item(&key)? else {
                continue;
            };
            let entry = entry.cast_into::<Ticket>()?;
            let ticket = entry.get();
            let result = PyDict::new(py);
            let built = columns.iter_mut().try_for_each(|(name, whole, per_row)| {
                let value = if ticket.batched {
                    let end = (route.start + route.rows) as isize;
                    whole.get_item(PySlice::new(py, route.start as isize, end, 1))?
                } else {
                    let per_row = match per_row {
                        Some(rows) => rows,
                        None => per_row.insert(
                            whole
                                .call_method1(intern!(py, "unbind"), (0,))?
                                .cast_into::<PyTuple>()?,
                        ),
                    };
                    per_row.get_item(route.start as usize)?
                };
                result.set_item(&*name, value)
            });
            if let Err(err) = built {
                // Rows that cannot be taken from the outputs (the model
                // returned something odd): failed below as a model error.
                unbuilt.push(*route);
                build_error.get_or_insert(err);
                continue;
            }
            pending.del_item(&key)?;
            ticket.cancel_timer(py)?;
            let future = ticket.future.bind(py);
            match future.call_method1(intern!(py, "set_result"), (result,)) {
                Ok(_) => {
                    succeeded += 1;
                    request_ns += now
                        .saturating_duration_since(ticket.enqueued_at())
                        .as_nanos() as u64;
                }
                // Already resolved (cancelled, or past its deadline): drop the result.
                Err(_) if future.call_method0(intern!(py, "done"))?.is_truthy()? => {}
                Err(e) => return Err(e),
            }
        }
        let counters = self.counters.get();
        counters.succeeded.fetch_add(succeeded, Ordering::Relaxed);
        counters.request_ns.fetch_add(request_ns, Ordering::Relaxed);
        if let Some(err) = build_error {
            let routes = Routes {
                routes: Arc::new(unbuilt),
            };
            self.on_error.call1(py, (routes, err.value(py)))?;
        }
        Ok(())
    }
}
