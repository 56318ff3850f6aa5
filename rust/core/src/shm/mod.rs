//! Shared-memory clients: requests from other processes of the same user.
//!
//! One segment per shared name (a file in `/dev/shm`, mapped by the server
//! and by every client process) holds, in this order ([`Layout`]):
//!
//! * a header: magic, layout and crate version (a client of another
//!   ferrobatch version is refused), the server's pid and state, the sizes
//!   below, and the server's doorbell;
//! * the model's metadata (JSON written by the binding: names, dtypes, shapes);
//! * the **request ring**: a bounded lock-free multi-producer queue of
//!   descriptors (client, cell, tag), [`Ring`], into which every client
//!   process pushes;
//! * one **client area** per client slot: its owner's pid and state, its
//!   doorbell, a completion [`Ring`] the server pushes finished requests on,
//!   one [`Entry`] per cell (a request's state, rows, deadline and error),
//!   and the arena: per cell one row of every input and one row of every
//!   output. A request of `r` rows takes `r` consecutive cells, allocated by
//!   its client process alone ([`Arena`]) and named by its first cell. A
//!   model with BYTES or variable-length tensors has cells of a size given
//!   at share time instead, and a request takes as many as its bytes need,
//!   laid out as [`varying`] says.
//!
//! # Ownership of a cell
//!
//! An entry's `word` holds `(tag << 32) | state` and moves, by atomic
//! stores and compare-and-swaps on the whole word:
//!
//! ```text
//! FREE --client writes inputs, rows, deadline--> QUEUED --server pops--> ACCEPTED
//!   ^                                               |                       |
//!   +---------- client withdraws (CAS) -------------+                       |
//!   +---- client reads the outputs or error <-- DONE <-- server writes -----+
//! ```
//!
//! The client owns a cell's bytes in `FREE` and `DONE`, the server from
//! `ACCEPTED` until it stores `DONE` (Release; the client loads it with
//! Acquire), and nobody writes them while `QUEUED`. The tag, new for every
//! request of a client slot, makes a stale descriptor (of a withdrawn
//! request whose cell was reused, or of a dead client) find another word
//! than the one it names, so it is dropped: each `QUEUED` is accepted once.
//!
//! # Wake-ups
//!
//! The server's pull thread and each client process's collector sleep on a
//! futex word (an event count: the sleeper says it sleeps, re-checks its
//! ring, then waits for the word to change; the waker bumps the word and
//! wakes only when someone sleeps), always with a timeout, so a dead peer is
//! noticed: a client watches the server's process and state, the server
//! each client's ([`Peer`]: a pidfd, never `kill(pid, 0)`, which a zombie
//! passes). A batch wakes each client process once, whatever its number of
//! requests in the batch.
//!
//! # Hostile memory
//!
//! Every process that may write the segment may write anything anywhere
//! in it. The server validates each word it reads before use (a
//! descriptor's client and cell, a request's rows, a slot's state), keeps
//! its own state in its own memory, and bounds every loop over shared
//! words ([`Ring`]). A client's malformed slot or completion ring fails
//! that client alone (its slot is closed and reclaimed, logged once); a
//! malformed request ring, which every client shares, is reset, and the
//! requests whose descriptors it lost are found by the server's sweep of
//! the entries (each `QUEUED` entry is accepted by one compare-and-swap,
//! whichever finds it first). Clients connect only to a segment owned by
//! their own user unless told to trust another.

mod arena;
mod client;
mod liveness;
#[cfg(all(test, not(miri), not(loom)))]
mod protocol_tests;
mod ring;
mod segment;
mod server;
pub mod varying;

pub use arena::Arena;
pub use client::{ClientCore, Completed, ServerGone};
pub use liveness::{start_time, Peer};
pub use ring::{Corrupt, PushError, Ring};
pub(crate) use segment::SEGMENT_PREFIX;
pub use segment::{current_uid, remove_stale_segments, Entry, Layout, Segment, SegmentConfig};
pub use server::{CellLayout, Delivery, OnFault, SharedServer, VaryingColumn};

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// "FERROSHM", little-endian: the first word of every segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FERROSHM");
/// Bumped whenever the layout or the protocol changes.
pub const LAYOUT_VERSION: u32 = 5;
/// The version of ferrobatch that made a segment, checked by clients too.
pub const CRATE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// How often a sleeper wakes to check its peer (and its stop flag): a dead
/// peer is noticed within this (plus a check).
pub const POLL: Duration = Duration::from_millis(50);

