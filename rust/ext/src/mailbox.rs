//! Event loops as a way in: each loop's `LoopMailbox` (its pending
//! requests, what its callers saw, its doorbell).
//!
//! A loop's requests wait in the core's pending table
//! ([`ferrobatch_core::pending`], which owns the exactly-once rules): a
//! caller is answered through its future, resolved on the loop's thread.
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
//! A task may cancel the future it awaits before the mailbox hears of it
//! (`cancel` comes later in the same loop iteration). So whoever takes the
//! answer of a future already done counts `Cancelled`, what its caller saw,
//! and hands it nothing; `cancel` settles the rest. Everything here but
//! `post`, `listening` and the ringing runs on the mailbox's loop thread.

use std::fs::File;
use std::io::{Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use ferrobatch_core::{
    Batcher, Inbox, Outcome, Pending, Request, RequestState, Route, Tally, Unflushed, Withdraw,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{error_class, ferrobatch_error};
use crate::inputs::Keep;
use crate::results::{
    outcome_of_error, BatchAnswers, BatchOutcome, FailedRows, ModelFailure, ResultRows,
};

/// One batch's outcome for one loop, waiting to be drained; or (`partial`)
/// one response of a decoupled model's batch, for its streaming requests.
struct Post {
    routes: Arc<Vec<Route>>,
    outcome: BatchOutcome,
    failed: Option<FailedRows>,
    partial: bool,
}

/// How a loop's caller is answered.
pub(crate) struct LoopAnswer {
    /// Resolved once, on the loop's thread, with the outputs or an error.
    future: Py<PyAny>,
    /// The deadline's TimerHandle (its callback's args hold the mailbox and
    /// the request id, never the answer): cancelled by whoever answers.
    timer: Option<Py<PyAny>>,
    /// A multi-row request (`infer_batch`): its result keeps the batch dimension.
    batched: bool,
    /// A decoupled model's request: where each response goes
    /// (`put_nowait`); its future then resolves at the end of the stream.
    stream: Option<Py<PyAny>>,
}

impl LoopAnswer {
    pub(crate) fn new(future: Py<PyAny>, batched: bool, stream: Option<Py<PyAny>>) -> LoopAnswer {
        LoopAnswer {
            future,
            timer: None,
            batched,
            stream,
        }
    }
}

/// What a loop's request holds until no batch can read its inputs.
pub(crate) struct LoopHeld {
    /// The queue it went to: a loop's requests may outlive a batcher
    /// (a server stopped and started again).
    batcher: Arc<Batcher>,
    _keep: Vec<Keep>,
}

impl LoopHeld {
    pub(crate) fn new(batcher: Arc<Batcher>, keep: Vec<Keep>) -> LoopHeld {
        LoopHeld {
            batcher,
            _keep: keep,
        }
    }
}

/// Withdraws a loop's request from the queue it went to.
struct ItsQueue;

impl Withdraw<LoopHeld> for ItsQueue {
    fn withdraw(&self, request: &Request, held: &LoopHeld, to: RequestState) -> bool {
        held.batcher.withdraw(request, to)
    }
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

/// One event loop's requests to one server: the pending table, what its
/// callers saw, posted batches and the doorbell.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct LoopMailbox {
    loop_id: u32,
    pub(crate) event_loop: Py<PyAny>,
    model_name: Arc<str>,
    pending: Pending<LoopAnswer, LoopHeld>,
    create_future: Py<PyAny>,
    call_soon: Py<PyAny>,
    call_later: Py<PyAny>,
    /// Requests this loop submitted in its current iteration, held from the
    /// workers until `flush`, which `call_soon` runs after everything else
    /// the iteration does (greedy batchers only).
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
    fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Sends the workers the requests this loop submitted since the last
    /// flush (loop thread, scheduled by the first submit after it).
    fn flush(&self) {
        self.unflushed.flush();
    }

    /// The deadline timer of request `id` fired (loop thread).
    fn expire(&self, py: Python<'_>, id: u64, timeout: f64) {
        let gave_up = self.pending.abandon(
            &ItsQueue,
            id,
            RequestState::Expired,
            Outcome::DeadlineExceeded,
        );
        if let Some(answer) = gave_up {
            let message = format!(
                "request to model '{}' exceeded its {timeout}s timeout",
                self.model_name
            );
            let error = ferrobatch_error(py, "DeadlineExceededError", message);
            self.settle(py, answer, Err(&error), Outcome::DeadlineExceeded);
        }
    }

    /// Fails every request still pending with `ServerClosedError` (loop
    /// thread): those numbered below `before` (the run that stopped; a later
    /// run's, submitted before this call came round, stay pending).
    #[pyo3(signature = (message, before=u64::MAX))]
    fn fail_all(&self, py: Python<'_>, message: &str, before: u64) {
        // Answers posted before the stop are their callers' (this call may
        // come round before the doorbell's reader does).
        self.drain(py);
        for answer in self
            .pending
            .fail_all_before(Some(&ItsQueue), Outcome::ServerClosed, before)
        {
            let error = ferrobatch_error(py, "ServerClosedError", message.to_owned());
            self.settle(py, answer, Err(&error), Outcome::ServerClosed);
        }
    }

    /// Resolves everything posted since the last drain (loop thread; the
    /// doorbell's reader callback).
    fn drain(&self, py: Python<'_>) {
        if let Some(d) = self.doorbell.get() {
            // SAFETY: as in `ring_fd`; the fd is non-blocking, so this never waits.
            let mut file = ManuallyDrop::new(unsafe { File::from_raw_fd(d.read.as_raw_fd()) });
            let mut buf = [0u8; 64];
            let _ = file.read(&mut buf);
        }
        let posts = self.inbox.drain();
        if posts.is_empty() {
            return;
        }
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        for post in posts {
            if post.partial {
                if let Ok(outputs) = &post.outcome {
                    self.stream_rows(py, &post.routes, outputs.bind(py));
                }
                continue;
            }
            self.resolve(py, &post);
        }
    }
}

impl LoopMailbox {
    pub(crate) fn new(
        loop_id: u32,
        event_loop: &Bound<'_, PyAny>,
        model_name: Arc<str>,
    ) -> PyResult<LoopMailbox> {
        let py = event_loop.py();
        Ok(LoopMailbox {
            loop_id,
            event_loop: event_loop.clone().unbind(),
            model_name,
            pending: Pending::new(),
            create_future: event_loop.getattr(intern!(py, "create_future"))?.unbind(),
            call_soon: event_loop.getattr(intern!(py, "call_soon"))?.unbind(),
            call_later: event_loop.getattr(intern!(py, "call_later"))?.unbind(),
            unflushed: Unflushed::default(),
            inbox: Inbox::default(),
            doorbell: OnceLock::new(),
            wakeups: AtomicU64::new(0),
        })
    }

    /// What this loop's callers saw.
    pub(crate) fn tally(&self) -> &Tally {
        self.pending.tally()
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
        let routes: Vec<Route> = routes.collect();
        self.pending
            .peek(&routes, |answer, _| Some(answer.future.clone_ref(py)))
            .into_iter()
            .filter(|(_, future)| !is_done(future.bind(py)))
            .map(|(route, _)| route)
            .collect()
    }

    /// Submit side (loop thread): a new future of this loop, for a request.
    pub(crate) fn new_future(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.create_future.call0(py)
    }

    /// Submit side: registers `request` (not queued yet) with its answer
    /// and what it holds.
    pub(crate) fn register(&self, request: &Arc<Request>, answer: LoopAnswer, held: LoopHeld) {
        self.pending.register(request, answer, held);
    }

    /// Submit side: drops the entry of a request the queue refused.
    pub(crate) fn unregister(&self, id: u64) {
        self.pending.unregister(id);
    }

    /// Submit side (loop thread): arms the deadline timer of queued request `id`.
    pub(crate) fn arm_timer(this: &Bound<'_, LoopMailbox>, id: u64, timeout: f64) -> PyResult<()> {
        let py = this.py();
        let expire = this.getattr(intern!(py, "expire"))?;
        let handle = this
            .get()
            .call_later
            .call1(py, (timeout, expire, id, timeout))?;
        let mut handle = Some(handle);
        this.get()
            .pending
            .update(id, |answer| answer.timer = handle.take());
        if let Some(unused) = handle {
            unused.call_method0(py, intern!(py, "cancel"))?; // answered already
        }
        Ok(())
    }

    /// Submit side (loop thread), before a request to `batcher` is queued:
    /// makes sure a flush of this iteration's requests is scheduled. Only
    /// for batchers that wait for it (`Readiness::OnFlush`).
    pub(crate) fn schedule_flush(
        this: &Bound<'_, LoopMailbox>,
        batcher: &Arc<Batcher>,
    ) -> PyResult<()> {
        let mailbox = this.get();
        if mailbox.unflushed.open(batcher) {
            let py = this.py();
            let scheduled = this
                .getattr(intern!(py, "flush"))
                .and_then(|flush| mailbox.call_soon.call1(py, (flush,)));
            if let Err(err) = scheduled {
                mailbox.unflushed.flush(); // nothing held yet: the next submit opens again
                return Err(err);
            }
        }
        Ok(())
    }

    /// What holds this loop's requests until the scheduled flush (after `schedule_flush`).
    pub(crate) fn unflushed(&self) -> &Unflushed {
        &self.unflushed
    }

    pub(crate) fn loop_id(&self) -> u32 {
        self.loop_id
    }

    /// `(fd, eventfd)` to ring, if the mailbox has a doorbell.
    pub(crate) fn doorbell_target(&self) -> Option<(RawFd, bool)> {
        self.doorbell.get().map(|d| (d.write_fd(), d.eventfd))
    }

    /// Settles requests nobody can await any more (the loop is closed):
    /// drops delivered batches and withdraws the queued requests (counted
    /// as cancelled: their tasks are gone). True once no batch holds any of
    /// them, so the mailbox may go.
    pub(crate) fn abandon(&self) -> bool {
        let now = Instant::now();
        for post in self.inbox.drain() {
            // Nobody is left to hand them to: their callers saw a cancellation.
            for taken in self.pending.take(&post.routes) {
                if !taken.counted {
                    self.pending
                        .count(Outcome::Cancelled, taken.enqueued_at, now);
                }
            }
        }
        self.pending.withdraw_where(
            &ItsQueue,
            |_| true,
            RequestState::Closed,
            Outcome::Cancelled,
        );
        self.unflushed.flush(); // withdrawn: the workers skip them
        self.pending.is_empty()
    }

    /// Answers this loop's requests of one finished batch: each gets its
    /// rows (`{name: row}`, or `{name: rows}` for a multi-row request), or
    /// the `ModelError` of its batch or of its own rows.
    fn resolve(&self, py: Python<'_>, post: &Post) {
        let taken = self.pending.take(&post.routes);
        if taken.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut answers =
            BatchAnswers::new(py, &self.model_name, &post.outcome, post.failed.as_ref());
        for t in taken {
            let (answer, outcome) = match answers.answer(&t.route, t.answer.batched) {
                Ok(rows) => (Ok(rows), Outcome::Succeeded),
                Err((error, outcome)) => (Err(error), outcome),
            };
            let counted = match hand_over(py, t.answer, answer.as_ref().map(Some)) {
                false => Outcome::Cancelled, // its task cancelled the future first
                true => outcome,
            };
            self.pending.count(counted, t.enqueued_at, now);
        }
    }

    /// Hands each streaming request of `routes` still awaited its rows of
    /// one response (`put_nowait` on its stream; loop thread). Rows that
    /// cannot be taken from the outputs fail that request as a model error;
    /// a stream whose reader left too much unread refuses the response
    /// (`StreamBacklogError`), which fails that request as its queue full.
    fn stream_rows(&self, py: Python<'_>, routes: &[Route], outputs: &Bound<'_, PyDict>) {
        let mut rows = ResultRows::new(outputs);
        let listening = self.pending.peek(routes, |answer, _| {
            let stream = answer.stream.as_ref()?.clone_ref(py);
            Some((answer.future.clone_ref(py), stream, answer.batched))
        });
        for (route, (future, stream, batched)) in listening {
            if is_done(future.bind(py)) {
                continue; // its caller is gone
            }
            let handed = rows
                .result(&route, batched)
                .and_then(|result| stream.call_method1(py, intern!(py, "put_nowait"), (result,)));
            let Err(err) = handed else {
                continue;
            };
            let backlog =
                error_class(py, "StreamBacklogError").is_ok_and(|cls| err.is_instance(py, &cls));
            let (error, outcome) = if backlog {
                (err, Outcome::QueueFull)
            } else {
                let what = "returned a response its rows could not be taken from:";
                let failure = ModelFailure::new(py, &self.model_name, err.value(py), what);
                (failure.error(py), Outcome::ModelError)
            };
            // Its batch holds it: the entry stays until the batch is done.
            let gave_up =
                self.pending
                    .abandon(&ItsQueue, route.id, RequestState::Cancelled, outcome);
            if let Some(answer) = gave_up {
                self.settle(py, answer, Err(&error), outcome);
            }
        }
    }

    /// Hands over an answer taken by giving up on its request, counted as
    /// `counted` already: recounted as cancelled if its task cancelled the
    /// future first.
    fn settle(
        &self,
        py: Python<'_>,
        answer: LoopAnswer,
        outcome: Result<Option<&Bound<'_, PyDict>>, &PyErr>,
        counted: Outcome,
    ) {
        if !hand_over(py, answer, outcome) {
            self.pending.tally().recount(counted, Outcome::Cancelled);
        }
    }

    /// The task awaiting request `id`'s `future` was cancelled (loop
    /// thread): withdraws the request if no batch took it, and counts it as
    /// `outcome` (cancelled, or the error its caller saw instead of its
    /// answer), whatever else may have resolved the future meanwhile (in
    /// the same loop iteration; or a stream that ended before its caller,
    /// who left, read its end): the caller saw that.
    pub(crate) fn cancel(
        &self,
        py: Python<'_>,
        id: u64,
        future: &Bound<'_, PyAny>,
        outcome: Outcome,
    ) -> PyResult<()> {
        let gave_up = self
            .pending
            .abandon(&ItsQueue, id, RequestState::Cancelled, outcome);
        if let Some(answer) = gave_up {
            hand_over(py, answer, Ok(None)); // counted: a late result is dropped
            if !is_done(future) {
                future.call_method0(intern!(py, "cancel"))?;
            }
            return Ok(());
        }
        if !is_done(future) {
            future.call_method0(intern!(py, "cancel"))?;
            self.pending.tally().count(outcome);
        } else if !future.call_method0(intern!(py, "cancelled"))?.is_truthy()? {
            // Answered before its task saw it.
            let error = future.call_method0(intern!(py, "exception"))?;
            let counted = if error.is_none() {
                Outcome::Succeeded
            } else {
                outcome_of_error(py, &error)
            };
            self.pending.tally().recount(counted, outcome);
        }
        // Otherwise whoever took its answer counted it cancelled.
        Ok(())
    }
}

/// Hands a taken answer over: cancels its deadline timer, then resolves its
/// future with a result (`Ok(Some)`), an error, or nothing (`Ok(None)`: its
/// caller is gone). False when the future was done already (its task
/// cancelled it) and refused what it was handed, which is fine: the caller
/// counts what its caller saw.
fn hand_over(
    py: Python<'_>,
    answer: LoopAnswer,
    outcome: Result<Option<&Bound<'_, PyDict>>, &PyErr>,
) -> bool {
    if let Some(timer) = answer.timer {
        let _ = timer.call_method0(py, intern!(py, "cancel"));
    }
    let future = answer.future.bind(py);
    let handed = match outcome {
        Ok(None) => return true,
        Ok(Some(result)) => future.call_method1(intern!(py, "set_result"), (result,)),
        Err(error) => future.call_method1(intern!(py, "set_exception"), (error.value(py),)),
    };
    match handed {
        Ok(_) => true,
        Err(_) if is_done(future) => false,
        Err(err) => {
            err.write_unraisable(py, Some(future)); // a bug: the future took nothing
            true
        }
    }
}

fn is_done(future: &Bound<'_, PyAny>) -> bool {
    let py = future.py();
    future
        .call_method0(intern!(py, "done"))
        .and_then(|d| d.is_truthy())
        .unwrap_or(true)
}
