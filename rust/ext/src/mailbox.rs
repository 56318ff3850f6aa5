//! Event loops as a way in: each loop's `LoopMailbox` (its pending
//! requests' `Ticket`s, what its callers saw, its doorbell).
//!
//! A worker finishes a batch with one call (`Worker.finish`): it posts the
//! batch's outcome into the mailbox of each event loop it has requests from
//! (`LoopRegistry::route_batch`) and rings that loop's doorbell (an eventfd, or a pipe,
//! the loop watches with `add_reader`) once the GIL is released, so the woken
//! loop never waits for the GIL the worker still holds. The loop drains
//! everything posted since its last drain in one callback and resolves each
//! request's future there, without a Python frame per request.
//!
//! Only the post that arms a mailbox's inbox rings (the core's [`Inbox`]
//! rule): a busy loop gets one wake-up however many batches land before it
//! drains, and no post is ever left undrained.
//!
//! Failing a request has one path, [`LoopMailbox::fail`], whatever the
//! reason (deadline, stop, model error, a fan-out that could not take the
//! rows); a caller's cancellation goes through [`LoopMailbox::cancel`],
//! which also settles what the caller saw. Everything here but `post` and
//! the ringing runs on the mailbox's loop thread.

use std::fs::File;
use std::io::{Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use ferrobatch_core::{Batcher, Inbox, Outcome, Request, RequestState, Route, Tally, Unflushed};
use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::ferrobatch_error;
use crate::inputs::Keep;
use crate::results::{outcome_of_error, BatchOutcome, FailedRows, ModelFailure, ResultRows};

/// One batch's outcome for one loop, waiting to be drained; or (`partial`)
/// one response of a decoupled model's batch, for its streaming requests.
struct Post {
    routes: Arc<Vec<Route>>,
    outcome: BatchOutcome,
    failed: Option<FailedRows>,
    partial: bool,
}

/// The file descriptors a loop watches; `write` is None for an eventfd.
struct Doorbell {
    read: OwnedFd,
    write: Option<OwnedFd>,
    eventfd: bool,
}

impl Doorbell {
    fn write_fd(&self) -> RawFd {
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

/// Rings the doorbells of `mailboxes` (call with the GIL released; the
/// caller keeps each mailbox, and so its fd, alive meanwhile).
pub(crate) fn doorbells(mailboxes: &[Py<LoopMailbox>]) -> Vec<(RawFd, bool)> {
    mailboxes
        .iter()
        .filter_map(|m| m.get().doorbell_target())
        .collect()
}

/// One event loop's requests to one server: pending tickets by id, what
/// its callers saw, posted batches and the doorbell.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct LoopMailbox {
    loop_id: u32,
    pub(crate) event_loop: Py<PyAny>,
    model_name: Arc<str>,
    /// Request id -> Ticket, for requests submitted from this loop.
    pending: Py<PyDict>,
    pub(crate) tally: Tally,
    create_future: Py<PyAny>,
    call_soon: Py<PyAny>,
    call_later: Py<PyAny>,
    /// Rows this loop submitted in its current iteration, and the batcher
    /// they went to: made ready at once by `flush`, which `call_soon` runs
    /// after everything else the iteration does (greedy batchers only).
    unflushed: Unflushed,
    inbox: Inbox<Post>,
    doorbell: OnceLock<Doorbell>,
    wakeups: AtomicU64,
}

#[pymethods]
impl LoopMailbox {
    /// The fd the loop watches for readability, or None.
    #[getter]
    pub(crate) fn doorbell_fd(&self) -> Option<RawFd> {
        self.doorbell.get().map(|d| d.read.as_raw_fd())
    }

    /// Times the loop was woken to drain (one per batch or fewer).
    #[getter]
    fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// Requests of this loop not resolved yet (or resolved, and still held
    /// by the batch that took them).
    #[getter]
    fn pending_count(&self, py: Python<'_>) -> usize {
        self.pending.bind(py).len()
    }

    /// Readies for the workers the requests this loop submitted since the
    /// last flush (loop thread, scheduled by the first submit after it).
    fn flush(&self) {
        self.unflushed.flush();
    }

    /// The deadline timer of request `id` fired (loop thread).
    fn expire(&self, py: Python<'_>, id: u64, timeout: f64) {
        self.fail(
            py,
            id,
            Some(RequestState::Expired),
            Outcome::DeadlineExceeded,
            || {
                let message = format!(
                    "request to model '{}' exceeded its {timeout}s timeout",
                    self.model_name
                );
                ferrobatch_error(py, "DeadlineExceededError", message)
            },
        );
    }

    /// Fails every request still pending with `ServerClosedError` (loop thread).
    fn fail_all(&self, py: Python<'_>, message: &str) {
        let ids: Vec<u64> = self
            .pending
            .bind(py)
            .keys()
            .iter()
            .filter_map(|k| k.extract().ok())
            .collect();
        for id in ids {
            self.fail(
                py,
                id,
                Some(RequestState::Closed),
                Outcome::ServerClosed,
                || ferrobatch_error(py, "ServerClosedError", message.to_owned()),
            );
        }
    }

    /// Resolves everything posted since the last drain (loop thread; the
    /// doorbell's reader callback).
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(d) = self.doorbell.get() {
            // SAFETY: as in `ring_fd`; the fd is non-blocking, so this never waits.
            let mut file = ManuallyDrop::new(unsafe { File::from_raw_fd(d.read.as_raw_fd()) });
            let mut buf = [0u8; 64];
            let _ = file.read(&mut buf);
        }
        let posts = self.inbox.drain();
        if posts.is_empty() {
            return Ok(());
        }
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        let mut first_error = None;
        for post in posts {
            if post.partial {
                if let Ok(outputs) = &post.outcome {
                    self.stream_rows(py, &post.routes, outputs.bind(py));
                }
                continue;
            }
            match post.outcome {
                Ok(outputs) => {
                    let routes = match &post.failed {
                        Some(failed) => self.fail_rows(py, &post.routes, failed),
                        None => post.routes.clone(),
                    };
                    if let Err(e) = self.resolve(py, &routes, outputs.bind(py)) {
                        // A bug, or outputs Python refused to index: whatever
                        // it was, no caller of this batch is left waiting.
                        self.fail_batch(py, &routes, e.value(py), "could not deliver its rows:");
                        first_error.get_or_insert(e);
                    }
                }
                Err(error) => self.fail_batch(py, &post.routes, error.bind(py), "raised"),
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl LoopMailbox {
    pub(crate) fn new(
        py: Python<'_>,
        loop_id: u32,
        event_loop: &Bound<'_, PyAny>,
        model_name: Arc<str>,
    ) -> PyResult<LoopMailbox> {
        Ok(LoopMailbox {
            loop_id,
            event_loop: event_loop.clone().unbind(),
            model_name,
            pending: PyDict::new(py).unbind(),
            tally: Tally::default(),
            create_future: event_loop.getattr(intern!(py, "create_future"))?.unbind(),
            call_soon: event_loop.getattr(intern!(py, "call_soon"))?.unbind(),
            call_later: event_loop.getattr(intern!(py, "call_later"))?.unbind(),
            unflushed: Unflushed::default(),
            inbox: Inbox::default(),
            doorbell: OnceLock::new(),
            wakeups: AtomicU64::new(0),
        })
    }

    /// Takes ownership of the doorbell's non-blocking file descriptors: an
    /// eventfd (`write` None) or a pipe. Without one, `post_batch` wakes the
    /// loop with `call_soon_threadsafe(drain)`.
    pub(crate) fn set_doorbell(&self, read: OwnedFd, write: Option<OwnedFd>) -> PyResult<()> {
        let eventfd = write.is_none();
        self.doorbell
            .set(Doorbell {
                read,
                write,
                eventfd,
            })
            .map_err(|_| PyRuntimeError::new_err("this mailbox already has a doorbell"))
    }

    /// Posts a batch's outcome (worker thread). True when this post must
    /// wake the loop.
    pub(crate) fn post(
        &self,
        routes: Arc<Vec<Route>>,
        outcome: BatchOutcome,
        failed: Option<FailedRows>,
    ) -> bool {
        self.inbox.post(Post {
            routes,
            outcome,
            failed,
            partial: false,
        })
    }

    /// Posts one response of a decoupled model's batch for its streaming
    /// requests `routes` (worker thread). True when this post must wake the loop.
    pub(crate) fn post_partial(&self, routes: Arc<Vec<Route>>, outputs: Py<PyDict>) -> bool {
        self.inbox.post(Post {
            routes,
            outcome: Ok(outputs),
            failed: None,
            partial: true,
        })
    }

    /// Of `routes`, those whose caller still awaits its stream (worker
    /// thread, with the GIL: a future's `done()` only reads its state).
    pub(crate) fn listening(
        &self,
        py: Python<'_>,
        routes: impl Iterator<Item = Route>,
    ) -> Vec<Route> {
        let pending = self.pending.bind(py);
        routes
            .filter(|route| {
                let Ok(Some(entry)) = pending.get_item(route.id) else {
                    return false;
                };
                entry
                    .cast_into::<Ticket>()
                    .is_ok_and(|ticket| !is_done(ticket.get().future.bind(py)))
            })
            .collect()
    }

    /// Hands each streaming request of `routes` still awaited its rows of
    /// one response (`put_nowait` on its stream; loop thread). Rows that
    /// cannot be taken from the outputs fail that request as a model error.
    fn stream_rows(&self, py: Python<'_>, routes: &[Route], outputs: &Bound<'_, PyDict>) {
        let mut rows = ResultRows::new(outputs);
        let pending = self.pending.bind(py);
        for route in routes {
            let Ok(Some(entry)) = pending.get_item(route.id) else {
                continue;
            };
            let Ok(ticket) = entry.cast_into::<Ticket>() else {
                continue;
            };
            let ticket = ticket.get();
            let Some(stream) = &ticket.stream else {
                continue;
            };
            if is_done(ticket.future.bind(py)) {
                continue; // its caller is gone
            }
            let handed = rows
                .result(route, ticket.batched)
                .and_then(|result| stream.call_method1(py, intern!(py, "put_nowait"), (result,)));
            if let Err(err) = handed {
                let what = "returned a response its rows could not be taken from:";
                self.fail_batch(py, std::slice::from_ref(route), err.value(py), what);
            }
        }
    }

    /// Fails the requests of `routes` listed in `failed` (each with its own
    /// error, as `fail_batch` does) and returns the others, to resolve.
    fn fail_rows(
        &self,
        py: Python<'_>,
        routes: &Arc<Vec<Route>>,
        failed: &[(u32, Py<PyAny>)],
    ) -> Arc<Vec<Route>> {
        let mut rest = Vec::with_capacity(routes.len());
        for route in routes.iter() {
            match failed.binary_search_by_key(&route.start, |(start, _)| *start) {
                Ok(i) => {
                    let error = failed[i].1.bind(py);
                    self.fail_batch(py, std::slice::from_ref(route), error, "raised");
                }
                Err(_) => rest.push(*route),
            }
        }
        Arc::new(rest)
    }

    /// Submit side (loop thread): a new future of this loop, for a ticket.
    pub(crate) fn new_future(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.create_future.call0(py)
    }

    /// Submit side (loop thread): registers a queued request's ticket.
    pub(crate) fn add_pending(&self, py: Python<'_>, ticket: &Bound<'_, Ticket>) -> PyResult<()> {
        self.pending.bind(py).set_item(ticket.get().id(), ticket)
    }

    /// Submit side (loop thread): arms the deadline timer of a queued request.
    pub(crate) fn arm_timer(
        this: &Bound<'_, LoopMailbox>,
        ticket: &Ticket,
        timeout: f64,
    ) -> PyResult<()> {
        let py = this.py();
        let expire = this.getattr(intern!(py, "expire"))?;
        // The handle's args hold the mailbox and the id, never the ticket.
        let handle = this
            .get()
            .call_later
            .call1(py, (timeout, expire, ticket.id(), timeout))?;
        ticket.set_timer(handle);
        Ok(())
    }

    /// Submit side (loop thread), before a request to `batcher` is queued:
    /// makes sure a flush of this iteration's requests is scheduled. Only
    /// for batchers that wait for it (`Readiness::OnFlush`).
    pub(crate) fn schedule_flush(
        this: &Bound<'_, LoopMailbox>,
        batcher: &Arc<ferrobatch_core::Batcher>,
    ) -> PyResult<()> {
        let mailbox = this.get();
        if mailbox.unflushed.open(batcher) {
            let py = this.py();
            let scheduled = this
                .getattr(intern!(py, "flush"))
                .and_then(|flush| mailbox.call_soon.call1(py, (flush,)));
            if let Err(err) = scheduled {
                mailbox.unflushed.flush(); // nothing counted yet: the next submit opens again
                return Err(err);
            }
        }
        Ok(())
    }

    /// Counts `rows` more rows for the scheduled flush (after `schedule_flush`).
    pub(crate) fn add_unflushed(&self, rows: usize) {
        self.unflushed.add(rows);
    }

    pub(crate) fn loop_id(&self) -> u32 {
        self.loop_id
    }

    /// `(fd, eventfd)` to ring, if the mailbox has a doorbell.
    pub(crate) fn doorbell_target(&self) -> Option<(RawFd, bool)> {
        self.doorbell.get().map(|d| (d.write_fd(), d.eventfd))
    }

    /// Settles requests nobody can await any more (the loop is closed):
    /// withdraws the queued ones and drops delivered batches. True once no
    /// batch holds any of them, so the mailbox may go.
    pub(crate) fn abandon(&self, py: Python<'_>) -> bool {
        let posts = self.inbox.drain();
        let pending = self.pending.bind(py);
        for post in &posts {
            for route in post.routes.iter() {
                let _ = pending.del_item(route.id);
            }
        }
        let entries: Vec<_> = pending.iter().collect();
        for (key, entry) in entries {
            let Ok(ticket) = entry.cast_into::<Ticket>() else {
                continue;
            };
            if ticket.get().withdraw_as(RequestState::Closed) {
                let _ = pending.del_item(key);
            }
        }
        pending.is_empty()
    }

    /// The one path that fails request `id`: cancels its deadline timer,
    /// withdraws it (`withdraw_as`; None for a request whose batch is done),
    /// lets the ticket (and its inputs) go once no batch can read them, and
    /// hands its future `error()` unless it is resolved already, counting
    /// `outcome` then. Cannot fail: a request it cannot fail is one resolved
    /// already.
    fn fail(
        &self,
        py: Python<'_>,
        id: u64,
        withdraw_as: Option<RequestState>,
        outcome: Outcome,
        error: impl FnOnce() -> PyErr,
    ) {
        let pending = self.pending.bind(py);
        let Ok(Some(entry)) = pending.get_item(id) else {
            return;
        };
        let Ok(ticket) = entry.cast_into::<Ticket>() else {
            return;
        };
        let ticket = ticket.get();
        let _ = ticket.cancel_timer(py);
        // Still held by a batch (it took the request): its inputs stay until
        // that batch resolves it.
        let gone = match withdraw_as {
            Some(to) => ticket.withdraw_as(to),
            None => true,
        };
        if gone {
            let _ = pending.del_item(id);
        }
        let future = ticket.future.bind(py);
        if is_done(future) {
            return;
        }
        let set = future.call_method1(intern!(py, "set_exception"), (error().value(py),));
        if set.is_ok() {
            self.tally.count(outcome);
        }
    }

    /// Fails this loop's requests of a batch with `ModelError`: its model
    /// call raised `error` (or the fan-out could not take its rows, `what`).
    /// The message is made once, and cannot raise.
    fn fail_batch(&self, py: Python<'_>, routes: &[Route], error: &Bound<'_, PyAny>, what: &str) {
        let failure = ModelFailure::new(py, &self.model_name, error, what);
        for route in routes {
            self.fail(py, route.id, None, Outcome::ModelError, || {
                failure.error(py)
            });
        }
    }

    /// The task awaiting request `id`'s `future` was cancelled (loop
    /// thread): withdraws the request if no batch took it, and counts it as
    /// cancelled, whatever else may have resolved the future meanwhile (in
    /// the same loop iteration): the caller saw the cancellation.
    pub(crate) fn cancel(
        &self,
        py: Python<'_>,
        id: u64,
        future: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let pending = self.pending.bind(py);
        if let Some(entry) = pending.get_item(id)? {
            let ticket = entry.cast_into::<Ticket>()?;
            let ticket = ticket.get();
            ticket.cancel_timer(py)?;
            if ticket.withdraw_as(RequestState::Cancelled) {
                pending.del_item(id)?; // never runs: its inputs may go
            }
        }
        if !is_done(future) {
            future.call_method0(intern!(py, "cancel"))?; // a late result is dropped, uncounted
        } else if !future.call_method0(intern!(py, "cancelled"))?.is_truthy()? {
            let error = future.call_method0(intern!(py, "exception"))?;
            let counted = if error.is_none() {
                Outcome::Succeeded
            } else {
                outcome_of_error(py, &error)
            };
            self.tally.recount(counted, Outcome::Cancelled);
            return Ok(());
        }
        self.tally.count(Outcome::Cancelled);
        Ok(())
    }

    /// Resolves this loop's requests of one successful batch.
    ///
    /// Each pending ticket found is given `{name: row}` (one-sample
    /// requests: a row of `outputs[name].unbind(0)`, made here at most once
    /// per batch, and only if a one-sample request is in it: the loop thread
    /// runs it, so the worker never drops the GIL for it) or
    /// `{name: outputs[name][first:first + n]}` (multi-row requests), then
    /// removed, its timer cancelled, and its future resolved. A future
    /// already done (its task was cancelled, or its deadline passed)
    /// refuses the result, and that is fine: it was resolved once already.
    /// Rows that cannot be taken from the outputs fail as a model error.
    fn resolve(
        &self,
        py: Python<'_>,
        routes: &[Route],
        outputs: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let mut rows = ResultRows::new(outputs);
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
            let result = match rows.result(route, ticket.batched) {
                Ok(result) => result,
                Err(err) => {
                    unbuilt.push(*route);
                    build_error.get_or_insert(err);
                    continue;
                }
            };
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
                Err(_) if is_done(future) => {}
                Err(e) => return Err(e),
            }
        }
        self.tally.count_n(Outcome::Succeeded, succeeded);
        self.tally.add_request_ns(request_ns);
        if let Some(err) = build_error {
            let what = "returned outputs its rows could not be taken from:";
            self.fail_batch(py, &unbuilt, err.value(py), what);
        }
        Ok(())
    }
}

fn is_done(future: &Bound<'_, PyAny>) -> bool {
    let py = future.py();
    future
        .call_method0(intern!(py, "done"))
        .and_then(|d| d.is_truthy())
        .unwrap_or(true)
}

/// One submitted request: its future, deadline timer, and the caller's input
/// objects, held alive until the request is resolved or withdrawn
/// (`withdraw` returned True); its loop's `pending` holds it until then.
///
/// Not seen by Python's cycle collector (cheaper per request), so nothing the
/// ticket refers to may refer back to it once it is resolved: callers await
/// its future without keeping the ticket, and the deadline timer (whose
/// callback holds the ticket) is dropped by `cancel_timer` on every path.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct Ticket {
    request: Arc<Request>,
    batcher: Arc<Batcher>,
    /// Resolved once, on the submitting loop, with the outputs or an error.
    pub(crate) future: Py<PyAny>,
    /// The deadline's TimerHandle (its callback args hold the mailbox and
    /// the request id): cancelled and dropped when the request resolves.
    timer: Mutex<Option<Py<PyAny>>>,
    /// A multi-row request (`infer_batch`): its result keeps the batch dimension.
    pub(crate) batched: bool,
    /// A decoupled model's request: where each response goes
    /// (`put_nowait`); its future then resolves at the end of the stream.
    pub(crate) stream: Option<Py<PyAny>>,
    _keep: Vec<Keep>,
}

impl Ticket {
    pub(crate) fn new(
        request: Arc<Request>,
        batcher: Arc<Batcher>,
        future: Py<PyAny>,
        batched: bool,
        stream: Option<Py<PyAny>>,
        keep: Vec<Keep>,
    ) -> Ticket {
        Ticket {
            request,
            batcher,
            future,
            timer: Mutex::new(None),
            batched,
            stream,
            _keep: keep,
        }
    }

    pub(crate) fn enqueued_at(&self) -> Instant {
        self.request.enqueued_at
    }

    /// True if the request has a deadline (a timeout short enough to
    /// represent; a longer one means none).
    pub(crate) fn has_deadline(&self) -> bool {
        self.request.deadline.is_some()
    }

    /// Remembers the request's deadline timer, cancelled when it resolves.
    pub(crate) fn set_timer(&self, handle: Py<PyAny>) {
        *self.timer.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
    }

    /// Cancels the deadline timer, if any, and lets go of it.
    pub(crate) fn cancel_timer(&self, py: Python<'_>) -> PyResult<()> {
        let timer = self.timer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(timer) = timer {
            timer.call_method0(py, intern!(py, "cancel"))?;
        }
        Ok(())
    }

    /// Withdraws the request (`to`: `Cancelled`, `Expired` or `Closed`).
    /// True if it will never run; False if a batch already took it.
    pub(crate) fn withdraw_as(&self, to: RequestState) -> bool {
        self.batcher.withdraw(&self.request, to)
    }
}

#[pymethods]
impl Ticket {
    #[getter]
    pub(crate) fn id(&self) -> u64 {
        self.request.id
    }

    #[getter]
    fn future(&self, py: Python<'_>) -> Py<PyAny> {
        self.future.clone_ref(py)
    }
}
