//! When a gathered batch is dispatched: a pure function of its size, the age
//! of its oldest request and whether more requests are waiting.
//!
//! In order:
//! 1. `max_batch_size` rows gathered: dispatch.
//! 2. Fewer than `min_batch_size` rows: wait for more, however long it takes
//!    (callers bound that with their own timeouts; shutdown flushes).
//! 3. A preferred batch size reached and nothing else waiting: dispatch.
//! 4. `max_delay` elapsed since the oldest gathered request: dispatch. With
//!    `max_delay == 0` (greedy) this holds at once, so a free worker takes
//!    whatever is queued, up to `max_batch_size`.
//! 5. Otherwise wait until the oldest request is `max_delay` old.

use std::time::Duration;

use crate::CoreError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchRule {
    pub max_batch_size: usize,
    pub max_delay: Duration,
    pub min_batch_size: usize,
    /// Sorted ascending, each within `1..=max_batch_size`.
    pub preferred_batch_sizes: Vec<usize>,
    /// `max_delay="auto"`: `max_delay` is only a cap, and a batch goes as
    /// soon as it has as many rows as the batch before it (see
    /// [`DispatchRule::decide_adaptive`]).
    pub adaptive: bool,
    /// `max_delay` counts from when a free worker starts gathering, if that
    /// is later than the oldest request's arrival (TorchRL's `timeout`: a
    /// server back from a batch waits that long for its callers' next
    /// requests instead of sending what queued meanwhile at once).
    pub delay_from_free_worker: bool,
}

/// Why a batch was released to its model call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchReason {
    /// `max_batch_size` rows gathered.
    Full,
    /// The next request would not fit: it leads the next batch.
    NextDoesNotFit,
    /// A preferred batch size reached with nothing else waiting.
    PreferredSize,
    /// `max_delay` passed since the oldest request.
    DelayExpired,
    /// Greedy (`max_delay == 0`): whatever was queued.
    Greedy,
    /// Adaptive: as many rows as the load brought the batch before.
    Adaptive,
    /// Every caller that could add a row blocks on a request already in it
    /// (see [`crate::callers`]): waiting longer could not fill it.
    CallersWaiting,
    /// The batcher closed: what was left goes, whatever its size.
    Shutdown,
}

impl DispatchReason {
    pub const ALL: [DispatchReason; 8] = [
        DispatchReason::Full,
        DispatchReason::NextDoesNotFit,
        DispatchReason::PreferredSize,
        DispatchReason::DelayExpired,
        DispatchReason::Greedy,
        DispatchReason::Adaptive,
        DispatchReason::CallersWaiting,
        DispatchReason::Shutdown,
    ];

    /// The name stats report it under.
    pub fn name(self) -> &'static str {
        match self {
            DispatchReason::Full => "full",
            DispatchReason::NextDoesNotFit => "next_does_not_fit",
            DispatchReason::PreferredSize => "preferred_size",
            DispatchReason::DelayExpired => "delay_expired",
            DispatchReason::Greedy => "greedy",
            DispatchReason::Adaptive => "adaptive",
            DispatchReason::CallersWaiting => "callers_waiting",
            DispatchReason::Shutdown => "shutdown",
        }
    }
}

/// What a worker does next with the batch it is gathering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Dispatch(DispatchReason),
    /// Wait for another request, at most this long (`None`: no limit).
    Wait(Option<Duration>),
}

impl DispatchRule {
    pub fn new(
        max_batch_size: usize,
        max_delay: Duration,
        min_batch_size: usize,
        mut preferred_batch_sizes: Vec<usize>,
    ) -> Result<DispatchRule, CoreError> {
        if max_batch_size == 0 {
            return Err(CoreError::InvalidConfig(
                "max_batch_size must be at least 1".into(),
            ));
        }
        if min_batch_size == 0 || min_batch_size > max_batch_size {
            return Err(CoreError::InvalidConfig(format!(
                "min_batch_size must be in 1..={max_batch_size} (max_batch_size), got {min_batch_size}"
            )));
        }
        preferred_batch_sizes.sort_unstable();
        preferred_batch_sizes.dedup();
        if let Some(&bad) = preferred_batch_sizes
            .iter()
            .find(|&&s| s == 0 || s > max_batch_size)
        {
            return Err(CoreError::InvalidConfig(format!(
                "preferred_batch_sizes must be in 1..={max_batch_size} (max_batch_size), got {bad}"
            )));
        }
        Ok(DispatchRule {
            max_batch_size,
            max_delay,
            min_batch_size,
            preferred_batch_sizes,
            adaptive: false,
            delay_from_free_worker: false,
        })
    }

