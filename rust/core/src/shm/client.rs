//! A client process's side: claim a slot, write requests into its cells
//! and push their descriptors, withdraw them, collect finished ones, and
//! notice a server that stopped or died.
//!
//! One `ClientCore` per connected process; what waits for each request (an
//! asyncio future, a blocked thread) is the binding's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::segment::word;
use super::{
    client_state, code, current_pid, notify, server_state, sleep_unless, state, varying, Arena,
    CellLayout, Corrupt, Descriptor, Peer, PushError, Segment, ShmError, Withdraw, SPIN,
};

/// A finished request, read from its entry (its outputs still in its cells
/// until [`ClientCore::release`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub cell: u32,
    pub tag: u32,
    pub rows: u32,
    /// Cells it took: its rows, or more for a varying model's request.
    pub span: u32,
    pub code: u32,
    pub message: String,
}

/// Why the server no longer answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerGone {
    /// It is stopping: accepted requests still run, new ones are refused.
    Stopping,
    /// It stopped: every request it accepted was answered.
    Stopped,
    /// Its process is gone.
    Died,
    /// It closed this client's slot: it found words there the protocol
    /// never writes, or took this process for dead.
    Evicted,
}

/// This process's own record of its cells: which are used, and the tag,
/// span and rows of each request in flight (by its first cell). The
/// segment's copies are for the server; what a completion names is checked
/// here.
#[derive(Debug)]
struct Cells {
    arena: Arena,
    /// `(tag, span, rows)` per first cell; span 0: no request starts there.
    requests: Vec<(u32, u32, u32)>,
}

impl Cells {
    fn alloc(&mut self, span: u32, rows: u32, tag: u32) -> Option<u32> {
        let cell = self.arena.alloc(span as usize)?;
        self.requests[cell] = (tag, span, rows);
        Some(cell as u32)
    }

    /// The span and rows of request `(cell, tag)`, if it is in flight.
    fn find(&self, cell: u32, tag: u32) -> Option<(u32, u32)> {
        match self.requests.get(cell as usize) {
            Some(&(t, span, rows)) if t == tag && span > 0 => Some((span, rows)),
            _ => None,
        }
    }

    /// Frees request `(cell, tag)`'s cells (nothing if it is not in flight).
    fn free(&mut self, cell: u32, tag: u32) {
        if let Some((span, _)) = self.find(cell, tag) {
            self.requests[cell as usize] = (0, 0, 0);
            self.arena.free(cell as usize, span as usize);
        }
    }
}

#[derive(Debug)]
pub struct ClientCore {
    segment: Arc<Segment>,
    slot: u32,
    /// The process that claimed the slot: a forked child is not it.
    pid: u32,
    /// The server's process.
    server: Peer,
    layout: CellLayout,
    cells: Mutex<Cells>,
    /// Withdrawals the ring had no room for, retried by `retry_withdrawals`.
    withdrawals: Mutex<Vec<u64>>,
    closed: AtomicBool,
}

