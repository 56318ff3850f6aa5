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
//! # Memory another process writes
//!
//! Any process mapping the segment may write anything into a ring: a bug,
//! a crash mid-push or a hostile neighbour. Nothing here trusts it: no loop
//! runs more than [`MAX_RETRIES`] rounds, a position that cannot be right
//! (a slot's sequence ahead of the index that should have moved past it)
//! is [`Corrupt`], and [`Ring::check`] tells its only consumer whether the
//! indices still bound the queue. What to do with a corrupt ring is the
//! owner's call ([`Ring::reset`]); values popped are validated by whoever
//! uses them.
//!
//! A producer killed between claiming a position and publishing it leaves
//! that position unreadable: consumers see the queue empty from there on,
//! with `head != tail` ([`Ring::stuck`]); the owner resets such a ring.

#[cfg(all(loom, test))]
use loom::sync::atomic::AtomicU64;
#[cfg(not(all(loom, test)))]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

const LINE: usize = 64;
/// `head`, then `tail`, each on a cache line of its own.
const HEADER: usize = 2 * LINE;
const SLOT: usize = 16;
const WORD: usize = 8;

/// Most rounds one push or pop takes: a race lost to another producer or
/// consumer costs one round, so far more than the processes sharing a
/// ring can cost means the indices lie.
pub const MAX_RETRIES: u32 = 1 << 12;

/// The ring's words break its invariants: someone wrote into it what the
/// algorithm never writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a shared ring holds words its algorithm never writes")
    }
}

/// Why a push did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// No room: the value, given back.
    Full(u64),
    Corrupt,
}

