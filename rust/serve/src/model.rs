//! One served model as the native front-end sees it: its inputs, and the
//! path of one infer request from its decoded tensors to the queue and back,
//! the same for every protocol.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrobatch_core::v2::{Codec, Data, HeaderMemo, InferRequest};
use ferrobatch_core::{
    timeout_from_secs, CoreError, DType, InputBytes, InputRules, InputSpec, Inputs, Layout,
    Outcome, PerTensor, RequestState, Sink, Submission,
};
use thread_local::ThreadLocal;
use tokio::sync::oneshot;

use crate::replies::{Failure, InputOwners, Replies, Reply, ResponsePlan};

/// The sink of every request of the native front-end: their results go to
/// the model's reply table, found by request id.
pub const SINK: Sink = Sink::Connection(0);

/// A client that goes away this close to its request's deadline went away
/// because of it (a gRPC client cancels its call when its deadline passes,
/// about when the server's own timer fires): the request is counted
/// `deadline_exceeded`, not `cancelled`.
pub const DEADLINE_SLACK: Duration = Duration::from_millis(20);

/// A model the native front-end serves.
pub struct ServedModel {
    /// Shared: each gRPC answer echoes it.
    pub name: Arc<str>,
    specs: Vec<InputSpec>,
    replies: Arc<Replies>,
    /// Binary requests' headers decoded lately, one memo per runtime
    /// thread: no lock between connections.
    headers: ThreadLocal<RefCell<HeaderMemo>>,
    /// Whether its instances can run batches (false while every one is
    /// down); readiness says so, requests are still taken.
    ready: AtomicBool,
}

/// A request in the queue, and where its reply will come.
pub struct Submitted {
    pub id: u64,
    pub reply: oneshot::Receiver<Reply>,
    /// When to stop waiting, and the timeout it came from (seconds).
    pub deadline: Option<(Instant, f64)>,
}

/// One input tensor of a request, decoded and checked against its own
/// shape; its bytes are in the request's [`InputOwners`].
pub struct Tensor<'a> {
    pub name: &'a str,
    pub dtype: DType,
    /// With the leading batch dimension.
    pub shape: &'a [u64],
    pub bytes: Source,
}

/// A shape, inline for the few dimensions tensors have.
type Dims = smallvec::SmallVec<[usize; 6]>;

/// A wire shape as the input rules measure it: a dimension past `usize`
/// becomes `usize::MAX`, which every bound refuses.
fn dims(shape: &[u64]) -> Dims {
    shape
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
        .collect()
}

/// Where a tensor's bytes are among its request's [`InputOwners`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A range of `shared[buffer]`.
    Shared { buffer: usize, range: Range<usize> },
    /// All of `decoded[buffer]`.
    Decoded(usize),
}

/// A tensor whose bytes are `range` of its request's body.
fn body_source(range: &Range<usize>) -> Source {
    Source::Shared {
        buffer: 0,
        range: range.clone(),
    }
}

/// What a request says besides its tensors.
#[derive(Debug, Default)]
pub struct RequestMeta {
    /// Seconds it may wait (`None`: no limit).
    pub timeout: Option<f64>,
    /// Priority level (1: most urgent; `None`: the model's default).
    pub priority: Option<u32>,
    /// Its parameters, a JSON object's text, handed to models that ask.
    pub parameters: Option<String>,
    /// Never looked up in nor kept in the response cache: it names a
    /// shared-memory region (its result is not its request's bytes alone).
    pub uncached: bool,
}

/// `parameters` (a JSON object's text) with the `forwarded` headers added as
/// string parameters (a parameter of the same name wins, as the request said it).
pub fn with_headers(
    parameters: Option<String>,
    forwarded: &[(String, String)],
) -> Result<Option<String>, Failure> {
    if forwarded.is_empty() {
        return Ok(parameters);
    }
    let mut object = match &parameters {
        None => serde_json::Map::new(),
        Some(text) => serde_json::from_str(text).map_err(|e| {
            Failure::new(
                400,
                format!("the request's parameters are not a JSON object: {e}"),
            )
        })?,
    };
    for (name, value) in forwarded {
        if !object.contains_key(name) {
            object.insert(name.clone(), serde_json::Value::String(value.clone()));
        }
    }
    Ok(Some(serde_json::Value::Object(object).to_string()))
}

