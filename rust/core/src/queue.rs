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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use crate::{CoreError, Request};

/// What travels on the queue.
#[derive(Debug)]
pub enum Message {
    Request(Arc<Request>),
    /// Tells one worker that no request will follow: dispatch and stop.
    Close,
}

#[derive(Debug)]
pub struct RequestQueue {
    tx: Sender<Message>,
    rx: Receiver<Message>,
    capacity: usize,
    /// Request messages the channel may hold, withdrawn ones included.
    room: usize,
    waiting: AtomicUsize,
    in_channel: AtomicUsize,
    closed: AtomicBool,
}

/// What a pop saw.
#[derive(Debug)]
pub enum Popped {
    Request(Arc<Request>),
    Close,
    /// Nothing arrived (non-blocking pop, or the wait timed out).
    Empty,
}

impl RequestQueue {
    pub fn new(capacity: usize, wake_slots: usize) -> RequestQueue {
        let room = (2 * capacity).max(capacity + 1024);
        let (tx, rx) = crossbeam_channel::bounded(room + wake_slots.max(1));
        RequestQueue {
            tx,
            rx,
            capacity,
            room,
            waiting: AtomicUsize::new(0),
            in_channel: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        }
    }

    /// Pushes a request, or refuses it at once when full or closed.
    pub fn push(&self, request: Arc<Request>) -> Result<(), CoreError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(CoreError::Closed);
        }
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.capacity {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(CoreError::QueueFull { capacity: self.capacity });
        }
        if self.in_channel.fetch_add(1, Ordering::AcqRel) >= self.room {
            // Full of withdrawn requests no worker has popped yet (a stuck model).
            self.in_channel.fetch_sub(1, Ordering::AcqRel);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(CoreError::QueueFull { capacity: self.capacity });
        }
        // Cannot fail for lack of room: `in_channel` reserved a place, and close
        // messages have places of their own.
        self.tx
            .try_send(Message::Request(request))
            .expect("in_channel reserved a place in the channel");
        Ok(())
    }

    /// Pops without blocking.
    pub fn try_pop(&self) -> Popped {
        match self.rx.try_recv() {
            Ok(msg) => self.popped(msg),
            Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => Popped::Empty,
        }
    }

    /// Pops, blocking until a message arrives or `deadline` passes.
    pub fn pop_until(&self, deadline: Option<Instant>) -> Popped {
        let msg = match deadline {
            None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => self.rx.recv_deadline(d),
        };
        match msg {
            Ok(msg) => self.popped(msg),
            Err(_) => Popped::Empty,
        }
    }

    fn popped(&self, msg: Message) -> Popped {
        match msg {
            Message::Request(r) => {
                self.in_channel.fetch_sub(1, Ordering::AcqRel);
                Popped::Request(r)
            }
            Message::Close => Popped::Close,
        }
    }

    /// Records that one pushed request left the queued state (taken or withdrawn).
    /// Call exactly once per request, by whoever won its transition.
    pub fn left(&self) {
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }

    /// Refuses new requests from now on and sends one close message per
    /// worker, behind every request already accepted.
    pub fn close(&self, workers: usize) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        for _ in 0..workers {
            // Never blocks: request messages cannot take the last `wake_slots` places.
            let _ = self.tx.try_send(Message::Close);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Live requests waiting: pushed and not yet taken or withdrawn.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u64) -> Arc<Request> {
        Arc::new(Request::new(id, 0, 1, Box::new([]), None))
    }

    #[test]
    fn refuses_beyond_capacity_then_admits_once_a_request_left() {
        let q = RequestQueue::new(2, 1);
        q.push(req(1)).unwrap();
        q.push(req(2)).unwrap();
        assert_eq!(q.push(req(3)), Err(CoreError::QueueFull { capacity: 2 }));
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        assert_eq!(q.len(), 2, "popped is not yet taken");
        q.left();
        q.push(req(3)).unwrap();
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn withdrawn_requests_do_not_crowd_out_new_ones_until_the_channel_is_full() {
        let q = RequestQueue::new(2, 1);
        for id in 0..q.room as u64 {
            q.push(req(id)).unwrap();
            q.left(); // withdrawn at once; still in the channel
        }
        assert_eq!(q.len(), 0);
        assert!(matches!(q.push(req(9)), Err(CoreError::QueueFull { .. })), "channel full");
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 0));
        q.push(req(10)).unwrap();
        q.close(1); // fits in the wake slot
    }

    #[test]
    fn close_refuses_new_requests_and_queues_behind_accepted_ones() {
        let q = RequestQueue::new(4, 2);
        q.push(req(1)).unwrap();
        q.close(2);
        assert_eq!(q.push(req(2)), Err(CoreError::Closed));
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        assert!(matches!(q.try_pop(), Popped::Close));
        assert!(matches!(q.try_pop(), Popped::Close));
        assert!(matches!(q.try_pop(), Popped::Empty));
    }

    #[test]
    fn close_fits_even_when_the_queue_is_full() {
        let q = RequestQueue::new(1, 3);
        q.push(req(1)).unwrap();
        q.close(3); // must not block
        assert_eq!(q.len(), 1);
    }
}
