//! One request: its input bytes, its size in rows, and its one-shot state.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

/// Where a request stands. It leaves `Queued` exactly once.
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

/// A borrowed view of one input's bytes: `rows * row_nbytes` contiguous bytes.
#[derive(Debug, Clone, Copy)]
pub struct InputBytes {
    ptr: *const u8,
    len: usize,
}

impl InputBytes {
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes for as long as the request
    /// holding this view can still be taken into a batch and collated, i.e.
    /// until the request is resolved (see [`Request`]).
    pub unsafe fn new(ptr: *const u8, len: usize) -> InputBytes {
        InputBytes { ptr, len }
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
    /// Which event loop (or other waiter group) to wake with the result.
    pub loop_id: u32,
    /// Number of rows this request carries (the leading dimension).
    pub rows: u32,
    pub enqueued_at: Instant,
    pub deadline: Option<Instant>,
    inputs: Box<[InputBytes]>,
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
        loop_id: u32,
        rows: u32,
        inputs: Box<[InputBytes]>,
        deadline: Option<Instant>,
    ) -> Request {
        Request {
            id,
            loop_id,
            rows,
            enqueued_at: Instant::now(),
            deadline,
            inputs,
            state: AtomicU8::new(RequestState::Queued as u8),
        }
    }

    pub fn inputs(&self) -> &[InputBytes] {
        &self.inputs
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

    /// True if the deadline has passed at `now`.
    pub fn is_past_deadline(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};

    fn request(id: u64) -> Request {
        Request::new(id, 0, 1, Box::new([]), None)
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

    /// Many threads race to take or withdraw the same requests: each request
    /// leaves `Queued` exactly once, and only its winner sees success.
    #[test]
    fn racing_transitions_resolve_each_request_exactly_once() {
        const N: usize = 20_000;
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
}
