//! How each request ended, as its caller saw it, and the counts of them.
//!
//! Every sink owner (an event loop's mailbox, the native front-end) counts
//! each request once, under one [`Outcome`], when its caller is answered;
//! `stats()` adds the tallies up, so it equals what callers saw.

use std::sync::atomic::{AtomicU64, Ordering};

/// How a request ended, as its caller saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    InvalidInput,
    QueueFull,
    DeadlineExceeded,
    Cancelled,
    ModelError,
    ServerClosed,
}

pub const OUTCOMES: usize = 7;

impl Outcome {
    pub const ALL: [Outcome; OUTCOMES] = [
        Outcome::Succeeded,
        Outcome::InvalidInput,
        Outcome::QueueFull,
        Outcome::DeadlineExceeded,
        Outcome::Cancelled,
        Outcome::ModelError,
        Outcome::ServerClosed,
    ];

    /// The name `stats()` reports it under.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::InvalidInput => "invalid_input",
            Outcome::QueueFull => "queue_full",
            Outcome::DeadlineExceeded => "deadline_exceeded",
            Outcome::Cancelled => "cancelled",
            Outcome::ModelError => "model_error",
            Outcome::ServerClosed => "server_closed",
        }
    }
}

/// Upper bounds, in microseconds, of the buckets the successes'
/// submit-to-result times are counted in (a 1-2-5 series from 50 µs to
/// 10 s, Prometheus's `le`: a time equal to a bound is in its bucket); one
/// more bucket holds the times above the last.
pub const REQUEST_BOUNDS_US: [u64; 18] = [
    50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000,
    1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000,
];

/// Buckets of [`REQUEST_BOUNDS_US`], and the one above the last bound.
pub const REQUEST_BUCKETS: usize = REQUEST_BOUNDS_US.len() + 1;

/// The bucket of a submit-to-result time of `ns` nanoseconds.
pub fn request_bucket(ns: u64) -> usize {
    // Rounded up to whole microseconds, so 1,000.5 µs is above a bound of 1,000.
    let us = ns.div_ceil(1_000);
    REQUEST_BOUNDS_US.partition_point(|&bound| bound < us)
}

/// What [`Tally::add_to`] adds up: requests by outcome, and the successes'
/// submit-to-result times, summed and by bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub counts: [u64; OUTCOMES],
    pub request_ns: u64,
    pub request_buckets: [u64; REQUEST_BUCKETS],
}

/// Requests by outcome, and the submit-to-result time of the successes.
#[derive(Debug, Default)]
pub struct Tally {
    counts: [AtomicU64; OUTCOMES],
    request_ns: AtomicU64,
    request_buckets: [AtomicU64; REQUEST_BUCKETS],
}

impl Tally {
    pub fn count(&self, outcome: Outcome) {
        self.count_n(outcome, 1);
    }

    pub fn count_n(&self, outcome: Outcome, n: u64) {
        self.counts[outcome as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// Adds a success's `ns` of submit-to-result time, to the sum and to
    /// its bucket.
    pub fn add_request_ns(&self, ns: u64) {
        self.request_ns.fetch_add(ns, Ordering::Relaxed);
        self.request_buckets[request_bucket(ns)].fetch_add(1, Ordering::Relaxed);
    }

    /// A request counted as `from` whose caller saw `to` after all. The
    /// caller counted it as `from` before, so the count never goes below zero.
    pub fn recount(&self, from: Outcome, to: Outcome) {
        self.counts[from as usize].fetch_sub(1, Ordering::Relaxed);
        self.count(to);
    }

    /// Adds this tally into `totals`.
    pub fn add_to(&self, totals: &mut Totals) {
        let add =
            |total: &mut u64, n: &AtomicU64| *total = total.wrapping_add(n.load(Ordering::Relaxed));
        for (total, n) in totals.counts.iter_mut().zip(&self.counts) {
            add(total, n);
        }
        add(&mut totals.request_ns, &self.request_ns);
        for (total, n) in totals.request_buckets.iter_mut().zip(&self.request_buckets) {
            add(total, n);
        }
    }

    /// Takes over `other`'s counts (a mailbox being dropped).
    pub fn absorb(&self, other: &Tally) {
        let take = |mine: &AtomicU64, theirs: &AtomicU64| {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        };
        for (mine, theirs) in self.counts.iter().zip(&other.counts) {
            take(mine, theirs);
        }
        take(&self.request_ns, &other.request_ns);
        for (mine, theirs) in self.request_buckets.iter().zip(&other.request_buckets) {
            take(mine, theirs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_on_a_bound_is_in_its_bucket_and_a_nanosecond_more_in_the_next() {
        assert_eq!(request_bucket(0), 0);
        assert_eq!(request_bucket(50_000), 0);
        assert_eq!(request_bucket(50_001), 1);
        assert_eq!(request_bucket(1_000_000), 4);
        assert_eq!(request_bucket(1_000_001), 5);
        assert_eq!(request_bucket(20_000_000_000), REQUEST_BUCKETS - 2);
        assert_eq!(request_bucket(20_000_000_001), REQUEST_BUCKETS - 1);
        assert_eq!(request_bucket(u64::MAX), REQUEST_BUCKETS - 1);
        for (i, &bound) in REQUEST_BOUNDS_US.iter().enumerate() {
            assert_eq!(request_bucket(bound * 1_000), i);
            assert_eq!(request_bucket(bound * 1_000 + 1), i + 1);
        }
    }

    #[test]
    fn a_tally_adds_up_and_hands_over_its_times() {
        let (a, b) = (Tally::default(), Tally::default());
        a.add_request_ns(30_000);
        a.add_request_ns(3_000_000);
        b.add_request_ns(3_000_000);
        b.count(Outcome::Succeeded);
        a.absorb(&b);
        let mut totals = Totals::default();
        a.add_to(&mut totals);
        a.add_to(&mut totals);
        assert_eq!(totals.request_ns, 2 * 6_030_000);
        assert_eq!(totals.counts[Outcome::Succeeded as usize], 2);
        let mut expected = [0; REQUEST_BUCKETS];
        expected[0] = 2;
        expected[6] = 4;
        assert_eq!(totals.request_buckets, expected);
    }
}
