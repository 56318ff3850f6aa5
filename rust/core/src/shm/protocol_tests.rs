//! A server and its clients in one process: the whole protocol, without
//! Python (the Python tests run it across processes).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::{Batcher, BatcherConfig, DispatchRule, Readiness, SlotBuffer, Worker};

const ROW: usize = 8;
const MAX: usize = 16;

struct Fixture {
    name: String,
    batcher: Arc<Batcher>,
    server: Arc<SharedServer>,
    slots: Arc<Vec<Mutex<Vec<u8>>>>,
}

fn fixture(test: &str, clients: u32, cells: u32, ring: u32) -> Fixture {
    let name = format!("coretest-{test}-{}", std::process::id());
    let slots: Arc<Vec<Mutex<Vec<u8>>>> =
        Arc::new((0..3).map(|_| Mutex::new(vec![0u8; MAX * ROW])).collect());
    let buffers = slots
        .iter()
        // SAFETY: the vectors live in `slots`, which the fixture keeps
        // alive as long as the batcher; they are never resized.
        .map(|v| vec![unsafe { SlotBuffer::new(v.lock().unwrap().as_mut_ptr(), MAX * ROW) }])
        .collect();
    let config = BatcherConfig {
        rule: DispatchRule::new(MAX, Duration::from_micros(200), 1, vec![]).unwrap(),
        row_nbytes: vec![ROW],
        max_queue_size: 10_000,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: Vec::new(),
        max_batch_elements: None,
        bytes_limits: Default::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    let batcher = Arc::new(Batcher::new(config, buffers).unwrap());
    let segment = SegmentConfig {
        clients,
        cells,
        ring_capacity: ring,
        in_row: ROW as u32,
        out_row: ROW as u32,
        max_rows: MAX as u32,
        meta_len: 0,
    };
    let (segment, _) = Segment::create(&name, segment, b"{}", 0o600).unwrap();
    let server =
        SharedServer::start(Arc::new(segment), batcher.clone(), vec![ROW], vec![ROW]).unwrap();
    Fixture {
        name,
        batcher,
        server,
        slots,
    }
}

/// The model: each output row is the input row with every byte plus one.
fn spawn_worker(f: &Fixture) -> std::thread::JoinHandle<()> {
    let (batcher, server, slots) = (f.batcher.clone(), f.server.clone(), f.slots.clone());
    std::thread::spawn(move || {
        let mut w = Worker::new();
        while let Some(batch) = batcher.next_batch(&mut w) {
            let out: Vec<u8> = slots[batch.slot.index()].lock().unwrap()[..batch.rows * ROW]
                .iter()
                .map(|b| b.wrapping_add(1))
                .collect();
            drop(batch.slot);
            for (sink, routes) in &batch.routes.groups {
                let crate::Sink::SharedMemory(client) = sink else {
                    panic!("only shared-memory requests here")
                };
                let columns = [&out[..]];
                server.deliver(
                    *client,
                    routes,
                    Delivery::Outputs {
                        columns: &columns,
                        failed: &[],
                    },
                );
            }
        }
    })
}

fn connect(f: &Fixture) -> ClientCore {
    let segment = Arc::new(Segment::open(&f.name).unwrap());
    ClientCore::connect(segment, vec![ROW], vec![ROW]).unwrap()
}

/// Waits for `n` completions.
fn collect(client: &ClientCore, n: usize) -> Vec<Completed> {
    let mut done = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while done.len() < n {
        assert!(
            Instant::now() < until,
            "only {} of {n} answered",
            done.len()
        );
        client.wait(Duration::from_millis(20));
        client.collect(&mut done);
    }
    done
}

#[test]
fn every_request_gets_its_own_rows_back() {
    let f = fixture("rows", 4, 64, 64);
    let worker = spawn_worker(&f);
    let clients: Vec<_> = (0..3).map(|_| connect(&f)).collect();
    assert_eq!(f.server.clients().len(), 3);
    std::thread::scope(|s| {
        for (c, client) in clients.iter().enumerate() {
            s.spawn(move || {
                let mut sent: HashMap<(u32, u32), Vec<u8>> = HashMap::new();
                for i in 0..2000u32 {
                    let rows = 1 + (i % 3);
                    let bytes: Vec<u8> = (0..rows as usize * ROW)
                        .map(|k| (i as usize * 7 + k + c * 31) as u8)
                        .collect();
                    loop {
                        match client.submit(&[&bytes], rows, None) {
                            Ok(key) => {
                                sent.insert(key, bytes);
                                break;
                            }
                            Err(ShmError::Full(_)) => {
                                // Its cells, or the ring (shared with the
                                // other clients), are full: take what came.
                                let mut done = Vec::new();
                                client.wait(Duration::from_millis(1));
                                client.collect(&mut done);
                                for done in done {
                                    check(client, &mut sent, &done);
                                }
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                let left = sent.len();
                for done in collect(client, left) {
                    check(client, &mut sent, &done);
                }
                assert!(sent.is_empty());
                assert_eq!(client.in_flight(), 0, "every cell was freed");
            });
        }
    });
    assert_eq!(f.server.in_flight(), 0);
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
    assert_eq!(clients[0].server_gone(), Some(ServerGone::Stopped));
}

fn check(client: &ClientCore, sent: &mut HashMap<(u32, u32), Vec<u8>>, done: &Completed) {
    assert_eq!(done.code, code::OK, "{}", done.message);
    let input = sent
        .remove(&(done.cell, done.tag))
        .expect("an answer to a request sent");
    let expected: Vec<u8> = input.iter().map(|b| b.wrapping_add(1)).collect();
    assert_eq!(client.output(done, 0), &expected[..]);
    client.release(done);
}

#[test]
fn a_queued_request_is_withdrawn_and_never_run() {
    let f = fixture("withdraw", 2, 8, 8);
    // No worker: the request stays queued in the batcher once accepted.
    let client = connect(&f);
    let bytes = [1u8; ROW];
    // Withdrawn before the server took it off the ring, or after: either
    // way it never runs and its cells come back.
    let (cell, tag) = client.submit(&[&bytes], 1, None).unwrap();
    if !client.withdraw(cell, tag, 1, Withdraw::Cancelled) {
        let done = collect(&client, 1);
        assert_eq!(done[0].code, code::CANCELLED);
        client.release(&done[0]);
    }
    assert_eq!(client.in_flight(), 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.batcher.queue_len() > 0 || f.server.in_flight() > 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    f.server.close("stopped");
}

#[test]
fn full_cells_and_full_ring_refuse_at_once() {
    let f = fixture("full", 1, 4, 2);
    let client = connect(&f);
    let bytes = [0u8; 4 * ROW];
    client.submit(&[&bytes], 4, None).unwrap();
    let err = client.submit(&[&bytes[..ROW]], 1, None).unwrap_err();
    assert!(matches!(err, ShmError::Full(_)), "{err}");
    let err = ClientCore::connect(
        Arc::new(Segment::open(&f.name).unwrap()),
        vec![ROW],
        vec![ROW],
    )
    .unwrap_err();
    assert!(err.to_string().contains("client slots"), "{err}");
    f.server.close("stopped");
}

#[test]
fn a_dead_clients_slot_and_requests_are_reclaimed() {
    let f = fixture("dead", 1, 8, 8);
    let client = connect(&f);
    let bytes = [0u8; ROW];
    for _ in 0..3 {
        client.submit(&[&bytes], 1, None).unwrap();
    }
    // The process "dies": its pid no longer exists.
    f.server
        .segment()
        .client_owner(client.slot())
        .store(1 << 30, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.server.reclaimed() == 0 {
        assert!(Instant::now() < deadline, "never reclaimed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(f.server.in_flight(), 0);
    assert_eq!(
        f.batcher.queue_len(),
        0,
        "its queued requests were withdrawn"
    );
    assert_eq!(client.server_gone(), Some(ServerGone::Died));
    // The slot serves a new client.
    let again = connect(&f);
    assert_eq!(again.slot(), 0);
    f.server.close("stopped");
}

#[test]
fn stop_answers_what_is_pending_with_server_closed() {
    let f = fixture("stop", 1, 8, 8);
    let client = connect(&f);
    client.submit(&[&[0u8; ROW]], 1, None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.server.in_flight() == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    f.server.close("server 'm' stopped");
    let done = collect(&client, 1);
    assert_eq!(done[0].code, code::SERVER_CLOSED);
    assert_eq!(done[0].message, "server 'm' stopped");
    assert!(matches!(
        client.submit(&[&[0u8; ROW]], 1, None),
        Err(ShmError::Closed(_))
    ));
    assert!(matches!(Segment::open(&f.name), Err(ShmError::NotFound(_))));
}
