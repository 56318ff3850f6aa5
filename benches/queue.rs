//! Push + pop of `Arc<Request>` through ferrobatch's `RequestQueue`, beside
//! crossbeam's `ArrayQueue` (bounded) and `SegQueue` (unbounded) carrying the
//! same payload.
//!
//! * `queue/uncontended`: one thread pushes one request and pops it back, so
//!   the figure is the cost of one push plus one pop.
//! * `queue/1p1c`, `queue/2p1c`, `queue/4p1c`, `queue/8p1c`: producers on
//!   their own threads push pre-made requests while one consumer pops them
//!   all (the native front-end's runtime threads, or event loops, submitting
//!   to one model). Threads start together on a barrier; the time is from
//!   the first thread's start to the last thread's stop (`iter_custom`), per
//!   request. More producers than cores measure the queue under preemption.
//!
//! Requests are made before the clock starts and dropped after it stops, so
//! no allocation or reference counting is timed; the consumer keeps what it
//! pops in a pre-sized vector for the same reason. A pop from `RequestQueue`
//! is followed by `left()`, as the batcher does once it has taken the
//! request: that is what frees its place under `max_queue_size`.
//!
//! Run: `cargo bench --bench queue`.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::{ArrayQueue, SegQueue};
use ferrobatch_core::queue::Popped;
use ferrobatch_core::{InputBytes, Request, RequestQueue, Sink};

/// Bounded capacity for the bounded queues (the Python default is 10 000).
const CAPACITY: usize = 4096;
/// The bytes every request points at: one 256-float sample.
static SAMPLE: [u8; 1024] = [0; 1024];

fn requests(n: u64, first_id: u64) -> Vec<Arc<Request>> {
    (first_id..first_id + n)
        .map(|id| {
            // SAFETY: `SAMPLE` is static, so it outlives every request.
            let input = unsafe { InputBytes::new(SAMPLE.as_ptr(), SAMPLE.len()) };
            Arc::new(Request::new(id, Sink::EventLoop(0), 1, [input], None))
        })
        .collect()
}

/// The operations the bench needs from each queue. `try_push` hands the
/// request back when there is no room, so nothing is lost while spinning.
trait BenchQueue: Send + Sync + 'static {
    const NAME: &'static str;
    fn make(producers: usize) -> Self;
    fn try_push(&self, r: Arc<Request>) -> Result<(), Arc<Request>>;
    fn try_pop(&self) -> Option<Arc<Request>>;
}

struct Ferrobatch {
    queue: RequestQueue,
}

impl BenchQueue for Ferrobatch {
    const NAME: &'static str = "ferrobatch RequestQueue";

    fn make(_producers: usize) -> Self {
        Ferrobatch {
            queue: RequestQueue::new(CAPACITY, 1),
        }
    }

    fn try_push(&self, r: Arc<Request>) -> Result<(), Arc<Request>> {
        // A refused push hands the request back (the queue is never closed
        // here, so only for lack of room).
        self.queue.push(r).map_err(|e| e.into_request())
    }

    fn try_pop(&self) -> Option<Arc<Request>> {
        match self.queue.try_pop() {
            Popped::Request(r) => {
                self.queue.left(&r);
                Some(r)
            }
            Popped::Close | Popped::Empty => None,
        }
    }
}

struct Array(ArrayQueue<Arc<Request>>);

impl BenchQueue for Array {
    const NAME: &'static str = "crossbeam ArrayQueue";

    fn make(_producers: usize) -> Self {
        Array(ArrayQueue::new(CAPACITY))
    }

    fn try_push(&self, r: Arc<Request>) -> Result<(), Arc<Request>> {
        self.0.push(r)
    }

    fn try_pop(&self) -> Option<Arc<Request>> {
        self.0.pop()
    }
}

struct Seg(SegQueue<Arc<Request>>);

impl BenchQueue for Seg {
    const NAME: &'static str = "crossbeam SegQueue";

    fn make(_producers: usize) -> Self {
        Seg(SegQueue::new())
    }

    fn try_push(&self, r: Arc<Request>) -> Result<(), Arc<Request>> {
        self.0.push(r);
        Ok(())
    }

    fn try_pop(&self) -> Option<Arc<Request>> {
        self.0.pop()
    }
}

/// One request pushed and popped back by the same thread, `iters` times.
fn uncontended<Q: BenchQueue>(iters: u64) -> Duration {
    let q = Q::make(1);
    let mut r = requests(1, 0).pop().expect("one request");
    let start = Instant::now();
    for _ in 0..iters {
        if q.try_push(black_box(r)).is_err() {
            unreachable!("an empty queue refused a push");
        }
        r = black_box(q.try_pop().expect("the request just pushed"));
    }
    start.elapsed()
}

/// `producers` threads push `iters` requests in all; this thread pops them.
fn contended<Q: BenchQueue>(iters: u64, producers: usize) -> Duration {
    let q = Q::make(producers);
    let per = iters / producers as u64;
    let batches: Vec<Vec<Arc<Request>>> = (0..producers as u64)
        .map(|p| {
            let n = if p + 1 == producers as u64 {
                iters - per * p
            } else {
                per
            };
            requests(n, p * per)
        })
        .collect();
    let mut popped: Vec<Arc<Request>> = Vec::with_capacity(iters as usize);
    let barrier = Barrier::new(producers + 1);
    let (q, barrier) = (&q, &barrier);
    let elapsed = std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .into_iter()
            .map(|batch| {
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for mut r in batch {
                        while let Err(back) = q.try_push(r) {
                            r = back;
                            std::hint::spin_loop();
                        }
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        barrier.wait();
        let mut first = Instant::now();
        while (popped.len() as u64) < iters {
            match q.try_pop() {
                Some(r) => popped.push(r),
                None => std::hint::spin_loop(),
            }
        }
        let mut last = Instant::now();
        for h in handles {
            let (start, stop) = h.join().expect("producer thread");
            first = first.min(start);
            last = last.max(stop);
        }
        last.duration_since(first)
    });
    assert_eq!(
        popped.len() as u64,
        iters,
        "every request pushed was popped"
    );
    drop(popped);
    elapsed
}

fn bench_queues(c: &mut Criterion) {
    let mut group = c.benchmark_group("queue/uncontended");
    group.throughput(Throughput::Elements(1));
    group.bench_function(Ferrobatch::NAME, |b| {
        b.iter_custom(uncontended::<Ferrobatch>)
    });
    group.bench_function(Array::NAME, |b| b.iter_custom(uncontended::<Array>));
    group.bench_function(Seg::NAME, |b| b.iter_custom(uncontended::<Seg>));
    group.finish();

    for producers in [1usize, 2, 4, 8] {
        let mut group = c.benchmark_group(format!("queue/{producers}p1c"));
        group.throughput(Throughput::Elements(1));
        // Two-thread runs vary with scheduling on a small machine: fewer,
        // longer samples.
        group.sample_size(20);
        group.bench_with_input(
            BenchmarkId::new(Ferrobatch::NAME, producers),
            &producers,
            |b, &p| b.iter_custom(|iters| contended::<Ferrobatch>(iters, p)),
        );
        group.bench_with_input(
            BenchmarkId::new(Array::NAME, producers),
            &producers,
            |b, &p| b.iter_custom(|iters| contended::<Array>(iters, p)),
        );
        group.bench_with_input(
            BenchmarkId::new(Seg::NAME, producers),
            &producers,
            |b, &p| b.iter_custom(|iters| contended::<Seg>(iters, p)),
        );
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_queues
}
criterion_main!(benches);
