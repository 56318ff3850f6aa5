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

/// Requests by outcome, and the submit-to-result time of the successes.
#[derive(Debug, Default)]
pub struct Tally {
    counts: [AtomicU64; OUTCOMES],
    request_ns: AtomicU64,
}

impl Tally {
    pub fn count(&self, outcome: Outcome) {
        self.count_n(outcome, 1);
    }

    pub fn count_n(&self, outcome: Outcome, n: u64) {
        self.counts[outcome as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// Adds `ns` of submit-to-result time (of successes).
    pub fn add_request_ns(&self, ns: u64) {
        self.request_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// A request counted as `from` whose caller saw `to` after all. The
    /// caller counted it as `from` before, so the count never goes below zero.
    pub fn recount(&self, from: Outcome, to: Outcome) {
        self.counts[from as usize].fetch_sub(1, Ordering::Relaxed);
        self.count(to);
    }

    /// Adds this tally into `counts` and `request_ns`.
    pub fn add_to(&self, counts: &mut [u64; OUTCOMES], request_ns: &mut u64) {
        for (total, n) in counts.iter_mut().zip(&self.counts) {
            *total = total.wrapping_add(n.load(Ordering::Relaxed));
        }
        *request_ns = request_ns.wrapping_add(self.request_ns.load(Ordering::Relaxed));
    }

    /// Takes over `other`'s counts (a mailbox being dropped).
    pub fn absorb(&self, other: &Tally) {
        for (mine, theirs) in self.counts.iter().zip(&other.counts) {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.add_request_ns(other.request_ns.load(Ordering::Relaxed));
    }
}
