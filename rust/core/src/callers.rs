//! Callers that block on one request at a time: a thread that submits, then
//! waits for its answer before it can submit again (`infer_sync`, TorchRL's
//! thread clients).
//!
//! While every such caller seen lately has its request in the batch being
//! gathered, and no caller that does not block (an event loop, a connection,
//! a shared-memory client) submitted lately, no row can join that batch until
//! one of them is answered: waiting out `max_delay` would only delay it. The
//! gathering worker then releases it at once
//! ([`crate::DispatchReason::CallersWaiting`]).
//!
//! A blocking request admitted to the queue but not yet sent (pushed a
//! moment ago, or held for a flush) is not in that batch yet: the worker
//! waits for it, and its submitter, once it sent it, checks
//! [`BlockingCallers::all_in`] and nudges the worker. The submitter that
//! sends last sees every other's admission (each admits before it sends, and
//! the sends meet on the doorbell's read-modify-write row counter), so that
//! nudge is never lost.
//!
//! A caller counts as seen for a horizon after its last request (the longer
//! of [`HORIZON`] and twice `max_delay`, so a caller whose request waits in
//! the batch is never forgotten meanwhile), so one that stops calling holds
//! the batch back for that long at most (then it goes, as all the others are
//! in); a thread that ends is forgotten at once. One never seen before can
//! only miss a batch.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a caller counts as one that may still send a row, at least.
pub const HORIZON: Duration = Duration::from_secs(1);

/// How stale the last submission of a caller that does not block may be
/// recorded: a small part of the horizon, so a few writes a second at most.
const OPEN_STAMP_STEP_NS: u64 = 10_000_000;

#[derive(Debug)]
pub struct BlockingCallers {
    /// Each blocking caller seen within the horizon (its key, its last request).
    seen: Mutex<Vec<(u64, Instant)>>,
    /// `seen`'s length, read without the lock.
    active: AtomicUsize,
    /// When a caller that does not block last submitted: nanoseconds since
    /// `epoch`, plus one (0: never).
    open_at: AtomicU64,
    epoch: Instant,
    horizon: Duration,
}

impl BlockingCallers {
    /// The callers of a batcher whose batches wait up to `max_delay`.
    pub fn new(max_delay: Duration) -> BlockingCallers {
        BlockingCallers {
            seen: Mutex::new(Vec::new()),
            active: AtomicUsize::new(0),
            open_at: AtomicU64::new(0),
            epoch: Instant::now(),
            horizon: HORIZON.max(max_delay.saturating_mul(2)),
        }
    }

