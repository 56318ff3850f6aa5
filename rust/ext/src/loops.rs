//! `LoopRegistry`: the one owner, for one server, of every event loop's
//! `LoopMailbox` (its pending requests, what its callers saw, its doorbell).
//!
//! A loop gets a mailbox on its first submit, with a doorbell it watches
//! (`add_reader` on an eventfd, or a pipe; none where the loop cannot watch
//! file descriptors). Mailboxes are found by loop id (workers, per batch)
//! and by loop (submitters, on a cache miss). A closed loop's mailbox goes,
//! with its doorbell's fds, once none of its requests is held by a batch:
//! each new loop sweeps the closed ones, so a program that runs
//! `asyncio.run` again and again keeps one mailbox at a time. The counts of
//! the dropped ones are kept in `retired`.
//!
//! The map is behind a mutex that is never held while Python code runs
//! (which could re-enter the registry on the same thread).

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyNotImplementedError, PyOSError, PyRuntimeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use ferrobatch_core::{Outcome, Route, Sink, Tally, Totals};

use crate::mailbox::{doorbells, ring_fd, LoopMailbox};
use crate::native_sink::{self, NativeSink};
use crate::results::{outcome_of_error, BatchOutcome, FailedRows};
use crate::shm_sink::{self, SharedSink};
use crate::threads::{ThreadWaiters, Waiter};

#[derive(Default)]
struct Mailboxes {
    by_id: HashMap<u32, Py<LoopMailbox>>,
    /// Loop object address -> id. An address stays valid as a key while its
    /// mailbox (which holds the loop) is in `by_id`.
    by_loop: HashMap<usize, u32>,
    next_id: u32,
}

/// Every event loop that submits to one server, and what its callers saw.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct LoopRegistry {
    model_name: Arc<str>,
    mailboxes: Mutex<Mailboxes>,
    /// What the callers of dropped mailboxes saw.
    retired: Tally,
    /// The requests of callers blocked in plain threads.
    pub(crate) threads: ThreadWaiters,
    /// The native front-ends' reply tables for this model, once one serves
    /// it: one, unless a front-end served it after another whose requests
    /// are not all answered yet. Each table answers its own requests, so a
    /// second front-end loses none of the first's.
    native: Mutex<Arc<[Arc<NativeSink>]>>,
    /// The shared-memory clients of this model, once it is shared.
    shared: Mutex<Option<Arc<SharedSink>>>,
}

/// Whom a finished batch wakes once the GIL is released (woken with it
/// held, they would only sleep again on it): the event loops whose
/// doorbells ring, and the blocked threads answered.
#[derive(Default)]
pub(crate) struct Wakeups {
    pub(crate) mailboxes: Vec<Py<LoopMailbox>>,
    pub(crate) threads: Vec<Arc<Waiter>>,
}

impl Wakeups {
    pub(crate) fn append(&mut self, mut other: Wakeups) {
        self.mailboxes.append(&mut other.mailboxes);
        self.threads.append(&mut other.threads);
    }

    /// The doorbells to ring, read with the GIL held.
    pub(crate) fn doorbells(&self) -> Vec<(RawFd, bool)> {
        doorbells(&self.mailboxes)
    }

    /// Rings `doorbells` (this value's, which it keeps open meanwhile) and
    /// wakes the threads. Call without the GIL.
    pub(crate) fn wake(&self, doorbells: &[(RawFd, bool)]) {
        for &(fd, eventfd) in doorbells {
            ring_fd(fd, eventfd);
        }
        for thread in &self.threads {
            thread.wake();
        }
    }
}

#[pymethods]
impl LoopRegistry {
    #[new]
    fn new(model_name: &str) -> LoopRegistry {
        let model_name: Arc<str> = model_name.into();
        LoopRegistry {
            threads: ThreadWaiters::new(model_name.clone()),
            model_name,
            mailboxes: Mutex::new(Mailboxes::default()),
            retired: Tally::default(),
            native: Mutex::new(Arc::new([])),
            shared: Mutex::new(None),
        }
    }

