//! A bounded lock-free multi-producer multi-consumer queue of `u64`s that
//! lives in memory it does not own (a shared mapping), after Dmitry Vyukov's
//! bounded MPMC queue (the algorithm of crossbeam's `ArrayQueue`).
//!
//! Layout: `head` and `tail` on cache lines of their own, then `capacity`
//! slots of `(seq, value)`. Slot `i` starts with `seq = i`. A producer that
//! reads `seq == pos` at `slots[pos & mask]` claims `pos` by moving `tail`
//! from `pos` to `pos + 1`, writes the value, then stores `seq = pos + 1`
//! (Release): the value is readable. A consumer that reads
//! `seq == pos + 1` claims `pos` by moving `head`, reads the value, then
//! stores `seq = pos + capacity` (Release): the slot is free for the next
//! lap. Everything is an atomic of the mapping, so processes that map the
//! same memory share the queue.
//!
//! A producer killed between claiming a position and publishing it leaves
//! that position unreadable: consumers see the queue empty from there on.
//! The window is a few instructions long.

use std::sync::atomic::{AtomicU64, Ordering};

const LINE: usize = 64;
/// `head`, then `tail`, each on a cache line of its own.
const HEADER: usize = 2 * LINE;
const SLOT: usize = 16;

/// A view of a ring in memory someone else owns (see [`Ring::attach`]).
#[derive(Debug)]
pub struct Ring {
    base: *const u8,
    mask: u64,
}

// SAFETY: every access to the ring's memory goes through atomics; the
// memory outlives the view (the contract of `attach`).
unsafe impl Send for Ring {}
// SAFETY: as above: shared use is what the algorithm is for.
unsafe impl Sync for Ring {}

impl Ring {
    /// Bytes a ring of `capacity` slots takes.
    pub fn bytes(capacity: usize) -> Option<usize> {
        capacity.checked_mul(SLOT)?.checked_add(HEADER)
    }

