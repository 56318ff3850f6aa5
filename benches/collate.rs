//! Collation: N requests of S bytes each, every one in its own allocation,
//! copied back to back into a staging slot by `StagingRing::collate`, beside
//! one plain `copy_from_slice` of the same N * S bytes between two contiguous
//! buffers (the memcpy bandwidth collation is held to). Both report GB/s.
//!
//! Run: `cargo bench --bench collate`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use ferrobatch_core::{InputBytes, Request, SlotBuffer, StagingRing};

const REQUESTS: [usize; 3] = [1, 64, 256];
const SIZES: [(usize, &str); 4] =
    [(16, "16B"), (1024, "1KiB"), (64 * 1024, "64KiB"), (600 * 1024, "600KiB")];

/// A ring of one slot sized for `n` rows of `size` bytes, holding that slot,
/// and `n` taken requests whose bytes live in `_sources`.
struct Setup {
    ring: StagingRing,
    slot: usize,
    requests: Vec<Arc<Request>>,
    _sources: Vec<Vec<u8>>,
    _slot_memory: Vec<u8>,
}

fn setup(n: usize, size: usize) -> Setup {
    // Non-zero bytes so every page is really backed before timing starts.
    let sources: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 251 + 1) as u8; size]).collect();
    let mut slot_memory = vec![1u8; n * size];
    // SAFETY: `slot_memory` moves into the returned `Setup` next to the ring,
    // and a Vec's heap buffer does not move when the Vec does.
    let buffer = unsafe { SlotBuffer::new(slot_memory.as_mut_ptr(), slot_memory.len()) };
    let ring = StagingRing::new(vec![size], n, vec![vec![buffer]]).expect("a valid ring");
    let requests = sources
        .iter()
        .enumerate()
        .map(|(id, bytes)| {
            // SAFETY: `sources` moves into the `Setup` with the requests and
            // outlives them there; its heap buffers never move.
            let input = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
            let r = Arc::new(Request::new(id as u64, 0, 1, Box::new([input]), None));
            assert!(r.take(), "a fresh request is queued");
            r
        })
        .collect();
    let slot = ring.acquire();
    Setup { ring, slot, requests, _sources: sources, _slot_memory: slot_memory }
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
            let s = setup(n, size);
            group.bench_with_input(BenchmarkId::new("StagingRing::collate", n), &s, |b, s| {
                b.iter(|| black_box(s.ring.collate(s.slot, black_box(&s.requests))))
            });
            drop(s);
            let src = vec![3u8; total];
            let mut dst = vec![1u8; total];
            group.bench_with_input(BenchmarkId::new("copy_from_slice", n), &src, |b, src| {
                b.iter(|| {
                    dst.copy_from_slice(black_box(src));
                    black_box(dst.as_ptr());
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
        .measurement_time(Duration::from_millis(1500));
    targets = bench_collate
}
criterion_main!(benches);