    /// Counts a request refused before it reached the batcher (a front-end
    /// that closes, ...) under the outcome its caller sees: `error`'s.
    fn count_refusal(&self, py: Python<'_>, error: &Bound<'_, PyAny>) {
        self.retired.count(outcome_of_error(py, error));
    }

    /// Counts a request counted as succeeded under the outcome its caller
    /// saw after all: `error`'s (a front-end could not write its answer).
    /// Its time stays among the successes'. The tallies are summed with
    /// wrapping additions, so taking it from `retired` is exact.
    fn recount_success(&self, py: Python<'_>, error: &Bound<'_, PyAny>) {
        self.retired
            .recount(Outcome::Succeeded, outcome_of_error(py, error));
    }

    /// The mailboxes of the loops not dropped yet.
    fn mailboxes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.all(py))
    }

    /// `{outcome: requests}` for every outcome (`succeeded`, `invalid_input`,
    /// `queue_full`, `deadline_exceeded`, `cancelled`, `model_error`,
    /// `server_closed`), plus `request_ns` (submit to result, summed over
    /// the successes).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let totals = self.totals(py);
        let stats = PyDict::new(py);
        for outcome in Outcome::ALL {
            stats.set_item(outcome.name(), totals.counts[outcome as usize])?;
        }
        stats.set_item("request_ns", totals.request_ns)?;
        Ok(stats)
    }

    /// The successes by their submit-to-result time: one count per bound of
    /// `REQUEST_BOUNDS_US` (times up to it and above the one before), then
    /// the count of those above the last.
    fn request_buckets(&self, py: Python<'_>) -> Vec<u64> {
        self.totals(py).request_buckets.to_vec()
    }

    /// Fails every pending request of every loop with `ServerClosedError`,
    /// each on its own loop's thread (at once for the calling loop's): those
    /// numbered below `before`, the stopped run's (a loop's own call may come
    /// round after the server started again).
    #[pyo3(signature = (message, before=u64::MAX))]
    fn fail_all(&self, py: Python<'_>, message: &str, before: u64) -> PyResult<()> {
        for native in self.native().iter() {
            native_sink::fail_all(native, message, before);
        }
        // The workers are done by now: a request still here was never taken.
        self.threads.fail_all(py, message, before);
        let partial = py
            .import(intern!(py, "functools"))?
            .getattr(intern!(py, "partial"))?;
        for mailbox in self.all(py) {
            let fail_all = mailbox.bind(py).getattr(intern!(py, "fail_all"))?;
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "before"), before)?;
            let bounded = partial.call((fail_all,), Some(&kwargs))?;
            on_loop(py, &mailbox.get().event_loop, &bounded, message)?;
        }
        Ok(())
    }

    /// Stops every loop watching its doorbell (the server is going away).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        for mailbox in self.all(py) {
            if let Some(fd) = mailbox.get().doorbell_fd() {
                let event_loop = mailbox.get().event_loop.bind(py);
                let remove = event_loop.getattr(intern!(py, "remove_reader"))?;
                on_loop(py, event_loop.as_unbound(), &remove, fd)?;
            }
        }
        Ok(())
    }
}