impl ServedModel {
    /// `specs`: the model's inputs, in the order its batcher collates them.
    pub fn new(name: &str, specs: Vec<InputSpec>, replies: Arc<Replies>) -> ServedModel {
        ServedModel {
            name: Arc::from(name),
            specs,
            replies,
            headers: ThreadLocal::new(),
            ready: AtomicBool::new(true),
        }
    }

    /// See [`ServedModel::set_ready`].
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Whether its instances can run batches: its readiness (and the
    /// server's) says so.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn replies(&self) -> &Arc<Replies> {
        &self.replies
    }

    fn refuse(&self, outcome: Outcome, failure: Failure) -> Failure {
        self.replies.tally().count(outcome);
        failure
    }

    /// Decodes one HTTP infer request body and queues it: no copy of binary
    /// inputs (the body is kept until the request resolves), JSON inputs
    /// decoded once into buffers of their own.
    ///
    /// `forwarded`: request headers that join the request's parameters.
    pub fn submit(
        &self,
        body: Bytes,
        header_length: Option<&str>,
        forwarded: &[(String, String)],
    ) -> Result<Submitted, Failure> {
        self.refuse_decoupled("the HTTP endpoint")?;
        self.submit_planned(body, header_length, forwarded, |request, codec| {
            ResponsePlan::Encoded {
                id: request.id.clone(),
                outputs: request.selected_outputs(codec),
                regions: request.output_regions(),
                classes: request.output_classes(),
            }
        })
    }

    /// [`ServedModel::submit`] for any model, answered as `plan` says of
    /// the decoded request (a decoupled model's generate request streams).
    pub fn submit_planned(
        &self,
        body: Bytes,
        header_length: Option<&str>,
        forwarded: &[(String, String)],
        plan: impl FnOnce(&InferRequest, &Codec) -> ResponsePlan,
    ) -> Result<Submitted, Failure> {
        let codec = self.replies.codec();
        let mut refused_input = false;
        let mut check = |name: &str, dtype: DType, shape: &[u64]| {
            self.check_header(name, dtype, shape).map_err(|e| {
                refused_input = true;
                ferrobatch_core::v2::V2Error::Invalid(e.message)
            })
        };
        // Held until the request is queued: a remembered request is lent by the memo.
        let mut memo = self.headers.get_or_default().try_borrow_mut();
        let decoded = match memo.as_deref_mut() {
            Ok(memo) => codec.decode_remembered(memo, &body, header_length, &mut check),
            // Not reached (nothing here decodes twice at once): decode it afresh.
            Err(_) => codec
                .decode_checked(&body, header_length, &mut check)
                .map(Cow::Owned),
        };
        let mut request = decoded.map_err(|e| {
            let failure = Failure::new(e.status(), e.to_string());
            match refused_input {
                // Counted as match_inputs' refusals are.
                true => self.refuse(Outcome::InvalidInput, failure),
                false => failure,
            }
        })?;
        let plan = plan(&request, codec);
        if request
            .inputs
            .iter()
            .any(|i| matches!(i.data, Data::Owned(_)))
        {
            // Its decoded buffers move into the request's owners: a
            // remembered request's are copied (the memo keeps its own).
            request.to_mut();
        }
        let mut decoded = Vec::new();
        let sources: PerTensor<Source> = match &mut request {
            Cow::Owned(request) => request
                .inputs
                .iter_mut()
                .map(|input| match &mut input.data {
                    Data::Owned(buffer) => {
                        decoded.push(std::mem::take(buffer));
                        Source::Decoded(decoded.len() - 1)
                    }
                    Data::Body(range) => body_source(range),
                })
                .collect(),
            // Only ranges of the body (made owned above otherwise; a source
            // out of the owners would be refused, never misread).
            Cow::Borrowed(request) => request
                .inputs
                .iter()
                .map(|input| match &input.data {
                    Data::Body(range) => body_source(range),
                    Data::Owned(_) => Source::Decoded(usize::MAX),
                })
                .collect(),
        };
        let tensors: PerTensor<Tensor<'_>> = request
            .inputs
            .iter()
            .zip(sources)
            .map(|(input, bytes)| Tensor {
                name: &input.name,
                dtype: input.dtype,
                shape: &input.shape,
                bytes,
            })
            .collect();
        // Only a model that asks for parameters gets them: others copy nothing.
        let parameters = if self.replies.batcher().keeps_parameters() {
            let text = request
                .parameters
                .clone()
                .and_then(|span| body.get(span))
                .map(|text| String::from_utf8_lossy(text).into_owned());
            with_headers(text, forwarded)?
        } else {
            None
        };
        let owners = InputOwners {
            shared: smallvec::smallvec![body],
            decoded,
        };
        let meta = RequestMeta {
            timeout: request.timeout,
            priority: request.priority,
            parameters,
            uncached: request.shared_memory,
        };
        self.enqueue(&tensors, owners, meta, plan)
    }

