//! Callers in plain threads (`client.infer_sync`, TorchRL's thread
//! transport): the calling thread submits straight into the batcher and
//! blocks, with the GIL released, on a waiter of its own; the worker that
//! finishes the batch hands it its rows. No event loop, no hop between
//! threads other than the batch's own.
//!
//! Their requests wait in the server's [`ThreadWaiters`] (in its
//! `LoopRegistry`): the core's pending table ([`ferrobatch_core::pending`],
//! which owns the exactly-once rules), a thread's answer handed to its
//! [`Waiter`].

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ferrobatch_core::{Batcher, Outcome, Pending, Request, RequestState, Route, Tally};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::ferrobatch_error;
use crate::inputs::Keep;
use crate::results::{BatchAnswers, BatchOutcome, FailedRows};
use crate::without_gil;

/// How often a waiting thread comes back for the GIL to see signals (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// A blocked thread's answer slot: set once by whoever answers, taken by
/// the thread waiting on it (see [`Waiter::wait_until`]). `T` is what the
/// answer is: a result built with the GIL (in-process callers), or plain
/// data from a collector that never takes it (shared-memory clients).
pub(crate) struct Waiter<T = PyResult<Py<PyDict>>> {
    answer: Mutex<Option<T>>,
    ready: Condvar,
}

impl<T> Default for Waiter<T> {
    fn default() -> Self {
        Waiter {
            answer: Mutex::new(None),
            ready: Condvar::new(),
        }
    }
}

impl<T> Waiter<T> {
    pub(crate) fn set(&self, answer: T) {
        self.put(answer);
        self.wake();
    }

    /// Leaves the answer for the thread without waking it: [`Waiter::wake`]
    /// follows once the GIL is released (a thread woken while the GIL is
    /// held would only sleep again on it). Its next periodic look finds the
    /// answer even if no wake comes.
    pub(crate) fn put(&self, answer: T) {
        *self.answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(answer);
    }

    /// Wakes the thread waiting for the answer put.
    pub(crate) fn wake(&self) {
        self.ready.notify_one();
    }

    /// Waits (call without the GIL) until the answer is in or `until`.
    pub(crate) fn wait_until(&self, until: Instant) -> Option<T> {
        let mut answer = self.answer.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(done) = answer.take() {
                return Some(done);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            answer = self
                .ready
                .wait_timeout(answer, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// What a thread caller's request holds until its batch is done.
struct Held {
    /// A multi-row request: its result keeps the batch dimension.
    batched: bool,
    /// What keeps its input bytes alive.
    _keep: Vec<Keep>,
}

/// The requests of one server's thread callers, until each is answered
/// (the core's pending table; a thread's answer is handed to its waiter).
pub(crate) struct ThreadWaiters {
    model_name: Arc<str>,
    pending: Pending<Arc<Waiter>, Held>,
}

impl ThreadWaiters {
    pub(crate) fn new(model_name: Arc<str>) -> ThreadWaiters {
        ThreadWaiters {
            model_name,
            pending: Pending::new(),
        }
    }

    /// What this server's thread callers saw.
    pub(crate) fn tally(&self) -> &Tally {
        self.pending.tally()
    }

    /// Registers `request` (not queued yet): its answer goes to the waiter returned.
    pub(crate) fn register(
        &self,
        request: &Arc<Request>,
        batched: bool,
        keep: Vec<Keep>,
    ) -> Arc<Waiter> {
        let waiter = Arc::new(Waiter::default());
        let held = Held {
            batched,
            _keep: keep,
        };
        self.pending.register(request, waiter.clone(), held);
        waiter
    }

    /// Drops the entry of a request the queue refused.
    pub(crate) fn unregister(&self, id: u64) {
        self.pending.unregister(id);
    }

    /// Blocks the calling thread (GIL released) until request `id` is
    /// answered; at `deadline` (from `timeout` seconds) it fails with
    /// `DeadlineExceededError`, and a signal (Ctrl-C) withdraws it and raises.
    pub(crate) fn wait(
        &self,
        py: Python<'_>,
        batcher: &Batcher,
        id: u64,
        waiter: &Waiter,
        deadline: Option<(Instant, f64)>,
    ) -> PyResult<Py<PyDict>> {
        loop {
            let slice = Instant::now() + SIGNAL_CHECK;
            let until = deadline.map_or(slice, |(at, _)| at.min(slice));
            if let Some(answer) = without_gil(py, || waiter.wait_until(until)) {
                return answer;
            }
            if let Some((_, timeout)) = deadline.filter(|(at, _)| Instant::now() >= *at) {
                let gave_up = self.pending.abandon(
                    batcher,
                    id,
                    RequestState::Expired,
                    Outcome::DeadlineExceeded,
                );
                if gave_up.is_some() {
                    let message = format!(
                        "request to model '{}' exceeded its {timeout}s timeout",
                        self.model_name
                    );
                    return Err(ferrobatch_error(py, "DeadlineExceededError", message));
                }
                continue; // answered meanwhile: it is in the waiter now
            }
            if let Err(interrupted) = py.check_signals() {
                let gave_up =
                    self.pending
                        .abandon(batcher, id, RequestState::Cancelled, Outcome::Cancelled);
                if gave_up.is_some() {
                    return Err(interrupted);
                }
            }
        }
    }

    /// Answers this server's thread callers of one finished batch (worker
    /// thread, GIL held): each gets `{name: its row}` (or its rows, for a
    /// multi-row request), or the `ModelError` of its batch or of its own
    /// row (`failed`; see `BatchAnswers`). Counted before the caller can see it. The waiters
    /// answered are added to `to_wake`: wake them once the GIL is released.
    pub(crate) fn deliver(
        &self,
        py: Python<'_>,
        routes: &[Route],
        outcome: &BatchOutcome,
        failed: Option<&FailedRows>,
        to_wake: &mut Vec<Arc<Waiter>>,
    ) {
        let taken = self.pending.take(routes);
        if taken.is_empty() {
            return;
        }
        to_wake.reserve(taken.len());
        let now = Instant::now();
        let mut answers = BatchAnswers::new(py, &self.model_name, outcome, failed);
        for t in taken {
            let (answer, counted) = match answers.answer(&t.route, t.held.batched) {
                Ok(rows) => (Ok(rows.unbind()), Outcome::Succeeded),
                Err((error, outcome)) => (Err(error), outcome),
            };
            self.pending.count(counted, t.enqueued_at, now);
            t.answer.put(answer);
            to_wake.push(t.answer);
        }
    }

    /// Answers every thread still waiting with `ServerClosedError` (the
    /// server stops; its workers are done, so nothing is left to withdraw).
    pub(crate) fn fail_all(&self, py: Python<'_>, message: &str, before: u64) {
        for waiter in self
            .pending
            .fail_all_before(None, Outcome::ServerClosed, before)
        {
            waiter.set(Err(ferrobatch_error(
                py,
                "ServerClosedError",
                message.to_owned(),
            )));
        }
    }
}