impl LoopRegistry {
    /// Hands a finished batch's rows to each way in it has requests from
    /// (one group per sink): event loops' mailboxes, blocked threads, native
    /// connections, shared-memory clients.
    /// Returns whom to wake once the GIL is released: the mailboxes whose
    /// doorbell must ring, and the threads answered. A loop without a
    /// doorbell is woken here with `call_soon_threadsafe`. A loop dropped
    /// from the registry (closed) is skipped: nobody awaits its requests any
    /// more.
    pub(crate) fn route_batch(
        &self,
        py: Python<'_>,
        groups: &[(Sink, Arc<Vec<Route>>)],
        outcome: &BatchOutcome,
        failed: Option<&FailedRows>,
    ) -> Wakeups {
        let mut wakeups = Wakeups::default();
        let to_ring = &mut wakeups.mailboxes;
        for (sink, routes) in groups {
            let loop_id = match sink {
                Sink::EventLoop(loop_id) => loop_id,
                Sink::Connection(_) => {
                    let natives = self.native();
                    for native in natives.iter() {
                        if natives.len() == 1 || native.replies.holds_any(routes) {
                            native_sink::deliver(py, native, routes, outcome, failed);
                        }
                    }
                    continue;
                }
                Sink::Thread => {
                    let to_wake = &mut wakeups.threads;
                    self.threads.deliver(py, routes, outcome, failed, to_wake);
                    continue;
                }
                Sink::SharedMemory(client) => {
                    if let Some(shared) = self.shared() {
                        shm_sink::deliver(py, &shared, *client, routes, outcome, failed);
                    }
                    continue;
                }
            };
            let Some(mailbox) = self.get(py, *loop_id) else {
                continue;
            };
            let outcome = match outcome {
                Ok(outputs) => Ok(outputs.clone_ref(py)),
                Err(error) => Err(error.clone_ref(py)),
            };
            if !mailbox.get().post(routes.clone(), outcome, failed.cloned()) {
                continue; // the loop is already due to drain
            }
            self.wake(py, mailbox, to_ring);
        }
        wakeups
    }

    /// Hands one partial answer of a decoupled model's batch to its
    /// streaming requests (`only`: those whose first rows are these): the
    /// native front-end's gRPC streams at once, event loops' streams through
    /// their mailboxes. Returns how many of them still listen, and the
    /// mailboxes whose doorbell must ring (after the GIL is released). The
    /// other ways in (threads, shared memory) refuse a decoupled model's
    /// requests when they are submitted.
    pub(crate) fn route_partial(
        &self,
        py: Python<'_>,
        groups: &[(Sink, Arc<Vec<Route>>)],
        outputs: &Bound<'_, PyDict>,
        only: Option<&[u32]>,
    ) -> (usize, Vec<Py<LoopMailbox>>) {
        let chosen = |routes: &[Route]| -> Vec<Route> {
            routes
                .iter()
                .filter(|r| only.map_or(true, |starts| starts.contains(&r.start)))
                .copied()
                .collect()
        };
        let mut listening = 0;
        let mut to_ring = Vec::new();
        for (sink, routes) in groups {
            match sink {
                Sink::Connection(_) => {
                    let natives = self.native();
                    for native in natives.iter() {
                        if natives.len() == 1 || native.replies.holds_any(routes) {
                            listening += native_sink::stream(py, native, &chosen(routes), outputs);
                        }
                    }
                }
                Sink::EventLoop(loop_id) => {
                    let Some(mailbox) = self.get(py, *loop_id) else {
                        continue;
                    };
                    let awaited = mailbox.get().listening(py, chosen(routes).into_iter());
                    if awaited.is_empty() {
                        continue;
                    }
                    listening += awaited.len();
                    let posted = mailbox
                        .get()
                        .post_partial(Arc::new(awaited), outputs.clone().unbind());
                    if posted {
                        self.wake(py, mailbox, &mut to_ring);
                    }
                }
                Sink::Thread | Sink::SharedMemory(_) => {}
            }
        }
        (listening, to_ring)
    }

    /// Wakes `mailbox`'s loop to drain what was posted: its doorbell (rung
    /// by the caller, once the GIL is released: added to `to_ring`), or
    /// `call_soon_threadsafe(drain)` for a loop without one.
    fn wake(&self, py: Python<'_>, mailbox: Py<LoopMailbox>, to_ring: &mut Vec<Py<LoopMailbox>>) {
        if mailbox.get().doorbell_target().is_some() {
            to_ring.push(mailbox);
            return;
        }
        let drain = mailbox.bind(py).getattr(intern!(py, "drain"));
        let woken = drain.and_then(|drain| {
            mailbox
                .get()
                .event_loop
                .call_method1(py, intern!(py, "call_soon_threadsafe"), (drain,))
        });
        // A closed loop: nobody is left to await these requests.
        drop(woken);
    }

