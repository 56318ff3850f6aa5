//! Triton's generate extension on the native front-end: `POST
//! .../generate` and `.../generate_stream`, for every model.
//!
//! A generate request is translated into the v2 JSON inference request it
//! stands for ([`generate::infer_request`]) and submitted as any other, so
//! every rule, limit and count of inference applies. Its answer is written
//! from the rows of its outputs, flat, in one pass
//! ([`Codec::encode_generate`](ferrobatch_core::v2::Codec::encode_generate)):
//! a model of one response per request answers with its rows (a
//! [`ResponsePlan::Raw`]); a decoupled model's responses come as a gRPC
//! stream's do (a [`ResponsePlan::Stream`]: raw rows per response, bounded
//! by the stream's backlog), each written as it comes:
//!
//! - `generate_stream` sends one Server-Sent Event per response. Its head
//!   waits for the first one (or the end), so a failure before it is a JSON
//!   error with its status; a failure after it ends the stream with an
//!   `{"error": ...}` event.
//! - `generate` takes exactly one response; none, or a second, is Triton's
//!   400 ([`generate::ONE_RESPONSE`]), counted `invalid_input` (the request
//!   is withdrawn at its second response).
//!
//! A client that leaves drops the body, and with it the request's reply:
//! the request is cancelled (counted so) and its batch stops sending it
//! responses.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use ferrobatch_core::v2::generate::{self, GenerateInput};
use ferrobatch_core::v2::{Codec, InferRequest, Output, V2Error};
use ferrobatch_core::{Outcome, PerTensor};
use hyper::Response;
use tokio::sync::mpsc;

use super::{error, response, Body, JSON};
use crate::model::ServedModel;
use crate::replies::{failed_outcome, Answer, Backlog, Failure, RawOutput, ResponsePlan};
use crate::server::Shared;
use crate::streamed::Streamed;

/// Answers a generate request (`body`, read and inflated) to `model`
/// (`stream`: `generate_stream`).
pub(super) async fn generate(
    shared: &Shared,
    model: &Arc<ServedModel>,
    stream: bool,
    body: &[u8],
    forwarded: &[(String, String)],
) -> Response<Body> {
    let request = shared.with_catalogued(&model.name, |metadata| {
        let inputs: Vec<GenerateInput<'_>> = metadata
            .inputs
            .iter()
            .map(|t| GenerateInput {
                name: &t.name,
                datatype: &t.datatype,
                shape: &t.shape,
            })
            .collect();
        generate::infer_request(body, &inputs)
    });
    let request = match request {
        Some(Ok(request)) => Bytes::from(request),
        Some(Err(e)) => return failed(&e),
        None => return error(&Failure::new(500, "the model's metadata is not known")),
    };
    if model.decoupled() {
        return streamed(shared, model, stream, request, forwarded).await;
    }
    // Answered with the rows of the outputs it selects, written here as the
    // flat answer in one pass.
    let mut id = None;
    let submitted = model.submit_planned(request, None, forwarded, |request, codec| {
        id.clone_from(&request.id);
        ResponsePlan::Raw {
            outputs: answered_outputs(request, codec),
            regions: Vec::new(), // a generate request names no region, nor classes
            classes: Vec::new(),
        }
    });
    let answered = match submitted {
        Ok(submitted) => model.reply(submitted).await,
        Err(failure) => return error(&failure),
    };
    let outputs = match answered {
        Ok(Answer::Raw(outputs)) => outputs,
        Ok(_) => {
            return error(&Failure::new(
                500,
                "a generate request answered as another kind",
            ))
        }
        Err(failure) => return error(&failure),
    };
    match flat_answer(model, id.as_deref(), &outputs) {
        Ok(answer) if stream => response(200, generate::EVENT_STREAM, generate::event(&answer)),
        Ok(answer) => response(200, JSON, answer),
        Err(failure) => {
            // Counted a success by its worker: recounted as its caller sees it.
            model
                .replies()
                .tally()
                .recount(Outcome::Succeeded, failed_outcome(&failure));
            error(&failure)
        }
    }
}

/// The indices of the outputs a generate request is answered with: every
/// one (the v2 request it stands for names none).
fn answered_outputs<T: FromIterator<usize>>(request: &InferRequest, codec: &Codec) -> T {
    request
        .selected_outputs(codec)
        .iter()
        .map(|&(index, _)| index)
        .collect()
}

/// One response's `outputs` as the generate answer's flat JSON object,
/// echoing the request's `id`.
fn flat_answer(
    model: &ServedModel,
    id: Option<&str>,
    outputs: &[RawOutput],
) -> Result<Vec<u8>, Failure> {
    let outputs: PerTensor<Output<'_>> = outputs
        .iter()
        .map(|o| Output {
            index: o.index,
            shape: &o.shape,
            data: &o.data,
            binary: false,
            classified: o.classified,
        })
        .collect();
    model
        .replies()
        .codec()
        .encode_generate(id, &outputs)
        .map_err(|e| Failure::new(e.status(), e.to_string()))
}