    /// A request arrives at `now`: from the blocking caller `caller`, or
    /// (`None`) from one that does not block.
    pub fn arrive(&self, caller: Option<u64>, now: Instant) {
        let Some(key) = caller else {
            let since = now.saturating_duration_since(self.epoch).as_nanos();
            let stamp = u64::try_from(since).unwrap_or(u64::MAX - 1) + 1;
            // Every request of every loop and connection passes here: write the
            // shared word only when it moved on, not once per request.
            let last = self.open_at.load(Ordering::Relaxed);
            if last == 0 || stamp.saturating_sub(last) >= OPEN_STAMP_STEP_NS {
                self.open_at.store(stamp, Ordering::Relaxed);
            }
            return;
        };
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|&(k, at)| k == key || now.saturating_duration_since(at) < self.horizon);
        match seen.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = now,
            None => seen.push((key, now)),
        }
        self.active.store(seen.len(), Ordering::Relaxed);
    }

    /// The caller `key` is gone (its thread ended): it sends no more rows.
    pub fn forget(&self, key: u64) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|&(k, _)| k != key);
        self.active.store(seen.len(), Ordering::Relaxed);
    }

    /// Whether a blocking caller was seen within the horizon.
    pub fn any_seen(&self) -> bool {
        self.active.load(Ordering::Relaxed) > 0
    }

    /// [`BlockingCallers::all_in`] for the gathering worker, whose batch
    /// holds `gathered` of the `live` blocking requests in the batcher; it
    /// first forgets the callers that went quiet. Also when the next one
    /// would (when to decide again: a caller that stopped calling holds the
    /// batch back until then at most).
    ///
    /// Live requests it has not gathered were admitted and not yet sent
    /// (the worker gathers all it can pop before it decides): they are not
    /// in this batch, so it waits for them, and their submitters nudge it.
    pub fn all_in_now(
        &self,
        gathered: usize,
        live: usize,
        now: Instant,
    ) -> (bool, Option<Instant>) {
        let next_quiet = {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.retain(|&(_, at)| now.saturating_duration_since(at) < self.horizon);
            self.active.store(seen.len(), Ordering::Relaxed);
            seen.iter()
                .filter_map(|&(_, at)| at.checked_add(self.horizon))
                .min()
        };
        let on_the_way = live.saturating_sub(gathered);
        (on_the_way == 0 && self.all_in(gathered, now), next_quiet)
    }

    /// Whether every blocking caller seen lately has a request in the
    /// batcher (`live` of them, gathered or queued), with no caller that
    /// does not block seen lately: no other row can come.
    pub fn all_in(&self, live: usize, now: Instant) -> bool {
        let active = self.active.load(Ordering::Relaxed);
        // With no caller seen lately, rows still in the batcher are those of
        // callers that have waited past the horizon (a batch below
        // `min_batch_size` waits without a limit): they are blocked all the same.
        if live == 0 || live < active {
            return false;
        }
        let open_at = self.open_at.load(Ordering::Relaxed);
        if open_at == 0 {
            return true;
        }
        match self.epoch.checked_add(Duration::from_nanos(open_at - 1)) {
            Some(at) => now.saturating_duration_since(at) >= self.horizon,
            None => false, // unrepresentable: as if just now
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_caller_in_means_no_row_can_come() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        assert!(!callers.all_in(0, now), "nobody seen: nothing to conclude");
        callers.arrive(Some(1), now);
        callers.arrive(Some(2), now);
        assert!(!callers.all_in(1, now), "caller 2 may still send");
        assert!(callers.all_in(2, now));
        callers.arrive(Some(1), now); // seen again: still two callers
        assert!(callers.all_in(2, now));
    }

    #[test]
    fn a_caller_that_does_not_block_keeps_the_window_for_the_horizon() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        callers.arrive(Some(1), now);
        callers.arrive(None, now);
        assert!(!callers.all_in(1, now));
        assert!(!callers.all_in(1, now + HORIZON / 2));
        assert!(callers.all_in(1, now + HORIZON));
    }

    #[test]
    fn a_caller_that_stopped_is_forgotten_after_the_horizon() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        callers.arrive(Some(1), now);
        callers.arrive(Some(2), now);
        let later = now + HORIZON;
        callers.arrive(Some(1), later);
        assert!(callers.all_in(1, later), "caller 2 went quiet");
    }

    #[test]
    fn callers_that_waited_past_the_horizon_are_all_in() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        callers.arrive(Some(1), now); // answered, then idle
        callers.arrive(Some(2), now); // its request waits in the batch
        assert_eq!(callers.all_in_now(1, 1, now), (false, Some(now + HORIZON)));
        // Both went quiet at once: the one in the batch can only be waiting.
        assert_eq!(callers.all_in_now(1, 1, now + HORIZON), (true, None));
        assert!(
            !callers.all_in(0, now + HORIZON),
            "nobody in the batcher: nothing to release"
        );
    }

    #[test]
    fn a_caller_that_ended_is_forgotten_at_once() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        callers.arrive(Some(1), now);
        callers.arrive(Some(2), now);
        callers.forget(2);
        assert!(callers.all_in(1, now));
    }

    #[test]
    fn the_gathering_worker_learns_when_to_decide_again() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        callers.arrive(Some(1), now);
        callers.arrive(Some(2), now + HORIZON / 2);
        assert_eq!(callers.all_in_now(1, 1, now), (false, Some(now + HORIZON)));
        // Caller 1 went quiet; caller 2's request is the only one in.
        let later = now + HORIZON;
        assert_eq!(
            callers.all_in_now(1, 1, later),
            (true, Some(now + HORIZON / 2 + HORIZON))
        );
    }

    #[test]
    fn a_caller_waiting_in_a_long_window_is_not_forgotten() {
        let max_delay = HORIZON * 2;
        let callers = BlockingCallers::new(max_delay);
        let now = Instant::now();
        callers.arrive(Some(1), now);
        callers.arrive(Some(2), now + max_delay / 2); // answered: thinking
        let later = now + max_delay; // caller 1's request waited the whole window
        assert!(!callers.all_in_now(1, 1, later).0, "caller 2 is not in");
    }

    #[test]
    fn a_request_admitted_and_not_yet_sent_is_not_in_the_batch() {
        let callers = BlockingCallers::new(Duration::from_millis(1));
        let now = Instant::now();
        callers.arrive(Some(1), now);
        callers.arrive(Some(2), now);
        // Caller 2's request is admitted, on its way: the batch of caller 1's
        // one waits for it (going now would leave it to wait alone).
        assert!(!callers.all_in_now(1, 2, now).0);
        // Once sent, its submitter sees both in and nudges the worker.
        assert!(callers.all_in(2, now));
        assert!(callers.all_in_now(2, 2, now).0);
    }
}