    /// Makes an empty ring of `capacity` slots (a power of two) at `base`.
    ///
    /// # Safety
    /// `base` is 64-byte aligned and valid for reads and writes of
    /// `Ring::bytes(capacity)` bytes for as long as any view of the ring is
    /// used, and nobody else uses that memory while it is initialised.
    pub unsafe fn init(base: *mut u8, capacity: usize) -> Ring {
        assert!(capacity.is_power_of_two());
        // SAFETY: the caller gives us the memory, aligned and in bounds.
        let ring = unsafe { Ring::attach(base, capacity) };
        ring.head().store(0, Ordering::Relaxed);
        ring.tail().store(0, Ordering::Relaxed);
        for i in 0..capacity {
            ring.seq(i as u64).store(i as u64, Ordering::Relaxed);
            ring.value(i as u64).store(0, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::Release);
        ring
    }

    /// A view of a ring [`Ring::init`] made at `base` (here or in another
    /// process mapping the same memory).
    ///
    /// # Safety
    /// `base` holds a ring of `capacity` slots made by `init`, 64-byte
    /// aligned and valid for `Ring::bytes(capacity)` bytes for as long as
    /// the view is used, and only ever accessed through ring views.
    pub unsafe fn attach(base: *mut u8, capacity: usize) -> Ring {
        debug_assert!(capacity.is_power_of_two());
        debug_assert_eq!(base as usize % LINE, 0);
        Ring {
            base,
            mask: capacity as u64 - 1,
        }
    }

    pub fn capacity(&self) -> usize {
        (self.mask + 1) as usize
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `offset` is within the ring's bytes and 8-byte aligned
        // (callers below), the memory is valid while `self` is (attach's
        // contract), and it is only ever accessed atomically.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    fn head(&self) -> &AtomicU64 {
        self.atomic(0)
    }

    fn tail(&self) -> &AtomicU64 {
        self.atomic(LINE)
    }

    fn seq(&self, pos: u64) -> &AtomicU64 {
        self.atomic(HEADER + (pos & self.mask) as usize * SLOT)
    }

    fn value(&self, pos: u64) -> &AtomicU64 {
        self.atomic(HEADER + (pos & self.mask) as usize * SLOT + 8)
    }

    /// Appends `value`; gives it back if the ring is full.
    pub fn push(&self, value: u64) -> Result<(), u64> {
        let mut pos = self.tail().load(Ordering::Relaxed);
        loop {
            let seq = self.seq(pos).load(Ordering::Acquire);
            let diff = seq.wrapping_sub(pos) as i64;
            if diff == 0 {
                match self.tail().compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        self.value(pos).store(value, Ordering::Relaxed);
                        self.seq(pos).store(pos.wrapping_add(1), Ordering::Release);
                        return Ok(());
                    }
                    Err(now) => pos = now,
                }
            } else if diff < 0 {
                return Err(value); // the slot still holds last lap's value: full
            } else {
                pos = self.tail().load(Ordering::Relaxed);
            }
        }
    }

    /// Takes the oldest value, if any.
    pub fn pop(&self) -> Option<u64> {
        let mut pos = self.head().load(Ordering::Relaxed);
        loop {
            let seq = self.seq(pos).load(Ordering::Acquire);
            let diff = seq.wrapping_sub(pos.wrapping_add(1)) as i64;
            if diff == 0 {
                match self.head().compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        let value = self.value(pos).load(Ordering::Relaxed);
                        self.seq(pos)
                            .store(pos.wrapping_add(self.mask + 1), Ordering::Release);
                        return Some(value);
                    }
                    Err(now) => pos = now,
                }
            } else if diff < 0 {
                return None; // not published yet: empty
            } else {
                pos = self.head().load(Ordering::Relaxed);
            }
        }
    }

    /// True when nothing is ready to pop (a snapshot).
    pub fn is_empty(&self) -> bool {
        let pos = self.head().load(Ordering::SeqCst);
        self.seq(pos).load(Ordering::SeqCst) != pos.wrapping_add(1)
    }

    /// Values pushed and not popped (a snapshot; may count claims not yet
    /// published).
    pub fn len(&self) -> usize {
        let tail = self.tail().load(Ordering::SeqCst);
        let head = self.head().load(Ordering::SeqCst);
        tail.wrapping_sub(head).min(self.mask + 1) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::{Arc, Barrier};

    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);

    /// Heap memory standing in for a mapping: 64-byte aligned.
    struct Memory(Vec<Line>);

    fn ring(capacity: usize) -> (Memory, Ring) {
        let lines = Ring::bytes(capacity).unwrap().div_ceil(64);
        let mut memory = Memory(vec![Line([0u8; 64]); lines]);
        // SAFETY: the memory is aligned, large enough, and outlives the ring
        // in every test (the tuple keeps it).
        let ring = unsafe { Ring::init(memory.0.as_mut_ptr().cast(), capacity) };
        (memory, ring)
    }

    #[test]
    fn fifo_until_full_then_refuses() {
        let (_m, r) = ring(4);
        assert!(r.is_empty());
        for v in 10..14 {
            r.push(v).unwrap();
        }
        assert_eq!(r.push(99), Err(99));
        assert_eq!(r.len(), 4);
        assert_eq!(r.pop(), Some(10));
        r.push(14).unwrap();
        assert_eq!(
            std::iter::from_fn(|| r.pop()).collect::<Vec<_>>(),
            vec![11, 12, 13, 14]
        );
        assert!(r.is_empty());
        assert_eq!(r.pop(), None);
    }

    #[test]
    fn two_views_of_one_memory_share_the_queue() {
        let (m, a) = ring(8);
        // SAFETY: the same memory, made by `init` above, outliving `b`.
        let b = unsafe { Ring::attach(m.0.as_ptr() as *mut u8, 8) };
        a.push(1).unwrap();
        b.push(2).unwrap();
        assert_eq!(b.pop(), Some(1));
        assert_eq!(a.pop(), Some(2));
    }

    /// Producers and consumers race over many laps: every value comes out
    /// exactly once, and each producer's values in the order pushed.
    #[test]
    fn concurrent_producers_and_consumers_lose_and_duplicate_nothing() {
        const PRODUCERS: u64 = 4;
        const CONSUMERS: usize = 2;
        const PER: u64 = if cfg!(miri) { 200 } else { 100_000 };
        let (memory, r) = ring(64);
        let r = Arc::new(r);
        let barrier = Arc::new(Barrier::new(PRODUCERS as usize + CONSUMERS));
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let (r, barrier) = (r.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    for i in 0..PER {
                        let mut v = (p << 32) | i;
                        while let Err(back) = r.push(v) {
                            v = back;
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let total = PRODUCERS * PER;
        let popped = Arc::new(AtomicU64::new(0));
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let (r, barrier, popped) = (r.clone(), barrier.clone(), popped.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut got = Vec::new();
                    while popped.load(Ordering::Relaxed) < total {
                        match r.pop() {
                            Some(v) => {
                                popped.fetch_add(1, Ordering::Relaxed);
                                got.push(v);
                            }
                            None => std::thread::yield_now(),
                        }
                    }
                    got
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let mut all = HashSet::new();
        for c in consumers {
            let got = c.join().unwrap();
            // Per consumer, each producer's values come in increasing order.
            let mut last = [None::<u64>; PRODUCERS as usize];
            for v in &got {
                let (p, i) = ((v >> 32) as usize, v & 0xffff_ffff);
                assert!(last[p].is_none_or_less(i), "producer {p} out of order");
                last[p] = Some(i);
                assert!(all.insert(*v), "{v:#x} popped twice");
            }
        }
        assert_eq!(all.len() as u64, total);
        assert!(r.is_empty());
        drop(memory);
    }

    trait LessThan {
        fn is_none_or_less(&self, i: u64) -> bool;
    }

    impl LessThan for Option<u64> {
        fn is_none_or_less(&self, i: u64) -> bool {
            match self {
                None => true,
                Some(prev) => *prev < i,
            }
        }
    }
}
