//! The bounded request queue: crossbeam's array channel (lock-free push and
//! pop; blocking waits park the thread) plus admission control.
//!
//! Admission counts *live* requests: `waiting` is raised before a push and
//! lowered when a request leaves the queued state (taken into a batch, or
//! withdrawn by its caller: cancelled, expired, closed), so at most `capacity`
//! live requests wait, and withdrawn ones never crowd out new ones.
//!
//! Withdrawn requests stay in the channel until a worker pops and skips them,
//! so the channel has room for more request messages than live ones
//! (`room`, counted by `in_channel`; past that, a push is refused as full, which
//! only a worker stuck for long under many timeouts reaches) plus `wake_slots`
//! places that only close messages use: closing never blocks.
//!
//! Waiting is a doorbell, not a blocking pop (`crate::doorbell`): the
//! worker gathering a batch (the one holding the gatherer's role) sleeps
//! until enough rows for its next decision have arrived, so a submitter
//! makes a wake-up syscall once per batch at most, not once per request.
//!
//! A submitter may hold requests back: `RequestQueue::admit` counts a
//! request in (admission, and its place in the channel, are settled there)
//! and `RequestQueue::send` hands admitted requests to the workers
//! together, ringing once for all of them. An event loop holds what it
//! submitted in one iteration and sends it at the iteration's end
//! ([`crate::Unflushed`]), so a worker takes the burst as one batch instead
//! of waking at its first request; requests held by one submitter never
//! stand in front of another's, because nothing reaches the channel before
//! it is sent.

use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::doorbell::{Doorbell, GatherRole};
use crate::{CoreError, Request};

/// What travels on the queue.
#[derive(Debug)]
pub enum Message {
    Request(Arc<Request>),
    /// Tells one worker that no request will follow: dispatch and stop.
    Close,
}

/// A push the queue refused: why, and the request, handed back to the caller
/// (as crossbeam's `ArrayQueue::push` returns `Err(PushError(value))`), so a
/// caller may retry or fail it without having lost it.
#[derive(Debug)]
pub struct PushError {
    /// [`CoreError::QueueFull`] or [`CoreError::Closed`].
    pub error: CoreError,
    /// The request, untouched: still `Queued`, never counted by the queue.
    pub request: Arc<Request>,
}

impl PushError {
    /// The request handed back.
    pub fn into_request(self) -> Arc<Request> {
        self.request
    }
}

impl From<PushError> for CoreError {
    fn from(e: PushError) -> CoreError {
        e.error
    }
}

impl std::fmt::Display for PushError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for PushError {}

/// A request the queue admitted that its submitter has not sent yet: it
/// counts against the capacity, has its place in the channel, and reaches
/// the workers at `RequestQueue::send` of the queue that admitted it.
#[derive(Debug)]
#[must_use = "an admitted request holds its place in the queue until it is sent"]
pub(crate) struct Admitted(Arc<Request>);

impl Admitted {
    /// Whether its caller blocks on it (see [`crate::callers`]).
    pub(crate) fn is_blocking(&self) -> bool {
        self.0.blocking
    }
}

/// Priority levels: one lane per level, popped most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priorities {
    /// Lanes (at least 1); lane 0 is the most urgent.
    pub levels: u8,
    /// How long the head of a less urgent lane may be passed over before it
    /// goes first (`None`: strict priority, a busy urgent lane starves the others).
    pub max_wait: Option<Duration>,
}

impl Priorities {
    /// One lane: plain FIFO.
    pub const NONE: Priorities = Priorities {
        levels: 1,
        max_wait: None,
    };
}

/// One priority level's part of the queue.
#[derive(Debug)]
struct Lane {
    tx: Sender<Message>,
    rx: Receiver<Message>,
    /// Live requests this lane admits (see [`RequestQueue::with_priorities`]).
    capacity: usize,
    /// Request messages the channel may hold, withdrawn ones included.
    room: usize,
    /// Live requests of this lane (kept only with several lanes: one lane's is the total).
    waiting: AtomicUsize,
    in_channel: AtomicUsize,
}

impl Lane {
    fn new(capacity: usize, extra: usize) -> Lane {
        // Bounded by the batcher (MAX_QUEUE_SIZE); saturating all the same.
        let room = capacity
            .saturating_mul(2)
            .max(capacity.saturating_add(1024));
        let (tx, rx) = crossbeam_channel::bounded(room.saturating_add(extra));
        Lane {
            tx,
            rx,
            capacity,
            room,
            waiting: AtomicUsize::new(0),
            in_channel: AtomicUsize::new(0),
        }
    }
}

