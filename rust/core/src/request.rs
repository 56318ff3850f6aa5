//! One request: its input bytes, its size in rows, and its one-shot state.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::sync::AtomicU8;
use crate::Sink;

/// Where a request stands. It leaves `Queued` exactly once, by one atomic
/// compare-and-swap: whoever makes that move owns the request's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RequestState {
    /// Waiting to be taken into a batch.
    Queued = 0,
    /// Taken into a batch by a worker; its batch resolves it.
    Taken = 1,
    /// Withdrawn by its caller before it was taken; it is never run.
    Cancelled = 2,
    /// Its deadline passed before it was taken; it is never run.
    Expired = 3,
    /// The server shut down before it was taken; it is never run.
    Closed = 4,
}

impl RequestState {
    fn from_u8(v: u8) -> RequestState {
        match v {
            0 => RequestState::Queued,
            1 => RequestState::Taken,
            2 => RequestState::Cancelled,
            3 => RequestState::Expired,
            _ => RequestState::Closed,
        }
    }
}

/// What [`Request::withdraw`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Withdrawal {
    /// This call moved the request out of `Queued`: it is never run, and the
    /// caller counts it off the queue.
    Withdrew,
    /// It had left `Queued` for another withdrawn state already (a worker
    /// found it past its deadline, or another withdraw won): it is never run.
    AlreadyWithdrawn,
    /// A worker took it: its inputs stay alive until its batch resolves it.
    Taken,
}

/// A borrowed view of one input's bytes: `rows * row_nbytes` contiguous bytes.
#[derive(Debug, Clone, Copy)]
pub struct InputBytes {
    ptr: *const u8,
    len: usize,
    /// Positions per row along a variable-length first dimension (0 for
    /// other inputs); for an input padded along several variable
    /// dimensions ([`crate::Layout::Padded`]), each one's length, in order.
    extents: [usize; MAX_VARIABLE_DIMS],
}

/// The most variable-length (`-1`) dimensions one input may have.
pub const MAX_VARIABLE_DIMS: usize = 4;

impl InputBytes {
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes for as long as the request
    /// holding this view can still be taken into a batch and collated, i.e.
    /// until the request is resolved (see [`Request`]).
    pub unsafe fn new(ptr: *const u8, len: usize) -> InputBytes {
        InputBytes {
            ptr,
            len,
            extents: [0; MAX_VARIABLE_DIMS],
        }
    }

    /// The same view, its rows `extent` positions long (a variable-length
    /// input: `len` is `rows * extent` positions' bytes).
    pub fn with_extent(self, extent: usize) -> InputBytes {
        let mut extents = [0; MAX_VARIABLE_DIMS];
        extents[0] = extent;
        InputBytes { extents, ..self }
    }

    /// The same view, its rows as long as `extents` along their variable
    /// dimensions, in order; `None` for more than [`MAX_VARIABLE_DIMS`].
    pub fn with_extents(self, extents: &[usize]) -> Option<InputBytes> {
        let mut all = [0; MAX_VARIABLE_DIMS];
        all.get_mut(..extents.len())?.copy_from_slice(extents);
        Some(InputBytes {
            extents: all,
            ..self
        })
    }

    /// The length along the (first) variable dimension.
    pub fn extent(&self) -> usize {
        self.extents[0]
    }

