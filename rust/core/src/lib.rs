//! The hot path of ferrobatch, in plain Rust (no Python).
//!
//! Many callers submit one request each; worker threads take them in batches,
//! copy their bytes into a staging slot, run the model (outside this crate) and
//! route each row of the output back to the request it belongs to.
//!
//! # Threading and ownership contract
//!
//! * **Submitters** (event-loop threads, any number) call [`Batcher::submit`].
//!   It validates byte lengths, applies admission control and pushes an
//!   `Arc<Request>` on a bounded lock-free queue. The request holds raw
//!   pointers to the caller's input bytes; the *submitter* keeps the objects
//!   behind those pointers alive until the request is resolved (see
//!   [`Request`]). Nothing else crosses threads.
//! * **Workers** (one thread per model instance) call [`Batcher::next_batch`].
//!   One worker gathers at a time (the gather lock), sleeping on the queue's
//!   doorbell until enough rows for its next dispatch decision have arrived
//!   or its deadline passes, so a submit wakes it at most once per batch.
//!   With [`Readiness::OnFlush`] (greedy batching) a submitter's rows count
//!   only once it calls [`Batcher::flush`]; an event loop does so once per
//!   iteration, so a burst of requests is taken as one batch.
//!   A worker owns the staging slot it acquired from the [`StagingRing`] until
//!   it calls [`Batcher::release_slot`]. It reads a request's input bytes only
//!   after it won the `Queued -> Taken` transition for that request, and only
//!   during collation, before `next_batch` returns.
//! * **Request state** moves once, atomically, from `Queued` to exactly one of
//!   `Taken`, `Cancelled`, `Expired` or `Closed` ([`RequestState`]). Whoever wins
//!   that transition owns the request's outcome: a taken request is resolved
//!   by its batch; any other by the submitter side.
//! * **Staging slots** are written only by the worker holding them. A slot
//!   index is either in the free list or held by exactly one worker, so a
//!   slot marked in flight is never rewritten (see [`staging`]).
//!
//! The dispatch rule ([`DispatchRule`]) is a pure function of the batch being
//! gathered, so it is tested without threads or clocks.

mod batcher;
pub mod dispatch;
pub mod dtype;
pub mod error;
pub mod fanout;
pub mod queue;
pub mod request;
pub mod staging;
pub mod v2;

pub use batcher::{Batch, Batcher, BatcherConfig, Stats, Worker};
pub use dispatch::{Decision, DispatchRule};
pub use dtype::DType;
pub use error::CoreError;
pub use fanout::{Route, Routes};
pub use queue::{Message, Readiness, RequestQueue};
pub use request::{InputBytes, Request, RequestState};
pub use staging::{SlotBuffer, StagingRing};