/// What the popping worker took out of the lanes' channels and has not
/// handed out yet.
#[derive(Debug)]
struct Heads {
    /// Each lane's oldest request, popped to read its age.
    requests: Box<[Option<Arc<Request>>]>,
    /// Close messages met while reading ages: handed out once every lane is empty.
    closes: usize,
}

/// The bounded queue of requests between submitters and workers.
///
/// Any number of threads push; one worker at a time waits and pops: the
/// holder of the gatherer's role (`RequestQueue::take_role`). Shared by
/// reference (`&self` throughout).
///
/// With several priority levels each has a lane of its own. A pop takes the
/// most urgent lane's oldest request, except that a less urgent lane's head
/// that has waited `max_wait` goes first (the longest-waiting such head), so
/// nothing starves. Admission is per level and in total: lane `i` of `n`
/// admits while fewer than `capacity` requests wait in all and fewer than
/// `ceil(capacity * (n - i) / n)` wait in it, so the most urgent level may
/// fill the whole queue, and a full less urgent level never refuses a more
/// urgent request while the queue has room.
#[derive(Debug)]
pub struct RequestQueue {
    lanes: Box<[Lane]>,
    /// With several lanes: each lane's head, popped from its channel to read
    /// its age and not yet handed out. Only the popping worker locks it.
    heads: Mutex<Heads>,
    max_wait: Option<Duration>,
    capacity: usize,
    waiting: AtomicUsize,
    /// New requests are refused (the close has begun).
    refused: AtomicBool,
    /// Ready rows (sent and not yet popped), the close,
    /// the sleeping gatherer and the workers waiting for its role.
    doorbell: Doorbell,
    /// Live requests of callers that block on them (signed: the worker may
    /// count one off before its push counted it on).
    blocking: AtomicIsize,
}

/// What a pop saw.
#[derive(Debug)]
pub enum Popped {
    Request(Arc<Request>),
    Close,
    /// Nothing is queued.
    Empty,
}

impl RequestQueue {
    pub fn new(capacity: usize, wake_slots: usize) -> RequestQueue {
        RequestQueue::with_priorities(capacity, wake_slots, Priorities::NONE)
    }

    /// A queue of `priorities.levels` lanes (see the type's documentation).
    pub fn with_priorities(
        capacity: usize,
        wake_slots: usize,
        priorities: Priorities,
    ) -> RequestQueue {
        let levels = usize::from(priorities.levels.max(1));
        let last = levels - 1;
        let lanes: Box<[Lane]> = (0..levels)
            .map(|i| {
                // Close messages go behind every request, in the least urgent lane.
                let extra = if i == last { wake_slots.max(1) } else { 0 };
                let share = capacity
                    .saturating_mul(levels - i)
                    .div_ceil(levels)
                    .clamp(1, capacity.max(1));
                Lane::new(share, extra)
            })
            .collect();
        RequestQueue {
            heads: Mutex::new(Heads {
                requests: (0..levels).map(|_| None).collect(),
                closes: 0,
            }),
            lanes,
            max_wait: priorities.max_wait,
            capacity,
            waiting: AtomicUsize::new(0),
            refused: AtomicBool::new(false),
            doorbell: Doorbell::new(),
            blocking: AtomicIsize::new(0),
        }
    }

    /// Priority levels (lanes).
    pub fn levels(&self) -> usize {
        self.lanes.len()
    }

    /// Pushes a request into its lane, ready for the workers at once, or
    /// refuses it at once when full or closed (or its lane does not exist)
    /// and hands it back in the error.
    pub fn push(&self, request: Arc<Request>) -> Result<(), PushError> {
        let admitted = self.admit(request)?;
        self.send([admitted]);
        Ok(())
    }

    /// Admits a request into its lane without sending it (see the module's
    /// documentation), or refuses it as [`RequestQueue::push`] does.
    pub(crate) fn admit(&self, request: Arc<Request>) -> Result<Admitted, PushError> {
        if self.refused.load(Ordering::SeqCst) {
            return Err(PushError {
                error: CoreError::Closed,
                request,
            });
        }
        let Some(lane) = self.lanes.get(usize::from(request.lane)) else {
            let error = CoreError::InvalidInput(format!(
                "priority level {} does not exist (levels: {})",
                u32::from(request.lane) + 1,
                self.lanes.len()
            ));
            return Err(PushError { error, request });
        };
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.capacity {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(self.full(request));
        }
        let several = self.lanes.len() > 1; // one lane: its count is the total
        if several && lane.waiting.fetch_add(1, Ordering::AcqRel) >= lane.capacity {
            lane.waiting.fetch_sub(1, Ordering::AcqRel);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(self.full(request));
        }
        if lane.in_channel.fetch_add(1, Ordering::AcqRel) >= lane.room {
            // Full of withdrawn requests no worker has popped yet (a stuck model).
            lane.in_channel.fetch_sub(1, Ordering::AcqRel);
            if several {
                lane.waiting.fetch_sub(1, Ordering::AcqRel);
            }
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(self.full(request));
        }
        if request.blocking {
            self.blocking.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Admitted(request))
    }