    /// The lengths along every variable dimension (unused ones 0).
    pub fn extents(&self) -> &[usize; MAX_VARIABLE_DIMS] {
        &self.extents
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The viewed bytes.
    ///
    /// # Safety
    /// Only while the contract of [`InputBytes::new`] holds.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller upholds `new`'s contract: ptr is valid for len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A request's inputs, one view per input. Up to two are held in the
/// request itself, so the usual model's request costs no allocation of its
/// own for them.
#[derive(Debug, Default)]
pub struct Inputs(smallvec::SmallVec<[InputBytes; 2]>);

impl Inputs {
    pub fn with_capacity(n: usize) -> Inputs {
        Inputs(smallvec::SmallVec::with_capacity(n))
    }

    pub fn push(&mut self, input: InputBytes) {
        self.0.push(input);
    }

    pub fn as_slice(&self) -> &[InputBytes] {
        &self.0
    }
}

impl std::ops::Deref for Inputs {
    type Target = [InputBytes];

    fn deref(&self) -> &[InputBytes] {
        &self.0
    }
}

impl std::ops::DerefMut for Inputs {
    fn deref_mut(&mut self) -> &mut [InputBytes] {
        &mut self.0
    }
}

impl From<Vec<InputBytes>> for Inputs {
    fn from(inputs: Vec<InputBytes>) -> Inputs {
        Inputs(smallvec::SmallVec::from_vec(inputs))
    }
}

impl<const N: usize> From<[InputBytes; N]> for Inputs {
    fn from(inputs: [InputBytes; N]) -> Inputs {
        inputs.into_iter().collect()
    }
}

impl From<Box<[InputBytes]>> for Inputs {
    fn from(inputs: Box<[InputBytes]>) -> Inputs {
        Inputs::from(inputs.into_vec())
    }
}

impl FromIterator<InputBytes> for Inputs {
    fn from_iter<I: IntoIterator<Item = InputBytes>>(iter: I) -> Inputs {
        Inputs(iter.into_iter().collect())
    }
}

/// A request in flight.
///
/// The submitter keeps the memory behind `inputs` alive until the request is
/// resolved; the worker reads it only after winning [`Request::take`]. So the
/// submitter may free the inputs as soon as it wins any other transition, or
/// once the batch that took the request has been collated.
#[derive(Debug)]
pub struct Request {
    /// Unique within one batcher; names the request in fan-out routes.
    pub id: u64,
    /// Where the result goes (and so whom its batch wakes).
    pub sink: Sink,
    /// Number of rows this request carries (the leading dimension).
    pub rows: u32,
    pub enqueued_at: Instant,
    pub deadline: Option<Instant>,
    /// The queue lane it waits in: 0 is the most urgent priority level.
    pub lane: u8,
    /// The caller's request parameters, a JSON object's text, for models that
    /// ask for them; `None`: none given.
    pub parameters: Option<Box<str>>,
    /// Bit `i` set: the caller left out optional input `i`.
    pub absent: u64,
    /// Bit `i` set: the caller asked for output `i` (a v2 request's
    /// `outputs`); 0: it did not say.
    pub requested_outputs: u64,
    /// Its caller blocks until it is answered (see [`crate::callers`]).
    pub blocking: bool,
    /// Never looked up in nor kept in the response cache: its result is not
    /// its inputs' alone (a v2 request naming a shared-memory region).
    pub uncached: bool,
    inputs: Inputs,
    state: AtomicU8,
}

// SAFETY: the raw pointers in `inputs` are only dereferenced by the worker that
// won `take()`, while the submitter keeps the pointed-to memory alive (the
// contract above); all other fields are plain data or atomics.
unsafe impl Send for Request {}
// SAFETY: shared access only reads plain fields or goes through the atomic state.
unsafe impl Sync for Request {}

impl Request {
    pub fn new(
        id: u64,
        sink: Sink,
        rows: u32,
        inputs: impl Into<Inputs>,
        deadline: Option<Instant>,
    ) -> Request {
        Request {
            id,
            sink,
            rows,
            enqueued_at: Instant::now(),
            deadline,
            lane: 0,
            parameters: None,
            absent: 0,
            requested_outputs: 0,
            blocking: false,
            uncached: false,
            inputs: inputs.into(),
            state: AtomicU8::new(RequestState::Queued as u8),
        }
    }

    /// This request, waiting in queue lane `lane` (0: most urgent).
    pub fn in_lane(mut self, lane: u8) -> Request {
        self.lane = lane;
        self
    }

    /// This request, without the optional inputs of the bits of `absent`.
    pub fn with_absent(mut self, absent: u64) -> Request {
        self.absent = absent;
        self
    }

    /// This request, asking for the outputs of the bits of `outputs` (0: not said).
    pub fn with_requested_outputs(mut self, outputs: u64) -> Request {
        self.requested_outputs = outputs;
        self
    }

    /// This request, from a caller that blocks until it is answered.
    pub fn blocking(mut self, blocking: bool) -> Request {
        self.blocking = blocking;
        self
    }

    /// This request, never looked up in nor kept in the response cache.
    pub fn uncached(mut self, uncached: bool) -> Request {
        self.uncached = uncached;
        self
    }

    /// This request, carrying `parameters` (a JSON object's text).
    pub fn with_parameters(mut self, parameters: Option<Box<str>>) -> Request {
        self.parameters = parameters;
        self
    }

    pub fn inputs(&self) -> &[InputBytes] {
        self.inputs.as_slice()
    }

    pub fn state(&self) -> RequestState {
        RequestState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Moves `Queued -> to`; true if this call made the transition.
    pub(crate) fn transition(&self, to: RequestState) -> bool {
        self.state
            .compare_exchange(
                RequestState::Queued as u8,
                to as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// The worker's claim. True means this worker (alone) may read the inputs.
    /// [`crate::Batcher::next_batch`] makes it (and keeps the queue's count);
    /// it is public for collation benches and tests that act as a worker.
    pub fn take(&self) -> bool {
        self.transition(RequestState::Taken)
    }

    /// The submitter's side: withdraws the request (`to`: `Cancelled`,
    /// `Expired` or `Closed`) unless a worker took it first.
    ///
    /// # Panics
    /// In debug builds, if `to` is `Queued` or `Taken`.
    pub fn withdraw(&self, to: RequestState) -> Withdrawal {
        debug_assert!(!matches!(to, RequestState::Queued | RequestState::Taken));
        if self.transition(to) {
            return Withdrawal::Withdrew;
        }
        match self.state() {
            RequestState::Taken => Withdrawal::Taken,
            _ => Withdrawal::AlreadyWithdrawn,
        }
    }

    /// True if the deadline has passed at `now`.
    pub fn is_past_deadline(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
}

/// Request parameters as they reach a model: the text of one JSON object
/// whose values are bools, numbers or strings, as the v2 protocol has them.
/// Text that comes from another process (a shared-memory entry) or from a
/// caller as it is must pass this before it is queued: the model's side
/// reads it without a check.
pub fn check_parameters(text: &str) -> Result<(), String> {
    use serde_json::Value;
    let object: serde_json::Map<String, Value> =
        serde_json::from_str(text).map_err(|e| format!("parameters must be a JSON object: {e}"))?;
    for (name, value) in &object {
        match value {
            Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
            _ => {
                return Err(format!(
                    "parameter '{name}' must be a bool, number or string"
                ))
            }
        }
    }
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};

    fn request(id: u64) -> Request {
        Request::new(id, Sink::EventLoop(0), 1, Inputs::default(), None)
    }

    #[test]
    fn first_transition_wins() {
        let r = request(1);
        assert!(r.take());
        assert!(!r.take());
        assert!(!r.transition(RequestState::Cancelled));
        assert_eq!(r.state(), RequestState::Taken);

        let r = request(2);
        assert!(r.transition(RequestState::Expired));
        assert!(!r.take());
        assert!(!r.transition(RequestState::Cancelled));
        assert_eq!(r.state(), RequestState::Expired);
    }

    #[test]
    fn withdraw_says_whether_the_request_can_still_be_read() {
        let r = request(1);
        assert_eq!(r.withdraw(RequestState::Cancelled), Withdrawal::Withdrew);
        assert_eq!(
            r.withdraw(RequestState::Closed),
            Withdrawal::AlreadyWithdrawn
        );
        assert_eq!(r.state(), RequestState::Cancelled);
        let r = request(2);
        assert!(r.take());
        assert_eq!(r.withdraw(RequestState::Expired), Withdrawal::Taken);
        assert_eq!(r.state(), RequestState::Taken);
    }

    /// Many threads race to take or withdraw the same requests: each request
    /// leaves `Queued` exactly once, and only its winner sees success.
    #[test]
    fn racing_transitions_resolve_each_request_exactly_once() {
        // Miri runs every test far slower: a smaller race still interleaves.
        const N: usize = if cfg!(miri) { 200 } else { 20_000 };
        const THREADS: usize = 4;
        let requests: Arc<Vec<Request>> = Arc::new((0..N as u64).map(request).collect());
        let wins = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (requests, wins, barrier) = (requests.clone(), wins.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut mine = 0;
                    for r in requests.iter() {
                        let won = match t % 3 {
                            0 => r.take(),
                            1 => r.transition(RequestState::Cancelled),
                            _ => r.transition(RequestState::Expired),
                        };
                        mine += won as usize;
                    }
                    wins.fetch_add(mine, Ordering::Relaxed);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(wins.load(Ordering::Relaxed), N);
        assert!(requests.iter().all(|r| r.state() != RequestState::Queued));
    }
    #[test]
    fn parameters_are_one_json_object_of_scalars() {
        assert!(check_parameters(r#"{"a": 1, "b": 2.5, "c": "x", "d": true}"#).is_ok());
        assert!(check_parameters("{}").is_ok());
        for bad in [
            "{not json",
            "[1, 2]",
            "1",
            r#"{"a": [1]}"#,
            r#"{"a": {}}"#,
            r#"{"a": null}"#,
            "",
        ] {
            assert!(check_parameters(bad).is_err(), "{bad}");
        }
        assert!(check_parameters(r#"{"a": [1]}"#)
            .unwrap_err()
            .contains("parameter 'a'"));
    }
}

/// Loom models (`make loom`): every interleaving of a worker and a submitter.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicUsize;
    use loom::sync::Arc;
    use loom::thread;

    /// A request whose input stands in a loom cell: the worker reads it only
    /// if it took the request, the submitter frees it (writes) only once the
    /// request can no longer be read; loom fails the model if the two race.
    struct Shared {
        request: Request,
        input: UnsafeCell<u32>,
        /// The queue's count of live requests (`RequestQueue::left` is
        /// called once by whoever moved the request out of `Queued`).
        waiting: AtomicUsize,
        /// Worker sides that won (took or expired the request).
        worker_won: AtomicUsize,
    }

    // SAFETY: `input` is accessed by the side that owns it per the
    // request's state (what the model checks).
    unsafe impl Sync for Shared {}

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            request: Request::new(1, Sink::EventLoop(0), 1, Inputs::default(), None),
            input: UnsafeCell::new(7),
            waiting: AtomicUsize::new(1),
            worker_won: AtomicUsize::new(0),
        })
    }

    /// The worker's `admit`: expire a request past its deadline, else take it.
    fn worker(s: &Shared, past_deadline: bool) {
        if past_deadline {
            if s.request.transition(RequestState::Expired) {
                s.waiting.fetch_sub(1, Ordering::AcqRel);
                s.worker_won.fetch_add(1, Ordering::AcqRel);
            }
        } else if s.request.take() {
            s.waiting.fetch_sub(1, Ordering::AcqRel);
            s.worker_won.fetch_add(1, Ordering::AcqRel);
            // SAFETY: taken by this thread: the submitter frees it only after
            // the batch resolved it (the join below).
            assert_eq!(s.input.with(|p| unsafe { *p }), 7);
        }
    }

    /// The submitter withdraws (a cancel, its own deadline timer, or the
    /// shutdown) and frees the input once the answer says it is never read.
    fn submitter(s: &Shared, to: RequestState) -> Withdrawal {
        let outcome = s.request.withdraw(to);
        match outcome {
            Withdrawal::Withdrew => {
                s.waiting.fetch_sub(1, Ordering::AcqRel);
            }
            Withdrawal::AlreadyWithdrawn => {}
            Withdrawal::Taken => return outcome,
        }
        // SAFETY: not taken, so no worker reads it from now on.
        s.input.with_mut(|p| unsafe { *p = 0 });
        outcome
    }

    fn race(past_deadline: bool, to: RequestState) {
        loom::model(move || {
            let s = shared();
            let w = {
                let s = s.clone();
                thread::spawn(move || worker(&s, past_deadline))
            };
            let outcome = submitter(&s, to);
            w.join().unwrap();
            let state = s.request.state();
            let worker_won = s.worker_won.load(Ordering::Acquire);
            assert_ne!(state, RequestState::Queued);
            assert_eq!(
                worker_won + (outcome == Withdrawal::Withdrew) as usize,
                1,
                "one winner"
            );
            assert_eq!(outcome == Withdrawal::Taken, state == RequestState::Taken);
            if outcome == Withdrawal::Withdrew {
                assert_eq!(state, to);
            }
            assert_eq!(s.waiting.load(Ordering::Acquire), 0, "counted off once");
        });
    }

    #[test]
    fn loom_take_races_cancel_exactly_once() {
        race(false, RequestState::Cancelled);
    }

    #[test]
    fn loom_take_races_close_exactly_once() {
        race(false, RequestState::Closed);
    }

    #[test]
    fn loom_worker_expiry_races_the_submitters_timer_exactly_once() {
        race(true, RequestState::Expired);
    }

    #[test]
    fn loom_worker_expiry_races_cancel_exactly_once() {
        race(true, RequestState::Cancelled);
    }
}
