//! The whole Rust core for one batch, without Python: `Batcher::submit` of
//! 1 or 64 one-row requests (validation, admission, queue push), then one
//! greedy `Batcher::next_batch` (pop, take, collate into the staging slot,
//! routes) and the batch's slot guard dropped. Reported per request: the floor under what
//! the Python binding adds on either side.
//!
//! Run: `cargo bench --bench batcher`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrobatch_core::{
    Batcher, BatcherConfig, DispatchRule, InputBytes, Readiness, Request, Sink, SlotBuffer, Worker,
};

const MAX_BATCH: usize = 64;
/// One float32[256] sample, as in the end-to-end bench.
const ROW: usize = 1024;
static SAMPLE: [u8; ROW] = [7; ROW];

fn bench_batcher(c: &mut Criterion) {
    let mut slot_memory: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; MAX_BATCH * ROW]).collect();
    let slots = slot_memory
        .iter_mut()
        // SAFETY: `slot_memory` lives until the end of this function, past the batcher.
        .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
        .collect();
    let rule = DispatchRule::new(MAX_BATCH, Duration::ZERO, 1, vec![]).expect("a valid rule");
    let config = BatcherConfig {
        rule,
        row_nbytes: vec![ROW],
        max_queue_size: 10_000,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: Vec::new(),
        max_batch_elements: None,
        bytes_limits: Default::default(),
        priorities: ferrobatch_core::Priorities::NONE,
        default_priority: None,
    };
    let batcher = Batcher::new(config, slots).expect("a valid batcher");
    let mut worker = Worker::new();
    let mut tickets: Vec<Arc<Request>> = Vec::with_capacity(MAX_BATCH);

    let mut group = c.benchmark_group("batcher/submit+next_batch");
    for n in [1usize, MAX_BATCH] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("greedy", n), &n, |b, &n| {
            b.iter(|| {
                for _ in 0..n {
                    // SAFETY: `SAMPLE` is static, so it outlives the request.
                    let input = unsafe { InputBytes::new(SAMPLE.as_ptr(), ROW) };
                    tickets.push(
                        batcher
                            .submit(Sink::EventLoop(0), 1, [input], None)
                            .expect("admitted"),
                    );
                }
                let batch = batcher.next_batch(&mut worker).expect("a batch");
                assert_eq!(batch.rows, n);
                batch.slot.release();
                // The submitter side drops its tickets once resolved.
                tickets.clear();
                black_box(batch.routes)
            })
        });
    }
    group.finish();
    drop(batcher);
    drop(slot_memory);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench_batcher
}
criterion_main!(benches);