/// How long a sleeper with work in flight polls before it sleeps on the
/// futex: about one round trip of a lone caller, so back-to-back requests
/// cost no wake-up (one caller, identity: 70 µs round trip with it, 130
/// µs without; 150 µs polls measured no better).
pub const SPIN: Duration = Duration::from_micros(50);

/// States of an [`Entry`] (the low 32 bits of its word).
pub mod state {
    pub const FREE: u32 = 0;
    pub const QUEUED: u32 = 1;
    pub const ACCEPTED: u32 = 2;
    pub const DONE: u32 = 3;
}

/// How a request ended, as written in its entry's `code` (the client raises
/// the matching error).
pub mod code {
    pub const OK: u32 = 0;
    pub const INVALID_INPUT: u32 = 1;
    pub const QUEUE_FULL: u32 = 2;
    pub const DEADLINE_EXCEEDED: u32 = 3;
    pub const CANCELLED: u32 = 4;
    pub const MODEL_ERROR: u32 = 5;
    pub const SERVER_CLOSED: u32 = 6;

    /// The code of a request whose caller sees `outcome`.
    pub fn of(outcome: crate::Outcome) -> u32 {
        use crate::Outcome;
        match outcome {
            Outcome::Succeeded => OK,
            Outcome::InvalidInput => INVALID_INPUT,
            Outcome::QueueFull => QUEUE_FULL,
            Outcome::DeadlineExceeded => DEADLINE_EXCEEDED,
            Outcome::Cancelled => CANCELLED,
            Outcome::ModelError => MODEL_ERROR,
            Outcome::ServerClosed => SERVER_CLOSED,
        }
    }
}

/// The server's state in the header.
pub mod server_state {
    pub const STARTING: u32 = 0;
    pub const RUNNING: u32 = 1;
    /// Accepted requests still run; new ones are refused.
    pub const STOPPING: u32 = 2;
    /// Every request it accepted has been answered.
    pub const STOPPED: u32 = 3;
}

/// A client slot's state.
pub mod client_state {
    pub const FREE: u32 = 0;
    pub const ACTIVE: u32 = 1;
    /// Its owner closed it (or died): the server reclaims it once none of
    /// its requests is held by a batch.
    pub const CLOSING: u32 = 2;
}

/// Most client slots (the descriptor has 12 bits for them).
pub const MAX_CLIENTS: u32 = 1 << 12;
/// Most cells per client (18 bits in the descriptor).
pub const MAX_CELLS: u32 = 1 << 18;
/// Most descriptors the submission ring holds (4096 by default): past it
/// the segment grows by 16 bytes a descriptor for no use.
pub const MAX_RING: u32 = 1 << 20;
/// Longest error message kept in an entry.
pub const MESSAGE_BYTES: usize = 200;
/// Longest request parameters (a JSON object's text) an entry carries.
pub const PARAMETERS_BYTES: usize = 256;

/// One ring element: a request (or a request's withdrawal) of a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub client: u32,
    pub cell: u32,
    pub tag: u32,
    /// Not a new request: the client withdraws this one (its caller gave up).
    pub withdraw: Option<Withdraw>,
}

/// Why a client withdraws a request the server has accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Withdraw {
    Cancelled,
    Expired,
}

impl Descriptor {
    /// `tag:32 | kind:2 | client:12 | cell:18`, one `u64`.
    pub fn encode(self) -> u64 {
        let kind = match self.withdraw {
            None => 0u64,
            Some(Withdraw::Cancelled) => 1,
            Some(Withdraw::Expired) => 2,
        };
        (u64::from(self.tag) << 32)
            | (kind << 30)
            | (u64::from(self.client & (MAX_CLIENTS - 1)) << 18)
            | u64::from(self.cell & (MAX_CELLS - 1))
    }

