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
//! Waiting is a doorbell, not a blocking pop: a worker gathering a batch
//! sleeps until enough rows for its next decision have arrived
//! ([`RequestQueue::wait_for_rows`]), so a submitter makes a wake-up syscall
//! once per batch at most, not once per request. `ready_rows` counts the rows
//! of request messages sent and not yet popped; a sleeping worker publishes in
//! `wake_at` the count it waits for, and the push that reaches it rings. Both
//! sides use SeqCst on those two counters (a store then a load each), so either
//! the push sees the worker's `wake_at` or the worker sees the push's rows:
//! no wake-up is lost. Ringing takes the sleep lock, which the worker holds
//! from its check until it sleeps, and notifies after letting it go: a
//! worker woken while the lock is held (on one core the woken thread often
//! runs at once) would block on it, and the hand-back would cost two more
//! futex calls and context switches per batch. The order still holds: the
//! ringer takes the lock after the worker checked and began to wait, or
//! before it checked.
//!
//! With [`Readiness::OnFlush`] (greedy batching) pushed rows count as ready
//! only once their submitter flushes them: an event loop flushes once per
//! iteration, so a worker takes everything the loop submitted in that
//! iteration as one batch instead of waking at its first request. A worker
//! pops only while ready rows remain (or the queue is closed), so it never
//! takes part of an iteration's requests before the flush.

use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::{CoreError, Request};

/// When pushed rows become ready for a worker to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// At once.
    OnPush,
    /// When the submitter calls [`RequestQueue::flush`] for them.
    OnFlush,
}

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
        let room = (2 * capacity).max(capacity + 1024);
        let (tx, rx) = crossbeam_channel::bounded(room + extra);
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
/// Any number of threads push; one worker at a time waits and pops (the
/// batcher's gather lock). Shared by reference (`&self` throughout).
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
    closed: AtomicBool,
    readiness: Readiness,
    /// Rows of request messages sent (`OnPush`) or flushed (`OnFlush`) and
    /// not yet popped (signed: a pop may count its rows off before the push
    /// or flush that readied them counted them on).
    ready_rows: AtomicIsize,
    /// `ready_rows` a sleeping worker waits for; `NOBODY_WAITS` otherwise.
    wake_at: AtomicIsize,
    sleep_lock: Mutex<()>,
    bell: Condvar,
    /// Times a push or close rang the doorbell (for tests and stats).
    rings: AtomicUsize,
    /// Live requests of callers that block on them (signed: the worker may
    /// count one off before its push counted it on).
    blocking: AtomicIsize,
    /// A submitter asked the sleeping worker to decide again now.
    nudged: AtomicBool,
}

const NOBODY_WAITS: isize = isize::MAX;

/// What a pop saw.
#[derive(Debug)]
pub enum Popped {
    Request(Arc<Request>),
    Close,
    /// Nothing is queued.
    Empty,
}

impl RequestQueue {
    pub fn new(capacity: usize, wake_slots: usize, readiness: Readiness) -> RequestQueue {
        RequestQueue::with_priorities(capacity, wake_slots, readiness, Priorities::NONE)
    }

