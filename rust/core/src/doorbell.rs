//! The doorbell between a queue's submitters and the workers of its batcher,
//! and the gatherer's role.
//!
//! One worker at a time gathers a batch: it holds the *role*. It sleeps
//! until enough rows for its next dispatch decision have arrived
//! ([`GatherRole::wait_for_rows`]), so a submitter makes a wake-up syscall once
//! per batch at most, not once per request. `ready_rows` counts the rows of
//! request messages sent and not yet popped; the sleeping worker publishes in
//! `wake_at` the count it waits for, and the push that reaches it rings. Each
//! side writes its counter, then a SeqCst fence, then reads the other's, so
//! either the push sees the worker's `wake_at` or the worker sees the push's
//! rows: no wake-up is lost. (The fences, not SeqCst accesses alone, are
//! what loom's models check: it weakens SeqCst accesses to AcqRel.)
//!
//! The other workers wait for the role on a condvar of their own (`turn`),
//! and only for a role worth taking: a worker letting the role go wakes one
//! of them when there is something to gather (ready rows, a carried request,
//! the close), and otherwise publishes `wake_at = 1` on their behalf, so the
//! next push rings for them. A waiting worker thus sleeps once per batch it
//! gathers, not once for the role and again for rows, and the worker giving
//! the role back makes no wake-up syscall when there is nothing to take.
//!
//! Ringing takes the state lock, which a sleeper holds from its check until
//! it sleeps, and notifies after letting it go: a worker woken while the lock
//! is held (on one core the woken thread often runs at once) would block on
//! it, and the hand-back would cost two more futex calls and context switches
//! per batch. The order still holds: the ringer takes the lock after the
//! sleeper checked and began to wait, or before it checked.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::sync::{fence, AtomicBool, AtomicIsize, AtomicUsize, Condvar, Mutex, MutexGuard};

const NOBODY_WAITS: isize = isize::MAX;

/// Who holds the gatherer's role, and who waits for it.
#[derive(Debug)]
struct Role {
    held: bool,
    /// Workers asleep on `turn`.
    waiting: usize,
}

/// See the module's documentation.
#[derive(Debug)]
pub(crate) struct Doorbell {
    /// Rows of request messages sent (or flushed) and not yet popped
    /// (signed: a pop may count its rows off before the push that readied
    /// them counted them on).
    ready_rows: AtomicIsize,
    /// `ready_rows` a sleeper waits for; `NOBODY_WAITS` otherwise.
    wake_at: AtomicIsize,
    closed: AtomicBool,
    /// A submitter asked the gatherer to decide again now.
    nudged: AtomicBool,
    role: Mutex<Role>,
    /// The role's holder sleeps here for rows.
    bell: Condvar,
    /// Workers wait here for the role.
    turn: Condvar,
    /// Times a push or close rang (for tests and stats).
    rings: AtomicUsize,
}

/// Which sleepers a ring wakes.
enum Sleeper {
    Gatherer,
    NextInTurn,
    Nobody,
}

