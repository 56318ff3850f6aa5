//! The server's side: a pull thread of its own takes descriptors off the
//! request ring and submits them into the batcher (`Sink::SharedMemory`),
//! their input bytes read in place from the clients' cells; a finished
//! batch writes each client's rows into its cells and wakes each client
//! process once ([`SharedServer::deliver`]). The pull thread also reclaims
//! the slots of clients that closed or died.
//!
//! One owner: `pending` holds every request accepted and not yet answered;
//! whoever removes it from there writes its entry's `DONE` (a batch, a
//! withdrawal, the server stopping), so each is answered exactly once, and
//! a slot is reclaimed only when none of its requests is pending (a batch
//! may still be reading its cells).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::segment::word;
use super::{
    client_state, code, server_state, sleep_unless, state, Descriptor, Segment, Withdraw, POLL,
    SPIN,
};
use crate::{Batcher, CoreError, InputBytes, Outcome, Request, RequestState, Route, Sink, Tally};

/// A finished batch, as the binding hands it over.
#[derive(Debug, Clone, Copy)]
pub enum Delivery<'a> {
    /// Each output's bytes for the whole batch (row `r` of output `i` at
    /// `r * out_rows[i]`); `failed` names requests, by their first row,
    /// that failed alone, with their message.
    Outputs {
        columns: &'a [&'a [u8]],
        failed: &'a [(u32, String)],
    },
    /// The batch failed as a whole (the model raised): this message.
    Failed(&'a str),
}

#[derive(Debug)]
struct Held {
    client: u32,
    cell: u32,
    tag: u32,
    rows: u32,
    request: Arc<Request>,
}

#[derive(Debug, Default)]
struct Pending {
    by_id: HashMap<u64, Held>,
    by_cell: HashMap<(u32, u32), u64>,
}

impl Pending {
    fn remove(&mut self, id: u64) -> Option<Held> {
        let held = self.by_id.remove(&id)?;
        self.by_cell.remove(&(held.client, held.cell));
        Some(held)
    }
}

