//! Callers in plain threads (`client.infer_sync`, TorchRL's thread
//! transport): the calling thread submits straight into the batcher and
//! blocks, with the GIL released, on a waiter of its own; the worker that
//! finishes the batch hands it its rows. No event loop, no hop between
//! threads other than the batch's own.
//!
//! One owner: the server's [`ThreadWaiters`] table (in its `LoopRegistry`).
//! Whoever takes an entry's answer slot answers the request and counts its
//! outcome once: the batch ([`ThreadWaiters::deliver`]), the waiting thread
//! giving up (deadline, interrupt: [`ThreadWaiters::abandon`]) or the server
//! stopping ([`ThreadWaiters::fail_all`]). An entry whose request a batch
//! took stays, with its input bytes, until that batch resolves it.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferrobatch_core::{Batcher, Outcome, Request, RequestState, Route, Tally};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::ferrobatch_error;
use crate::fanout::{BatchOutcome, FailedRows, ModelFailure, ResultRows};
use crate::inputs::Keep;
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
        *self.answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(answer);
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

struct Entry {
    /// None once answered by its thread (a batch still holds the request).
    waiter: Option<Arc<Waiter>>,
    request: Arc<Request>,
    /// A multi-row request: its result keeps the batch dimension.
    batched: bool,
    _keep: Vec<Keep>,
}

/// The requests of one server's thread callers, until each is answered.
pub(crate) struct ThreadWaiters {
    model_name: Arc<str>,
    entries: Mutex<HashMap<u64, Entry>>,
    pub(crate) tally: Tally,
}

impl ThreadWaiters {
    pub(crate) fn new(model_name: Arc<str>) -> ThreadWaiters {
        ThreadWaiters {
            model_name,
            entries: Mutex::new(HashMap::new()),
            tally: Tally::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        // Nothing that can panic runs under this lock; a poisoned map is still whole.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `request` (not queued yet): its answer goes to the waiter returned.
    pub(crate) fn register(
        &self,
        request: &Arc<Request>,
        batched: bool,
        keep: Vec<Keep>,
    ) -> Arc<Waiter> {
        let waiter = Arc::new(Waiter::default());
        let entry = Entry {
            waiter: Some(waiter.clone()),
            request: request.clone(),
            batched,
            _keep: keep,
        };
        self.lock().insert(request.id, entry);
        waiter
    }

    /// Drops the entry of a request the queue refused.
    pub(crate) fn unregister(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// The thread of request `id` gives up (`to`: `Expired` or `Cancelled`):
    /// withdraws it if no batch took it, counts `outcome`. False when an
    /// answer was given first (the thread takes that one instead).
    fn abandon(&self, batcher: &Batcher, id: u64, to: RequestState, outcome: Outcome) -> bool {
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(&id) else {
            return false;
        };
        if entry.waiter.take().is_none() {
            return false;
        }
        self.tally.count(outcome);
        if batcher.withdraw(&entry.request, to) {
            entries.remove(&id); // never read by a worker: its inputs may go
        }
        true
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
                if self.abandon(
                    batcher,
                    id,
                    RequestState::Expired,
                    Outcome::DeadlineExceeded,
                ) {
                    let message = format!(
                        "request to model '{}' exceeded its {timeout}s timeout",
                        self.model_name
                    );
                    return Err(ferrobatch_error(py, "DeadlineExceededError", message));
                }
                continue; // answered meanwhile: it is in the waiter now
            }
            if let Err(interrupted) = py.check_signals() {
                if self.abandon(batcher, id, RequestState::Cancelled, Outcome::Cancelled) {
                    return Err(interrupted);
                }
            }
        }
    }

    /// Takes the entries of `routes` still waiting for their answer (an
    /// entry answered by its thread is dropped here: its batch is done).
    fn take(&self, routes: &[Route]) -> Vec<(Route, Arc<Waiter>, bool, Instant)> {
        let mut entries = self.lock();
        routes
            .iter()
            .filter_map(|r| {
                let entry = entries.remove(&r.id)?;
                Some((*r, entry.waiter?, entry.batched, entry.request.enqueued_at))
            })
            .collect()
    }

    /// Answers this server's thread callers of one finished batch (worker
    /// thread, GIL held): each gets `{name: its row}` (or its rows, for a
    /// multi-row request), or the `ModelError` of its batch or of its own
    /// row (`failed`). Counted before the caller can see it.
    pub(crate) fn deliver(
        &self,
        py: Python<'_>,
        routes: &[Route],
        outcome: &BatchOutcome,
        failed: Option<&FailedRows>,
    ) {
        let taken = self.take(routes);
        if taken.is_empty() {
            return;
        }
        let outputs = match outcome {
            Ok(outputs) => outputs.bind(py),
            Err(error) => {
                let failure = ModelFailure::new(py, &self.model_name, error.bind(py), "raised");
                for (_, waiter, ..) in taken {
                    self.tally.count(Outcome::ModelError);
                    waiter.set(Err(failure.error(py)));
                }
                return;
            }
        };
        let mut rows = ResultRows::new(outputs);
        let now = Instant::now();
        for (route, waiter, batched, enqueued_at) in taken {
            let failed_alone = failed.and_then(|f| {
                let i = f
                    .binary_search_by_key(&route.start, |(start, _)| *start)
                    .ok()?;
                Some(f[i].1.bind(py).clone())
            });
            if let Some(error) = failed_alone {
                let failure = ModelFailure::new(py, &self.model_name, &error, "raised");
                self.tally.count(Outcome::ModelError);
                waiter.set(Err(failure.error(py)));
                continue;
            }
            let built = rows.result(&route, batched);
            match built {
                Ok(result) => {
                    let waited = now.saturating_duration_since(enqueued_at);
                    self.tally.add_request_ns(waited.as_nanos() as u64);
                    self.tally.count(Outcome::Succeeded);
                    waiter.set(Ok(result.unbind()));
                }
                Err(err) => {
                    let what = "returned outputs its rows could not be taken from:";
                    let failure = ModelFailure::new(py, &self.model_name, err.value(py), what);
                    self.tally.count(Outcome::ModelError);
                    waiter.set(Err(failure.error(py)));
                }
            }
        }
    }

    /// Answers every thread still waiting with `ServerClosedError` (the
    /// server stops); requests no batch took are withdrawn.
    pub(crate) fn fail_all(&self, py: Python<'_>, batcher: Option<&Batcher>, message: &str) {
        let mut waiters = Vec::new();
        self.lock().retain(|_, entry| {
            if let Some(waiter) = entry.waiter.take() {
                self.tally.count(Outcome::ServerClosed);
                waiters.push(waiter);
            }
            !batcher.is_some_and(|b| b.withdraw(&entry.request, RequestState::Closed))
        });
        for waiter in waiters {
            waiter.set(Err(ferrobatch_error(
                py,
                "ServerClosedError",
                message.to_owned(),
            )));
        }
    }
}