impl Doorbell {
    pub(crate) fn new() -> Doorbell {
        Doorbell {
            ready_rows: AtomicIsize::new(0),
            wake_at: AtomicIsize::new(NOBODY_WAITS),
            closed: AtomicBool::new(false),
            nudged: AtomicBool::new(false),
            role: Mutex::new(Role {
                held: false,
                waiting: 0,
            }),
            bell: Condvar::new(),
            turn: Condvar::new(),
            rings: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Role> {
        self.role.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `rows` more rows are ready to pop; rings when a sleeper waits for them.
    pub(crate) fn make_ready(&self, rows: usize) {
        let rows = rows as isize;
        let ready = self.ready_rows.fetch_add(rows, Ordering::SeqCst) + rows;
        fence(Ordering::SeqCst);
        if ready >= self.wake_at.load(Ordering::SeqCst) {
            self.ring();
        }
    }

    /// A worker popped `rows` rows.
    pub(crate) fn popped(&self, rows: usize) {
        self.ready_rows.fetch_sub(rows as isize, Ordering::SeqCst);
    }

    pub(crate) fn ready_rows(&self) -> isize {
        self.ready_rows.load(Ordering::SeqCst)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Marks the queue closed; true for the first call only. The caller
    /// has sent its close messages; it then rings.
    pub(crate) fn mark_closed(&self) -> bool {
        !self.closed.swap(true, Ordering::SeqCst)
    }

    /// Wakes the gatherer if it sleeps, or else one worker waiting for the
    /// role; later pushes do not ring again until someone sleeps anew.
    pub(crate) fn ring(&self) {
        let sleeper = {
            let role = self.lock();
            self.wake_at.store(NOBODY_WAITS, Ordering::SeqCst);
            Self::sleeper(&role)
        };
        // Notified once the lock is let go (see the module's comment).
        self.wake(sleeper);
        self.rings.fetch_add(1, Ordering::Relaxed);
    }

    fn sleeper(role: &Role) -> Sleeper {
        if role.held {
            Sleeper::Gatherer
        } else if role.waiting > 0 {
            Sleeper::NextInTurn
        } else {
            Sleeper::Nobody
        }
    }

    fn wake(&self, sleeper: Sleeper) {
        match sleeper {
            Sleeper::Gatherer => self.bell.notify_all(),
            Sleeper::NextInTurn => self.turn.notify_one(),
            Sleeper::Nobody => {}
        }
    }

    /// Whether a worker sleeps for rows or waits for the role (for tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn someone_waits(&self) -> bool {
        let role = self.lock();
        role.waiting > 0 || self.wake_at.load(Ordering::SeqCst) != NOBODY_WAITS
    }

    /// Times the doorbell rang since it was made.
    pub(crate) fn rings(&self) -> usize {
        self.rings.load(Ordering::Relaxed)
    }

    /// Wakes the gatherer to decide again now, whatever its row count (or
    /// the next one to sleep for rows, at once).
    pub(crate) fn nudge(&self) {
        let gathering = {
            let role = self.lock();
            self.nudged.store(true, Ordering::SeqCst);
            role.held
        };
        if gathering {
            self.bell.notify_all();
        }
    }

    /// Takes the gatherer's role, sleeping while another worker holds it;
    /// one letting it go wakes a waiter only when there is something to
    /// gather (see the module's comment).
    pub(crate) fn take_role(&self) -> GatherRole<'_> {
        let mut role = self.lock();
        while role.held {
            role.waiting += 1;
            role = self.turn.wait(role).unwrap_or_else(|e| e.into_inner());
            role.waiting -= 1;
        }
        role.held = true;
        GatherRole { doorbell: self }
    }

    /// Lets the role go; wakes one worker waiting for it when `more` (a
    /// request the last batch could not take) or ready rows or the close
    /// give it something to do, or else has the next push wake one.
    fn release_role(&self, more: bool) {
        let wake = {
            let mut role = self.lock();
            role.held = false;
            if role.waiting == 0 {
                false
            } else if more || self.is_closed() {
                true
            } else {
                // Store, fence, load, as a sleeper's (the module's comment).
                self.wake_at.store(1, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                if self.ready_rows() > 0 {
                    self.wake_at.store(NOBODY_WAITS, Ordering::SeqCst);
                    true
                } else {
                    false
                }
            }
        };
        if wake {
            self.turn.notify_one();
        }
    }
}

/// The gatherer's role, held by one worker at a time: only its holder
/// pops, and sleeps for rows. Dropping it lets it go as
/// [`GatherRole::release`] with more to do.
#[derive(Debug)]
pub(crate) struct GatherRole<'a> {
    doorbell: &'a Doorbell,
}

impl GatherRole<'_> {
    /// Sleeps until at least `rows` rows are ready to pop, the queue is
    /// closed, a submitter nudged, or `deadline` passes.
    pub(crate) fn wait_for_rows(&self, rows: usize, deadline: Option<Instant>) {
        let bell = self.doorbell;
        let rows = rows.clamp(1, NOBODY_WAITS as usize - 1) as isize;
        let mut role = bell.lock();
        loop {
            bell.wake_at.store(rows, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if bell.ready_rows.load(Ordering::SeqCst) >= rows
                || bell.closed.load(Ordering::SeqCst)
                || bell.nudged.swap(false, Ordering::SeqCst)
            {
                break;
            }
            role = match deadline {
                None => bell.bell.wait(role).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break;
                    }
                    bell.bell
                        .wait_timeout(role, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
        bell.wake_at.store(NOBODY_WAITS, Ordering::SeqCst);
    }

    /// Lets the role go; `more`: a request is left over for the next
    /// batch, so a waiting worker is woken at once.
    pub(crate) fn release(self, more: bool) {
        let doorbell = self.doorbell;
        std::mem::forget(self); // released here, not again by `drop`
        doorbell.release_role(more);
    }
}

impl Drop for GatherRole<'_> {
    fn drop(&mut self) {
        self.doorbell.release_role(true);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// One gather: take the role, wait for a row, pop exactly one, let go.
    fn gather_one(bell: &Doorbell) {
        let role = bell.take_role();
        while bell.ready_rows() < 1 {
            role.wait_for_rows(1, None);
        }
        bell.popped(1);
        role.release(false);
    }

    /// Two workers each gather one row of two pushed one at a time: in
    /// every interleaving both finish (a lost wake-up leaves one asleep,
    /// which loom reports as a deadlock) and nothing is popped twice.
    /// Interleavings of up to 4 preemptions (seconds; all of them take minutes).
    #[test]
    fn loom_two_workers_two_pushes_every_row_is_gathered() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(4);
        model.check(|| {
            let bell = Arc::new(Doorbell::new());
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let bell = bell.clone();
                    thread::spawn(move || gather_one(&bell))
                })
                .collect();
            bell.make_ready(1);
            bell.make_ready(1);
            for w in workers {
                w.join().unwrap();
            }
            assert_eq!(bell.ready_rows(), 0);
        });
    }

    /// A worker that leaves a carried request wakes the one waiting for
    /// the role with no push to ring for it.
    #[test]
    fn loom_a_carried_request_wakes_the_next_worker_without_a_push() {
        loom::model(|| {
            let bell = Arc::new(Doorbell::new());
            let carried = Arc::new(AtomicBool::new(false));
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (bell, carried) = (bell.clone(), carried.clone());
                    thread::spawn(move || {
                        let role = bell.take_role();
                        if carried.swap(false, Ordering::SeqCst) {
                            role.release(false); // took the carry: the batch it led
                        } else {
                            while bell.ready_rows() < 1 {
                                role.wait_for_rows(1, None);
                            }
                            bell.popped(1);
                            carried.store(true, Ordering::SeqCst); // popped one too many
                            role.release(true);
                        }
                    })
                })
                .collect();
            bell.make_ready(1);
            for w in workers {
                w.join().unwrap();
            }
            assert!(!carried.load(Ordering::SeqCst));
        });
    }

    /// Closing wakes every worker, the gatherer and those waiting for the
    /// role, one after another.
    #[test]
    fn loom_close_wakes_every_worker() {
        loom::model(|| {
            let bell = Arc::new(Doorbell::new());
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let bell = bell.clone();
                    thread::spawn(move || {
                        let role = bell.take_role();
                        while !bell.is_closed() {
                            role.wait_for_rows(1, None);
                        }
                        role.release(false);
                    })
                })
                .collect();
            if bell.mark_closed() {
                bell.ring();
            }
            for w in workers {
                w.join().unwrap();
            }
        });
    }
}
