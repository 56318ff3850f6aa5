//! One served model as the native front-end sees it: its inputs, and the
//! path of one infer request from body to queue and back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrobatch_core::specs::match_inputs;
use ferrobatch_core::v2::Data;
use ferrobatch_core::{
    CoreError, DType, InputBytes, InputSpec, Outcome, Readiness, RequestState, Sink,
};
use tokio::sync::oneshot;

use crate::replies::{Failure, InputOwners, Replies, Reply, ResponsePlan};

/// The sink of every request of the native front-end: their results go to
/// the model's reply table, found by request id.
pub const SINK: Sink = Sink::Connection(0);

/// A model the native front-end serves.
pub struct ServedModel {
    pub name: String,
    specs: Vec<InputSpec>,
    replies: Arc<Replies>,
}

/// A request in the queue, and where its reply will come.
pub struct Submitted {
    pub id: u64,
    pub reply: oneshot::Receiver<Reply>,
    /// When to stop waiting, and the timeout it came from (seconds).
    pub deadline: Option<(Instant, f64)>,
}

impl ServedModel {
    /// `specs`: the model's inputs, in the order its batcher collates them.
    pub fn new(name: &str, specs: Vec<InputSpec>, replies: Arc<Replies>) -> ServedModel {
        ServedModel {
            name: name.to_owned(),
            specs,
            replies,
        }
    }

    pub fn replies(&self) -> &Arc<Replies> {
        &self.replies
    }

    fn refuse(&self, outcome: Outcome, failure: Failure) -> Failure {
        self.replies.tally().count(outcome);
        failure
    }

    /// Decodes one infer request body and queues it: no copy of binary
    /// inputs (the body is kept until the request resolves), JSON inputs
    /// decoded once into buffers of their own.
    pub fn submit(&self, body: Bytes, header_length: Option<&str>) -> Result<Submitted, Failure> {
        let codec = self.replies.codec();
        let batcher = self.replies.batcher();
        let request = codec
            .decode(&body, header_length)
            .map_err(|e| Failure::new(e.status(), e.to_string()))?;
        let shapes: Vec<Vec<usize>> = request
            .inputs
            .iter()
            .map(|i| {
                i.shape
                    .iter()
                    .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
                    .collect()
            })
            .collect();
        let tensors: Vec<(&str, DType, &[usize])> = request
            .inputs
            .iter()
            .zip(&shapes)
            .map(|(i, shape)| (i.name.as_str(), i.dtype, shape.as_slice()))
            .collect();
        let max_rows = batcher.rule().max_batch_size;
        let matched = match_inputs(&self.specs, &tensors, max_rows)
            .map_err(|e| self.refuse(Outcome::InvalidInput, Failure::new(400, e.0)))?;
        let timeout = match request.timeout {
            None => None,
            Some(t) if t.is_nan() || t < 0.0 => {
                let message = format!("timeout must be >= 0 seconds, got {t}");
                return Err(self.refuse(Outcome::InvalidInput, Failure::new(400, message)));
            }
            // Too long to represent: no deadline at all.
            Some(t) => Duration::try_from_secs_f64(t).ok().map(|d| (d, t)),
        };
        let plan = ResponsePlan {
            id: request.id.clone(),
            outputs: request.selected_outputs(codec),
        };
        let mut inputs = request.inputs;
        let mut views = Vec::with_capacity(matched.order.len());
        for &i in &matched.order {
            let bytes = match &inputs[i].data {
                Data::Owned(buffer) => buffer.as_slice(),
                Data::Body(range) => body.get(range.clone()).unwrap_or(&[]),
            };
            // SAFETY: the bytes are the body's (kept in `InputOwners::body`) or
            // a decoded buffer's heap memory (moved, not reallocated, into
            // `InputOwners::decoded`); the reply table keeps both until the
            // request is resolved, as `InputBytes` requires.
            views.push(unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) });
        }
        let decoded: Vec<Vec<u8>> = inputs
            .iter_mut()
            .filter_map(|i| match &mut i.data {
                Data::Owned(buffer) => Some(std::mem::take(buffer)),
                Data::Body(_) => None,
            })
            .collect();
        let owners = InputOwners { body, decoded };
        let (tx, rx) = oneshot::channel();
        let mut registered = None;
        let submitted = batcher.submit_with(
            SINK,
            matched.rows,
            views.into_boxed_slice(),
            timeout.map(|(d, _)| d),
            |request| {
                registered = Some(request.id);
                self.replies.register(request, plan, owners, tx);
            },
        );
        match submitted {
            Ok(request) => {
                if batcher.readiness() == Readiness::OnFlush {
                    batcher.flush(matched.rows);
                }
                Ok(Submitted {
                    id: request.id,
                    reply: rx,
                    deadline: request
                        .deadline
                        .and_then(|at| timeout.map(|(_, t)| (at, t))),
                })
            }
            Err(err) => {
                if let Some(id) = registered {
                    self.replies.unregister(id);
                }
                let (outcome, status) = match err {
                    CoreError::QueueFull { .. } => (Outcome::QueueFull, 503),
                    CoreError::Closed => (Outcome::ServerClosed, 503),
                    CoreError::InvalidInput(_) | CoreError::InvalidConfig(_) => {
                        (Outcome::InvalidInput, 400)
                    }
                };
                let message = match err {
                    CoreError::Closed => format!("model '{}' is not running", self.name),
                    other => other.to_string(),
                };
                Err(self.refuse(outcome, Failure::new(status, message)))
            }
        }
    }

    /// Waits for the reply of `submitted`. Its deadline passing answers 504
    /// (and withdraws the request if no batch took it). Dropping this future
    /// (the client went away) cancels the request the same way.
    pub async fn reply(&self, submitted: Submitted) -> Reply {
        let mut guard = Abandon {
            replies: &self.replies,
            id: submitted.id,
            armed: true,
        };
        let mut rx = submitted.reply;
        let received = match submitted.deadline {
            None => (&mut rx).await,
            Some((at, timeout)) => {
                match tokio::time::timeout_at(at.into(), &mut rx).await {
                    Ok(received) => received,
                    Err(_) => {
                        let gave_up = self.replies.abandon(
                            submitted.id,
                            RequestState::Expired,
                            Outcome::DeadlineExceeded,
                        );
                        if gave_up {
                            guard.armed = false;
                            return Err(Failure::new(
                                504,
                                format!(
                                    "request to model '{}' exceeded its {timeout}s timeout",
                                    self.name
                                ),
                            ));
                        }
                        // A result was sent meanwhile.
                        rx.await
                    }
                }
            }
        };
        guard.armed = false;
        received.unwrap_or_else(|_| {
            Err(Failure::new(
                503,
                format!("model '{}' stopped before answering", self.name),
            ))
        })
    }
}

/// Cancels a request whose handler is dropped before its reply came.
struct Abandon<'a> {
    replies: &'a Replies,
    id: u64,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.replies
                .abandon(self.id, RequestState::Cancelled, Outcome::Cancelled);
        }
    }
}