    /// Sends requests this queue admitted to the workers, ringing once for
    /// all of them. Crate-private, with `admit`: only [`crate::Unflushed`]
    /// holds admitted requests, and only for the batcher it opened with.
    pub(crate) fn send(&self, admitted: impl IntoIterator<Item = Admitted>) {
        let mut rows = 0usize;
        for Admitted(request) in admitted {
            rows = rows.saturating_add(request.rows as usize);
            // `admit` found the lane, and `in_channel` reserved a place in
            // it (close messages have places of their own): cannot fail.
            self.lanes[usize::from(request.lane)]
                .tx
                .try_send(Message::Request(request))
                .expect("in_channel reserved a place in the channel");
        }
        if rows > 0 {
            self.doorbell.make_ready(rows);
        }
    }

    #[cold]
    fn full(&self, request: Arc<Request>) -> PushError {
        let capacity = match self.lanes.get(usize::from(request.lane)) {
            Some(lane) if self.lanes.len() > 1 => lane.capacity.min(self.capacity),
            _ => self.capacity,
        };
        PushError {
            error: CoreError::QueueFull { capacity },
            request,
        }
    }

    /// Times the doorbell rang since the queue was made.
    pub fn rings(&self) -> usize {
        self.doorbell.rings()
    }

    /// Takes the gatherer's role: only its holder pops and sleeps for rows
    /// ([`GatherRole::wait_for_rows`]). Sleeps while another worker holds
    /// it; see [`crate::doorbell`] for when a waiter is woken.
    pub(crate) fn take_role(&self) -> GatherRole<'_> {
        self.doorbell.take_role()
    }

    /// Pops without blocking: the most urgent lane's oldest request, unless a
    /// less urgent lane's head has waited past `max_wait`.
    pub fn try_pop(&self) -> Popped {
        if let [lane] = &*self.lanes {
            return match lane.rx.try_recv() {
                Ok(msg) => self.popped(lane, msg),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => Popped::Empty,
            };
        }
        let mut heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(max_wait) = self.max_wait {
            let now = Instant::now();
            let mut overdue: Option<(usize, Instant)> = None;
            for i in 1..self.lanes.len() {
                if heads.requests[i].is_none() {
                    match self.lanes[i].rx.try_recv() {
                        Ok(Message::Request(r)) => {
                            self.lanes[i].in_channel.fetch_sub(1, Ordering::AcqRel);
                            heads.requests[i] = Some(r);
                        }
                        // Only the last lane carries close messages, behind its
                        // requests: they go once every lane is empty.
                        Ok(Message::Close) => heads.closes += 1,
                        Err(_) => continue,
                    }
                }
                if let Some(r) = &heads.requests[i] {
                    let since = r.enqueued_at;
                    let older = match overdue {
                        None => true,
                        Some((_, seen)) => since < seen,
                    };
                    if older && now.saturating_duration_since(since) >= max_wait {
                        overdue = Some((i, since));
                    }
                }
            }
            if let Some((i, _)) = overdue {
                let r = heads.requests[i]
                    .take()
                    .expect("an overdue head was just seen");
                return self.handed_out(r);
            }
        }
        for (i, lane) in self.lanes.iter().enumerate() {
            if let Some(r) = heads.requests[i].take() {
                return self.handed_out(r);
            }
            if heads.closes > 0 && i + 1 == self.lanes.len() {
                break;
            }
            match lane.rx.try_recv() {
                Ok(msg) => return self.popped(lane, msg),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => continue,
            }
        }
        if heads.closes > 0 {
            heads.closes -= 1;
            return Popped::Close;
        }
        Popped::Empty
    }

    fn popped(&self, lane: &Lane, msg: Message) -> Popped {
        match msg {
            Message::Request(r) => {
                lane.in_channel.fetch_sub(1, Ordering::AcqRel);
                self.handed_out(r)
            }
            Message::Close => Popped::Close,
        }
    }

    /// A request leaves the channel (or the heads) for the worker: its rows
    /// are no longer ready.
    fn handed_out(&self, r: Arc<Request>) -> Popped {
        self.doorbell.popped(r.rows as usize);
        Popped::Request(r)
    }

    /// Records that one pushed request left the queued state (taken or withdrawn).
    /// Call exactly once per request, by whoever won its transition.
    pub fn left(&self, request: &Request) {
        if self.lanes.len() > 1 {
            if let Some(lane) = self.lanes.get(usize::from(request.lane)) {
                lane.waiting.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        if request.blocking {
            self.blocking.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Live requests of callers that block on them (see [`crate::callers`]).
    pub fn blocking(&self) -> usize {
        usize::try_from(self.blocking.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// Wakes the sleeping gatherer to decide again now, whatever its row
    /// count (or the next one to sleep, at once).
    pub fn nudge(&self) {
        self.doorbell.nudge();
    }

    /// Refuses new requests from now on and sends one close message per
    /// worker, behind every request already sent.
    pub fn close(&self, workers: usize) {
        if self.refuse() {
            self.send_closes(workers);
        }
    }

    /// Refuses new requests from now on; true for the first call only,
    /// which must then [`RequestQueue::send_closes`] (after sending what
    /// was admitted before).
    pub fn refuse(&self) -> bool {
        !self.refused.swap(true, Ordering::SeqCst)
    }

    /// Sends one close message per worker, behind every request sent, then
    /// tells the workers (until then a gatherer sleeps as usual: it does not
    /// spin while what was admitted is sent).
    pub fn send_closes(&self, workers: usize) {
        let last = &self.lanes[self.lanes.len() - 1];
        for _ in 0..workers {
            // Never blocks: request messages cannot take the last `wake_slots` places.
            let _ = last.tx.try_send(Message::Close);
        }
        if self.doorbell.mark_closed() {
            self.doorbell.ring();
        }
    }

    /// Live requests waiting: pushed and not yet taken or withdrawn.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Live requests waiting at each priority level, most urgent first.
    pub fn lane_lens(&self) -> Vec<usize> {
        if self.lanes.len() == 1 {
            return vec![self.len()];
        }
        self.lanes
            .iter()
            .map(|l| l.waiting.load(Ordering::Acquire))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::RequestState;
    use crate::Sink;
    use std::time::Duration;

    fn req(id: u64) -> Arc<Request> {
        Arc::new(Request::new(
            id,
            Sink::EventLoop(0),
            1,
            crate::Inputs::default(),
            None,
        ))
    }

    #[test]
    fn admitted_requests_count_at_once_and_reach_workers_together_when_sent() {
        let q = Arc::new(RequestQueue::new(3, 1));
        let held = vec![q.admit(req(1)).unwrap(), q.admit(req(2)).unwrap()];
        assert_eq!(q.len(), 2, "admitted requests count against the capacity");
        q.push(req(3)).unwrap();
        assert!(matches!(
            q.push(req(4)),
            Err(PushError {
                error: CoreError::QueueFull { .. },
                ..
            })
        ));
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || {
                q.take_role()
                    .wait_for_rows(2, Some(Instant::now() + Duration::from_secs(10)))
            })
        };
        // Only the pushed request is in the channel: the held ones do not stand before it.
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 3));
        assert!(matches!(q.try_pop(), Popped::Empty));
        std::thread::sleep(Duration::from_millis(20));
        let rings = q.rings();
        q.send(held);
        waiter.join().unwrap();
        assert_eq!(
            q.rings(),
            rings + 1,
            "one ring for everything sent together"
        );
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 2));
        assert!(matches!(q.try_pop(), Popped::Empty));
    }

    #[test]
    fn refuses_beyond_capacity_then_admits_once_a_request_left() {
        let q = RequestQueue::new(2, 1);
        q.push(req(1)).unwrap();
        q.push(req(2)).unwrap();
        let third = req(3);
        let refused = q.push(third.clone()).unwrap_err();
        assert_eq!(refused.error, CoreError::QueueFull { capacity: 2 });
        assert!(Arc::ptr_eq(&refused.request, &third), "handed back");
        assert_eq!(third.state(), RequestState::Queued);
        let third = refused.into_request();
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        assert_eq!(q.len(), 2, "popped is not yet taken");
        q.left(&req(0));
        q.push(third).unwrap();
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn withdrawn_requests_do_not_crowd_out_new_ones_until_the_channel_is_full() {
        let q = RequestQueue::new(2, 1);
        for id in 0..q.lanes[0].room as u64 {
            q.push(req(id)).unwrap();
            q.left(&req(0)); // withdrawn at once; still in the channel
        }
        assert_eq!(q.len(), 0);
        let refused = q.push(req(9)).unwrap_err();
        assert!(
            matches!(refused.error, CoreError::QueueFull { .. }),
            "channel full"
        );
        assert_eq!(refused.request.id, 9);
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 0));
        q.push(req(10)).unwrap();
        q.close(1); // fits in the wake slot
    }

    #[test]
    fn close_refuses_new_requests_and_queues_behind_accepted_ones() {
        let q = RequestQueue::new(4, 2);
        q.push(req(1)).unwrap();
        q.close(2);
        let refused = q.push(req(2)).unwrap_err();
        assert_eq!(CoreError::from(refused), CoreError::Closed);
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        assert!(matches!(q.try_pop(), Popped::Close));
        assert!(matches!(q.try_pop(), Popped::Close));
        assert!(matches!(q.try_pop(), Popped::Empty));
    }

    #[test]
    fn a_waiting_worker_wakes_once_enough_rows_arrived_and_not_before() {
        let q = Arc::new(RequestQueue::new(64, 1));
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                q.take_role()
                    .wait_for_rows(4, Some(started + std::time::Duration::from_secs(30)));
                started.elapsed()
            })
        };
        while !q.doorbell.someone_waits() {
            std::thread::yield_now();
        }
        for id in 0..3 {
            q.push(req(id)).unwrap();
        }
        assert_eq!(q.rings(), 0, "three rows of four wake nobody");
        q.push(req(3)).unwrap();
        let waited = waiter.join().unwrap();
        assert_eq!(q.rings(), 1);
        assert!(
            waited < std::time::Duration::from_secs(20),
            "woken by the 4th row, not the deadline"
        );
        q.push(req(4)).unwrap();
        assert_eq!(q.rings(), 1, "nobody sleeps: pushes do not ring");
    }

    #[test]
    fn wait_returns_at_once_when_rows_are_ready_and_at_the_deadline_when_not() {
        let q = RequestQueue::new(8, 1);
        q.push(req(1)).unwrap();
        let role = q.take_role();
        role.wait_for_rows(1, None); // would hang if the ready row were missed
        let deadline = Instant::now() + std::time::Duration::from_millis(20);
        role.wait_for_rows(5, Some(deadline));
        assert!(Instant::now() >= deadline);
    }

    #[test]
    fn no_wake_up_is_lost_between_check_and_sleep() {
        // Each round the waiter wants exactly the one row the pusher sends;
        // a lost wake-up hangs the round (and the test) on `None` deadline.
        let q = Arc::new(RequestQueue::new(4, 1));
        let rounds = if cfg!(miri) { 20 } else { 2_000 };
        let pusher = {
            let q = q.clone();
            std::thread::spawn(move || {
                for id in 0..rounds {
                    while !q.is_empty() {
                        std::thread::yield_now();
                    }
                    q.push(req(id)).unwrap();
                }
            })
        };
        let role = q.take_role();
        for _ in 0..rounds {
            role.wait_for_rows(1, None);
            assert!(matches!(q.try_pop(), Popped::Request(_)));
            q.left(&req(0));
        }
        pusher.join().unwrap();
    }

    #[test]
    fn a_worker_waiting_for_the_role_takes_it_at_the_next_push_not_at_the_release() {
        let q = Arc::new(RequestQueue::new(8, 2));
        let held = q.take_role();
        let (took, taken) = std::sync::mpsc::channel();
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || {
                let role = q.take_role();
                took.send(()).unwrap();
                role.release(false);
            })
        };
        while !q.doorbell.someone_waits() {
            std::thread::yield_now();
        }
        held.release(false); // nothing to gather: the waiter sleeps on
        let wait = Duration::from_millis(50);
        assert!(
            taken.recv_timeout(wait).is_err(),
            "woken with nothing to do"
        );
        assert_eq!(q.rings(), 0);
        q.push(req(1)).unwrap();
        taken.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(q.rings(), 1, "the push rang for the waiter");
        waiter.join().unwrap();
    }

    #[test]
    fn a_release_with_rows_ready_or_a_carry_hands_the_role_over_at_once() {
        for carry in [false, true] {
            let q = Arc::new(RequestQueue::new(8, 2));
            let held = q.take_role();
            let waiter = {
                let q = q.clone();
                std::thread::spawn(move || q.take_role().release(false))
            };
            while !q.doorbell.someone_waits() {
                std::thread::yield_now();
            }
            if !carry {
                q.push(req(1)).unwrap();
            }
            held.release(carry);
            waiter.join().unwrap(); // hangs if the hand-over were missed
        }
    }

    #[test]
    fn close_fits_even_when_the_queue_is_full() {
        let q = RequestQueue::new(1, 3);
        q.push(req(1)).unwrap();
        q.close(3); // must not block
        assert_eq!(q.len(), 1);
    }
}
