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
    faults: Arc<Mutex<Vec<String>>>,
    batcher: Arc<Batcher>,
    server: Arc<SharedServer>,
    slots: Arc<Vec<Mutex<Vec<u8>>>>,
}

fn fixture(test: &str, clients: u32, cells: u32, ring: u32) -> Fixture {
    fixture_with(test, clients, cells, ring, rows_layout())
}

/// A varying model's layout: cells of `VARYING_CELL` bytes each way.
const VARYING_CELL: usize = 64;

fn varying_layout() -> CellLayout {
    CellLayout::Varying {
        inputs: VARYING_CELL,
        outputs: VARYING_CELL,
    }
}

fn fixture_with(test: &str, clients: u32, cells: u32, ring: u32, layout: CellLayout) -> Fixture {
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
        in_row: layout.cell_bytes().0 as u32,
        out_row: layout.cell_bytes().1 as u32,
        max_rows: MAX as u32,
        meta_len: 0,
    };
    let (segment, _) = Segment::create(&name, segment, b"{}", 0o600).unwrap();
    let faults = Arc::new(Mutex::new(Vec::new()));
    let log = faults.clone();
    let on_fault: OnFault = Box::new(move |m: &str| log.lock().unwrap().push(m.to_string()));
    let server = SharedServer::start(
        Arc::new(segment),
        batcher.clone(),
        layout,
        (1, 1),
        0,
        on_fault,
    )
    .unwrap();
    Fixture {
        name,
        faults,
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
                let ranges: Vec<_> = (0..batch.rows).map(|r| r * ROW..(r + 1) * ROW).collect();
                let shapes = vec![vec![ROW as u64]; batch.rows];
                let varying = [VaryingColumn {
                    data: &out,
                    rows: &ranges,
                    shapes: &shapes,
                    pad: &[],
                }];
                let delivery = match server.segment().config().in_row as usize {
                    ROW => Delivery::Outputs {
                        columns: &columns,
                        failed: &[],
                    },
                    _ => Delivery::Varying {
                        columns: &varying,
                        failed: &[],
                    },
                };
                server.deliver(*client, routes, delivery);
            }
        }
    })
}

fn connect(f: &Fixture) -> ClientCore {
    let segment = Arc::new(Segment::open(&f.name, None).unwrap());
    let layout = match segment.config().in_row as usize {
        ROW => rows_layout(),
        _ => varying_layout(),
    };
    ClientCore::connect(segment, layout).unwrap()
}

/// Queues a request the way a hostile process could: `region` written
/// as the request's input cells, `rows` and `span` as its entry says.
fn forge(f: &Fixture, client: &ClientCore, cell: u32, rows: u32, span: u32, region: &[u8]) {
    let segment = Segment::open(&f.name, None).unwrap();
    let slot = client.slot();
    let tag = segment
        .client_next_tag(slot)
        .fetch_add(1, Ordering::Relaxed);
    let base = segment.inputs(slot, cell, 1).unwrap();
    // SAFETY: the cell's input bytes (VARYING_CELL of them) lie at `base`;
    // the region written is at most that long.
    unsafe { std::ptr::copy_nonoverlapping(region.as_ptr(), base, region.len().min(VARYING_CELL)) };
    let entry = segment.entry(slot, cell);
    entry.rows().store(rows, Ordering::Relaxed);
    entry.span().store(span, Ordering::Relaxed);
    entry.timeout_ns().store(u64::MAX, Ordering::Relaxed);
    entry
        .word()
        .store(super::segment::word(tag, state::QUEUED), Ordering::Release);
    let descriptor = Descriptor {
        client: slot,
        cell,
        tag,
        withdraw: None,
    };
    segment.ring().push(descriptor.encode()).unwrap();
}

/// Waits until `cell` of `client` is DONE: its code and message.
fn done_code(f: &Fixture, client: &ClientCore, cell: u32) -> (u32, String) {
    let segment = Segment::open(&f.name, None).unwrap();
    let entry = segment.entry(client.slot(), cell);
    let until = Instant::now() + Duration::from_secs(20);
    while entry.word().load(Ordering::Acquire) as u32 != state::DONE {
        assert!(Instant::now() < until, "never answered");
        std::thread::sleep(Duration::from_millis(1));
    }
    (entry.code().load(Ordering::Relaxed), entry.message())
}

