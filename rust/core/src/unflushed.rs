//! `Unflushed`: the rows one submitter queued on a greedy batcher
//! ([`Readiness::OnFlush`]) since its last flush.
//!
//! An event loop submits a burst of requests in one iteration; workers must
//! see the burst as one batch, not take its first request alone. So the
//! first submit of an iteration opens a count ([`Unflushed::open`] returns
//! true: the caller schedules one flush at the end of the iteration), every
//! submit adds its rows, and the flush makes them all ready at once
//! ([`Unflushed::flush`]). One flush per iteration, however many submits.

use std::sync::{Arc, Mutex};

use crate::{Batcher, Readiness};

/// Rows submitted to one batcher since the last flush; see the module docs.
#[derive(Debug, Default)]
pub struct Unflushed {
    /// Some while a flush is due: the batcher and the rows counted.
    due: Mutex<Option<(Arc<Batcher>, usize)>>,
}

impl Unflushed {
    /// Before submitting to `batcher`: true when a flush must be scheduled
    /// (the first submit since the last flush, to a batcher that waits for
    /// flushes). A submitter only ever submits to one batcher.
    pub fn open(&self, batcher: &Arc<Batcher>) -> bool {
        if batcher.readiness() != Readiness::OnFlush {
            return false;
        }
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        if due.is_some() {
            return false;
        }
        *due = Some((batcher.clone(), 0));
        true
    }

    /// After a submit of `rows` rows was queued: they wait for the flush.
    pub fn add(&self, rows: usize) {
        if let Some((_, n)) = &mut *self.due.lock().unwrap_or_else(|e| e.into_inner()) {
            *n = n.saturating_add(rows);
        }
    }

    /// Makes every row counted since the last flush ready for the workers.
    pub fn flush(&self) {
        let due = self.due.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((batcher, rows)) = due {
            batcher.flush(rows);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::{BatcherConfig, DispatchRule, InputBytes, Sink, SlotBuffer, Worker};

    const ROW: usize = 4;
    static BYTES: [u8; ROW] = [1, 2, 3, 4];

    #[test]
    fn a_burst_is_ready_at_its_one_flush_as_one_batch() {
        let mut store: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 8 * ROW]).collect();
        let slots = store
            .iter_mut()
            // SAFETY: `store` outlives the batcher (dropped at the end of the test).
            .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
            .collect();
        let config = BatcherConfig {
            rule: DispatchRule::new(8, Duration::ZERO, 1, vec![]).unwrap(),
            row_nbytes: vec![ROW],
            max_queue_size: 16,
            workers: 1,
            readiness: Readiness::OnFlush,
            layouts: Vec::new(),
            max_batch_elements: None,
            bytes_limits: Default::default(),
            priorities: crate::Priorities::NONE,
            default_priority: None,
        };
        let batcher = Arc::new(Batcher::new(config, slots).unwrap());
        let unflushed = Unflushed::default();
        let mut opened = 0;
        for _ in 0..3 {
            opened += usize::from(unflushed.open(&batcher));
            // SAFETY: static bytes outlive the batcher.
            let input = unsafe { InputBytes::new(BYTES.as_ptr(), ROW) };
            batcher
                .submit(Sink::EventLoop(0), 1, [input], None)
                .unwrap();
            unflushed.add(1);
        }
        assert_eq!(opened, 1, "one flush per burst");
        let (tx, rx) = mpsc::channel();
        let worker = {
            let batcher = batcher.clone();
            std::thread::spawn(move || {
                let batch = batcher.next_batch(&mut Worker::new()).map(|b| b.rows);
                let _ = tx.send(batch);
            })
        };
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "nothing is ready before the flush"
        );
        unflushed.flush();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), Some(3));
        assert!(unflushed.open(&batcher), "the next burst opens a new count");
        worker.join().unwrap();
        batcher.close();
        drop(store);
    }
}