    pub(crate) fn model_name(&self) -> &str {
        &self.model_name
    }

    /// Routes this model's `Sink::Connection` rows to `sink` too, from now
    /// on. The tables of front-ends that no longer serve the model and hold
    /// no request go, their counts kept (in `retired`).
    pub(crate) fn attach_native(&self, sink: NativeSink) {
        let mut natives = self.native.lock().unwrap_or_else(|e| e.into_inner());
        let mut kept: Vec<Arc<NativeSink>> = Vec::with_capacity(natives.len() + 1);
        for old in natives.iter() {
            // Only the sink holds its table once the front-end dropped the model.
            if Arc::strong_count(&old.replies) == 1 && old.replies.is_idle() {
                self.retired.absorb(old.replies.tally());
            } else {
                kept.push(old.clone());
            }
        }
        kept.push(Arc::new(sink));
        *natives = kept.into();
    }

    /// Routes this model's `Sink::SharedMemory` rows to `sink` from now on.
    /// A model shared before keeps its counts (in `retired`).
    pub(crate) fn attach_shared(&self, sink: Arc<SharedSink>) {
        let old = self
            .shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(sink);
        if let Some(old) = old {
            self.retired.absorb(old.tally());
            for (outcome, n) in old.refusals() {
                self.retired.count_n(outcome, n);
            }
        }
    }