#[test]
fn a_varying_request_spans_the_cells_its_bytes_need() {
    let f = fixture_with("varying", 2, 16, 16, varying_layout());
    let worker = spawn_worker(&f);
    let client = connect(&f);
    let submission = crate::Submission::default();
    for rows in [1u32, 3, 7] {
        let bytes: Vec<u8> = (0..rows as usize * ROW).map(|k| k as u8).collect();
        let (cell, tag) = client
            .submit_varying(&[(&bytes, [0; 4])], rows, &submission)
            .unwrap();
        let done = collect(&client, 1);
        assert_eq!((done[0].cell, done[0].tag), (cell, tag));
        assert_eq!(done[0].code, code::OK, "{}", done[0].message);
        // 40 header bytes and the rows: more than one cell from 3 rows on.
        let need = (varying::INPUT_HEADER + bytes.len()).div_ceil(VARYING_CELL) as u32;
        assert_eq!(done[0].span, need.max(rows));
        let outputs = client.varying_outputs(&done[0], 1).unwrap();
        let expected: Vec<u8> = bytes.iter().map(|b| b.wrapping_add(1)).collect();
        assert_eq!(outputs[0].data, &expected[..]);
        assert_eq!(outputs[0].shapes, vec![vec![ROW]; rows as usize]);
        client.release(&done[0]);
    }
    // More bytes than the client's cells: refused before anything is written.
    let huge = vec![0u8; 16 * VARYING_CELL];
    let err = client
        .submit_varying(&[(&huge, [0; 4])], 1, &submission)
        .unwrap_err();
    assert!(matches!(err, ShmError::Invalid(_)), "{err}");
    assert_eq!(client.in_flight(), 0);
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
}

