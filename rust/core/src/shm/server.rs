//! The server's side: a pull thread of its own takes descriptors off the
//! request ring and submits them into the batcher (`Sink::SharedMemory`),
//! their input bytes read in place from the clients' cells; a finished
//! batch writes each client's rows into its cells and wakes each client
//! process once ([`SharedServer::deliver`]). The pull thread also reclaims
//! the slots of clients that closed or died.
//!
//! One owner: every request accepted waits in the core's pending table
//! ([`crate::pending`]) until its `DONE` is written (by its batch, a
//! withdrawal, the server stopping), so each is answered exactly once, and
//! a slot is reclaimed only when none of its requests is pending (a batch
//! may still be reading its cells). A client may withdraw a request only
//! while no batch took it: its cells are the batch's until then.
//!
//! What clients can write is checked before use (see "Hostile memory" in
//! [`crate::shm`]): the server's own state lives here, not in the header;
//! a corrupt or stuck request ring is reset and the entries swept for the
//! requests it lost; a client whose completion ring or slot state is
//! malformed is closed and reclaimed. Each such fault is reported once
//! through [`OnFault`] and counted ([`SharedServer::faults`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::segment::word;
use super::{
    client_state, code, server_state, sleep_unless, state, varying, Descriptor, Peer, Segment,
    Withdraw, POLL, SPIN,
};
use crate::pending::Pending;
use crate::{Batcher, CoreError, InputBytes, Outcome, RequestState, Route, Sink, Tally, Unflushed};

/// How the server reports a fault of a client or of the shared ring (a
/// line for the log; called rarely, from any of the server's threads).
pub type OnFault = Box<dyn Fn(&str) + Send + Sync>;

/// How often the pull thread sweeps the entries for requests whose
/// descriptor a ring lost (at once after a reset).
const SWEEP: Duration = Duration::from_secs(1);

/// How long the request ring may stay stuck at one position (a producer
/// killed between claiming and publishing it) before it is reset.
const STUCK: Duration = Duration::from_millis(250);

/// A finished batch, as the binding hands it over.
#[derive(Debug, Clone, Copy)]
pub enum Delivery<'a> {
    /// Each output's bytes for the whole batch (row `r` of output `i` at
    /// `r * out_rows[i]`); `failed` names requests, by their first row,
    /// that failed alone, with how their callers see it and its message.
    Outputs {
        columns: &'a [&'a [u8]],
        failed: &'a [(u32, Outcome, String)],
    },
    /// The batch failed as a whole (the model raised): how its callers see
    /// it (`Outcome::ModelError`, or the error a forwarding model passed
    /// on), and this message.
    Failed(Outcome, &'a str),
    /// The outputs of a model with BYTES or variable-length tensors: per
    /// output, each batch row's bytes and shape and one pad element;
    /// `failed` as for `Outputs`.
    Varying {
        columns: &'a [VaryingColumn<'a>],
        failed: &'a [(u32, Outcome, String)],
    },
}

/// One output of a batch of a model with BYTES or variable-length tensors.
#[derive(Debug, Clone, Copy)]
pub struct VaryingColumn<'a> {
    /// Batch row `r`'s bytes: `data[rows[r].clone()]`, of shape `shapes[r]`.
    pub data: &'a [u8],
    pub rows: &'a [std::ops::Range<usize>],
    pub shapes: &'a [Vec<u64>],
    pub pad: &'a [u8],
}

/// How a model's requests lie in their cells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellLayout {
    /// Fixed-shape tensors: a request of `r` rows takes `r` cells, each
    /// holding a row of every input and output (these bytes each).
    Rows {
        inputs: Vec<usize>,
        outputs: Vec<usize>,
    },
    /// BYTES or variable-length tensors: a request takes as many cells as
    /// its bytes need, laid out as [`super::varying`] says.
    Varying { inputs: usize, outputs: usize },
}

impl CellLayout {
    /// Bytes of one cell's inputs and outputs, as the segment has them.
    pub fn cell_bytes(&self) -> (usize, usize) {
        match self {
            CellLayout::Rows { inputs, outputs } => (inputs.iter().sum(), outputs.iter().sum()),
            CellLayout::Varying { inputs, outputs } => (*inputs, *outputs),
        }
    }
}

/// The cells of one accepted request: where its `DONE` (and its rows) go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cell {
    client: u32,
    cell: u32,
    tag: u32,
    rows: u32,
    /// Cells it takes: its rows, or more for a varying model's request.
    span: u32,
}

