//! The one table of requests waiting for their answer, whatever way they
//! came in: blocked threads, the native front-end's connections and
//! shared-memory clients each keep their requests in a [`Pending`], and
//! supply only how an answer is handed over (the `A` of the table: a
//! thread's waiter, a connection's oneshot sender, a client's cell).
//!
//! # Rules (each enforced here, once)
//!
//! * **Register before queue.** A request is registered before it is pushed
//!   (a worker may take and finish it at once); a request the queue refuses
//!   is unregistered, uncounted (its caller gets the refusal).
//! * **Exactly once.** Each entry holds its caller's answer slot until one
//!   side takes it: the batch that took the request ([`Pending::take`]),
//!   its caller giving up ([`Pending::abandon`], [`Pending::withdraw`]) or
//!   the server stopping ([`Pending::fail_all`]). Whoever takes the slot
//!   answers the caller and counts the outcome in the table's [`Tally`],
//!   before the caller can see it (so `stats()` never lags an answer). One
//!   exception, counted once all the same: a caller whose slot its batch
//!   must answer (a shared-memory cell) is counted when it gives up
//!   ([`Pending::gave_up`]), and its batch answers the slot uncounted.
//! * **Inputs live until no batch can read them.** An entry whose request
//!   a batch took stays, with what keeps its input bytes alive (the `H` of
//!   the table), until that batch resolves it, even once its caller was
//!   answered; an entry withdrawn from the queue goes at once.
//! * **Dead peers** are the way in's own rule (a closed loop, a dead
//!   client process): it withdraws their requests with
//!   [`Pending::withdraw_where`], and what a batch still holds stays.
//!
//! The transitions run under one mutex per table; nothing under it can
//! panic or call out (answers are handed over after it is released). They
//! have loom models (`make loom`) beside the request state's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use foldhash::fast::FixedState;

use crate::fanout::Route;
use crate::outcome::{Outcome, Tally};
use crate::request::{Request, RequestState};
use crate::sync::{Mutex, MutexGuard};
use crate::Batcher;

/// Takes a queued request back out of its queue: true when it will never
/// be run (withdrawn now or before), false when a batch took it. `held` is
/// what its entry holds: a table whose requests may sit in several queues
/// (an event loop's, across a restart) names each one's queue there.
pub trait Withdraw<H = ()> {
    fn withdraw(&self, request: &Request, held: &H, to: RequestState) -> bool;
}

impl<H> Withdraw<H> for Batcher {
    fn withdraw(&self, request: &Request, _held: &H, to: RequestState) -> bool {
        Batcher::withdraw(self, request, to)
    }
}

struct Entry<A, H> {
    /// How the caller is answered; None once answered (a batch still holds
    /// the request, and `held` with it).
    answer: Option<A>,
    request: Arc<Request>,
    held: H,
    /// Its caller gave up while a batch held it, and that was counted
    /// ([`Pending::gave_up`]).
    counted: bool,
}

/// A request of a finished batch whose caller still waits for its answer.
pub struct Taken<A, H> {
    pub route: Route,
    pub answer: A,
    pub held: H,
    pub enqueued_at: Instant,
    /// Its caller gave up while the batch ran and its outcome is counted
    /// already ([`Pending::gave_up`]): answer it, do not count it.
    pub counted: bool,
}

/// The table's entries by request id. Ids are the batcher's own sequence
/// numbers, never a caller's: a fast fixed hash (SipHash's protection
/// against chosen keys buys nothing here).
type Entries<A, H> = HashMap<u64, Entry<A, H>, FixedState>;

/// The pending requests of one model through one way in. `A`: how a caller
/// is answered; `H`: what the request holds until its batch is done (its
/// input owners, how to encode its answer).
pub struct Pending<A, H = ()> {
    entries: Mutex<Entries<A, H>>,
    tally: Tally,
}

impl<A, H> Default for Pending<A, H> {
    fn default() -> Self {
        Pending {
            entries: Mutex::new(HashMap::default()),
            tally: Tally::default(),
        }
    }
}