#[test]
fn a_forged_varying_request_is_refused_alone() {
    let f = fixture_with("forged", 2, 16, 16, varying_layout());
    let worker = spawn_worker(&f);
    let client = connect(&f);
    let header = |len: u64| {
        let mut region = vec![0u8; VARYING_CELL];
        region[..8].copy_from_slice(&len.to_le_bytes());
        region
    };
    // An input longer than its cells, a length that overflows, a span past
    // the client's cells, more rows than cells, no rows.
    let forged = [
        (header(VARYING_CELL as u64), 1, 1),
        (header(u64::MAX - 3), 1, 1),
        (header(ROW as u64), 1, 17),
        (header(ROW as u64), 2, 1),
        (header(ROW as u64), 0, 1),
    ];
    for (cell, (region, rows, span)) in forged.iter().enumerate() {
        forge(&f, &client, cell as u32, *rows, *span, region);
        let (code, message) = done_code(&f, &client, cell as u32);
        assert_eq!(code, code::INVALID_INPUT, "forgery {cell}: {message}");
    }
    // The batcher itself refuses bytes that disagree with the rows.
    forge(&f, &client, 8, 1, 1, &header(3));
    assert_eq!(done_code(&f, &client, 8).0, code::INVALID_INPUT);
    // And an honest request still goes through.
    let bytes = [7u8; ROW];
    let submission = crate::Submission::default();
    client
        .submit_varying(&[(&bytes, [0; 4])], 1, &submission)
        .unwrap();
    let done = collect(&client, 1);
    assert_eq!(done[0].code, code::OK, "{}", done[0].message);
    assert!(f.faults.lock().unwrap().is_empty());
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
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
        client.collect(&mut done).unwrap();
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
                                client.collect(&mut done).unwrap();
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

#[test]
fn a_request_that_leaves_out_an_input_not_optional_is_refused() {
    let f = fixture("absent", 2, 8, 8); // its one input is not optional
    let worker = spawn_worker(&f);
    let client = connect(&f);
    let submission = crate::Submission {
        absent: 1,
        ..Default::default()
    };
    let bytes = vec![0u8; ROW];
    client.submit_with(&[&bytes], 1, &submission).unwrap();
    let done = collect(&client, 1);
    assert_eq!(done[0].code, code::INVALID_INPUT, "{}", done[0].message);
    assert!(
        done[0].message.contains("not optional"),
        "{}",
        done[0].message
    );
    client.release(&done[0]);
    // What a forged word cannot pass, an honest request still does.
    client.submit(&[&bytes], 1, None).unwrap();
    assert_eq!(collect(&client, 1)[0].code, code::OK);
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
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
    if !client.withdraw(cell, tag, Withdraw::Cancelled) {
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
        Arc::new(Segment::open(&f.name, None).unwrap()),
        rows_layout(),
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
    assert_eq!(client.server_gone(), Some(ServerGone::Evicted));
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
    assert!(matches!(
        Segment::open(&f.name, None),
        Err(ShmError::NotFound(_))
    ));
}

fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `n` one-row requests, four at a time, and checks every answer.
/// A full ring (shared with other clients) is retried for a while.
fn round_trips(client: &ClientCore, n: u8) {
    for first in (0..n).step_by(4) {
        let mut sent = HashMap::new();
        let last = n.min(first + 4);
        for i in first..last {
            let bytes = vec![i; ROW];
            let deadline = Instant::now() + Duration::from_secs(10);
            let key = loop {
                match client.submit(&[&bytes], 1, None) {
                    Ok(key) => break key,
                    Err(ShmError::Full(m)) if Instant::now() < deadline && m.contains("ring") => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("{e}"),
                }
            };
            sent.insert(key, bytes);
        }
        for done in collect(client, usize::from(last - first)) {
            check(client, &mut sent, &done);
        }
    }
}

/// Issue: one 8-byte write into a client's own completion ring made the
/// model's worker spin forever, for every client of the model.
#[test]
fn a_client_that_scribbles_its_completion_ring_is_closed_alone() {
    let f = fixture("scribble-completions", 4, 16, 64);
    let worker = spawn_worker(&f);
    let (bad, good) = (connect(&f), connect(&f));
    // Slot 0's sequence (word 16) ahead of the ring's tail.
    f.server.segment().completions(bad.slot()).scribble(16, 5);
    bad.submit(&[&[1u8; ROW]], 1, None).unwrap();
    until("the scribbler is evicted", || bad.server_gone().is_some());
    assert_eq!(bad.server_gone(), Some(ServerGone::Evicted));
    round_trips(&good, 20);
    until("its slot is reclaimed", || f.server.reclaimed() == 1);
    assert_eq!(f.server.faults(), 1);
    let faults = f.faults.lock().unwrap().clone();
    assert_eq!(faults.len(), 1, "logged once: {faults:?}");
    assert!(faults[0].contains("completion ring"), "{faults:?}");
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
}

/// Issue: a request ring whose head sequence is ahead, or whose head is
/// huge, spun the server's thread and every client's push forever, and
/// the server could not stop.
#[test]
fn a_corrupt_request_ring_is_reset_and_loses_no_request() {
    // The head (word 0), the sequence of the slot at the head (4 requests
    // went through: slot 4, word 16 + 2 * 4) and the tail (word 8).
    for (word, value) in [(0usize, u64::MAX - 3), (24, 77), (8, 1 << 40)] {
        let f = fixture("scribble-ring", 2, 16, 8);
        let worker = spawn_worker(&f);
        let client = connect(&f);
        round_trips(&client, 4);
        // The shared ring's words, as a client process could write them.
        f.server.segment().ring().scribble(word, value);
        round_trips(&client, 12);
        assert!(f.server.faults() >= 1, "word {word}: the reset is counted");
        assert_eq!(f.faults.lock().unwrap().len(), 1, "logged once");
        let stopped = Instant::now();
        f.server.close("stopped");
        assert!(stopped.elapsed() < Duration::from_secs(2));
        f.batcher.close();
        worker.join().unwrap();
    }
}

/// A producer killed between claiming a position and publishing it left
/// the ring empty to the server for good.
#[test]
fn a_ring_stuck_behind_a_dead_producer_is_reset() {
    let f = fixture("stuck", 2, 16, 8);
    let worker = spawn_worker(&f);
    let client = connect(&f);
    f.server.segment().ring().scribble(8, 1); // tail 1: position 0 claimed, never published
    let started = Instant::now();
    round_trips(&client, 6);
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(f.server.faults() >= 1);
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
}

/// Issue: only ACTIVE-with-a-dead-owner and CLOSING slots were reclaimed,
/// so garbage in every slot's state locked every client out until restart.
#[test]
fn garbage_in_slot_states_is_reclaimed() {
    let f = fixture("garbage-state", 3, 4, 8);
    for slot in 0..3 {
        f.server
            .segment()
            .client_status(slot)
            .store(0xdead_0000 + slot, Ordering::SeqCst);
    }
    until("every slot is reclaimed", || f.server.reclaimed() == 3);
    assert_eq!(f.faults.lock().unwrap().len(), 3, "one line per slot");
    let worker = spawn_worker(&f);
    let client = connect(&f);
    round_trips(&client, 3);
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
}

/// The header's state is for clients: a client writing STOPPING there
/// does not make the server refuse requests.
#[test]
fn a_forged_server_state_does_not_stop_the_server() {
    let f = fixture("forged-state", 2, 8, 8);
    let worker = spawn_worker(&f);
    let client = connect(&f);
    f.server.segment().set_state(server_state::STOPPING);
    until("the server writes its state back", || {
        f.server.segment().state() == server_state::RUNNING
    });
    round_trips(&client, 4);
    f.server.close("stopped");
    f.batcher.close();
    worker.join().unwrap();
}

/// A segment whose file belongs to another user is refused (another user
/// could have taken the name to read requests and forge answers), unless
/// the client names that user.
#[test]
fn a_segment_of_another_user_is_refused_unless_trusted() {
    let f = fixture("owner", 1, 4, 8);
    let me = current_uid();
    let err = Segment::open(&f.name, Some(me.wrapping_add(1))).unwrap_err();
    assert!(matches!(err, ShmError::Owner(_)), "{err}");
    assert!(err.to_string().contains(&format!("uid {me}")), "{err}");
    assert!(Segment::open(&f.name, Some(me)).is_ok());
    assert!(Segment::open(&f.name, None).is_ok());
    f.server.close("stopped");
}

/// Random words written into the request ring and into two clients' areas
/// (their states, doorbells, completion rings, entries and cells) while a
/// third client runs: it gets every answer right, and the server stops at
/// once. (`make fuzz FUZZ_TARGET=shm` lets libFuzzer pick the words.)
#[test]
fn scribblers_harm_only_themselves() {
    for seed in 1..=if cfg!(debug_assertions) { 4u64 } else { 16 } {
        let f = fixture("scribblers", 3, 16, 16);
        let worker = spawn_worker(&f);
        let good = connect(&f);
        let bad: Vec<ClientCore> = (0..2).map(|_| connect(&f)).collect();
        let segment = f.server.segment();
        let regions: Vec<_> = [None, Some(bad[0].slot()), Some(bad[1].slot())]
            .into_iter()
            .map(|r| segment.region(r).unwrap())
            .collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let mut next = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                while !stop.load(Ordering::Relaxed) {
                    let r = &regions[(next() % 3) as usize];
                    let offset = r.start + (next() as usize % (r.end - r.start));
                    let value = match next() % 4 {
                        0 => next() % 8,
                        1 => next(),
                        2 => u64::MAX - next() % 8,
                        _ => next() & 0xffff_ffff,
                    };
                    segment.scribble(offset, value);
                    // Some of the bad clients' own requests, too.
                    let _ = bad[(next() % 2) as usize].submit(&[&[1u8; ROW]], 1, None);
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
            // Stops the scribbler even if an assertion fails below.
            struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            round_trips(&good, 200);
        });
        assert_eq!(good.server_gone(), None, "seed {seed}");
        let stopped = Instant::now();
        f.server.close("stopped");
        assert!(stopped.elapsed() < Duration::from_secs(2), "seed {seed}");
        f.batcher.close();
        worker.join().unwrap();
    }
}

fn rows_layout() -> CellLayout {
    CellLayout::Rows {
        inputs: vec![ROW],
        outputs: vec![ROW],
    }
}
