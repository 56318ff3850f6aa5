//! `Unflushed`: the requests one submitter queued on a greedy batcher
//! ([`Readiness::OnFlush`]) since its last flush, held back from the workers.
//!
//! An event loop submits a burst of requests in one iteration; workers must
//! see the burst as one batch, not take its first request alone. So the
//! first submit of an iteration opens a flush ([`Unflushed::open`] returns
//! true: the caller schedules one flush at the end of the iteration), every
//! submit is admitted by the queue and held here ([`Batcher::submit_held`]),
//! and the flush sends them all at once ([`Unflushed::flush`]). One flush
//! per iteration, however many submits.
//!
//! Held requests are the holder's alone: they are not in the queue's
//! channel, so a submitter that never flushes (a loop stopped in the
//! iteration it submitted) holds up no other submitter's requests. A
//! holder registers with its batcher, which flushes it when it closes, so
//! held requests go out before the workers' close messages; a holder
//! dropped unflushed flushes itself.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::queue::Admitted;
use crate::{Batcher, CoreError, Request};

/// When submitted requests may be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// At once.
    OnPush,
    /// Requests submitted through an [`Unflushed`] at its flush; any other
    /// at once.
    OnFlush,
}

/// Requests held for one batcher since the last flush; see the module docs.
#[derive(Debug, Default)]
pub struct Unflushed {
    held: Arc<Held>,
}

#[derive(Debug, Default)]
pub(crate) struct Held {
    state: Mutex<HeldState>,
}

#[derive(Debug, Default)]
struct HeldState {
    /// The batcher this holder registered with (it flushes the holder as it closes).
    registered: Weak<Batcher>,
    /// Some while a flush is due: the batcher and the requests held for it.
    due: Option<(Arc<Batcher>, Vec<Admitted>)>,
}

impl Held {
    fn lock(&self) -> MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends every request held since the last flush to the workers.
    /// Sent under the lock: a closing batcher that finds nothing held here
    /// knows it is all in the channel, ahead of its close messages.
    pub(crate) fn flush(&self) {
        let mut state = self.lock();
        if let Some((batcher, held)) = state.due.take() {
            batcher.send_held(held);
        }
    }

    /// The batcher's part of [`Batcher::submit_held`]: `request` is held
    /// when a flush is due for `batcher`, else `None` (queue it at once).
    pub(crate) fn hold(
        &self,
        batcher: &Batcher,
        request: &Arc<Request>,
        register: impl FnOnce(&Arc<Request>),
    ) -> Option<Result<(), CoreError>> {
        let mut state = self.lock();
        let (for_batcher, held) = state.due.as_mut()?;
        if !std::ptr::eq(Arc::as_ptr(for_batcher), batcher) {
            return None;
        }
        // Admitted under the lock: a closing batcher flushes this holder
        // after refusing new requests, so a request is either refused or
        // held in time to be flushed before the close messages.
        register(request);
        Some(
            batcher
                .admit_held(request.clone())
                .map(|admitted| held.push(admitted)),
        )
    }
}

impl Unflushed {
    /// Before submitting to `batcher`: true when a flush must be scheduled
    /// (the first submit since the last flush, to a batcher that waits for
    /// flushes). A submitter submits to one batcher at a time.
    pub fn open(&self, batcher: &Arc<Batcher>) -> bool {
        if batcher.readiness() != Readiness::OnFlush {
            return false;
        }
        let mut state = self.held.lock();
        if state.due.is_some() {
            return false;
        }
        if !std::ptr::eq(state.registered.as_ptr(), Arc::as_ptr(batcher)) {
            batcher.register_holder(Arc::downgrade(&self.held));
            state.registered = Arc::downgrade(batcher);
        }
        state.due = Some((batcher.clone(), Vec::new()));
        true
    }

    /// Sends every request held since the last flush to the workers.
    pub fn flush(&self) {
        self.held.flush();
    }

    pub(crate) fn held(&self) -> &Held {
        &self.held
    }
}

