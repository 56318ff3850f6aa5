//! A live shared segment scribbled by libFuzzer: each input is a list of
//! `(region, offset, value)` words written into the request ring and into
//! two clients' areas (state, doorbell, completion ring, entries, cells)
//! while a third, well-behaved client runs requests. The well-behaved
//! client must get every answer right within a bound, and the server must
//! stop at once: a bad neighbour harms only itself (`make fuzz
//! FUZZ_TARGET=shm`).
#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrobatch_core::shm::{
    CellLayout, ClientCore, Delivery, Segment, SegmentConfig, SharedServer, ShmError,
};
use ferrobatch_core::{
    Batcher, BatcherConfig, DispatchRule, Priorities, Readiness, Sink, SlotBuffer, Worker,
};
use libfuzzer_sys::fuzz_target;

const ROW: usize = 8;
const MAX: usize = 16;
static RUN: AtomicU64 = AtomicU64::new(0);

fuzz_target!(|input: &[u8]| {
    let name = format!(
        "fuzz-shm-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    );
    let slots: Arc<Vec<Mutex<Vec<u8>>>> =
        Arc::new((0..2).map(|_| Mutex::new(vec![0u8; MAX * ROW])).collect());
    let buffers = slots
        .iter()
        // SAFETY: the vectors live in `slots`, which outlives the batcher's
        // use of them (the worker is joined before they drop); never resized.
        .map(|v| vec![unsafe { SlotBuffer::new(v.lock().unwrap().as_mut_ptr(), MAX * ROW) }])
        .collect();
    let config = BatcherConfig {
        rule: DispatchRule::new(MAX, Duration::from_micros(100), 1, vec![]).unwrap(),
        row_nbytes: vec![ROW],
        max_queue_size: 1000,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: Vec::new(),
        max_batch_elements: None,
        bytes_limits: Default::default(),
        priorities: Priorities::NONE,
        default_priority: None,
    };
    let batcher = Arc::new(Batcher::new(config, buffers).unwrap());
    let segment = SegmentConfig {
        clients: 3,
        cells: 8,
        ring_capacity: 8,
        in_row: ROW as u32,
        out_row: ROW as u32,
        max_rows: MAX as u32,
        meta_len: 0,
    };
    let (segment, _) = Segment::create(&name, segment, b"{}", 0o600).unwrap();
    let server = SharedServer::start(
        Arc::new(segment),
        batcher.clone(),
        rows_layout(),
        (1, 1),
        0,
        Box::new(|_| {}),
    )
    .unwrap();
    let worker = {
        let (batcher, server, slots) = (batcher.clone(), server.clone(), slots.clone());
        std::thread::spawn(move || {
            let mut w = Worker::new();
            while let Some(batch) = batcher.next_batch(&mut w) {
                let out: Vec<u8> = slots[batch.slot.index()].lock().unwrap()[..batch.rows * ROW]
                    .iter()
                    .map(|b| b.wrapping_add(1))
                    .collect();
                drop(batch.slot);
                for (sink, routes) in &batch.routes.groups {
                    if let Sink::SharedMemory(client) = sink {
                        let columns = [&out[..]];
                        let delivery = Delivery::Outputs {
                            columns: &columns,
                            failed: &[],
                        };
                        server.deliver(*client, routes, delivery);
                    }
                }
            }
        })
    };
    let connect = || {
        let segment = Arc::new(Segment::open(&name, None).unwrap());
        ClientCore::connect(segment, rows_layout()).unwrap()
    };
    let good = connect();
    let bad = [connect(), connect()];
    let shared = server.segment();
    let regions =
        [None, Some(bad[0].slot()), Some(bad[1].slot())].map(|c| shared.region(c).unwrap());

    let mut words = input.chunks_exact(13);
    for round in 0u8..8 {
        // Some scribbles, and a request from a bad client...
        for chunk in words.by_ref().take(4) {
            let region = &regions[usize::from(chunk[0]) % regions.len()];
            let at = u32::from_le_bytes(chunk[1..5].try_into().unwrap()) as usize;
            let value = u64::from_le_bytes(chunk[5..13].try_into().unwrap());
            shared.scribble(region.start + at % (region.end - region.start), value);
            let _ = bad[usize::from(chunk[0] >> 7)].submit(&[&[chunk[1]; ROW]], 1, None);
        }
        // ...then a round trip of the good one, answered right and in time.
        let bytes = [round; ROW];
        let deadline = Instant::now() + Duration::from_secs(5);
        let (cell, tag) = loop {
            match good.submit(&[&bytes], 1, None) {
                Ok(key) => break key,
                Err(ShmError::Full(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => panic!("the good client was refused: {e}"),
            }
        };
        let mut done = Vec::new();
        while done.is_empty() {
            assert!(Instant::now() < deadline, "the good client got no answer");
            assert_eq!(good.server_gone(), None);
            good.wait(Duration::from_millis(5));
            good.collect(&mut done)
                .expect("the good client's ring is sound");
        }
        assert_eq!((done[0].cell, done[0].tag, done[0].code), (cell, tag, 0));
        assert_eq!(good.output(&done[0], 0), &[round.wrapping_add(1); ROW]);
        good.release(&done[0]);
    }
    let stopped = Instant::now();
    server.close("stopped");
    assert!(
        stopped.elapsed() < Duration::from_secs(2),
        "the server did not stop"
    );
    batcher.close();
    worker.join().unwrap();
});

fn rows_layout() -> CellLayout {
    CellLayout::Rows {
        inputs: vec![ROW],
        outputs: vec![ROW],
    }
}
