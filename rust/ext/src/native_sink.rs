//! The native front-end as a way in: a model it serves has a [`NativeSink`]
//! in its `LoopRegistry`, holding the front-end's replies for that model
//! (the core's pending table), the codec that reads its outputs, and the
//! Python hook that words a model failure for remote clients (and logs it).
//! A finished batch's `Sink::Connection` rows come to [`deliver`]: the
//! outputs are read once per batch (with the GIL), then every request's
//! response is encoded and its handler woken without it.

use std::sync::Arc;

use ferrobatch_core::{Outcome, Route};
use ferrobatch_serve::{Column, Failure, Replies, VaryingRows};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::codec::V2Codec;
use crate::results::{failed_alone, outcome_of_error, BatchOutcome, FailedRows};
use crate::without_gil;

/// Where a model's natively submitted requests are answered.
pub(crate) struct NativeSink {
    pub replies: Arc<Replies>,
    codec: Py<V2Codec>,
    /// `describe(error) -> str`: the message a remote client gets for a
    /// model failure (logging it once).
    describe: Py<PyAny>,
}

impl NativeSink {
    pub(crate) fn new(
        replies: Arc<Replies>,
        codec: Py<V2Codec>,
        describe: Py<PyAny>,
    ) -> NativeSink {
        NativeSink {
            replies,
            codec,
            describe,
        }
    }

    /// What a remote client gets for a model call that raised `error`,
    /// and the outcome it is counted under: a 500, or for another of
    /// ferrobatch's errors (a forwarding model's downstream refused the
    /// request) that error's status, as in-process callers get its class.
    fn failure(&self, py: Python<'_>, error: &Bound<'_, PyAny>) -> (Failure, Outcome) {
        let message = self
            .describe
            .bind(py)
            .call1((error,))
            .and_then(|m| m.extract::<String>())
            .unwrap_or_else(|_| format!("model '{}' failed", self.replies.codec().model()));
        let outcome = outcome_of_error(py, error);
        (Failure::new(Failure::status_of(outcome), message), outcome)
    }
}

/// Answers the native requests (`routes`) of one finished batch. A
/// decoupled model's batch ends with no outputs: its streams end.
pub(crate) fn deliver(
    py: Python<'_>,
    sink: &NativeSink,
    routes: &[Route],
    outcome: &BatchOutcome,
    failed: Option<&FailedRows>,
) {
    let replies = &sink.replies;
    let outputs = match outcome {
        Ok(_) if replies.codec().decoupled() => {
            // Streams the model failed alone end with their error, the others as usual.
            let mut ended: Vec<Route> = Vec::with_capacity(routes.len());
            for route in routes {
                match failed_alone(failed, route.start) {
                    Some(error) => {
                        let (failure, outcome) = sink.failure(py, error.bind(py));
                        let one = std::slice::from_ref(route);
                        without_gil(py, || replies.fail_batch(one, &failure, outcome));
                    }
                    None => ended.push(*route),
                }
            }
            without_gil(py, || replies.end_streams(&ended));
            return;
        }
        Ok(outputs) => outputs.bind(py),
        Err(error) => {
            let (failure, outcome) = sink.failure(py, error.bind(py));
            without_gil(py, || replies.fail_batch(routes, &failure, outcome));
            return;
        }
    };
    let failed: Vec<(u32, Failure, Outcome)> = failed
        .map(|rows| {
            rows.iter()
                .map(|(start, error)| {
                    let (failure, outcome) = sink.failure(py, error.bind(py));
                    (*start, failure, outcome)
                })
                .collect()
        })
        .unwrap_or_default();
    with_columns(py, sink, outputs, routes, |columns| {
        replies.deliver(routes, columns, &failed)
    });
}

/// Hands one partial answer of a decoupled model's batch (`outputs`) to
/// its native streaming requests (`routes`); returns how many still listen.
/// Outputs that cannot be read fail those requests.
pub(crate) fn stream(
    py: Python<'_>,
    sink: &NativeSink,
    routes: &[Route],
    outputs: &Bound<'_, PyDict>,
) -> usize {
    with_columns(py, sink, outputs, routes, |columns| {
        sink.replies.stream(routes, columns)
    })
    .unwrap_or(0)
}

/// Runs `answer` on the columns of `outputs` (read once, with the GIL;
/// `answer` runs without it). Outputs that cannot be read fail `routes`
/// instead (None).
fn with_columns<R: Send>(
    py: Python<'_>,
    sink: &NativeSink,
    outputs: &Bound<'_, PyDict>,
    routes: &[Route],
    answer: impl FnOnce(&[Column<'_>]) -> R + Send,
) -> Option<R> {
    let replies = &sink.replies;
    let codec = sink.codec.get();
    let read = codec.read_outputs(py, outputs);
    let mut read = match read {
        Ok(read) => read,
        Err(err) => {
            // Outputs that cannot be read are the model's failure, whatever raised.
            let (failure, _) = sink.failure(py, err.value(py));
            let failure = Failure::new(500, failure.message);
            without_gil(py, || {
                replies.fail_batch(routes, &failure, Outcome::ModelError)
            });
            return None;
        }
    };
    let columns: Vec<(Vec<u64>, usize, usize, Option<VaryingRows>)> = read
        .iter_mut()
        .map(|r| (r.shape.clone(), r.ptr, r.len, r.rows.take()))
        .collect();
    let answered = without_gil(py, || {
        let columns: Vec<Column<'_>> = columns
            .iter()
            .map(|(shape, ptr, len, rows)| Column {
                shape,
                // SAFETY: each (ptr, len) is a contiguous CPU tensor's bytes
                // (or serialized BYTES), kept alive by `read` (outside this
                // closure, which it outlives).
                data: unsafe { crate::codec::bytes_at(*ptr, *len) },
                rows: rows.as_ref(),
            })
            .collect();
        answer(&columns)
    });
    drop(read);
    Some(answered)
}

/// The outcomes counted by a native sink, added into a registry's stats.
pub(crate) fn add_counts(sink: &NativeSink, totals: &mut ferrobatch_core::Totals) {
    sink.replies.tally().add_to(totals);
}

/// Answers the native requests still pending with 503 (the server stops):
/// those numbered below `before` (the stopped run's).
pub(crate) fn fail_all(sink: &NativeSink, message: &str, before: u64) {
    sink.replies
        .fail_all_before(&Failure::new(503, message), Outcome::ServerClosed, before);
}