impl Drop for Unflushed {
    /// Nothing stays held for ever: a request whose caller is gone was
    /// withdrawn, and a worker skips it.
    fn drop(&mut self) {
        self.held.flush();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::{BatcherConfig, DispatchRule, InputBytes, Sink, SlotBuffer, Worker};

    const ROW: usize = 4;
    static BYTES: [u8; ROW] = [1, 2, 3, 4];

    fn greedy_batcher(workers: usize, store: &mut [Vec<u8>]) -> Arc<Batcher> {
        let slots = store
            .iter_mut()
            // SAFETY: `store` outlives the batcher (the tests drop it last).
            .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
            .collect();
        let config = BatcherConfig {
            rule: DispatchRule::new(8, Duration::ZERO, 1, vec![]).unwrap(),
            row_nbytes: vec![ROW],
            max_queue_size: 16,
            workers,
            readiness: Readiness::OnFlush,
            layouts: Vec::new(),
            max_batch_elements: None,
            bytes_limits: Default::default(),
            priorities: crate::Priorities::NONE,
            default_priority: None,
        };
        Arc::new(Batcher::new(config, slots).unwrap())
    }

    fn submit(batcher: &Batcher, holder: &Unflushed) -> Arc<Request> {
        // SAFETY: static bytes outlive the batcher.
        let input = unsafe { InputBytes::new(BYTES.as_ptr(), ROW) };
        let submission = crate::Submission::default();
        batcher
            .submit_held(holder, Sink::EventLoop(0), 1, [input], submission, |_| ())
            .unwrap()
    }

    fn next_batch_on_a_thread(batcher: &Arc<Batcher>) -> mpsc::Receiver<Option<Vec<u64>>> {
        let (tx, rx) = mpsc::channel();
        let batcher = batcher.clone();
        std::thread::spawn(move || {
            let batch = batcher.next_batch(&mut Worker::new());
            let _ = tx.send(batch.map(|b| b.requests.iter().map(|r| r.id).collect()));
        });
        rx
    }

    #[test]
    fn a_burst_is_ready_at_its_one_flush_as_one_batch() {
        let mut store: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 8 * ROW]).collect();
        let batcher = greedy_batcher(1, &mut store);
        let unflushed = Unflushed::default();
        let mut opened = 0;
        for _ in 0..3 {
            opened += usize::from(unflushed.open(&batcher));
            submit(&batcher, &unflushed);
        }
        assert_eq!(opened, 1, "one flush per burst");
        assert_eq!(batcher.queue_len(), 3, "held requests count as queued");
        let batch = next_batch_on_a_thread(&batcher);
        assert!(
            batch.recv_timeout(Duration::from_millis(100)).is_err(),
            "nothing is ready before the flush"
        );
        unflushed.flush();
        let ids = batch.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(ids.map(|ids| ids.len()), Some(3));
        assert!(unflushed.open(&batcher), "the next burst opens a new flush");
        batcher.close();
        drop(store);
    }

    /// The defect this holder replaced: with rows counted as ready, a
    /// submitter that never flushed left its requests at the head of the
    /// channel, and another submitter's flushed request waited behind them.
    #[test]
    fn a_holder_that_never_flushes_holds_up_no_other() {
        let mut store: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 8 * ROW]).collect();
        let batcher = greedy_batcher(1, &mut store);
        let stopped = Unflushed::default();
        assert!(stopped.open(&batcher));
        submit(&batcher, &stopped);
        submit(&batcher, &stopped);
        let running = Unflushed::default();
        assert!(running.open(&batcher));
        let mine = submit(&batcher, &running);
        running.flush();
        let batch = next_batch_on_a_thread(&batcher);
        assert_eq!(
            batch.recv_timeout(Duration::from_secs(10)).unwrap(),
            Some(vec![mine.id])
        );
        drop(stopped); // flushes what it held
        let batch = next_batch_on_a_thread(&batcher);
        let ids = batch.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(ids.map(|ids| ids.len()), Some(2));
        batcher.close();
        drop(store);
    }

    #[test]
    fn closing_sends_what_holders_hold_ahead_of_the_close_and_refuses_more() {
        let mut store: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 8 * ROW]).collect();
        let batcher = greedy_batcher(1, &mut store);
        let holder = Unflushed::default();
        assert!(holder.open(&batcher));
        let held = [submit(&batcher, &holder), submit(&batcher, &holder)];
        batcher.close();
        let mut worker = Worker::new();
        let batch = batcher.next_batch(&mut worker).expect("the held requests");
        let ids: Vec<u64> = batch.requests.iter().map(|r| r.id).collect();
        assert_eq!(ids, held.iter().map(|r| r.id).collect::<Vec<_>>());
        drop(batch);
        assert!(batcher.next_batch(&mut worker).is_none());
        holder.flush(); // nothing left: the close sent it
        assert!(holder.open(&batcher));
        // SAFETY: static bytes outlive the batcher.
        let input = unsafe { InputBytes::new(BYTES.as_ptr(), ROW) };
        let refused = batcher.submit_held(
            &holder,
            Sink::EventLoop(0),
            1,
            [input],
            crate::Submission::default(),
            |_| (),
        );
        assert!(matches!(refused, Err(CoreError::Closed)));
        drop(store);
    }
}