    /// A queue of `priorities.levels` lanes (see the type's documentation).
    pub fn with_priorities(
        capacity: usize,
        wake_slots: usize,
        readiness: Readiness,
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
            closed: AtomicBool::new(false),
            readiness,
            ready_rows: AtomicIsize::new(0),
            wake_at: AtomicIsize::new(NOBODY_WAITS),
            sleep_lock: Mutex::new(()),
            bell: Condvar::new(),
            rings: AtomicUsize::new(0),
            blocking: AtomicIsize::new(0),
            nudged: AtomicBool::new(false),
        }
    }

    /// Priority levels (lanes).
    pub fn levels(&self) -> usize {
        self.lanes.len()
    }

    /// Pushes a request into its lane, or refuses it at once when full or
    /// closed (or its lane does not exist) and hands it back in the error.
    pub fn push(&self, request: Arc<Request>) -> Result<(), PushError> {
        if self.closed.load(Ordering::Acquire) {
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
        // Cannot fail for lack of room: `in_channel` reserved a place, and close
        // messages have places of their own.
        let rows = request.rows as usize;
        let blocking = request.blocking;
        lane.tx
            .try_send(Message::Request(request))
            .expect("in_channel reserved a place in the channel");
        if self.readiness == Readiness::OnPush {
            self.make_ready(rows);
        }
        if blocking {
            self.blocking.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
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

    /// Readies `rows` rows pushed since the submitter's last flush
    /// (`Readiness::OnFlush`; with `OnPush` pushes are ready already).
    pub fn flush(&self, rows: usize) {
        if self.readiness == Readiness::OnFlush && rows > 0 {
            self.make_ready(rows);
        }
    }

    fn make_ready(&self, rows: usize) {
        let rows = rows as isize;
        let ready = self.ready_rows.fetch_add(rows, Ordering::SeqCst) + rows;
        if ready >= self.wake_at.load(Ordering::SeqCst) {
            self.ring();
        }
    }

    /// Whether a worker may pop now: ready rows remain, or the queue is
    /// closed (then everything accepted goes out).
    pub fn may_pop(&self) -> bool {
        self.readiness == Readiness::OnPush
            || self.ready_rows.load(Ordering::SeqCst) > 0
            || self.closed.load(Ordering::SeqCst)
    }

    /// Wakes the sleeping worker, if any; later pushes do not ring again
    /// until it sleeps anew.
    fn ring(&self) {
        {
            let _held = self.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake_at.store(NOBODY_WAITS, Ordering::SeqCst);
        }
        // Notified once the lock is let go (see the module's comment).
        self.bell.notify_all();
        self.rings.fetch_add(1, Ordering::Relaxed);
    }

    pub fn readiness(&self) -> Readiness {
        self.readiness
    }

    /// Times the doorbell rang since the queue was made.
    pub fn rings(&self) -> usize {
        self.rings.load(Ordering::Relaxed)
    }

    /// Sleeps until at least `rows` rows of requests are ready to pop, the
    /// queue is closed, or `deadline` passes. One worker at a time may wait.
    pub fn wait_for_rows(&self, rows: usize, deadline: Option<Instant>) {
        let rows = rows.clamp(1, NOBODY_WAITS as usize - 1) as isize;
        let mut held = self.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            self.wake_at.store(rows, Ordering::SeqCst);
            if self.ready_rows.load(Ordering::SeqCst) >= rows
                || self.closed.load(Ordering::SeqCst)
                || self.nudged.swap(false, Ordering::SeqCst)
            {
                break;
            }
            held = match deadline {
                None => self.bell.wait(held).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break;
                    }
                    self.bell
                        .wait_timeout(held, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
        self.wake_at.store(NOBODY_WAITS, Ordering::SeqCst);
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
        self.ready_rows.fetch_sub(r.rows as isize, Ordering::SeqCst);
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

    /// Wakes the sleeping worker to decide again now, whatever its row
    /// count (or the next one to sleep, at once).
    pub fn nudge(&self) {
        {
            let _held = self.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.nudged.store(true, Ordering::SeqCst);
        }
        self.bell.notify_all();
    }

    /// Refuses new requests from now on and sends one close message per
    /// worker, behind every request already accepted.
    pub fn close(&self, workers: usize) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let last = &self.lanes[self.lanes.len() - 1];
        for _ in 0..workers {
            // Never blocks: request messages cannot take the last `wake_slots` places.
            let _ = last.tx.try_send(Message::Close);
        }
        self.ring();
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
        Arc::new(Request::new(id, Sink::EventLoop(0), 1, Box::new([]), None))
    }

    #[test]
    fn on_flush_pushes_wait_for_their_flush_until_close() {
        let q = Arc::new(RequestQueue::new(8, 1, Readiness::OnFlush));
        q.push(req(1)).unwrap();
        q.push(req(2)).unwrap();
        assert!(!q.may_pop(), "pushed, not yet flushed");
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || {
                q.wait_for_rows(2, Some(Instant::now() + Duration::from_secs(10)))
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(q.rings(), 0, "a push alone does not wake the worker");
        q.flush(2);
        waiter.join().unwrap();
        assert_eq!(q.rings(), 1);
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        assert!(q.may_pop());
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 2));
        assert!(!q.may_pop());
        q.push(req(3)).unwrap();
        assert!(!q.may_pop());
        q.close(1);
        assert!(q.may_pop(), "closing releases everything accepted");
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 3));
    }

    #[test]
    fn refuses_beyond_capacity_then_admits_once_a_request_left() {
        let q = RequestQueue::new(2, 1, Readiness::OnPush);
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
        let q = RequestQueue::new(2, 1, Readiness::OnPush);
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
        let q = RequestQueue::new(4, 2, Readiness::OnPush);
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
        let q = Arc::new(RequestQueue::new(64, 1, Readiness::OnPush));
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                q.wait_for_rows(4, Some(started + std::time::Duration::from_secs(30)));
                started.elapsed()
            })
        };
        while q.wake_at.load(Ordering::SeqCst) == NOBODY_WAITS {
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
        let q = RequestQueue::new(8, 1, Readiness::OnPush);
        q.push(req(1)).unwrap();
        q.wait_for_rows(1, None); // would hang if the ready row were missed
        let deadline = Instant::now() + std::time::Duration::from_millis(20);
        q.wait_for_rows(5, Some(deadline));
        assert!(Instant::now() >= deadline);
    }

    #[test]
    fn no_wake_up_is_lost_between_check_and_sleep() {
        // Each round the waiter wants exactly the one row the pusher sends;
        // a lost wake-up hangs the round (and the test) on `None` deadline.
        let q = Arc::new(RequestQueue::new(4, 1, Readiness::OnPush));
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
        for _ in 0..rounds {
            q.wait_for_rows(1, None);
            assert!(matches!(q.try_pop(), Popped::Request(_)));
            q.left(&req(0));
        }
        pusher.join().unwrap();
    }

    #[test]
    fn close_fits_even_when_the_queue_is_full() {
        let q = RequestQueue::new(1, 3, Readiness::OnPush);
        q.push(req(1)).unwrap();
        q.close(3); // must not block
        assert_eq!(q.len(), 1);
    }
}