/// What a pending request holds: its cells and, for a varying model's
/// request, the server's own copy of its inputs (the batch reads that).
#[derive(Debug)]
struct Held {
    cell: Cell,
    _copy: Option<Box<[u8]>>,
}

/// One model shared through one segment.
pub struct SharedServer {
    segment: Arc<Segment>,
    batcher: Arc<Batcher>,
    /// This drain's requests, sent together at its end (greedy batchers).
    held: Unflushed,
    /// How requests lie in their cells.
    layout: CellLayout,
    /// Inputs and outputs the model has.
    counts: (usize, usize),
    /// Bit `i` set: input `i` is optional (a request may leave it out).
    optional: u64,
    /// Accepted requests until their `DONE` is written; what the clients
    /// saw is counted there.
    pending: Pending<Cell, Held>,
    /// The request id last accepted in each cell (`client * cells + cell`),
    /// to find the one a client withdraws (a stale id finds nothing).
    cell_ids: Box<[AtomicU64]>,
    /// Client slots reclaimed (closed, or their process died).
    reclaimed: AtomicU64,
    /// Faults handled: ring resets, clients closed for malformed memory.
    faults: AtomicU64,
    on_fault: OnFault,
    /// The server's own truth; the header's copy is for clients (and is
    /// written back if someone else changes it).
    accepting: AtomicBool,
    /// A watch on each slot's owner, made when it changes.
    peers: Mutex<Vec<Option<Peer>>>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SharedServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedServer")
            .field("segment", &self.segment)
            .field("in_flight", &self.in_flight())
            .field("reclaimed", &self.reclaimed())
            .field("faults", &self.faults())
            .finish_non_exhaustive()
    }
}

