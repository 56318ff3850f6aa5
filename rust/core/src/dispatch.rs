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
    /// The batcher closed: what was left goes, whatever its size.
    Shutdown,
}

impl DispatchReason {
    pub const ALL: [DispatchReason; 6] = [
        DispatchReason::Full,
        DispatchReason::NextDoesNotFit,
        DispatchReason::PreferredSize,
        DispatchReason::DelayExpired,
        DispatchReason::Greedy,
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
        })
    }

    /// Decides for a batch of `rows` rows whose oldest request is `oldest_age`
    /// old, when `more_waiting` tells whether the queue still holds requests.
    pub fn decide(&self, rows: usize, oldest_age: Duration, more_waiting: bool) -> Decision {
        if rows >= self.max_batch_size {
            return Decision::Dispatch(DispatchReason::Full);
        }
        if rows < self.min_batch_size {
            return Decision::Wait(None);
        }
        if !more_waiting && self.preferred_batch_sizes.binary_search(&rows).is_ok() {
            return Decision::Dispatch(DispatchReason::PreferredSize);
        }
        if self.max_delay.is_zero() {
            return Decision::Dispatch(DispatchReason::Greedy);
        }
        match self.max_delay.checked_sub(oldest_age) {
            Some(left) if !left.is_zero() => Decision::Wait(Some(left)),
            _ => Decision::Dispatch(DispatchReason::DelayExpired),
        }
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
}