impl ClientCore {
    /// Claims a free client slot of `segment` for this process. `layout`:
    /// how the model's requests lie in their cells (its sizes must be the
    /// segment's).
    pub fn connect(segment: Arc<Segment>, layout: CellLayout) -> Result<ClientCore, ShmError> {
        let config = segment.config();
        if layout.cell_bytes() != (config.in_row as usize, config.out_row as usize) {
            return Err(ShmError::Version(
                "the model's inputs and outputs disagree with the shared segment's sizes".into(),
            ));
        }
        match segment.state() {
            server_state::RUNNING => {}
            server_state::STARTING => {
                return Err(ShmError::NotFound("the server is starting".into()))
            }
            _ => return Err(ShmError::Closed("the server is stopping".into())),
        }
        let server = segment.server();
        if !server.is_alive() {
            return Err(ShmError::Closed(format!(
                "the server (pid {}) is gone",
                server.pid()
            )));
        }
        let (pid, start) = Peer::me();
        for slot in 0..config.clients {
            let claimed = segment.client_status(slot).compare_exchange(
                client_state::FREE,
                client_state::ACTIVE,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            if claimed.is_ok() {
                segment
                    .client_owner_start(slot)
                    .store(start, Ordering::Release);
                segment.client_owner(slot).store(pid, Ordering::Release);
                return Ok(ClientCore {
                    server,
                    cells: Mutex::new(Cells {
                        arena: Arena::new(config.cells as usize),
                        requests: vec![(0, 0, 0); config.cells as usize],
                    }),
                    segment,
                    slot,
                    pid,
                    layout,
                    withdrawals: Mutex::new(Vec::new()),
                    closed: AtomicBool::new(false),
                });
            }
        }
        Err(ShmError::Full(format!(
            "all {} client slots are taken (max_clients)",
            config.clients
        )))
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }

    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    fn cells(&self) -> MutexGuard<'_, Cells> {
        self.cells.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows in flight (cells in use).
    pub fn in_flight(&self) -> usize {
        self.cells().arena.used()
    }

    /// Writes a request of `rows` rows (`inputs[i]`: input `i`'s bytes) into
    /// free cells and queues it: `(cell, tag)` name it from now on.
    /// `Full` at once when the cells or the ring have no room.
    pub fn submit(
        &self,
        inputs: &[&[u8]],
        rows: u32,
        timeout: Option<Duration>,
    ) -> Result<(u32, u32), ShmError> {
        let submission = crate::Submission {
            timeout,
            ..Default::default()
        };
        self.submit_with(inputs, rows, &submission)
    }

    /// [`ClientCore::submit`] with a priority level (the server checks it)
    /// and parameters (a JSON object's text, at most `PARAMETERS_BYTES`).
    pub fn submit_with(
        &self,
        inputs: &[&[u8]],
        rows: u32,
        submission: &crate::Submission,
    ) -> Result<(u32, u32), ShmError> {
        let CellLayout::Rows {
            inputs: in_rows, ..
        } = &self.layout
        else {
            return Err(ShmError::Invalid(
                "a model of varying tensors takes `submit_varying`".into(),
            ));
        };
        if inputs.len() != in_rows.len()
            || inputs
                .iter()
                .zip(in_rows)
                .any(|(bytes, row)| bytes.len() != row * rows as usize)
        {
            return Err(ShmError::Invalid(
                "input sizes disagree with the request's rows".into(),
            ));
        }
        self.queue(rows, rows, submission, |base, _| {
            let mut offset = 0;
            for bytes in inputs {
                // SAFETY: the cells are this process's (allocated, FREE):
                // nobody else reads or writes them until QUEUED is
                // published; `rows * in_row` bytes lie at `base` (`queue`).
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(offset), bytes.len())
                };
                offset += bytes.len();
            }
        })
    }

    /// Queues a request of a model with BYTES or variable-length tensors:
    /// `inputs[i]` is input `i`'s bytes and extents, as the batcher takes
    /// them. It takes as many cells as its bytes need (at least `rows`),
    /// laid out as [`super::varying`] says; its outputs must fit as many.
    pub fn submit_varying(
        &self,
        inputs: &[(&[u8], [usize; crate::request::MAX_VARIABLE_DIMS])],
        rows: u32,
        submission: &crate::Submission,
    ) -> Result<(u32, u32), ShmError> {
        let CellLayout::Varying { inputs: cell, .. } = self.layout else {
            return Err(ShmError::Invalid(
                "a model of fixed-size tensors takes `submit_with`".into(),
            ));
        };
        let lens: Vec<usize> = inputs.iter().map(|(b, _)| b.len()).collect();
        let config = self.segment.config();
        let need = varying::inputs_len(&lens)
            .zip(std::num::NonZeroUsize::new(cell))
            .map(|(n, cell)| n.div_ceil(cell.get()))
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n <= config.cells);
        let Some(need) = need else {
            return Err(ShmError::Invalid(format!(
                "a request of {} bytes; at most {} fit this client's cells \
                 (rows_per_client x cell_bytes)",
                lens.iter().sum::<usize>(),
                config.cells as usize * cell
            )));
        };
        let span = need.max(rows);
        self.queue(rows, span, submission, |base, len| {
            // SAFETY: as in `submit_with`: `span` cells of `cell` bytes, this
            // process's until QUEUED is published.
            let region = unsafe { std::slice::from_raw_parts_mut(base, len) };
            // Fits: `span` cells hold at least `need` cells' bytes.
            varying::write_inputs(region, inputs);
        })
    }

    /// Takes `span` free cells, lets `write` fill their `span * in_row`
    /// input bytes, and queues the request of `rows` rows.
    fn queue(
        &self,
        rows: u32,
        span: u32,
        submission: &crate::Submission,
        write: impl FnOnce(*mut u8, usize),
    ) -> Result<(u32, u32), ShmError> {
        let (timeout, priority) = (submission.timeout, submission.priority);
        let parameters = submission.parameters.as_deref();
        if parameters.is_some_and(|p| p.len() > super::PARAMETERS_BYTES) {
            return Err(ShmError::Invalid(format!(
                "parameters of {} bytes; at most {} cross shared memory",
                parameters.map_or(0, str::len),
                super::PARAMETERS_BYTES
            )));
        }
        if let Some(gone) = self.server_gone() {
            return Err(ShmError::Closed(gone.to_string()));
        }
        let config = self.segment.config();
        if rows == 0 || rows > config.max_rows || span > config.cells {
            return Err(ShmError::Invalid(format!(
                "a request of {rows} rows; at most {} fit (max_batch_size, rows_per_client)",
                config.max_rows.min(config.cells)
            )));
        }
        let tag = self
            .segment
            .client_next_tag(self.slot)
            .fetch_add(1, Ordering::Relaxed);
        let Some(cell) = self.cells().alloc(span, rows, tag) else {
            return Err(ShmError::Full(format!(
                "this client has {} rows in flight, all its cells (rows_per_client={})",
                self.in_flight(),
                config.cells
            )));
        };
        let entry = self.segment.entry(self.slot, cell);
        let Some(base) = self.segment.inputs(self.slot, cell, span) else {
            self.cells().free(cell, tag);
            return Err(ShmError::Invalid("cells out of range".into()));
        };
        write(base, span as usize * config.in_row as usize);
        entry.rows().store(rows, Ordering::Relaxed);
        entry.span().store(span, Ordering::Relaxed);
        entry
            .priority()
            .store(priority.unwrap_or(0), Ordering::Relaxed);
        entry.absent().store(submission.absent, Ordering::Relaxed);
        // Checked above: it fits.
        entry.set_parameters(parameters.unwrap_or(""));
        let ns = timeout.map_or(u64::MAX, |t| {
            t.as_nanos().min(u128::from(u64::MAX - 1)) as u64
        });
        entry.timeout_ns().store(ns, Ordering::Relaxed);
        entry
            .word()
            .store(word(tag, state::QUEUED), Ordering::Release);
        let descriptor = Descriptor {
            client: self.slot,
            cell,
            tag,
            withdraw: None,
        };
        let pushed = self.segment.ring().push(descriptor.encode());
        // A corrupt ring lost the descriptor, not the request: the server
        // resets the ring and its sweep finds the QUEUED entry.
        if let Err(PushError::Full(_)) = pushed {
            // Never seen by the server: take it back.
            entry
                .word()
                .store(word(tag, state::FREE), Ordering::Release);
            self.cells().free(cell, tag);
            return Err(ShmError::Full(format!(
                "the shared request ring is full ({} requests waiting: ring_size)",
                config.ring_capacity
            )));
        }
        let (word, sleeping) = self.segment.server_doorbell();
        notify(word, sleeping);
        Ok((cell, tag))
    }

    /// Withdraws request `(cell, tag)`. True: it will never
    /// run and its cells are free again. False: the server has it; a
    /// withdrawal is sent, and its answer (its result, or `why`'s code if
    /// the server withdrew it in time) still comes through `collect`.
    pub fn withdraw(&self, cell: u32, tag: u32, why: Withdraw) -> bool {
        let entry = self.segment.entry(self.slot, cell);
        let taken_back = entry.word().compare_exchange(
            word(tag, state::QUEUED),
            word(tag, state::FREE),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if taken_back.is_ok() {
            self.cells().free(cell, tag);
            return true;
        }
        let descriptor = Descriptor {
            client: self.slot,
            cell,
            tag,
            withdraw: Some(why),
        }
        .encode();
        if self.segment.ring().push(descriptor).is_err() {
            self.withdrawals
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(descriptor);
        } else {
            let (word, sleeping) = self.segment.server_doorbell();
            notify(word, sleeping);
        }
        false
    }

    /// Pushes withdrawals the ring had no room for earlier.
    pub fn retry_withdrawals(&self) {
        let mut left = self.withdrawals.lock().unwrap_or_else(|e| e.into_inner());
        if left.is_empty() {
            return;
        }
        let ring = self.segment.ring();
        left.retain(|&d| ring.push(d).is_err());
        let (word, sleeping) = self.segment.server_doorbell();
        notify(word, sleeping);
    }

    /// Sleeps until the server completes something, or `timeout`; with
    /// requests in flight it polls for `SPIN` first.
    pub fn wait(&self, timeout: Duration) {
        let (word, sleeping) = self.segment.client_doorbell(self.slot);
        let completions = self.segment.completions(self.slot);
        let spin = if self.in_flight() > 0 {
            SPIN
        } else {
            Duration::ZERO
        };
        sleep_unless(word, sleeping, timeout, spin, || completions.is_empty());
    }

    /// Appends the requests finished since the last call to `out`. `Err`:
    /// this client's completion ring holds words the server never writes
    /// (its answers can no longer be trusted to arrive).
    pub fn collect(&self, out: &mut Vec<Completed>) -> Result<(), Corrupt> {
        let completions = self.segment.completions(self.slot);
        completions.check()?;
        while let Some(cell) = completions.pop()? {
            let Ok(cell) = u32::try_from(cell) else {
                continue;
            };
            if cell >= self.segment.config().cells {
                continue;
            }
            let entry = self.segment.entry(self.slot, cell);
            let w = entry.word().load(Ordering::Acquire);
            let tag = (w >> 32) as u32;
            if w as u32 != state::DONE {
                continue;
            }
            // Only a request of ours, with the rows we sent.
            let Some((span, rows)) = self.cells().find(cell, tag) else {
                continue;
            };
            let code = entry.code().load(Ordering::Relaxed);
            out.push(Completed {
                cell,
                tag,
                rows,
                span,
                message: if code == code::OK {
                    String::new()
                } else {
                    entry.message()
                },
                code,
            });
        }
        Ok(())
    }

    /// Output `index`'s bytes of finished request `done` (valid until
    /// `release(done)`).
    pub fn output(&self, done: &Completed, index: usize) -> &[u8] {
        let CellLayout::Rows {
            outputs: out_rows, ..
        } = &self.layout
        else {
            return &[];
        };
        let Some(base) = self.segment.outputs(self.slot, done.cell, done.rows) else {
            return &[];
        };
        let rows = done.rows as usize;
        let offset: usize = out_rows[..index].iter().sum::<usize>() * rows;
        let len = out_rows.get(index).copied().unwrap_or(0) * rows;
        // SAFETY: the request is DONE: its cells are this process's until
        // `release`, which takes `&self` too but is called by the owner of
        // `done` only after the returned borrow ends; the bytes lie in the
        // cells (`outputs` checked the range).
        unsafe { std::slice::from_raw_parts(base.add(offset), len) }
    }

    /// The outputs of finished request `done` of a varying model, read from
    /// its cells (valid until `release(done)`); Err: the server wrote
    /// what its protocol never writes.
    pub fn varying_outputs(
        &self,
        done: &Completed,
        count: usize,
    ) -> Result<Vec<varying::OutputRead<'_>>, String> {
        let CellLayout::Varying { outputs: cell, .. } = self.layout else {
            return Err("a model of fixed-size outputs".into());
        };
        let Some(base) = self.segment.outputs(self.slot, done.cell, done.span) else {
            return Err("the request's cells are out of range".into());
        };
        // SAFETY: as in `output`: `span` cells of `cell` output bytes, this
        // process's while DONE.
        let region = unsafe { std::slice::from_raw_parts(base, done.span as usize * cell) };
        varying::read_outputs(region, count, done.rows as usize)
    }

    /// Frees a finished request's cells.
    pub fn release(&self, done: &Completed) {
        let entry = self.segment.entry(self.slot, done.cell);
        entry
            .word()
            .store(word(done.tag, state::FREE), Ordering::Release);
        self.cells().free(done.cell, done.tag);
    }

    /// Why the server no longer answers, if it does not.
    pub fn server_gone(&self) -> Option<ServerGone> {
        if self.closed.load(Ordering::Acquire) {
            return Some(ServerGone::Stopped);
        }
        let state = self.segment.state();
        if state == server_state::STOPPED {
            return Some(ServerGone::Stopped);
        }
        // Before STOPPING: a server killed while it stopped never writes
        // STOPPED, and its waiters would wait for it forever.
        if !self.server.is_alive() {
            // Nobody else removes what a killed server left behind.
            self.segment.unlink();
            return Some(ServerGone::Died);
        }
        if state == server_state::STOPPING {
            return Some(ServerGone::Stopping);
        }
        // The server closed or reclaimed our slot.
        if self.segment.client_owner(self.slot).load(Ordering::Acquire) != self.pid
            || self
                .segment
                .client_status(self.slot)
                .load(Ordering::Acquire)
                != client_state::ACTIVE
        {
            return Some(ServerGone::Evicted);
        }
        None
    }

    /// Gives the slot back (the server reclaims it once none of its requests
    /// is in a batch). A no-op in a forked child: the slot is its parent's.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) || current_pid() != self.pid {
            return;
        }
        let _ = self.segment.client_status(self.slot).compare_exchange(
            client_state::ACTIVE,
            client_state::CLOSING,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let (word, _) = self.segment.server_doorbell();
        word.fetch_add(1, Ordering::SeqCst);
        super::futex_wake(word);
    }

    /// How the model's requests lie in their cells.
    pub fn layout(&self) -> &CellLayout {
        &self.layout
    }
}

impl std::fmt::Display for ServerGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ServerGone::Stopping => "the shared server is stopping",
            ServerGone::Stopped => "the shared server stopped",
            ServerGone::Died => "the shared server's process is gone",
            ServerGone::Evicted => {
                "the shared server closed this client: its slot held words the protocol never \
                 writes, or its process was taken for dead"
            }
        })
    }
}

impl Drop for ClientCore {
    fn drop(&mut self) {
        self.close();
    }
}