    pub(crate) fn shared(&self) -> Option<Arc<SharedSink>> {
        self.shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn native(&self) -> Arc<[Arc<NativeSink>]> {
        self.native
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The mailbox of loop `loop_id`, if it has not been dropped.
    pub(crate) fn get(&self, py: Python<'_>, loop_id: u32) -> Option<Py<LoopMailbox>> {
        let mailboxes = self.lock();
        mailboxes.by_id.get(&loop_id).map(|m| m.clone_ref(py))
    }

    /// The mailbox of `event_loop` (the running loop of the calling thread),
    /// made on its first use.
    pub(crate) fn mailbox_for(
        &self,
        py: Python<'_>,
        event_loop: &Bound<'_, PyAny>,
    ) -> PyResult<Py<LoopMailbox>> {
        let key = event_loop.as_ptr() as usize;
        {
            let mailboxes = self.lock();
            if let Some(id) = mailboxes.by_loop.get(&key) {
                if let Some(m) = mailboxes.by_id.get(id) {
                    return Ok(m.clone_ref(py));
                }
            }
        }
        self.sweep_closed_loops(py);
        let loop_id = {
            let mut mailboxes = self.lock();
            let id = mailboxes.next_id;
            mailboxes.next_id = id
                .checked_add(1)
                .ok_or_else(|| PyRuntimeError::new_err("too many event loops for one server"))?;
            id
        };
        let mailbox = Bound::new(
            py,
            LoopMailbox::new(loop_id, event_loop, self.model_name.clone())?,
        )?;
        watch_doorbell(py, event_loop, &mailbox)?;
        let mailbox = mailbox.unbind();
        let mut mailboxes = self.lock();
        mailboxes.by_id.insert(loop_id, mailbox.clone_ref(py));
        mailboxes.by_loop.insert(key, loop_id);
        Ok(mailbox)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mailboxes> {
        self.mailboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What callers saw, added up over every sink of this server.
    fn totals(&self, py: Python<'_>) -> Totals {
        let mut totals = Totals::default();
        self.retired.add_to(&mut totals);
        self.threads.tally().add_to(&mut totals);
        for native in self.native().iter() {
            native_sink::add_counts(native, &mut totals);
        }
        if let Some(shared) = self.shared() {
            shared.tally().add_to(&mut totals);
            for (outcome, n) in shared.refusals() {
                totals.counts[outcome as usize] = totals.counts[outcome as usize].saturating_add(n);
            }
        }
        for mailbox in self.all(py) {
            mailbox.get().tally().add_to(&mut totals);
        }
        totals
    }

    fn all(&self, py: Python<'_>) -> Vec<Py<LoopMailbox>> {
        self.lock()
            .by_id
            .values()
            .map(|m| m.clone_ref(py))
            .collect()
    }

    /// Drops the mailboxes of closed loops whose requests no batch holds.
    fn sweep_closed_loops(&self, py: Python<'_>) {
        for mailbox in self.all(py) {
            let event_loop = mailbox.get().event_loop.bind(py);
            let closed = event_loop
                .call_method0(intern!(py, "is_closed"))
                .and_then(|c| c.is_truthy())
                .unwrap_or(false);
            if !closed || !mailbox.get().abandon() {
                continue;
            }
            self.retired.absorb(mailbox.get().tally());
            let mut mailboxes = self.lock();
            mailboxes.by_id.remove(&mailbox.get().loop_id());
            mailboxes.by_loop.remove(&(event_loop.as_ptr() as usize));
        }
    }
}

/// Calls `f(arg)` on `event_loop`'s thread: now if it is the running loop
/// of this thread, else with `call_soon_threadsafe`. A closed loop has
/// nobody left to serve: nothing happens.
fn on_loop<'py, A: IntoPyObject<'py>>(
    py: Python<'py>,
    event_loop: &Py<PyAny>,
    f: &Bound<'py, PyAny>,
    arg: A,
) -> PyResult<()> {
    let running = py
        .import(intern!(py, "asyncio"))?
        .call_method0(intern!(py, "_get_running_loop"))?;
    if running.is(event_loop) {
        f.call1((arg,))?;
        return Ok(());
    }
    let scheduled = event_loop.call_method1(py, intern!(py, "call_soon_threadsafe"), (f, arg));
    match scheduled {
        Err(e) if e.is_instance_of::<PyRuntimeError>(py) => Ok(()), // closed loop
        other => other.map(drop),
    }
}

/// Gives `mailbox` a doorbell `event_loop` watches (on the loop's thread).
/// Where the loop cannot watch file descriptors the mailbox has none, and
/// `call_soon_threadsafe` wakes the loop instead.
fn watch_doorbell(
    py: Python<'_>,
    event_loop: &Bound<'_, PyAny>,
    mailbox: &Bound<'_, LoopMailbox>,
) -> PyResult<()> {
    let os = py.import(intern!(py, "os"))?;
    let (read, write): (RawFd, RawFd) = if os.hasattr(intern!(py, "eventfd"))? {
        let flags = os.getattr(intern!(py, "EFD_NONBLOCK"))?.extract::<i64>()?
            | os.getattr(intern!(py, "EFD_CLOEXEC"))?.extract::<i64>()?;
        let fd = os
            .call_method1(intern!(py, "eventfd"), (0, flags))?
            .extract()?;
        (fd, fd)
    } else {
        let (read, write): (RawFd, RawFd) = os.call_method0(intern!(py, "pipe"))?.extract()?;
        for fd in [read, write] {
            os.call_method1(intern!(py, "set_blocking"), (fd, false))?;
        }
        (read, write)
    };
    // SAFETY: the fds were just made for this mailbox, and nothing else
    // holds or closes them: from here they are owned (and closed) here.
    let (read_fd, write_fd) = unsafe {
        let read_fd = OwnedFd::from_raw_fd(read);
        let write_fd = (write != read).then(|| OwnedFd::from_raw_fd(write));
        (read_fd, write_fd)
    };
    let watched = event_loop.call_method1(
        intern!(py, "add_reader"),
        (read, mailbox.getattr(intern!(py, "drain"))?),
    );
    match watched {
        Ok(_) => mailbox.get().set_doorbell(read_fd, write_fd),
        Err(e)
            if e.is_instance_of::<PyNotImplementedError>(py)
                || e.is_instance_of::<PyOSError>(py)
                || e.is_instance_of::<PyRuntimeError>(py) =>
        {
            Ok(()) // the fds close as they drop
        }
        Err(e) => Err(e),
    }
}