    /// The same rule with `max_delay` counted from when a free worker
    /// starts gathering (see [`DispatchRule::delay_from_free_worker`]).
    pub fn delay_from_free_worker(mut self) -> DispatchRule {
        self.delay_from_free_worker = true;
        self
    }

    /// The same rule with an adaptive window capped at `max_delay`.
    pub fn adaptive(mut self) -> DispatchRule {
        self.adaptive = true;
        self
    }

    /// The adaptive window (`max_delay="auto"`). Callers that each wait for
    /// their result (RL actors, request handlers) bring back about as many
    /// requests per batch cycle as there are callers, so the batch before
    /// this one is the estimate of what the load brings: a batch goes once
    /// it has `target` rows (that batch's size), at once for a lone caller
    /// (target 1), full under heavy load; if fewer come (the load fell), it
    /// goes when the cap `max_delay` is up, and the next target is smaller.
    /// `max_batch_size`, `min_batch_size` and preferred sizes apply first,
    /// as in [`DispatchRule::decide`].
    pub fn decide_adaptive(
        &self,
        rows: usize,
        oldest_age: Duration,
        more_waiting: bool,
        target: usize,
    ) -> Decision {
        match self.decide_sizes(rows, more_waiting) {
            Some(decision) => decision,
            None if rows >= target.clamp(1, self.max_batch_size) => {
                Decision::Dispatch(DispatchReason::Adaptive)
            }
            None => self.wait_out_delay(oldest_age),
        }
    }

    /// The adaptive counterpart of [`DispatchRule::recheck_at`].
    pub fn recheck_at_adaptive(&self, rows: usize, target: usize) -> usize {
        let target = target.clamp(1, self.max_batch_size);
        if rows < target {
            self.recheck_at(rows).min(target)
        } else {
            self.recheck_at(rows)
        }
    }

    /// The decisions that depend on the batch's size alone.
    fn decide_sizes(&self, rows: usize, more_waiting: bool) -> Option<Decision> {
        if rows >= self.max_batch_size {
            return Some(Decision::Dispatch(DispatchReason::Full));
        }
        if rows < self.min_batch_size {
            return Some(Decision::Wait(None));
        }
        if !more_waiting && self.preferred_batch_sizes.binary_search(&rows).is_ok() {
            return Some(Decision::Dispatch(DispatchReason::PreferredSize));
        }
        None
    }

    /// Waits until the oldest request is `max_delay` old.
    fn wait_out_delay(&self, oldest_age: Duration) -> Decision {
        match self.max_delay.checked_sub(oldest_age) {
            Some(left) if !left.is_zero() => Decision::Wait(Some(left)),
            _ => Decision::Dispatch(DispatchReason::DelayExpired),
        }
    }

    /// Decides for a batch of `rows` rows whose oldest request is `oldest_age`
    /// old, when `more_waiting` tells whether the queue still holds requests.
    pub fn decide(&self, rows: usize, oldest_age: Duration, more_waiting: bool) -> Decision {
        if let Some(decision) = self.decide_sizes(rows, more_waiting) {
            return decision;
        }
        if self.max_delay.is_zero() {
            return Decision::Dispatch(DispatchReason::Greedy);
        }
        self.wait_out_delay(oldest_age)
    }

