//! The bounded request queue: crossbeam's array channel (lock-free push and
//! pop; blocking waits park the thread) plus admission control.
//!
//! Admission counts *requests* waiting: `waiting` is raised before a push and
//! lowered when a worker pops, so at most `capacity` requests are ever queued.
//! The channel itself has room for `capacity + wake_slots` messages, so the
//! close messages (one per worker) always fit.

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
    waiting: AtomicUsize,
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
        let (tx, rx) = crossbeam_channel::bounded(capacity + wake_slots.max(1));
        RequestQueue { tx, rx, capacity, waiting: AtomicUsize::new(0), closed: AtomicBool::new(false) }
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
        // Cannot fail for lack of room: `waiting` reserved a place, and close
        // messages have places of their own.
        self.tx
            .try_send(Message::Request(request))
            .expect("admission control reserved a place in the channel");
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
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Popped::Request(r)
            }
            Message::Close => Popped::Close,
        }
    }

    /// Refuses new requests from now on and sends one close message per
    /// worker, behind every request already accepted.
    pub fn close(&self, workers: usize) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        for _ in 0..workers {
            // Blocking send: the channel has a place per worker beyond capacity.
            let _ = self.tx.send(Message::Close);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Requests queued and not yet popped by a worker.
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
    fn refuses_beyond_capacity_then_admits_after_a_pop() {
        let q = RequestQueue::new(2, 1);
        q.push(req(1)).unwrap();
        q.push(req(2)).unwrap();
        assert_eq!(q.push(req(3)), Err(CoreError::QueueFull { capacity: 2 }));
        assert!(matches!(q.try_pop(), Popped::Request(r) if r.id == 1));
        q.push(req(3)).unwrap();
        assert_eq!(q.len(), 2);
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
