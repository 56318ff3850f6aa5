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
//!   One worker gathers at a time (it holds the gatherer's role), sleeping
//!   on the queue's doorbell until enough rows for its next dispatch
//!   decision have arrived or its deadline passes, so a submit wakes it at
//!   most once per batch; the others wait for the role, woken only when
//!   there is something to gather (the `doorbell` module).
//!   With [`Readiness::OnFlush`] (greedy batching) an event loop holds the
//!   requests it submits in one iteration ([`Batcher::submit_held`] into
//!   its [`Unflushed`]) and sends them together at the iteration's end, so
//!   a burst of requests is taken as one batch; what one submitter holds
//!   never stands in front of another's.
//!   `next_batch` acquires a staging slot from the [`StagingRing`] as a
//!   [`HeldSlot`] guard and returns it inside the [`Batch`]: whoever owns the
//!   batch (or its `slot`) owns the slot, and dropping the guard is the only
//!   way to give it back (there is no release by index). A worker reads a
//!   request's input bytes only after it won the `Queued -> Taken` transition
//!   for that request, and only during collation, before `next_batch` returns.
//! * **Request state** moves once, atomically, from `Queued` to exactly one of
//!   `Taken`, `Cancelled`, `Expired` or `Closed` ([`RequestState`]). Whoever wins
//!   that transition owns the request's outcome: a taken request is resolved
//!   by its batch; any other by the submitter side. A worker takes the
//!   requests of a batch as it releases it, not as it gathers them, so one
//!   withdrawn while its batch fills never runs.
//! * **Staging slots** are written only through their guard
//!   ([`HeldSlot::collate`], `unsafe`: the caller vouches it took the
//!   requests). A slot index is either in the ring's free list or owned by
//!   exactly one live guard; guards are not `Clone`, so a slot is never
//!   released twice nor handed out while a guard for it lives. A guard is
//!   `Send`: the CUDA path collates on one thread and drops the guard on
//!   another, only once the slot's host-to-device copy has completed, so a
//!   slot in flight is never rewritten (see [`staging`]).
//! * **Inputs of varying size** ([`Layout`]): a variable-length input's
//!   request carries its rows' length ([`InputBytes::extent`]); a BYTES
//!   input its elements serialized as Triton does ([`bytes`]). `submit`
//!   checks both against their bytes, and against `max_batch_elements` and
//!   [`bytes::BytesLimits`], before a request is queued; the gather admits a
//!   request only while the batch stays within `max_batch_elements` (a
//!   padded input counted padded), so collation never passes the slot, which
//!   holds that many elements (a request that does not fit leads the next
//!   batch). An input padded along several variable dimensions
//!   ([`Layout::Padded`]) carries each one's length
//!   ([`InputBytes::extents`]) and is counted padded, its box at the
//!   batch's longest along each. BYTES are collated into memory the [`Batch`] owns
//!   ([`Collated::Bytes`]; with a variable-length dimension,
//!   [`Collated::RaggedBytes`], each row's length beside), not into the
//!   slot, and count against `max_batch_elements` as variable-length inputs
//!   do.
//! * **The queue** ([`RequestQueue`]) takes pushes from any thread; a refused
//!   push hands the request back ([`queue::PushError`]).
//! * **Fan-out**: each request names its [`Sink`] (an event loop's mailbox,
//!   a native connection, a shared-memory client). A batch's [`Routes`] group
//!   its rows by sink in one pass; each sink's owner (outside this crate)
//!   delivers its group with one wake-up per batch.
//! * **Response cache** ([`cache`]): a batcher with one looks each taken
//!   request up by a digest of its inputs as its batch is released; a hit
//!   leaves the batch, never collated nor run, and the worker's owner
//!   answers it with the kept result ([`Worker::take_cached`]). While every
//!   worker runs a slow batch ([`HIT_WAIT_FOR_BUSY`]), requests are looked
//!   up as they are submitted, and hits go to [`Batcher::wait_found`].
//! * **Pending requests**: a way in registers each request in a
//!   [`Pending`] table before queueing it; the table owns who answers it
//!   (exactly once: its batch, its caller giving up, or the stop), the
//!   count of what its caller saw, and when its inputs may go (only once
//!   no batch can read them). Ways in supply only how an answer is handed
//!   over.
//!
//! # Checked
//!
//! The unsafe code (staging ring, queue, request state) runs under Miri
//! (`make miri`: `cargo +nightly miri test` with smaller iteration counts
//! under `cfg(miri)`), and the request state transitions, the pending
//! table's, the ring's acquire/release and the doorbell's hand-over of the
//! gatherer's role have loom models (`make loom`: the `loom_` tests, built
//! with `--cfg loom`, which swaps in loom's mutex, condvar and atomics).
//!
//! The dispatch rule ([`DispatchRule`]) is a pure function of the batch being
//! gathered, so it is tested without threads or clocks.

mod batcher;
pub mod bytes;
pub mod cache;
pub mod callers;
pub mod dispatch;
mod doorbell;
pub mod dtype;
pub mod error;
pub mod fanout;
pub mod inbox;
pub mod outcome;
pub mod pending;
pub mod queue;
#[cfg(all(test, not(loom)))]
mod ragged_props;
pub mod request;
pub mod shm;
pub mod specs;
pub mod staging;
mod sync;
pub mod timeout;
pub mod unflushed;
pub mod v2;

pub use batcher::{
    Batch, Batcher, BatcherConfig, FoundInCache, Stats, Submission, Worker, HIT_WAIT_FOR_BUSY,
    MAX_QUEUE_SIZE,
};
pub use cache::{
    CacheCounts, CacheKey, CachedValue, Inserted, KeyRules, ResponseCache, SharedCache,
};
pub use callers::BlockingCallers;
pub use dispatch::{Decision, DispatchReason, DispatchRule};
pub use dtype::DType;
pub use error::CoreError;
pub use fanout::{Route, Routes, Sink};
pub use inbox::Inbox;
pub use outcome::{Outcome, Tally, Totals, OUTCOMES, REQUEST_BOUNDS_US, REQUEST_BUCKETS};
pub use pending::{Pending, Taken, Withdraw};
pub use queue::{Message, Priorities, PushError, RequestQueue};
pub use request::{InputBytes, Inputs, Request, RequestState, Withdrawal, MAX_VARIABLE_DIMS};
pub use specs::{
    Extents, InputRules, InputSpec, Matched, Measured, PerTensor, SpecError, MAX_OPTIONAL_INPUTS,
};
pub use staging::{
    Collated, HeldSlot, Layout, Padded, Ragged, RaggedBytes, SlotBuffer, StagingRing,
};
pub use timeout::{timeout_from_secs, InvalidTimeout};
pub use unflushed::{Readiness, Unflushed};