impl<A, H> Pending<A, H> {
    pub fn new() -> Self {
        Self::default()
    }

    /// What this way in's callers saw.
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// Entries in the table: callers waiting, and answered requests a batch
    /// still holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Entries<A, H>> {
        // Nothing that can panic runs under this lock; a poisoned map is still whole.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `request` (not queued yet): its answer goes to `answer`,
    /// and `held` stays until no batch can read its inputs.
    pub fn register(&self, request: &Arc<Request>, answer: A, held: H) {
        let entry = Entry {
            answer: Some(answer),
            request: request.clone(),
            held,
            counted: false,
        };
        self.lock().insert(request.id, entry);
    }

    /// Drops the entry of a request the queue refused (never queued,
    /// uncounted: its caller gets the refusal).
    pub fn unregister(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// The caller of request `id` gives up (`to`: `Expired`, `Cancelled`):
    /// takes its answer slot, counts `outcome`, and withdraws the request
    /// unless a batch took it (then its entry stays until that batch is
    /// done). None when it was answered first.
    pub fn abandon(
        &self,
        queue: &dyn Withdraw<H>,
        id: u64,
        to: RequestState,
        outcome: Outcome,
    ) -> Option<A> {
        let mut entries = self.lock();
        let entry = entries.get_mut(&id)?;
        let answer = entry.answer.take()?;
        self.tally.count(outcome);
        if queue.withdraw(&entry.request, &entry.held, to) {
            entries.remove(&id); // never read by a worker: its inputs may go
        }
        Some(answer)
    }

    /// Withdraws request `id` only if no batch took it and `held` passes
    /// `check` (a way in whose caller's memory the batch reads, which it
    /// may not reuse before the batch is done); counts `outcome`. None when
    /// a batch took it, it was answered, or `check` refused.
    pub fn withdraw(
        &self,
        queue: &dyn Withdraw<H>,
        id: u64,
        check: impl FnOnce(&H) -> bool,
        to: RequestState,
        outcome: Outcome,
    ) -> Option<(A, H)> {
        let mut entries = self.lock();
        let entry = entries.get(&id)?;
        if entry.answer.is_none()
            || !check(&entry.held)
            || !queue.withdraw(&entry.request, &entry.held, to)
        {
            return None;
        }
        let entry = entries.remove(&id)?;
        self.tally.count(outcome);
        Some((entry.answer?, entry.held))
    }

    /// The caller of request `id` gives up after a batch took it, in a way
    /// in whose answer slot must still be answered by that batch (the
    /// answer frees a peer's memory the batch reads): counts `outcome` now,
    /// once, so that `stats()` says what the caller saw, and the batch
    /// answers the slot uncounted ([`Taken::counted`]). False when it was
    /// answered first, `held` fails `check`, or it was counted before.
    pub fn gave_up(&self, id: u64, check: impl FnOnce(&H) -> bool, outcome: Outcome) -> bool {
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(&id) else {
            return false;
        };
        if entry.answer.is_none() || entry.counted || !check(&entry.held) {
            return false;
        }
        entry.counted = true;
        self.tally.count(outcome);
        true
    }

    /// Withdraws every request whose `held` matches (a peer that died),
    /// counting `outcome` for each still unanswered. Returns the answers of
    /// those withdrawn, and how many matching entries a batch still holds.
    pub fn withdraw_where(
        &self,
        queue: &dyn Withdraw<H>,
        matches: impl Fn(&H) -> bool,
        to: RequestState,
        outcome: Outcome,
    ) -> (Vec<A>, usize) {
        let mut withdrawn = Vec::new();
        let mut left = 0;
        self.lock().retain(|_, entry| {
            if !matches(&entry.held) {
                return true;
            }
            if !queue.withdraw(&entry.request, &entry.held, to) {
                left += 1;
                return true;
            }
            if let Some(answer) = entry.answer.take() {
                self.tally.count(outcome);
                withdrawn.push(answer);
            }
            false
        });
        (withdrawn, left)
    }

    /// The server stops: takes every answer slot still held, counting
    /// `outcome` for each, and withdraws what no batch took (with no queue,
    /// every entry stays until its batch, if any, is done). The caller
    /// answers the slots returned.
    pub fn fail_all(&self, queue: Option<&dyn Withdraw<H>>, outcome: Outcome) -> Vec<A> {
        self.fail_all_before(queue, outcome, u64::MAX)
    }

    /// [`Pending::fail_all`] for the requests whose id is below `before`
    /// only: those of one run of a server started again, whose batchers
    /// number requests on from the last (a later run's stay pending).
    pub fn fail_all_before(
        &self,
        queue: Option<&dyn Withdraw<H>>,
        outcome: Outcome,
        before: u64,
    ) -> Vec<A> {
        let mut answers = Vec::new();
        self.lock().retain(|&id, entry| {
            if id >= before {
                return true;
            }
            if let Some(answer) = entry.answer.take() {
                self.tally.count(outcome);
                answers.push(answer);
            }
            !queue.is_some_and(|q| q.withdraw(&entry.request, &entry.held, RequestState::Closed))
        });
        answers
    }

    /// For each of `routes` whose caller still waits, what `pick` reads from
    /// its answer and `held` (a streaming request's channel for its partial
    /// answers), the entry left in place. `pick` runs under the table's
    /// lock: it must only copy or clone.
    pub fn peek<T>(&self, routes: &[Route], pick: impl Fn(&A, &H) -> Option<T>) -> Vec<(Route, T)> {
        let entries = self.lock();
        routes
            .iter()
            .filter_map(|route| {
                let entry = entries.get(&route.id)?;
                Some((*route, pick(entry.answer.as_ref()?, &entry.held)?))
            })
            .collect()
    }

    /// Sets something on the answer of request `id` whose caller still
    /// waits (its deadline timer, armed once it is queued): false when it
    /// was answered. `set` runs under the table's lock: it must only move
    /// a value in.
    pub fn update(&self, id: u64, set: impl FnOnce(&mut A)) -> bool {
        match self.lock().get_mut(&id).and_then(|e| e.answer.as_mut()) {
            Some(answer) => {
                set(answer);
                true
            }
            None => false,
        }
    }

    /// Takes the entries of a finished batch's `routes` out of the table;
    /// returns those whose caller still waits (an entry answered already
    /// is dropped here: its batch is done with its inputs). Each one taken
    /// must be answered and counted with [`Pending::count`].
    pub fn take(&self, routes: &[Route]) -> Vec<Taken<A, H>> {
        let mut entries = self.lock();
        routes
            .iter()
            .filter_map(|route| {
                let entry = entries.remove(&route.id)?;
                Some(Taken {
                    route: *route,
                    answer: entry.answer?,
                    held: entry.held,
                    enqueued_at: entry.request.enqueued_at,
                    counted: entry.counted,
                })
            })
            .collect()
    }

    /// Counts the answer a taken request got (`now`: when its batch
    /// finished; a success adds its time from submit).
    pub fn count(&self, outcome: Outcome, enqueued_at: Instant, now: Instant) {
        if outcome == Outcome::Succeeded {
            let waited = now.saturating_duration_since(enqueued_at);
            self.tally
                .add_request_ns(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
        }
        self.tally.count(outcome);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::fanout::Sink;

    /// A queue of one request's state alone: withdrawing moves it out of
    /// `Queued` unless a worker took it.
    struct StateOnly;

    impl<H> Withdraw<H> for StateOnly {
        fn withdraw(&self, request: &Request, _held: &H, to: RequestState) -> bool {
            request.withdraw(to) != crate::request::Withdrawal::Taken
        }
    }

    fn request(id: u64) -> Arc<Request> {
        Arc::new(Request::new(
            id,
            Sink::Thread,
            1,
            crate::Inputs::default(),
            None,
        ))
    }

    fn route(id: u64, start: u32) -> Route {
        Route { id, start, rows: 1 }
    }

    fn counts(table: &Pending<u32, &'static str>) -> [u64; crate::OUTCOMES] {
        let mut totals = crate::Totals::default();
        table.tally().add_to(&mut totals);
        totals.counts
    }

    #[test]
    fn a_batch_answers_what_its_callers_still_wait_for() {
        let table = Pending::new();
        let (a, b) = (request(1), request(2));
        table.register(&a, 10, "a");
        table.register(&b, 20, "b");
        assert!(a.take() && b.take());
        // b's caller gives up after its batch took it: answered, entry stays.
        assert_eq!(
            table.abandon(&StateOnly, 2, RequestState::Cancelled, Outcome::Cancelled),
            Some(20)
        );
        assert_eq!(
            table.len(),
            2,
            "a taken request's inputs stay until its batch is done"
        );
        let taken = table.take(&[route(1, 0), route(2, 1)]);
        assert_eq!(taken.len(), 1);
        assert_eq!((taken[0].answer, taken[0].held), (10, "a"));
        table.count(Outcome::Succeeded, taken[0].enqueued_at, Instant::now());
        assert!(table.is_empty());
        let counts = counts(&table);
        assert_eq!(counts[Outcome::Succeeded as usize], 1);
        assert_eq!(counts[Outcome::Cancelled as usize], 1);
    }

    #[test]
    fn a_caller_that_gives_up_during_its_batch_is_counted_once_as_it_saw() {
        let table = Pending::new();
        let (a, b) = (request(1), request(2));
        table.register(&a, 10, "a");
        table.register(&b, 20, "b");
        assert!(a.take() && b.take());
        assert!(!table.gave_up(2, |held| *held == "other", Outcome::Cancelled));
        assert!(table.gave_up(2, |held| *held == "b", Outcome::Cancelled));
        assert!(
            !table.gave_up(2, |_| true, Outcome::DeadlineExceeded),
            "counted once"
        );
        assert!(
            !table.gave_up(3, |_| true, Outcome::Cancelled),
            "no such request"
        );
        let taken = table.take(&[route(1, 0), route(2, 1)]);
        // Both slots are answered by the batch; only `a` is counted by it.
        assert_eq!(
            taken
                .iter()
                .map(|t| (t.answer, t.counted))
                .collect::<Vec<_>>(),
            vec![(10, false), (20, true)]
        );
        let counts = counts(&table);
        assert_eq!(counts[Outcome::Cancelled as usize], 1);
        assert_eq!(counts[Outcome::DeadlineExceeded as usize], 0);
        assert!(!table.gave_up(1, |_| true, Outcome::Cancelled), "answered");
    }

    #[test]
    fn peek_reads_the_waiting_callers_and_leaves_their_entries() {
        let table = Pending::new();
        let (a, b) = (request(1), request(2));
        table.register(&a, 10, "a");
        table.register(&b, 20, "b");
        assert!(a.take() && b.take());
        table.abandon(&StateOnly, 2, RequestState::Cancelled, Outcome::Cancelled);
        let routes = [route(1, 0), route(2, 1), route(3, 2)];
        let seen = table.peek(&routes, |_, held| Some(held.len()));
        assert_eq!(seen, vec![(route(1, 0), 1)], "only callers still waiting");
        assert!(table.peek(&routes, |_, _| None::<()>).is_empty());
        assert_eq!(table.len(), 2, "nothing taken");
        assert_eq!(table.take(&routes).len(), 1);
        assert_eq!(
            counts(&table)[Outcome::Succeeded as usize],
            0,
            "peek counts nothing"
        );
    }

    #[test]
    fn a_queued_request_given_up_goes_at_once_and_is_answered_once() {
        let table = Pending::new();
        let a = request(1);
        table.register(&a, 10, "a");
        let gave_up = table.abandon(
            &StateOnly,
            1,
            RequestState::Expired,
            Outcome::DeadlineExceeded,
        );
        assert_eq!(gave_up, Some(10));
        assert!(
            table.is_empty(),
            "never read by a worker: its inputs may go"
        );
        assert_eq!(a.state(), RequestState::Expired);
        assert_eq!(
            table.abandon(&StateOnly, 1, RequestState::Cancelled, Outcome::Cancelled),
            None
        );
        assert!(table.take(&[route(1, 0)]).is_empty());
        assert_eq!(counts(&table)[Outcome::DeadlineExceeded as usize], 1);
        assert_eq!(counts(&table).iter().sum::<u64>(), 1);
    }

    #[test]
    fn withdraw_leaves_what_a_batch_took_and_what_fails_the_check() {
        let table = Pending::new();
        let (a, b) = (request(1), request(2));
        table.register(&a, 10, "a");
        table.register(&b, 20, "b");
        assert!(a.take());
        assert!(table
            .withdraw(
                &StateOnly,
                1,
                |_| true,
                RequestState::Cancelled,
                Outcome::Cancelled
            )
            .is_none());
        assert!(table
            .withdraw(
                &StateOnly,
                2,
                |h| *h == "stale",
                RequestState::Cancelled,
                Outcome::Cancelled
            )
            .is_none());
        assert_eq!(
            b.state(),
            RequestState::Queued,
            "a refused check withdraws nothing"
        );
        assert_eq!(
            table.withdraw(
                &StateOnly,
                2,
                |h| *h == "b",
                RequestState::Cancelled,
                Outcome::Cancelled
            ),
            Some((20, "b"))
        );
        assert_eq!(table.len(), 1);
        assert_eq!(counts(&table).iter().sum::<u64>(), 1);
    }

    #[test]
    fn a_dead_peers_requests_go_except_those_a_batch_holds() {
        let table = Pending::new();
        let (a, b, c) = (request(1), request(2), request(3));
        table.register(&a, 10, "dead");
        table.register(&b, 20, "dead");
        table.register(&c, 30, "alive");
        assert!(a.take());
        let (withdrawn, left) = table.withdraw_where(
            &StateOnly,
            |h| *h == "dead",
            RequestState::Closed,
            Outcome::Cancelled,
        );
        assert_eq!((withdrawn, left), (vec![20], 1));
        assert_eq!(c.state(), RequestState::Queued);
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn stopping_answers_every_caller_once_and_keeps_what_batches_hold() {
        let table = Pending::new();
        let (a, b) = (request(1), request(2));
        table.register(&a, 10, "a");
        table.register(&b, 20, "b");
        assert!(a.take());
        let mut answers = table.fail_all(Some(&StateOnly), Outcome::ServerClosed);
        answers.sort_unstable();
        assert_eq!(answers, vec![10, 20]);
        assert_eq!(
            table.len(),
            1,
            "the taken request's inputs stay for its batch"
        );
        assert!(table.take(&[route(1, 0)]).is_empty(), "answered already");
        assert!(table.is_empty());
        assert!(table
            .fail_all(Some(&StateOnly), Outcome::ServerClosed)
            .is_empty());
        assert_eq!(counts(&table)[Outcome::ServerClosed as usize], 2);
        assert_eq!(counts(&table).iter().sum::<u64>(), 2);
    }

    #[test]
    fn stopping_one_run_leaves_the_next_runs_requests_waiting() {
        let table = Pending::new();
        for id in [1u32, 2, 7, 8] {
            table.register(&request(u64::from(id)), id * 10, "r");
        }
        // Ids 7 and on are a later run's (its batcher numbers on from 7).
        let mut answers = table.fail_all_before(Some(&StateOnly), Outcome::ServerClosed, 7);
        answers.sort_unstable();
        assert_eq!(answers, vec![10, 20]);
        assert_eq!(table.len(), 2);
        assert_eq!(
            table.take(&[route(7, 0), route(8, 1)]).len(),
            2,
            "still waiting"
        );
        assert_eq!(counts(&table)[Outcome::ServerClosed as usize], 2);
    }

    #[test]
    fn a_refused_request_leaves_uncounted() {
        let table = Pending::new();
        table.register(&request(1), 10, "a");
        table.unregister(1);
        assert!(table.is_empty());
        assert_eq!(counts(&table).iter().sum::<u64>(), 0);
    }
}

/// Loom models (`make loom`): a batch finishing races its caller giving up
/// and the server stopping; each caller is answered and counted once, and
/// what keeps its inputs alive goes only once no batch can read them.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::fanout::Sink;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc as LoomArc;
    use loom::thread;

    struct StateOnly;

    impl<H> Withdraw<H> for StateOnly {
        fn withdraw(&self, request: &Request, _held: &H, to: RequestState) -> bool {
            request.withdraw(to) != crate::request::Withdrawal::Taken
        }
    }

    /// The request's input bytes: read by the worker that took it, freed
    /// (written) when the table drops its entry. Loom fails the model if
    /// the two race.
    struct Input(LoomArc<UnsafeCell<u32>>);

    impl Drop for Input {
        fn drop(&mut self) {
            // SAFETY: what the model checks: dropped only once no worker reads.
            self.0.with_mut(|p| unsafe { *p = 0 });
        }
    }

    struct Shared {
        table: Pending<u8, Input>,
        request: Arc<Request>,
        input: LoomArc<UnsafeCell<u32>>,
    }

    // SAFETY: `input` is accessed per the table's rule (what the model checks).
    unsafe impl Send for Shared {}
    unsafe impl Sync for Shared {}

    fn shared() -> LoomArc<Shared> {
        let input = LoomArc::new(UnsafeCell::new(7));
        let request = Arc::new(Request::new(
            1,
            Sink::Thread,
            1,
            crate::Inputs::default(),
            None,
        ));
        let table = Pending::new();
        table.register(&request, 1, Input(input.clone()));
        LoomArc::new(Shared {
            table,
            request,
            input,
        })
    }

    /// A worker takes the request, reads its input, and answers what is
    /// still waiting. Returns how many answers it gave.
    fn worker(s: &Shared) -> usize {
        if !s.request.take() {
            return 0;
        }
        // SAFETY: taken by this thread; the entry (and its input) stays until `take` below.
        assert_eq!(s.input.with(|p| unsafe { *p }), 7);
        let taken = s.table.take(&[Route {
            id: 1,
            start: 0,
            rows: 1,
        }]);
        for t in &taken {
            s.table
                .count(Outcome::Succeeded, t.enqueued_at, t.enqueued_at);
        }
        taken.len()
    }

    fn total(s: &Shared) -> u64 {
        let mut totals = crate::Totals::default();
        s.table.tally().add_to(&mut totals);
        totals.counts.iter().sum()
    }

    #[test]
    fn loom_a_batch_races_its_caller_giving_up_exactly_once() {
        loom::model(|| {
            let s = shared();
            let w = {
                let s = s.clone();
                thread::spawn(move || worker(&s))
            };
            let gave_up = s
                .table
                .abandon(&StateOnly, 1, RequestState::Cancelled, Outcome::Cancelled)
                .is_some();
            let answered_by_batch = w.join().unwrap();
            assert_eq!(answered_by_batch + gave_up as usize, 1, "answered once");
            assert_eq!(total(&s), 1, "counted once");
            assert!(s.table.is_empty(), "nothing left behind");
        });
    }

    #[test]
    fn loom_a_batch_races_the_server_stopping_exactly_once() {
        loom::model(|| {
            let s = shared();
            let w = {
                let s = s.clone();
                thread::spawn(move || worker(&s))
            };
            let failed = s
                .table
                .fail_all(Some(&StateOnly), Outcome::ServerClosed)
                .len();
            let answered_by_batch = w.join().unwrap();
            assert_eq!(answered_by_batch + failed, 1, "answered once");
            assert_eq!(total(&s), 1, "counted once");
            assert!(s.table.is_empty(), "nothing left behind");
        });
    }
}