    /// Checks one input's name, datatype and shape (with its rows) against
    /// the model's inputs, before its data is decoded: the failure names
    /// the input, what was expected and what was sent (not counted: the
    /// caller counts the refusal).
    pub fn check_header(&self, name: &str, dtype: DType, shape: &[u64]) -> Result<(), Failure> {
        self.rules()
            .check(name, dtype, &dims(shape))
            .map_err(|e| Failure::new(400, e.0))
    }

    /// The model's inputs as requests are checked against them: the same
    /// rules (and messages) as in process, every layout included.
    fn rules(&self) -> InputRules<'_> {
        let batcher = self.replies.batcher();
        InputRules {
            specs: &self.specs,
            layouts: batcher.layouts(),
            max_rows: batcher.rule().max_batch_size,
            max_elements: batcher.max_batch_elements(),
            batched: self.replies.codec().batching(),
        }
    }

    /// Whether the model streams its responses (decoupled).
    pub fn decoupled(&self) -> bool {
        self.replies.codec().decoupled()
    }

    /// Refuses a request that comes by `way` (a protocol that answers once)
    /// to a decoupled model, whose responses stream over gRPC
    /// `ModelStreamInfer` only (counted `invalid_input`).
    pub fn refuse_decoupled(&self, way: &str) -> Result<(), Failure> {
        if !self.replies.codec().decoupled() {
            return Ok(());
        }
        let message = format!(
            "model '{}' is decoupled (it streams its responses): {way} does not serve it; \
             use gRPC ModelStreamInfer or HTTP generate_stream",
            self.name
        );
        Err(self.refuse(Outcome::InvalidInput, Failure::new(400, message)))
    }

    /// Counts a request refused before it reached [`ServedModel::enqueue`]
    /// for its inputs ([`ServedModel::check_header`]).
    pub fn refuse_input(&self, failure: Failure) -> Failure {
        self.refuse(Outcome::InvalidInput, failure)
    }

    /// Queues a request whose tensors are decoded already (`tensors`, their
    /// bytes in `owners`, kept until it resolves): matched to the model's
    /// inputs (a mismatch is counted `invalid_input`), registered in the
    /// reply table to be answered as `plan` says, and queued with a deadline
    /// `meta.timeout` seconds from now (`None`: none), at `meta.priority`.
    /// Every protocol's requests come this way; a refusal is counted here, once.
    pub fn enqueue(
        &self,
        tensors: &[Tensor<'_>],
        owners: InputOwners,
        meta: RequestMeta,
        plan: ResponsePlan,
    ) -> Result<Submitted, Failure> {
        let RequestMeta {
            timeout,
            priority,
            parameters,
            uncached,
        } = meta;
        let batcher = self.replies.batcher();
        let timeout = timeout.or(batcher.default_timeout().map(|d| d.as_secs_f64()));
        let shapes: PerTensor<Dims> = tensors.iter().map(|t| dims(t.shape)).collect();
        let described: PerTensor<(&str, DType, &[usize])> = tensors
            .iter()
            .zip(&shapes)
            .map(|(t, shape)| (t.name, t.dtype, shape.as_slice()))
            .collect();
        let matched = self
            .rules()
            .match_tensors(&described)
            .map_err(|e| self.refuse(Outcome::InvalidInput, Failure::new(400, e.0)))?;
        let timeout = match timeout.map(|t| (timeout_from_secs(t), t)) {
            None => None,
            Some((Ok(deadline), t)) => deadline.map(|d| (d, t)),
            Some((Err(invalid), _)) => {
                let failure = Failure::new(400, invalid.to_string());
                return Err(self.refuse(Outcome::InvalidInput, failure));
            }
        };
        let mut owners = owners;
        let layouts = batcher.layouts();
        let mut views = Inputs::with_capacity(matched.order.len());
        for (spec_index, (&i, extents)) in matched.order.iter().zip(&matched.extents).enumerate() {
            let Some(i) = i else {
                // An optional input the request left out: zeros (or empty rows) in its place.
                let spec = &self.specs[spec_index];
                let layout = layouts.get(spec_index).unwrap_or(&Layout::Fixed);
                let Some((zeros, extents)) = spec.absent(layout, matched.rows) else {
                    let failure = Failure::new(400, spec.error("the input is too large").0);
                    return Err(self.refuse(Outcome::InvalidInput, failure));
                };
                owners.decoded.push(zeros);
                let bytes = owners.decoded.last().map_or(&[][..], Vec::as_slice);
                // SAFETY: as below: a `Vec`'s heap memory in `owners`, kept
                // until the request is resolved (pushing more buffers moves
                // the outer vector, never this one's bytes).
                let view = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
                views.push(view.with_extents(&extents).unwrap_or(view));
                continue;
            };
            let bytes = match tensors.get(i).map(|t| &t.bytes) {
                Some(Source::Shared { buffer, range }) => owners
                    .shared
                    .get(*buffer)
                    .and_then(|b| b.get(range.clone())),
                Some(Source::Decoded(buffer)) => owners.decoded.get(*buffer).map(Vec::as_slice),
                None => None,
            };
            // A source out of its owners is a bug of the caller; the batcher
            // refuses the empty view (its length is not the input's).
            let bytes = bytes.unwrap_or(&[]);
            // SAFETY: the bytes are a `Bytes` buffer's or a `Vec`'s heap
            // memory in `owners`, which moves (its buffers are not
            // reallocated or dropped) into the reply table below and stays
            // there until the request is resolved, as `InputBytes` requires;
            // if the request is refused, nothing reads the view.
            let view = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
            // Extents come from `measure`: at most MAX_VARIABLE_DIMS of them.
            views.push(view.with_extents(extents).unwrap_or(view));
        }
        let (tx, rx) = oneshot::channel();
        let mut registered = None;
        let submission = Submission {
            timeout: timeout.map(|(d, _)| d),
            priority,
            parameters: parameters.map(String::into_boxed_str),
            absent: matched.absent,
            requested_outputs: plan.requested_outputs(),
            blocking_caller: None,
            uncached,
        };
        let submitted = batcher.submit_request(SINK, matched.rows, views, submission, |request| {
            registered = Some(request.id);
            self.replies.register(request, plan, owners, tx);
        });
        match submitted {
            Ok(request) => Ok(Submitted {
                id: request.id,
                reply: rx,
                deadline: request
                    .deadline
                    .and_then(|at| timeout.map(|(_, t)| (at, t))),
            }),
            Err(err) => {
                if let Some(id) = registered {
                    self.replies.unregister(id);
                }
                let outcome = match err {
                    CoreError::QueueFull { .. } => Outcome::QueueFull,
                    CoreError::Closed => Outcome::ServerClosed,
                    CoreError::InvalidInput(_) | CoreError::InvalidConfig(_) => {
                        Outcome::InvalidInput
                    }
                };
                let status = Failure::status_of(outcome);
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
    /// (the client went away) cancels the request the same way, counted
    /// `cancelled` (`deadline_exceeded` within [`DEADLINE_SLACK`] of its
    /// deadline).
    pub async fn reply(&self, submitted: Submitted) -> Reply {
        let mut guard = Abandon {
            replies: &self.replies,
            id: submitted.id,
            deadline: submitted.deadline.map(|(at, _)| at),
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
                                    "request to model '{}' exceeded its {timeout:?}s timeout",
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
    deadline: Option<Instant>,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (to, outcome) = if gone_for_deadline(self.deadline, Instant::now()) {
            (RequestState::Expired, Outcome::DeadlineExceeded)
        } else {
            (RequestState::Cancelled, Outcome::Cancelled)
        };
        self.replies.abandon(self.id, to, outcome);
    }
}

/// Whether a client going away `now` went away for its `deadline`.
fn gone_for_deadline(deadline: Option<Instant>, now: Instant) -> bool {
    deadline.is_some_and(|at| {
        now.checked_add(DEADLINE_SLACK)
            .map_or(true, |late| late >= at)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_gone_near_its_deadline_is_counted_for_it() {
        let now = Instant::now();
        assert!(!gone_for_deadline(None, now));
        assert!(gone_for_deadline(Some(now), now));
        assert!(gone_for_deadline(Some(now + DEADLINE_SLACK), now));
        assert!(!gone_for_deadline(Some(now + DEADLINE_SLACK * 3), now));
    }
}