    /// The batch size at which `decide` may next answer differently for a
    /// batch of `rows` rows that is waiting: `min_batch_size` while below it,
    /// else the next preferred size, else `max_batch_size`. A worker sleeps
    /// until that many rows are gathered (or its deadline passes) instead of
    /// waking for every request.
    pub fn recheck_at(&self, rows: usize) -> usize {
        if rows < self.min_batch_size {
            return self.min_batch_size;
        }
        let next_preferred = self
            .preferred_batch_sizes
            .iter()
            .copied()
            .find(|&s| s > rows);
        next_preferred
            .unwrap_or(self.max_batch_size)
            .min(self.max_batch_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn rule(max: usize, delay: Duration, min: usize, preferred: &[usize]) -> DispatchRule {
        DispatchRule::new(max, delay, min, preferred.to_vec()).unwrap()
    }

    #[test]
    fn full_batch_dispatches_at_once() {
        let r = rule(8, 10 * MS, 1, &[]);
        assert_eq!(
            r.decide(8, Duration::ZERO, true),
            Decision::Dispatch(DispatchReason::Full)
        );
    }

    #[test]
    fn greedy_dispatches_whatever_is_gathered() {
        let r = rule(8, Duration::ZERO, 1, &[]);
        let greedy = Decision::Dispatch(DispatchReason::Greedy);
        assert_eq!(r.decide(1, Duration::ZERO, false), greedy);
        assert_eq!(r.decide(3, Duration::ZERO, true), greedy);
    }

    #[test]
    fn waits_for_the_rest_of_max_delay_counted_from_the_oldest() {
        let r = rule(8, 10 * MS, 1, &[]);
        assert_eq!(r.decide(3, 4 * MS, false), Decision::Wait(Some(6 * MS)));
        let expired = Decision::Dispatch(DispatchReason::DelayExpired);
        assert_eq!(r.decide(3, 10 * MS, false), expired);
        assert_eq!(r.decide(3, 15 * MS, true), expired);
    }

    #[test]
    fn preferred_size_dispatches_only_when_nothing_else_waits() {
        let r = rule(8, 10 * MS, 1, &[4, 2]);
        assert_eq!(r.preferred_batch_sizes, vec![2, 4]);
        assert_eq!(
            r.decide(4, MS, false),
            Decision::Dispatch(DispatchReason::PreferredSize)
        );
        assert_eq!(r.decide(4, MS, true), Decision::Wait(Some(9 * MS)));
        assert_eq!(r.decide(3, MS, false), Decision::Wait(Some(9 * MS)));
    }

    #[test]
    fn below_min_batch_size_waits_without_limit() {
        let r = rule(8, Duration::ZERO, 4, &[]);
        assert_eq!(r.decide(3, 100 * MS, false), Decision::Wait(None));
        assert_eq!(
            r.decide(4, Duration::ZERO, false),
            Decision::Dispatch(DispatchReason::Greedy)
        );
    }

    #[test]
    fn rechecks_at_the_next_size_where_the_decision_can_change() {
        let r = rule(16, 10 * MS, 3, &[4, 8]);
        assert_eq!(r.recheck_at(0), 3, "below min: the min");
        assert_eq!(r.recheck_at(2), 3);
        assert_eq!(r.recheck_at(3), 4, "then each preferred size");
        assert_eq!(r.recheck_at(4), 8);
        assert_eq!(r.recheck_at(9), 16, "then the max");
        assert_eq!(rule(8, MS, 1, &[]).recheck_at(5), 8);
    }

    #[test]
    fn rejects_bad_configs_with_a_reason() {
        assert!(DispatchRule::new(0, MS, 1, vec![]).is_err());
        let err = DispatchRule::new(8, MS, 9, vec![]).unwrap_err();
        assert!(err.to_string().contains("min_batch_size"));
        let err = DispatchRule::new(8, MS, 1, vec![16]).unwrap_err();
        assert!(err.to_string().contains("preferred_batch_sizes"));
    }

    #[test]
    fn adaptive_goes_at_the_previous_batch_size_or_at_the_cap() {
        let r = rule(64, 5 * MS, 1, &[]).adaptive();
        let adaptive = Decision::Dispatch(DispatchReason::Adaptive);
        // A lone caller (the batch before had 1 row): at once.
        assert_eq!(r.decide_adaptive(1, Duration::ZERO, false, 1), adaptive);
        // Heavy load (64 before): waits for 64, up to the cap.
        assert_eq!(
            r.decide_adaptive(10, MS, false, 64),
            Decision::Wait(Some(4 * MS))
        );
        assert_eq!(
            r.decide_adaptive(64, MS, true, 64),
            Decision::Dispatch(DispatchReason::Full)
        );
        assert_eq!(r.decide_adaptive(30, MS, false, 30), adaptive);
        // The load fell: the cap releases what came.
        let expired = Decision::Dispatch(DispatchReason::DelayExpired);
        assert_eq!(r.decide_adaptive(3, 5 * MS, false, 30), expired);
        // A target of 0 or past the maximum is clamped.
        assert_eq!(r.decide_adaptive(1, Duration::ZERO, false, 0), adaptive);
        assert_eq!(
            r.decide_adaptive(63, MS, false, 1000),
            Decision::Wait(Some(4 * MS))
        );
        // The worker sleeps until the target, not every request.
        assert_eq!(r.recheck_at_adaptive(10, 30), 30);
        assert_eq!(r.recheck_at_adaptive(30, 30), 64);
        assert_eq!(r.recheck_at_adaptive(0, 1), 1);
    }
}