/// One model shared through one segment.
#[derive(Debug)]
pub struct SharedServer {
    segment: Arc<Segment>,
    batcher: Arc<Batcher>,
    /// Bytes of one row of each input / output, in the model's order.
    in_rows: Vec<usize>,
    out_rows: Vec<usize>,
    pending: Mutex<Pending>,
    /// What the shared clients saw, counted when their entry is written.
    pub tally: Tally,
    /// Client slots reclaimed (closed, or their process died).
    reclaimed: AtomicU64,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl SharedServer {
    /// Serves `segment`'s clients into `batcher` from a thread of its own.
    pub fn start(
        segment: Arc<Segment>,
        batcher: Arc<Batcher>,
        in_rows: Vec<usize>,
        out_rows: Vec<usize>,
    ) -> Result<Arc<SharedServer>, std::io::Error> {
        let server = Arc::new(SharedServer {
            segment,
            batcher,
            in_rows,
            out_rows,
            pending: Mutex::default(),
            tally: Tally::default(),
            reclaimed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        server.segment.set_state(server_state::RUNNING);
        let pull = server.clone();
        let handle = std::thread::Builder::new()
            .name("ferrobatch-shm".into())
            .spawn(move || pull.run())?;
        *server.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(server)
    }

    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Nothing under this lock panics; a poisoned map is still whole.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests accepted and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
    }

    /// `(slot, pid)` of every connected client (closing ones included).
    pub fn clients(&self) -> Vec<(u32, u32)> {
        (0..self.segment.config().clients)
            .filter(|&c| {
                self.segment.client_status(c).load(Ordering::Acquire) != client_state::FREE
            })
            .map(|c| (c, self.segment.client_owner(c).load(Ordering::Acquire)))
            .collect()
    }

    fn run(&self) {
        let ring = self.segment.ring();
        let (word, sleeping) = self.segment.server_doorbell();
        let mut wake = Vec::new();
        let mut checked = Instant::now();
        // Requests came in lately: poll a little before sleeping.
        let mut active = false;
        while !self.stop.load(Ordering::Acquire) {
            let mut rows = 0;
            let mut taken = 0;
            while taken < 1024 {
                let Some(v) = ring.pop() else { break };
                rows += self.handle(Descriptor::decode(v), &mut wake);
                taken += 1;
            }
            // Greedy batchers take rows once flushed: all of this drain at once.
            self.batcher.flush(rows);
            self.wake(&mut wake);
            if checked.elapsed() >= POLL {
                self.reclaim();
                checked = Instant::now();
            }
            if taken == 0 {
                let spin = if active { SPIN } else { Duration::ZERO };
                sleep_unless(word, sleeping, POLL, spin, || {
                    ring.is_empty() && !self.stop.load(Ordering::Acquire)
                });
            }
            active = taken > 0;
        }
    }

    /// Wakes each client in `wake` once.
    fn wake(&self, wake: &mut Vec<u32>) {
        wake.sort_unstable();
        wake.dedup();
        for &client in wake.iter() {
            let (word, sleeping) = self.segment.client_doorbell(client);
            super::notify(word, sleeping);
        }
        wake.clear();
    }

    /// Answers the request at `cell` (its bytes are the server's) with
    /// `code` and `message`, and queues its completion.
    fn write_done(&self, client: u32, cell: u32, tag: u32, code: u32, message: &str) {
        let entry = self.segment.entry(client, cell);
        entry.code().store(code, Ordering::Relaxed);
        if code != code::OK {
            entry.set_message(message);
        }
        entry
            .word()
            .store(word(tag, state::DONE), Ordering::Release);
        // Never full: a client has at most `cells` requests, each completed once.
        let _ = self.segment.completions(client).push(u64::from(cell));
    }

    /// Handles one descriptor; returns the rows it queued.
    fn handle(&self, d: Descriptor, wake: &mut Vec<u32>) -> usize {
        let config = self.segment.config();
        if d.client >= config.clients || d.cell >= config.cells {
            return 0; // not from a client of this layout: nothing to answer
        }
        if let Some(why) = d.withdraw {
            self.withdraw(d, why, wake);
            return 0;
        }
        let entry = self.segment.entry(d.client, d.cell);
        let accepted = entry.word().compare_exchange(
            word(d.tag, state::QUEUED),
            word(d.tag, state::ACCEPTED),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if accepted.is_err() {
            return 0; // withdrawn by its client, or stale: never run
        }
        wake.push(d.client);
        let rows = entry.rows().load(Ordering::Relaxed);
        let fail = |code: u32, outcome: Outcome, message: &str| {
            self.tally.count(outcome);
            self.write_done(d.client, d.cell, d.tag, code, message);
            0
        };
        if self.segment.state() != server_state::RUNNING {
            return fail(
                code::SERVER_CLOSED,
                Outcome::ServerClosed,
                "the server is stopping",
            );
        }
        let base = match self.segment.inputs(d.client, d.cell, rows) {
            Some(base) if rows <= config.max_rows => base,
            _ => {
                return fail(
                    code::INVALID_INPUT,
                    Outcome::InvalidInput,
                    "a request whose rows do not fit its client's cells",
                )
            }
        };
        let mut inputs = Vec::with_capacity(self.in_rows.len());
        let mut offset = 0usize;
        for &row in &self.in_rows {
            let len = row * rows as usize;
            // SAFETY: the request's cells hold `rows * in_row` bytes at
            // `base` (checked by `inputs` above), laid out input after
            // input; they are the server's from ACCEPTED until it writes
            // DONE, which happens only after the request is resolved (by
            // its batch, a withdrawal, or the stop), and the segment is
            // mapped as long as `self` lives, which the batcher's sink does.
            inputs.push(unsafe { InputBytes::new(base.add(offset), len) });
            offset += len;
        }
        let timeout = match entry.timeout_ns().load(Ordering::Relaxed) {
            u64::MAX => None,
            ns => Some(Duration::from_nanos(ns)),
        };
        let submitted = self.batcher.submit_with(
            Sink::SharedMemory(d.client),
            rows as usize,
            inputs.into_boxed_slice(),
            timeout,
            |request| {
                let mut pending = self.lock();
                pending.by_cell.insert((d.client, d.cell), request.id);
                pending.by_id.insert(
                    request.id,
                    Held {
                        client: d.client,
                        cell: d.cell,
                        tag: d.tag,
                        rows,
                        request: request.clone(),
                    },
                );
            },
        );
        match submitted {
            Ok(_) => rows as usize,
            Err(err) => {
                {
                    let mut pending = self.lock();
                    if let Some(id) = pending.by_cell.get(&(d.client, d.cell)).copied() {
                        pending.remove(id);
                    }
                }
                let (code, outcome) = match err {
                    CoreError::QueueFull { .. } => (code::QUEUE_FULL, Outcome::QueueFull),
                    CoreError::Closed => (code::SERVER_CLOSED, Outcome::ServerClosed),
                    _ => (code::INVALID_INPUT, Outcome::InvalidInput),
                };
                fail(code, outcome, &err.to_string())
            }
        }
    }

    /// A client gave up on an accepted request: withdrawn unless a batch
    /// took it (then its batch answers it).
    fn withdraw(&self, d: Descriptor, why: Withdraw, wake: &mut Vec<u32>) {
        let mut pending = self.lock();
        let Some(&id) = pending.by_cell.get(&(d.client, d.cell)) else {
            return;
        };
        let Some(held) = pending.by_id.get(&id) else {
            return;
        };
        let (to, code, outcome) = match why {
            Withdraw::Cancelled => (RequestState::Cancelled, code::CANCELLED, Outcome::Cancelled),
            Withdraw::Expired => (
                RequestState::Expired,
                code::DEADLINE_EXCEEDED,
                Outcome::DeadlineExceeded,
            ),
        };
        if held.tag != d.tag || !self.batcher.withdraw(&held.request, to) {
            return;
        }
        if let Some(held) = pending.remove(id) {
            drop(pending);
            self.tally.count(outcome);
            self.write_done(held.client, held.cell, held.tag, code, "withdrawn");
            wake.push(held.client);
        }
    }

    /// Writes the rows of one finished batch (`routes`: this client's
    /// requests in it) into client `client`'s cells and wakes it once.
    pub fn deliver(&self, client: u32, routes: &[Route], delivery: Delivery<'_>) {
        let taken: Vec<(Route, Held)> = {
            let mut pending = self.lock();
            routes
                .iter()
                .filter_map(|r| Some((*r, pending.remove(r.id)?)))
                .collect()
        };
        if taken.is_empty() {
            return;
        }
        let now = Instant::now();
        for (route, held) in &taken {
            let outcome = match delivery {
                Delivery::Failed(message) => Err(message.to_string()),
                Delivery::Outputs { columns, failed } => {
                    match failed.iter().find(|(start, _)| *start == route.start) {
                        Some((_, message)) => Err(message.clone()),
                        None => self.write_rows(held, route, columns),
                    }
                }
            };
            match outcome {
                Ok(()) => {
                    let waited = now.saturating_duration_since(held.request.enqueued_at);
                    self.tally.add_request_ns(waited.as_nanos() as u64);
                    self.tally.count(Outcome::Succeeded);
                    self.write_done(held.client, held.cell, held.tag, code::OK, "");
                }
                Err(message) => {
                    self.tally.count(Outcome::ModelError);
                    self.write_done(
                        held.client,
                        held.cell,
                        held.tag,
                        code::MODEL_ERROR,
                        &message,
                    );
                }
            }
        }
        let (word, sleeping) = self.segment.client_doorbell(client);
        super::notify(word, sleeping);
    }

    /// Copies the request's rows of every output into its cells.
    fn write_rows(&self, held: &Held, route: &Route, columns: &[&[u8]]) -> Result<(), String> {
        if columns.len() != self.out_rows.len() {
            return Err(format!(
                "the model gave {} outputs, {} expected",
                columns.len(),
                self.out_rows.len()
            ));
        }
        let Some(base) = self.segment.outputs(held.client, held.cell, held.rows) else {
            return Err("the request's cells are out of range".into());
        };
        let mut offset = 0usize;
        for (i, (column, &row)) in columns.iter().zip(&self.out_rows).enumerate() {
            let len = row * route.rows as usize;
            let start = row * route.start as usize;
            let Some(src) = column.get(start..start + len) else {
                return Err(format!("output {i} has fewer rows than the batch"));
            };
            // SAFETY: the request's cells hold `rows * out_row` output bytes
            // at `base` (checked by `outputs`), laid out output after
            // output, and are the server's until it writes DONE (after this).
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(offset), len) };
            offset += len;
        }
        Ok(())
    }

    /// Withdraws the requests of closing slots and frees those with none
    /// left; marks the slots of dead processes closing.
    fn reclaim(&self) {
        let segment = &self.segment;
        for client in 0..segment.config().clients {
            let status = segment.client_status(client);
            if status.load(Ordering::Acquire) == client_state::ACTIVE
                && !super::pid_alive(segment.client_owner(client).load(Ordering::Acquire))
            {
                let _ = status.compare_exchange(
                    client_state::ACTIVE,
                    client_state::CLOSING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            if status.load(Ordering::Acquire) != client_state::CLOSING {
                continue;
            }
            let left = {
                let mut pending = self.lock();
                let ids: Vec<u64> = pending
                    .by_id
                    .iter()
                    .filter(|(_, h)| h.client == client)
                    .map(|(id, _)| *id)
                    .collect();
                let mut left = 0;
                for id in ids {
                    let withdrawn = pending
                        .by_id
                        .get(&id)
                        .is_some_and(|h| self.batcher.withdraw(&h.request, RequestState::Closed));
                    if withdrawn {
                        pending.remove(id);
                        self.tally.count(Outcome::Cancelled);
                    } else {
                        left += 1; // a batch holds it: its cells are still read
                    }
                }
                left
            };
            if left > 0 {
                continue;
            }
            for cell in 0..segment.config().cells {
                let entry = segment.entry(client, cell);
                let tag = (entry.word().load(Ordering::Acquire) >> 32) as u32;
                entry
                    .word()
                    .store(word(tag, state::FREE), Ordering::Release);
            }
            let completions = segment.completions(client);
            while completions.pop().is_some() {}
            segment.client_owner(client).store(0, Ordering::Release);
            status.store(client_state::FREE, Ordering::Release);
            self.reclaimed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Stops taking requests off the ring (accepted ones still run); the
    /// clients refuse new ones from now on. Returns once the pull thread ended.
    pub fn stop_accepting(&self) {
        self.segment.set_state(server_state::STOPPING);
        self.stop.store(true, Ordering::Release);
        let (word, _) = self.segment.server_doorbell();
        word.fetch_add(1, Ordering::SeqCst);
        super::futex_wake(word);
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    /// Answers every request still pending with `ServerClosedError`, tells
    /// the clients the server stopped, wakes them, and removes the file.
    pub fn close(&self, message: &str) {
        self.stop_accepting();
        let held: Vec<Held> = {
            let mut pending = self.lock();
            pending.by_cell.clear();
            pending.by_id.drain().map(|(_, h)| h).collect()
        };
        for h in held {
            self.batcher.withdraw(&h.request, RequestState::Closed);
            self.tally.count(Outcome::ServerClosed);
            self.write_done(h.client, h.cell, h.tag, code::SERVER_CLOSED, message);
        }
        self.segment.set_state(server_state::STOPPED);
        for client in 0..self.segment.config().clients {
            let (word, _) = self.segment.client_doorbell(client);
            word.fetch_add(1, Ordering::SeqCst);
            super::futex_wake(word);
        }
        self.segment.unlink();
    }
}