    pub fn decode(v: u64) -> Descriptor {
        let withdraw = match (v >> 30) & 3 {
            1 => Some(Withdraw::Cancelled),
            2 => Some(Withdraw::Expired),
            _ => None,
        };
        Descriptor {
            tag: (v >> 32) as u32,
            client: ((v >> 18) & u64::from(MAX_CLIENTS - 1)) as u32,
            cell: (v & u64::from(MAX_CELLS - 1)) as u32,
            withdraw,
        }
    }
}

/// What can go wrong attaching to or serving through a segment.
#[derive(Debug)]
pub enum ShmError {
    /// No segment of that name (no server shares it).
    NotFound(String),
    /// A segment of another ferrobatch version, or not one of ours.
    Version(String),
    /// The server stopped or died.
    Closed(String),
    /// The ring or the client's arena is full, or every client slot is taken.
    Full(String),
    /// A request that does not fit the segment (too many rows, wrong sizes).
    Invalid(String),
    /// The name is in use by a live server, or a bad name / size.
    Config(String),
    /// The segment belongs to a user the client was not told to trust.
    Owner(String),
    Io(String, std::io::Error),
}

impl fmt::Display for ShmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShmError::NotFound(m)
            | ShmError::Version(m)
            | ShmError::Closed(m)
            | ShmError::Full(m)
            | ShmError::Invalid(m)
            | ShmError::Config(m)
            | ShmError::Owner(m) => f.write_str(m),
            ShmError::Io(what, e) => write!(f, "{what}: {e}"),
        }
    }
}

impl std::error::Error for ShmError {}

/// This process's id.
pub fn current_pid() -> u32 {
    std::process::id()
}

/// Sleeps until `word` is no longer `seen`, a wake, or `timeout`.
pub fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    #[cfg(target_os = "linux")]
    {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a valid, aligned u32 for the duration of the call
        // (it may live in shared memory: FUTEX_WAIT without PRIVATE is the
        // cross-process form); `ts` is a valid relative timeout.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        if word.load(Ordering::Acquire) == seen {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
        }
    }
}

/// Wakes every process sleeping on `word`.
pub fn futex_wake(word: &AtomicU32) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `word` is a valid, aligned u32; waking has no other effect.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = word;
}

/// The waker's half of an event count: bumps `word` and wakes the sleeper
/// if it said it sleeps. Call after publishing what the sleeper re-checks.
pub fn notify(word: &AtomicU32, sleeping: &AtomicU32) {
    if sleeping.load(Ordering::SeqCst) != 0 {
        word.fetch_add(1, Ordering::SeqCst);
        futex_wake(word);
    }
}

/// The sleeper's half: polls `is_empty` for up to `spin` first (a peer that
/// answers within it costs no futex wake-up on either side), then says it
/// sleeps, runs `is_empty` again (the re-check) and waits for a bump (or
/// `timeout`) only if it is still empty.
pub fn sleep_unless(
    word: &AtomicU32,
    sleeping: &AtomicU32,
    timeout: Duration,
    spin: Duration,
    is_empty: impl Fn() -> bool,
) {
    if !spin.is_zero() {
        let until = std::time::Instant::now() + spin;
        let mut polls = 0u32;
        while is_empty() {
            polls = polls.wrapping_add(1);
            if polls % 64 == 0 {
                if std::time::Instant::now() >= until {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if !is_empty() {
            return;
        }
    }
    let seen = word.load(Ordering::SeqCst);
    sleeping.store(1, Ordering::SeqCst);
    if is_empty() {
        futex_wait(word, seen, timeout);
    }
    sleeping.store(0, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip() {
        for d in [
            Descriptor {
                client: 0,
                cell: 0,
                tag: 0,
                withdraw: None,
            },
            Descriptor {
                client: MAX_CLIENTS - 1,
                cell: MAX_CELLS - 1,
                tag: u32::MAX,
                withdraw: Some(Withdraw::Expired),
            },
            Descriptor {
                client: 7,
                cell: 1234,
                tag: 99,
                withdraw: Some(Withdraw::Cancelled),
            },
        ] {
            assert_eq!(Descriptor::decode(d.encode()), d);
        }
    }
}
