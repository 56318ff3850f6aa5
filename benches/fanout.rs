//! Fan-out bookkeeping: `Routes::for_batch`, which lays a batch's rows out
//! per request and groups the routes by the event loop to wake. Reported per
//! request (elements/s), for batches from one request to `max_batch_size`
//! (64), from one event loop and from four interleaved ones.
//!
//! Run: `cargo bench --bench fanout`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrobatch_core::{Request, Routes, Sink};

fn batch(n: usize, loops: u32) -> Vec<Arc<Request>> {
    (0..n)
        .map(|i| {
            Arc::new(Request::new(
                i as u64,
                Sink::EventLoop(i as u32 % loops),
                1,
                ferrobatch_core::Inputs::default(),
                None,
            ))
        })
        .collect()
}

fn bench_fanout(c: &mut Criterion) {
    let mut group = c.benchmark_group("fanout/Routes::for_batch");
    for (n, loops) in [(1usize, 1u32), (16, 1), (64, 1), (64, 4)] {
        let requests = batch(n, loops);
        assert_eq!(Routes::for_batch(&requests).len(), n);
        group.throughput(Throughput::Elements(n as u64));
        let id = BenchmarkId::new(format!("{loops} loop(s)"), n);
        group.bench_with_input(id, &requests, |b, requests| {
            b.iter(|| black_box(Routes::for_batch(black_box(requests))))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench_fanout
}
criterion_main!(benches);