fn failed(e: &V2Error) -> Response<Body> {
    error(&Failure::new(e.status(), e.to_string()))
}

/// A decoupled model's generate request (`request`: the v2 JSON it stands for).
async fn streamed(
    shared: &Shared,
    model: &Arc<ServedModel>,
    stream: bool,
    request: Bytes,
    forwarded: &[(String, String)],
) -> Response<Body> {
    let (partial, parts) = mpsc::unbounded_channel();
    let backlog = Backlog::new(shared.config.max_stream_backlog);
    let mut id = None;
    let submitted = model.submit_planned(request, None, forwarded, |request, codec| {
        id.clone_from(&request.id);
        ResponsePlan::Stream {
            outputs: answered_outputs(request, codec),
            regions: None, // a generate request names no region, nor classes
            classes: None,
            partial,
            backlog: backlog.clone(),
        }
    });
    let submitted = match submitted {
        Ok(submitted) => submitted,
        Err(failure) => return error(&failure),
    };
    let mut responses = Responses {
        streamed: Streamed::new(model.clone(), submitted, parts),
        id,
        backlog,
    };
    let first = match responses.next().await {
        None if stream => return response(200, generate::EVENT_STREAM, Bytes::new()),
        None => {
            return responses
                .refused(Failure::new(400, generate::ONE_RESPONSE))
                .await
        }
        Some(Err(failure)) => return error(&failure),
        Some(Ok(part)) => part,
    };
    let first = match responses.flattened(&first) {
        Ok(answer) => answer,
        Err(failure) => return responses.refused(failure).await,
    };
    if stream {
        let events = Events {
            first: Some(Bytes::from(generate::event(&first))),
            next: None,
            responses: Some(responses),
        };
        let mut answer = response(200, generate::EVENT_STREAM, Bytes::new());
        *answer.body_mut() = Body::Events(events);
        return answer;
    }
    match responses.next().await {
        None => response(200, JSON, first),
        Some(Ok(_)) => {
            responses
                .refused(Failure::new(400, generate::ONE_RESPONSE))
                .await
        }
        Some(Err(failure)) => error(&failure),
    }
}

/// One decoupled request's responses, each leaving the stream's backlog
/// as it is read, and the generate request's `id`, which each answer echoes.
struct Responses {
    streamed: Streamed,
    id: Option<String>,
    backlog: Arc<Backlog>,
}

impl Responses {
    /// The next response (its bytes leave the backlog), or the failure
    /// that ended the stream; None at its end.
    async fn next(&mut self) -> Option<Result<Vec<RawOutput>, Failure>> {
        let next = self.streamed.next().await;
        if let Some(Ok(part)) = &next {
            self.backlog.release(crate::replies::part_bytes(part));
        }
        next
    }

    /// One response as the generate answer's flat JSON object.
    fn flattened(&self, part: &[RawOutput]) -> Result<Vec<u8>, Failure> {
        flat_answer(self.streamed.model(), self.id.as_deref(), part)
    }

    /// [`Streamed::refuse`], answered as the JSON error.
    async fn refused(&mut self, failure: Failure) -> Response<Body> {
        self.streamed.refuse(&failure).await;
        error(&failure)
    }
}

/// The next event of a stream, and the responses still to come (None: it
/// ended). Owning them, it can be dropped at any await (its client left).
type NextEvent = Pin<Box<dyn Future<Output = (Option<Bytes>, Option<Responses>)> + Send>>;

/// A `generate_stream` body: each response of a decoupled model as an
/// event, fetched when the connection asks for more.
pub(crate) struct Events {
    first: Option<Bytes>,
    next: Option<NextEvent>,
    responses: Option<Responses>,
}

impl Events {
    pub(super) fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(first));
        }
        if self.next.is_none() {
            let Some(responses) = self.responses.take() else {
                return Poll::Ready(None);
            };
            self.next = Some(Box::pin(next_event(responses)));
        }
        let Some(next) = &mut self.next else {
            return Poll::Ready(None);
        };
        let (event, rest) = std::task::ready!(next.as_mut().poll(cx));
        self.next = None;
        self.responses = rest;
        Poll::Ready(event)
    }

    pub(super) fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.next.is_none() && self.responses.is_none()
    }
}

async fn next_event(mut responses: Responses) -> (Option<Bytes>, Option<Responses>) {
    match responses.next().await {
        None => (None, None),
        Some(Ok(part)) => match responses.flattened(&part) {
            Ok(answer) => (Some(Bytes::from(generate::event(&answer))), Some(responses)),
            Err(failure) => {
                responses.streamed.refuse(&failure).await;
                (
                    Some(Bytes::from(generate::error_event(&failure.message))),
                    None,
                )
            }
        },
        Some(Err(failure)) => (
            Some(Bytes::from(generate::error_event(&failure.message))),
            None,
        ),
    }
}
