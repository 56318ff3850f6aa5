//! A decoupled model's request as its stream reads it: each response, in
//! the order the worker sent it, then how the request ended. One reader for
//! every way a stream is answered (HTTP `generate_stream` and `generate`,
//! gRPC `ModelStreamInfer`).
//!
//! The worker sends a response's rows on the request's channel, and its end
//! (the reply) after the last of them; a batch that ends makes both ready at
//! once, so [`Streamed::poll_next`] hands over every response sent before the
//! end first. A response's bytes stay counted in its stream's
//! [`Backlog`](crate::replies::Backlog): the caller releases them when its
//! transport takes them (the HTTP body at the event, tonic at the message).
//!
//! Dropping a `Streamed` before its end drops the wait for its reply, which
//! cancels the request ([`ServedModel::reply`]): its batch stops sending it
//! responses.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ferrobatch_core::{Outcome, RequestState};
use tokio::sync::mpsc;

use crate::model::{ServedModel, Submitted};
use crate::replies::{failed_outcome, Failure, RawOutput, Reply};

/// The reply of a streamed request: its end (`Ok`), or why it failed.
type Ending = Pin<Box<dyn Future<Output = Reply> + Send>>;

/// One decoupled request's responses, in order, then how it ended.
pub(crate) struct Streamed {
    /// The request's number in the reply table.
    request: u64,
    model: Arc<ServedModel>,
    parts: mpsc::UnboundedReceiver<Vec<RawOutput>>,
    end: End,
}

/// Where a streamed request's reply (the end of its stream) stands.
enum End {
    /// Awaited; dropping it cancels the request.
    Awaited(Ending),
    /// Come, told after the responses sent before it.
    Came(Result<(), Failure>),
    /// Told: `true` if it was a success.
    Told(bool),
}

impl Streamed {
    /// The request `submitted` to `model`, whose responses come on `parts`
    /// (the channel of its [`ResponsePlan::Stream`](crate::replies::ResponsePlan)).
    pub(crate) fn new(
        model: Arc<ServedModel>,
        submitted: Submitted,
        parts: mpsc::UnboundedReceiver<Vec<RawOutput>>,
    ) -> Self {
        let request = submitted.id;
        let end = End::Awaited(Box::pin({
            let model = model.clone();
            async move { model.reply(submitted).await }
        }));
        Streamed {
            request,
            model,
            parts,
            end,
        }
    }

    pub(crate) fn model(&self) -> &Arc<ServedModel> {
        &self.model
    }

    /// The next response, or the failure that ended the stream; None at its
    /// end (a success), and ever after the end was told.
    pub(crate) async fn next(&mut self) -> Option<Result<Vec<RawOutput>, Failure>> {
        poll_fn(|cx| self.poll_next(cx)).await
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Vec<RawOutput>, Failure>>> {
        if let End::Awaited(reply) = &mut self.end {
            // A response the worker sent before it ended the stream comes first.
            if let Poll::Ready(Some(part)) = self.parts.poll_recv(cx) {
                return Poll::Ready(Some(Ok(part)));
            }
            let came = std::task::ready!(reply.as_mut().poll(cx));
            self.end = End::Came(came.map(|_| ()));
        }
        if let Ok(part) = self.parts.try_recv() {
            return Poll::Ready(Some(Ok(part)));
        }
        Poll::Ready(match std::mem::replace(&mut self.end, End::Told(false)) {
            End::Came(Err(failure)) => Some(Err(failure)),
            End::Came(Ok(())) => {
                self.end = End::Told(true);
                None
            }
            told => {
                self.end = told;
                None
            }
        })
    }

    /// Ends the request with `failure` where its stream refuses what came
    /// (a second answer to `generate`, a response that cannot be encoded),
    /// counted once as its caller sees it ([`failed_outcome`]): withdrawn
    /// from its batch if it is still running, recounted if it had ended as a
    /// success.
    pub(crate) async fn refuse(&mut self, failure: &Failure) {
        let outcome = failed_outcome(failure);
        let replies = self.model.replies();
        let succeeded = match std::mem::replace(&mut self.end, End::Told(false)) {
            End::Came(came) => came.is_ok(),
            End::Told(succeeded) => succeeded,
            // Answered here, unless its reply was sent meanwhile: then
            // counted as it ended, and recounted.
            End::Awaited(reply) => {
                !replies.abandon(self.request, RequestState::Cancelled, outcome)
                    && reply.await.is_ok()
            }
        };
        if succeeded {
            replies.tally().recount(Outcome::Succeeded, outcome);
        }
    }
}