impl SharedServer {
    /// Serves `segment`'s clients into `batcher` from a thread of its own.
    pub fn start(
        segment: Arc<Segment>,
        batcher: Arc<Batcher>,
        layout: CellLayout,
        counts: (usize, usize),
        optional: u64,
        on_fault: OnFault,
    ) -> Result<Arc<SharedServer>, std::io::Error> {
        let clients = segment.config().clients as usize;
        let cell_count = clients.saturating_mul(segment.config().cells as usize);
        let server = Arc::new(SharedServer {
            segment,
            batcher,
            held: Unflushed::default(),
            layout,
            counts,
            optional,
            pending: Pending::new(),
            cell_ids: (0..cell_count).map(|_| AtomicU64::new(0)).collect(),
            reclaimed: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            on_fault,
            accepting: AtomicBool::new(true),
            peers: Mutex::new((0..clients).map(|_| None).collect()),
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

    /// What the shared clients saw, counted when their entry is written.
    pub fn tally(&self) -> &Tally {
        self.pending.tally()
    }

    /// Requests accepted and not yet done with (unanswered, or answered at
    /// the stop while their batch still reads them).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Where cell `cell` of client `client` keeps its request id (both
    /// checked against the layout by the caller).
    fn cell_id(&self, client: u32, cell: u32) -> Option<&AtomicU64> {
        let cells = self.segment.config().cells as usize;
        self.cell_ids.get(
            (client as usize)
                .checked_mul(cells)?
                .checked_add(cell as usize)?,
        )
    }

    pub fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
    }

    /// Faults handled so far (see the module docs).
    pub fn faults(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    fn fault(&self, message: &str) {
        self.faults.fetch_add(1, Ordering::Relaxed);
        (self.on_fault)(message);
    }

    /// Closes client slot `client` for malformed memory: its requests are
    /// withdrawn and the slot reclaimed like a dead client's.
    fn evict(&self, client: u32, status: u32, why: &str) {
        let closed = self.segment.client_status(client).compare_exchange(
            status,
            client_state::CLOSING,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if closed.is_ok() {
            let pid = self.segment.client_owner(client).load(Ordering::Acquire);
            self.fault(&format!(
                "shared-memory client slot {client} (pid {pid}) closed: {why}"
            ));
        }
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
        let mut swept = Instant::now();
        let mut sweep_now = false;
        let mut stuck: Option<(u64, Instant)> = None;
        let mut reset_before = false;
        // Requests came in lately: poll a little before sleeping.
        let mut active = false;
        while !self.stop.load(Ordering::Acquire) {
            // Greedy batchers take this drain's requests at its end, at once.
            self.held.open(&self.batcher);
            let mut taken = 0;
            let mut corrupt = false;
            while taken < 1024 {
                match ring.pop() {
                    Ok(Some(v)) => self.handle(Descriptor::decode(v), &mut wake),
                    Ok(None) => break,
                    Err(_) => {
                        corrupt = true;
                        break;
                    }
                }
                taken += 1;
            }
            if taken == 0 && !corrupt {
                corrupt = ring.check().is_err();
                stuck = match (ring.stuck(), stuck) {
                    (Some(pos), Some((at, since))) if pos == at => {
                        corrupt |= since.elapsed() >= STUCK;
                        Some((at, since))
                    }
                    (Some(pos), _) => Some((pos, Instant::now())),
                    (None, _) => None,
                };
            }
            if corrupt {
                ring.reset();
                stuck = None;
                sweep_now = true;
                self.faults.fetch_add(1, Ordering::Relaxed);
                if !reset_before {
                    reset_before = true;
                    (self.on_fault)(
                        "the shared request ring held words its algorithm never writes (a client \
                         process wrote into it, or died pushing): reset it; requests it lost are \
                         taken from their entries",
                    );
                }
            }
            if sweep_now || swept.elapsed() >= SWEEP {
                self.sweep(&mut wake);
                swept = Instant::now();
                sweep_now = false;
            }
            self.held.flush();
            self.wake(&mut wake);
            if checked.elapsed() >= POLL {
                self.reclaim();
                if self.accepting.load(Ordering::Acquire)
                    && self.segment.state() != server_state::RUNNING
                {
                    self.segment.set_state(server_state::RUNNING);
                }
                checked = Instant::now();
            }
            if taken == 0 && !corrupt {
                let spin = if active { SPIN } else { Duration::ZERO };
                sleep_unless(word, sleeping, POLL, spin, || {
                    ring.is_empty() && !self.stop.load(Ordering::Acquire)
                });
            }
            active = taken > 0;
        }
    }

    /// Accepts every QUEUED entry of an active client, as its descriptor
    /// would have (the descriptor, if it comes, then finds it taken).
    fn sweep(&self, wake: &mut Vec<u32>) {
        let config = self.segment.config();
        for client in 0..config.clients {
            if self.segment.client_status(client).load(Ordering::Acquire) != client_state::ACTIVE {
                continue;
            }
            for cell in 0..config.cells {
                let w = self
                    .segment
                    .entry(client, cell)
                    .word()
                    .load(Ordering::Relaxed);
                if w as u32 == state::QUEUED {
                    let d = Descriptor {
                        client,
                        cell,
                        tag: (w >> 32) as u32,
                        withdraw: None,
                    };
                    self.handle(d, wake);
                }
            }
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
        // Never full from a sound client: it has at most `cells` requests,
        // each completed once, and pops each completion before reusing it.
        if self
            .segment
            .completions(client)
            .push(u64::from(cell))
            .is_err()
        {
            self.evict(
                client,
                client_state::ACTIVE,
                "its completion ring holds words the server never writes",
            );
        }
    }

    /// Handles one descriptor: a request is held until the drain's flush.
    fn handle(&self, d: Descriptor, wake: &mut Vec<u32>) {
        let config = self.segment.config();
        if d.client >= config.clients || d.cell >= config.cells {
            return; // not from a client of this layout: nothing to answer
        }
        if let Some(why) = d.withdraw {
            self.withdraw(d, why, wake);
            return;
        }
        let entry = self.segment.entry(d.client, d.cell);
        let accepted = entry.word().compare_exchange(
            word(d.tag, state::QUEUED),
            word(d.tag, state::ACCEPTED),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if accepted.is_err() {
            return; // withdrawn by its client, or stale: never run
        }
        wake.push(d.client);
        let rows = entry.rows().load(Ordering::Relaxed);
        let fail = |code: u32, outcome: Outcome, message: &str| {
            self.pending.tally().count(outcome);
            self.write_done(d.client, d.cell, d.tag, code, message);
        };
        if !self.accepting.load(Ordering::Acquire) {
            return fail(
                code::SERVER_CLOSED,
                Outcome::ServerClosed,
                "the server is stopping",
            );
        }
        let span = match self.layout {
            CellLayout::Rows { .. } => rows,
            CellLayout::Varying { .. } => entry.span().load(Ordering::Relaxed),
        };
        let base = match self.segment.inputs(d.client, d.cell, span) {
            Some(base) if rows <= config.max_rows && rows >= 1 && rows <= span => base,
            _ => {
                return fail(
                    code::INVALID_INPUT,
                    Outcome::InvalidInput,
                    "a request whose rows do not fit its client's cells",
                )
            }
        };
        let (inputs, copy) = match &self.layout {
            CellLayout::Rows {
                inputs: in_rows, ..
            } => {
                let mut inputs = crate::Inputs::with_capacity(in_rows.len());
                let mut offset = 0usize;
                for &row in in_rows {
                    let len = row * rows as usize;
                    // SAFETY: the request's cells hold `rows * in_row` bytes
                    // at `base` (checked by `inputs` above), laid out input
                    // after input; they are the server's from ACCEPTED until
                    // it writes DONE, which happens only after the request is
                    // resolved (by its batch, a withdrawal, or the stop), and
                    // the segment is mapped as long as `self` lives, which
                    // the batcher's sink does.
                    inputs.push(unsafe { InputBytes::new(base.add(offset), len) });
                    offset += len;
                }
                (inputs, None)
            }
            CellLayout::Varying {
                inputs: cell_in, ..
            } => {
                // `span` cells fit the client's area (checked by `inputs`).
                let region_len = span as usize * cell_in;
                match self.copy_inputs(base, region_len) {
                    Ok(copied) => copied,
                    Err(why) => return fail(code::INVALID_INPUT, Outcome::InvalidInput, &why),
                }
            }
        };
        let timeout = match entry.timeout_ns().load(Ordering::Relaxed) {
            u64::MAX => None,
            ns => Some(Duration::from_nanos(ns)),
        };
        let priority = match entry.priority().load(Ordering::Relaxed) {
            0 => None,
            level => Some(level),
        };
        // Read only for a model that asks for them (`with_requests`).
        let parameters = if self.batcher.keeps_parameters() {
            match entry.parameters() {
                Ok(parameters) => parameters,
                Err(why) => return fail(code::INVALID_INPUT, Outcome::InvalidInput, &why),
            }
        } else {
            None
        };
        // Only inputs the model declares optional may be left out.
        let absent = entry.absent().load(Ordering::Relaxed);
        if absent & !self.optional != 0 {
            let why = "the request left out inputs that are not optional";
            return fail(code::INVALID_INPUT, Outcome::InvalidInput, why);
        }
        let submission = crate::Submission {
            timeout,
            priority,
            parameters,
            absent,
            requested_outputs: 0, // every output: a cell holds them all
            blocking_caller: None,
            uncached: false,
        };
        let cell = Cell {
            client: d.client,
            cell: d.cell,
            tag: d.tag,
            rows,
            span,
        };
        let mut registered = None;
        let submitted = self.batcher.submit_held(
            &self.held,
            Sink::SharedMemory(d.client),
            rows as usize,
            inputs,
            submission,
            |request| {
                registered = Some(request.id);
                self.pending
                    .register(request, cell, Held { cell, _copy: copy });
                if let Some(id) = self.cell_id(d.client, d.cell) {
                    id.store(request.id, Ordering::Release);
                }
            },
        );
        match submitted {
            Ok(_) => {}
            Err(err) => {
                if let Some(id) = registered {
                    self.pending.unregister(id);
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
    /// took it (then its batch answers it, and the outcome counted is the
    /// caller's).
    fn withdraw(&self, d: Descriptor, why: Withdraw, wake: &mut Vec<u32>) {
        let Some(id) = self.cell_id(d.client, d.cell) else {
            return;
        };
        let id = id.load(Ordering::Acquire);
        let (to, code, outcome) = match why {
            Withdraw::Cancelled => (RequestState::Cancelled, code::CANCELLED, Outcome::Cancelled),
            Withdraw::Expired => (
                RequestState::Expired,
                code::DEADLINE_EXCEEDED,
                Outcome::DeadlineExceeded,
            ),
        };
        let this_cell =
            |h: &Held| (h.cell.client, h.cell.cell, h.cell.tag) == (d.client, d.cell, d.tag);
        if let Some((cell, _)) = self
            .pending
            .withdraw(&*self.batcher, id, this_cell, to, outcome)
        {
            self.write_done(cell.client, cell.cell, cell.tag, code, "withdrawn");
            wake.push(cell.client);
        } else {
            // A batch holds it: its caller's outcome is what the caller saw.
            self.pending.gave_up(id, this_cell, outcome);
        }
    }

    /// Writes the rows of one finished batch (`routes`: this client's
    /// requests in it) into client `client`'s cells and wakes it once.
    pub fn deliver(&self, client: u32, routes: &[Route], delivery: Delivery<'_>) {
        let taken = self.pending.take(routes);
        if taken.is_empty() {
            return;
        }
        let now = Instant::now();
        for t in &taken {
            let cell = &t.held.cell;
            let failed_alone = |failed: &[(u32, Outcome, String)]| {
                failed
                    .iter()
                    .find(|(start, ..)| *start == t.route.start)
                    .map(|(_, outcome, message)| (*outcome, message.clone()))
            };
            let written = match delivery {
                Delivery::Failed(outcome, message) => Err((outcome, message.to_string())),
                Delivery::Outputs { columns, failed } => match failed_alone(failed) {
                    Some(failure) => Err(failure),
                    None => self
                        .write_rows(cell, &t.route, columns)
                        .map_err(|m| (Outcome::ModelError, m)),
                },
                Delivery::Varying { columns, failed } => match failed_alone(failed) {
                    Some(failure) => Err(failure),
                    None => self
                        .write_varying(cell, &t.route, columns)
                        .map_err(|m| (Outcome::ModelError, m)),
                },
            };
            let (outcome, message) = match written {
                Ok(()) => (Outcome::Succeeded, String::new()),
                Err(failure) => failure,
            };
            if !t.counted {
                self.pending.count(outcome, t.enqueued_at, now);
            }
            self.write_done(
                cell.client,
                cell.cell,
                cell.tag,
                code::of(outcome),
                &message,
            );
        }
        let (word, sleeping) = self.segment.client_doorbell(client);
        super::notify(word, sleeping);
    }

    /// Copies the request's rows of every output into its cells.
    fn write_rows(&self, held: &Cell, route: &Route, columns: &[&[u8]]) -> Result<(), String> {
        let CellLayout::Rows {
            outputs: out_rows, ..
        } = &self.layout
        else {
            return Err("fixed-size outputs for a model of varying ones".into());
        };
        if columns.len() != out_rows.len() {
            return Err(format!(
                "the model gave {} outputs, {} expected",
                columns.len(),
                out_rows.len()
            ));
        }
        let Some(base) = self.segment.outputs(held.client, held.cell, held.rows) else {
            return Err("the request's cells are out of range".into());
        };
        let mut offset = 0usize;
        for (i, (column, &row)) in columns.iter().zip(out_rows).enumerate() {
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

    /// A varying model's request: its inputs copied out of its cells
    /// (`region_len` bytes at `base`) into the server's own memory and
    /// placed there; every length is checked against the region first.
    /// The copy is what the batch reads: a client that writes its cells
    /// after queueing them changes nothing the batcher checked.
    #[allow(clippy::type_complexity)]
    fn copy_inputs(
        &self,
        base: *const u8,
        region_len: usize,
    ) -> Result<(crate::Inputs, Option<Box<[u8]>>), String> {
        let count = self.counts.0;
        let header_len = count
            .checked_mul(varying::INPUT_HEADER)
            .filter(|&h| h <= region_len)
            .ok_or("the request's cells cannot hold its inputs' header")?;
        let mut header = vec![0u8; header_len];
        // SAFETY: `header_len <= region_len` bytes at `base` lie in the
        // request's cells (the caller's contract), the server's while ACCEPTED.
        unsafe { std::ptr::copy_nonoverlapping(base, header.as_mut_ptr(), header_len) };
        let used = varying::used_len(&header, count, region_len)?;
        let mut copy = Vec::new();
        copy.try_reserve_exact(used)
            .map_err(|_| format!("cannot allocate {used} bytes for a request"))?;
        copy.resize(used, 0);
        // SAFETY: `used <= region_len` (checked by `used_len`), as above.
        unsafe { std::ptr::copy_nonoverlapping(base, copy.as_mut_ptr(), used) };
        let copy = copy.into_boxed_slice();
        // Placed from the copy (whose header may differ from the first
        // read): every range is checked against the copy itself.
        let places = varying::read_inputs(&copy, count)?;
        let mut inputs = crate::Inputs::with_capacity(count);
        for (i, place) in places.iter().enumerate() {
            let bytes = &copy[place.range.clone()];
            // SAFETY: the view lies in `copy`, a boxed slice whose heap
            // memory does not move and which the pending entry holds
            // until the request is resolved (`Held`).
            let view = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
            let view = view
                .with_extents(&place.extents)
                .ok_or_else(|| format!("input {i}: too many extents"))?;
            inputs.push(view);
        }
        Ok((inputs, Some(copy)))
    }

    /// Copies the request's rows of every output of a varying model into
    /// its cells, each row with its shape.
    fn write_varying(
        &self,
        held: &Cell,
        route: &Route,
        columns: &[VaryingColumn<'_>],
    ) -> Result<(), String> {
        let CellLayout::Varying {
            outputs: cell_out, ..
        } = self.layout
        else {
            return Err("varying outputs for a model of fixed-size ones".into());
        };
        if columns.len() != self.counts.1 {
            return Err(format!(
                "the model gave {} outputs, {} expected",
                columns.len(),
                self.counts.1
            ));
        }
        let Some(base) = self.segment.outputs(held.client, held.cell, held.span) else {
            return Err("the request's cells are out of range".into());
        };
        let region_len = held.span as usize * cell_out;
        // Made here, then copied once: the cells are shared memory.
        let mut answer = Vec::new();
        let first = route.start as usize;
        let rows = first..first + route.rows as usize;
        for (i, column) in columns.iter().enumerate() {
            let (Some(ranges), Some(shapes)) = (
                column.rows.get(rows.clone()),
                column.shapes.get(rows.clone()),
            ) else {
                return Err(format!("output {i} has fewer rows than the batch"));
            };
            let bytes: Option<Vec<&[u8]>> =
                ranges.iter().map(|r| column.data.get(r.clone())).collect();
            let bytes = bytes.ok_or_else(|| format!("output {i}: a row outside its data"))?;
            let shapes: Vec<&[u64]> = shapes.iter().map(Vec::as_slice).collect();
            let output = varying::OutputRows {
                rows: &bytes,
                shapes: &shapes,
                pad: column.pad,
            };
            let len = output
                .encoded_len()
                .ok_or_else(|| format!("output {i}: rows of different ranks"))?;
            let at = answer.len();
            let grown = at.checked_add(len).filter(|&n| n <= region_len);
            let Some(grown) = grown else {
                let need = at.saturating_add(len);
                return Err(format!(
                    "the outputs take {need} bytes or more; the request's {} cells hold {region_len}: \
                     share() with a larger cell_bytes",
                    held.span
                ));
            };
            answer.resize(grown, 0);
            varying::write_output(&mut answer, at, &output)
                .map_err(|_| format!("output {i} does not fit"))?;
        }
        // SAFETY: `answer.len() <= region_len` bytes: the request's output
        // cells (checked by `outputs`), the server's until it writes DONE.
        unsafe { std::ptr::copy_nonoverlapping(answer.as_ptr(), base, answer.len()) };
        Ok(())
    }

    /// Withdraws the requests of closing slots and frees those with none
    /// left; marks the slots of dead processes closing.
    fn reclaim(&self) {
        let segment = &self.segment;
        for client in 0..segment.config().clients {
            let status = segment.client_status(client);
            match status.load(Ordering::Acquire) {
                client_state::FREE | client_state::CLOSING => {}
                client_state::ACTIVE => {
                    if !self.owner_alive(client) {
                        let _ = status.compare_exchange(
                            client_state::ACTIVE,
                            client_state::CLOSING,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                    }
                }
                garbage => self.evict(client, garbage, &format!("its state word is {garbage:#x}")),
            }
            if status.load(Ordering::Acquire) != client_state::CLOSING {
                continue;
            }
            // A closing slot's requests: withdrawn, counted cancelled (nobody
            // reads their answers); those a batch holds keep the slot.
            let (_, left) = self.pending.withdraw_where(
                &*self.batcher,
                |held| held.cell.client == client,
                RequestState::Closed,
                Outcome::Cancelled,
            );
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
            segment.completions(client).reset();
            segment.client_owner(client).store(0, Ordering::Release);
            status.store(client_state::FREE, Ordering::Release);
            self.reclaimed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// True while the process owning client slot `client` runs.
    fn owner_alive(&self, client: u32) -> bool {
        let pid = self.segment.client_owner(client).load(Ordering::Acquire);
        let start = self
            .segment
            .client_owner_start(client)
            .load(Ordering::Acquire);
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let Some(peer) = peers.get_mut(client as usize) else {
            return false;
        };
        match peer {
            Some(p) if p.pid() == pid && p.start() == start => p.is_alive(),
            _ => peer.insert(Peer::watch(pid, start)).is_alive(),
        }
    }

    /// Stops taking requests off the ring (accepted ones still run); the
    /// clients refuse new ones from now on. Returns once the pull thread ended.
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::Release);
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
        for cell in self
            .pending
            .fail_all(Some(&*self.batcher), Outcome::ServerClosed)
        {
            self.write_done(
                cell.client,
                cell.cell,
                cell.tag,
                code::SERVER_CLOSED,
                message,
            );
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
