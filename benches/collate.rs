//! Collation: N requests of S bytes each, every one in its own allocation,
//! copied back to back into a staging slot by `StagingRing::collate`. All
//! figures are GB/s of request bytes. References, for the same N * S bytes:
//!
//! * `copy_from_slice`: one copy between two contiguous buffers, the memcpy
//!   bandwidth collation is held to;
//! * `copy_from_slice per request`: N copies of S bytes between contiguous
//!   buffers, i.e. memcpy with collation's copy sizes. A gap between it and
//!   collation is collation's own cost; a gap between it and the single copy
//!   comes from the copy size.
//!
//! Sources and the slot are 64-byte aligned, as torch allocates them. The
//! `collate, sources 16 B behind their rows` case places every source 16
//! bytes before its slot row modulo 4 KiB: glibc's `rep movsb` memcpy (used
//! for copies from a few KiB up to the non-temporal threshold) runs several
//! times slower at that relative placement on some CPUs (AMD Zen 3 with
//! glibc < 2.39), and this case shows whether collation inherits that.
//!
//! Run: `cargo bench --bench collate`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use ferrobatch_core::{HeldSlot, InputBytes, Request, Sink, SlotBuffer, StagingRing};

const REQUESTS: [usize; 3] = [1, 64, 256];
const SIZES: [(usize, &str); 4] = [
    (16, "16B"),
    (1024, "1KiB"),
    (64 * 1024, "64KiB"),
    (600 * 1024, "600KiB"),
];
const ALIGN: usize = 64;
const PAGE: usize = 4096;

/// `len` bytes of `fill` at an address congruent to `residue` modulo `modulus`.
struct Buf {
    store: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, modulus: usize, residue: usize, fill: u8) -> Buf {
        // Non-zero fill: every page is backed before timing starts.
        let store = vec![fill; len + modulus];
        let base = store.as_ptr() as usize;
        let start = (residue + modulus - base % modulus) % modulus;
        Buf { store, start, len }
    }

    fn aligned(len: usize, fill: u8) -> Buf {
        Buf::new(len, ALIGN, 0, fill)
    }

    fn bytes(&self) -> &[u8] {
        &self.store[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.store[self.start..self.start + self.len]
    }
}

/// A ring of one slot sized for `n` rows of `size` bytes, holding that slot,
/// and `n` taken requests whose bytes live in `_sources`: 64-byte aligned, or
/// with `behind_rows`, each 16 bytes before its slot row modulo 4 KiB.
struct Setup {
    slot: HeldSlot,
    requests: Vec<Arc<Request>>,
    _sources: Vec<Buf>,
    _slot_memory: Buf,
}

fn setup(n: usize, size: usize, behind_rows: bool) -> Setup {
    let mut slot_memory = Buf::aligned(n * size, 1);
    let slot_bytes = slot_memory.bytes_mut();
    let slot_addr = slot_bytes.as_ptr() as usize;
    // SAFETY: `slot_memory` moves into the returned `Setup` beside the guard
    // that keeps the ring (the ring is dropped first, with the guard),
    // and a Vec's heap buffer does not move when the Vec does.
    let buffer = unsafe { SlotBuffer::new(slot_bytes.as_mut_ptr(), slot_bytes.len()) };
    let ring = Arc::new(StagingRing::new(vec![size], n, vec![vec![buffer]]).expect("a valid ring"));
    let sources: Vec<Buf> = (0..n)
        .map(|i| {
            let fill = (i % 251 + 1) as u8;
            if behind_rows {
                Buf::new(size, PAGE, (slot_addr + i * size + PAGE - 16) % PAGE, fill)
            } else {
                Buf::aligned(size, fill)
            }
        })
        .collect();
    let requests = sources
        .iter()
        .enumerate()
        .map(|(id, buf)| {
            let bytes = buf.bytes();
            // SAFETY: `sources` moves into the `Setup` with the requests and
            // outlives them there; its heap buffers never move.
            let input = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
            let r = Arc::new(Request::new(
                id as u64,
                Sink::EventLoop(0),
                1,
                [input],
                None,
            ));
            assert!(r.take(), "a fresh request is queued");
            r
        })
        .collect();
    let slot = ring.acquire();
    Setup {
        slot,
        requests,
        _sources: sources,
        _slot_memory: slot_memory,
    }
}

fn bench_collate(c: &mut Criterion) {
    for (size, label) in SIZES {
        let mut group = c.benchmark_group(format!("collate/{label}"));
        if size >= 64 * 1024 {
            // Up to 150 MB per iteration: a few long iterations per sample.
            group.sampling_mode(SamplingMode::Flat).sample_size(10);
        }
        for n in REQUESTS {
            let total = n * size;
            group.throughput(Throughput::BytesDecimal(total as u64));
            for (name, behind_rows) in [
                ("StagingRing::collate", false),
                ("StagingRing::collate, sources 16 B behind their rows", true),
            ] {
                let mut s = setup(n, size, behind_rows);
                group.bench_function(BenchmarkId::new(name, n), |b| {
                    // SAFETY: `setup` took every request and none is resolved.
                    b.iter(|| black_box(unsafe { s.slot.collate(black_box(&s.requests)) }))
                });
            }
            let src = Buf::aligned(total, 3);
            let mut dst = Buf::aligned(total, 1);
            group.bench_with_input(BenchmarkId::new("copy_from_slice", n), &src, |b, src| {
                b.iter(|| {
                    dst.bytes_mut().copy_from_slice(black_box(src.bytes()));
                    black_box(dst.bytes().as_ptr());
                })
            });
            let id = BenchmarkId::new("copy_from_slice per request", n);
            group.bench_with_input(id, &src, |b, src| {
                b.iter(|| {
                    let (from, to) = (black_box(src.bytes()), dst.bytes_mut());
                    for i in 0..n {
                        let range = i * size..(i + 1) * size;
                        to[range.clone()].copy_from_slice(&from[range]);
                    }
                    black_box(to.as_ptr());
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench_collate
}
criterion_main!(benches);