/// A view of a ring in memory someone else owns (see [`Ring::attach`]).
#[derive(Debug)]
pub struct Ring {
    /// The ring's words: `head`, `tail` (each at the start of its line),
    /// then `(seq, value)` per slot.
    base: *const AtomicU64,
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
        ring.reset();
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
            base: base as *const AtomicU64,
            mask: capacity as u64 - 1,
        }
    }

    pub fn capacity(&self) -> usize {
        (self.mask + 1) as usize
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `offset` is a multiple of 8 within the ring's bytes
        // (callers below; `pos & mask` keeps slots in range whatever the
        // indices hold), the memory is valid while `self` is (attach's
        // contract), and it is only ever accessed atomically.
        unsafe { &*self.base.add(offset / WORD) }
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
        self.atomic(HEADER + (pos & self.mask) as usize * SLOT + WORD)
    }

    /// Empties the ring, whatever its words held. Values pushed meanwhile
    /// may be lost, and a push racing the reset may leave a slot that the
    /// next push or pop finds [`Corrupt`]: the owner resets again.
    pub fn reset(&self) {
        self.head().store(0, Ordering::Relaxed);
        self.tail().store(0, Ordering::Relaxed);
        for i in 0..=self.mask {
            self.seq(i).store(i, Ordering::Relaxed);
            self.value(i).store(0, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Appends `value`; gives it back if the ring is full.
    pub fn push(&self, value: u64) -> Result<(), PushError> {
        let mut pos = self.tail().load(Ordering::Relaxed);
        for _ in 0..MAX_RETRIES {
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
                // Last lap's value is still there: full. (A slot that says
                // so in a ring whose indices say empty is corrupt; only the
                // consumer can tell, with `check`: with several consumers a
                // stalled one looks the same for a while.)
                return Err(PushError::Full(value));
            } else {
                // Another producer published `pos`, so it moved `tail` first
                // (before its Release of `seq`, which we acquired): an
                // unmoved tail means the slot's word is not the algorithm's.
                let now = self.tail().load(Ordering::Relaxed);
                if now == pos {
                    return Err(PushError::Corrupt);
                }
                pos = now;
            }
        }
        Err(PushError::Corrupt)
    }

    /// Takes the oldest value, if any.
    pub fn pop(&self) -> Result<Option<u64>, Corrupt> {
        let mut pos = self.head().load(Ordering::Relaxed);
        for _ in 0..MAX_RETRIES {
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
                        return Ok(Some(value));
                    }
                    Err(now) => pos = now,
                }
            } else if diff < 0 {
                return Ok(None); // not published yet: empty
            } else {
                // As in `push`: whoever moved the slot past `pos` moved
                // `head` first.
                let now = self.head().load(Ordering::Relaxed);
                if now == pos {
                    return Err(Corrupt);
                }
                pos = now;
            }
        }
        Err(Corrupt)
    }

    /// For the ring's only consumer: `Err` when the indices no longer bound
    /// the queue (`tail` behind `head`, or more than `capacity` ahead), or
    /// the slot at `head` holds a sequence other than "empty" (`head`) or
    /// "ready" (`head + 1`). Exact only there: with one consumer, `head`
    /// cannot move meanwhile, the consumer itself wrote `head` into that
    /// slot a lap ago, and producers cannot get a lap ahead of it.
    pub fn check(&self) -> Result<(), Corrupt> {
        let head = self.head().load(Ordering::SeqCst);
        let tail = self.tail().load(Ordering::SeqCst);
        let seq = self.seq(head).load(Ordering::SeqCst);
        if tail.wrapping_sub(head) > self.mask + 1 || seq.wrapping_sub(head) > 1 {
            return Err(Corrupt);
        }
        Ok(())
    }

    /// The position of the oldest value when positions were claimed that
    /// cannot be popped (`head != tail` yet nothing is ready): a producer
    /// died mid-push, or is merely slow, or someone wrote into the ring.
    /// The owner resets a ring stuck at the same position for long.
    pub fn stuck(&self) -> Option<u64> {
        let head = self.head().load(Ordering::SeqCst);
        let tail = self.tail().load(Ordering::SeqCst);
        (head != tail && self.seq(head).load(Ordering::SeqCst) != head.wrapping_add(1))
            .then_some(head)
    }

    /// Writes `value` over word `index` of the ring (0: head, 8: tail,
    /// then `seq`, `value` per slot from 16): what a buggy or hostile
    /// process can do, for the tests.
    #[cfg(all(test, not(miri), not(loom)))] // protocol_tests only
    pub(crate) fn scribble(&self, index: usize, value: u64) {
        self.atomic(index * WORD).store(value, Ordering::SeqCst);
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

#[cfg(all(test, not(loom)))]
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
        assert_eq!(r.push(99), Err(PushError::Full(99)));
        assert_eq!(r.len(), 4);
        assert_eq!(r.pop(), Ok(Some(10)));
        r.push(14).unwrap();
        assert_eq!(
            std::iter::from_fn(|| r.pop().unwrap()).collect::<Vec<_>>(),
            vec![11, 12, 13, 14]
        );
        assert!(r.is_empty());
        assert_eq!(r.pop(), Ok(None));
        assert_eq!(r.check(), Ok(()));
    }

    #[test]
    fn two_views_of_one_memory_share_the_queue() {
        let (m, a) = ring(8);
        // SAFETY: the same memory, made by `init` above, outliving `b`.
        let b = unsafe { Ring::attach(m.0.as_ptr() as *mut u8, 8) };
        a.push(1).unwrap();
        b.push(2).unwrap();
        assert_eq!(b.pop(), Ok(Some(1)));
        assert_eq!(a.pop(), Ok(Some(2)));
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
                        loop {
                            match r.push(v) {
                                Ok(()) => break,
                                Err(PushError::Full(back)) => v = back,
                                Err(PushError::Corrupt) => panic!("a sound ring found corrupt"),
                            }
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
                        match r.pop().expect("a sound ring found corrupt") {
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

    /// Words as another process could write them: every scribble ends in
    /// `Corrupt` or an ordinary answer within bounded time, never a spin.
    #[test]
    fn a_slot_sequence_ahead_of_its_index_is_corrupt_not_a_spin() {
        let (_m, r) = ring(8);
        r.seq(0).store(5, Ordering::SeqCst); // ahead of tail 0
        assert_eq!(r.push(1), Err(PushError::Corrupt));
        r.reset();
        r.push(1).unwrap();
        r.seq(1).store(9, Ordering::SeqCst); // ahead of head 1 + 1
        assert_eq!(r.pop(), Ok(Some(1)));
        assert_eq!(r.pop(), Err(Corrupt));
    }

    #[test]
    fn indices_out_of_bounds_are_corrupt_for_the_consumer() {
        let (_m, r) = ring(8);
        r.push(1).unwrap();
        r.head().store(u64::MAX - 3, Ordering::SeqCst);
        assert_eq!(r.pop(), Err(Corrupt), "a huge head spins no more");
        r.reset();
        r.head().store(1 << 40, Ordering::SeqCst);
        assert_eq!(r.check(), Err(Corrupt), "tail behind head");
        r.reset();
        r.tail().store(1 << 40, Ordering::SeqCst);
        assert_eq!(r.check(), Err(Corrupt));
        assert_eq!(r.pop(), Ok(None));
        r.reset();
        assert_eq!(r.check(), Ok(()));
        r.push(2).unwrap();
        assert_eq!(r.pop(), Ok(Some(2)));
    }

    /// A slot that says "full" while the indices say "empty": producers
    /// see no room, the consumer sees nothing to take.
    #[test]
    fn a_slot_claiming_full_in_an_empty_ring_is_corrupt() {
        let (_m, r) = ring(8);
        r.seq(0).store(0xfffe_feff_0000_0000, Ordering::SeqCst);
        assert_eq!(r.push(1), Err(PushError::Full(1)));
        assert_eq!(r.pop(), Ok(None));
        assert_eq!(r.check(), Err(Corrupt));
    }

    #[test]
    fn a_claimed_unpublished_position_is_stuck() {
        let (_m, r) = ring(4);
        assert_eq!(r.stuck(), None);
        r.tail().store(1, Ordering::SeqCst); // a producer claimed 0 and died
        r.push(7).unwrap();
        assert_eq!(r.pop(), Ok(None));
        assert_eq!(r.stuck(), Some(0));
        r.reset();
        assert_eq!(r.stuck(), None);
    }

    /// Random words in random places: every push and pop returns at once.
    #[test]
    fn scribbled_words_never_make_push_or_pop_loop() {
        let (_m, r) = ring(8);
        let words = Ring::bytes(8).unwrap() / WORD;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..if cfg!(miri) { 50 } else { 5_000 } {
            let at = (next() % words as u64) as usize;
            let v = next() >> (next() % 64);
            r.atomic(at * WORD).store(v, Ordering::SeqCst);
            let _ = r.push(next());
            let _ = r.pop();
            let _ = (r.check(), r.stuck(), r.len(), r.is_empty());
        }
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

/// Every interleaving of two producers and a consumer (`make loom`): each
/// value comes out once, and a sound ring is never found corrupt.
#[cfg(all(loom, test))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    struct Words(Vec<AtomicU64>);

    // SAFETY: the words are atomics; the Vec is never resized while shared.
    unsafe impl Send for Words {}
    // SAFETY: as above.
    unsafe impl Sync for Words {}

    fn ring(capacity: usize) -> (Arc<Words>, Ring) {
        let words = Ring::bytes(capacity).unwrap() / WORD;
        let memory = Arc::new(Words((0..words).map(|_| AtomicU64::new(0)).collect()));
        let ring = Ring {
            base: memory.0.as_ptr(),
            mask: capacity as u64 - 1,
        };
        for i in 0..capacity as u64 {
            ring.seq(i).store(i, Ordering::Relaxed);
        }
        (memory, ring)
    }

    fn view(memory: &Arc<Words>, capacity: usize) -> Ring {
        Ring {
            base: memory.0.as_ptr(),
            mask: capacity as u64 - 1,
        }
    }

    #[test]
    fn loom_ring_two_producers_one_consumer_exactly_once() {
        loom::model(|| {
            let (memory, consumer) = ring(2);
            let producers: Vec<_> = (0..2u64)
                .map(|p| {
                    let memory = memory.clone();
                    thread::spawn(move || {
                        let ring = view(&memory, 2);
                        assert_eq!(ring.push(10 + p), Ok(()), "room for both");
                    })
                })
                .collect();
            let mut got = Vec::new();
            for _ in 0..2 {
                if let Some(v) = consumer.pop().expect("a sound ring found corrupt") {
                    got.push(v);
                }
                assert_eq!(consumer.check(), Ok(()));
            }
            for p in producers {
                p.join().unwrap();
            }
            while let Some(v) = consumer.pop().expect("a sound ring found corrupt") {
                got.push(v);
            }
            got.sort_unstable();
            assert_eq!(got, vec![10, 11]);
        });
    }

    #[test]
    fn loom_ring_wraps_a_lap_under_a_racing_consumer() {
        loom::model(|| {
            let (memory, ring) = ring(2);
            ring.push(1).unwrap();
            ring.push(2).unwrap();
            let consumer = {
                let memory = memory.clone();
                thread::spawn(move || {
                    let ring = view(&memory, 2);
                    let mut got = Vec::new();
                    for _ in 0..3 {
                        if let Some(v) = ring.pop().expect("a sound ring found corrupt") {
                            got.push(v);
                        }
                    }
                    got
                })
            };
            let pushed = match ring.push(3) {
                Ok(()) => true,
                Err(PushError::Full(3)) => false,
                Err(e) => panic!("{e:?}"),
            };
            let mut got = consumer.join().unwrap();
            while let Some(v) = ring.pop().unwrap() {
                got.push(v);
            }
            let mut want = vec![1, 2];
            if pushed {
                want.push(3);
            }
            assert_eq!(got, want, "FIFO, each once");
        });
    }
}
