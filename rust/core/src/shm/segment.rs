//! The segment: a file in `/dev/shm` mapped by the server and its clients,
//! its layout, and typed views of its parts (see the module docs of
//! [`crate::shm`]).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::{
    server_state, ShmError, CRATE_VERSION, LAYOUT_VERSION, MAGIC, MAX_CELLS, MAX_CLIENTS, MAX_RING,
    MESSAGE_BYTES, PARAMETERS_BYTES,
};
use crate::shm::{Peer, Ring};
use crate::Outcome;

const LINE: usize = 64;
/// The header's size (one page).
const HEADER: usize = 4096;
/// Offsets of the header's fields.
mod at {
    pub const MAGIC: usize = 0;
    pub const LAYOUT: usize = 8;
    pub const SERVER_PID: usize = 12;
    pub const STATE: usize = 16;
    pub const CLIENTS: usize = 20;
    pub const CELLS: usize = 24;
    pub const RING: usize = 28;
    pub const IN_ROW: usize = 32;
    pub const OUT_ROW: usize = 36;
    pub const MAX_ROWS: usize = 40;
    pub const META_LEN: usize = 44;
    pub const TOTAL: usize = 48;
    /// The server process's start time (see `liveness`), a u64.
    pub const SERVER_START: usize = 56;
    /// The crate version, NUL-padded, as 4 u64 words.
    pub const VERSION: usize = 64;
    pub const SERVER_WORD: usize = 128;
    pub const SERVER_SLEEPING: usize = 192;
    /// Requests clients refused before queueing them, by outcome: a u64
    /// each for `REFUSALS`, in that order.
    pub const REFUSED: usize = 256;
}

/// The outcomes a client refuses a request with on its own side (its
/// checks, its full cells, a server that stops), counted in the header.
const REFUSALS: [Outcome; 3] = [
    Outcome::InvalidInput,
    Outcome::QueueFull,
    Outcome::ServerClosed,
];
/// Offsets within a client area.
mod client_at {
    pub const STATUS: usize = 0;
    pub const OWNER_PID: usize = 4;
    pub const NEXT_TAG: usize = 8;
    /// The owner's start time (see `liveness`), a u64.
    pub const OWNER_START: usize = 16;
    pub const WORD: usize = 64;
    pub const SLEEPING: usize = 128;
    pub const COMPLETIONS: usize = 192;
}
/// Bytes of one entry, and offsets within it.
const ENTRY: usize = 512;
mod entry_at {
    pub const WORD: usize = 0;
    pub const ROWS: usize = 8;
    pub const CODE: usize = 12;
    pub const TIMEOUT_NS: usize = 16;
    pub const MESSAGE_LEN: usize = 24;
    pub const MESSAGE: usize = 32;
    /// After the message's `MESSAGE_BYTES`.
    pub const PRIORITY: usize = 232;
    pub const PARAMETERS_LEN: usize = 236;
    pub const ABSENT: usize = 240;
    /// Cells a varying model's request takes (its rows, or more).
    pub const SPAN: usize = 248;
    /// `PARAMETERS_BYTES` of them, to the end of the entry.
    pub const PARAMETERS: usize = 256;
}

fn round_up(n: usize) -> Option<usize> {
    n.checked_add(LINE - 1).map(|n| n & !(LINE - 1))
}

/// The sizes a server shares with: fixed for the segment's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentConfig {
    /// Client slots: processes connected at once.
    pub clients: u32,
    /// Cells per client: rows it may have in flight at once.
    pub cells: u32,
    /// Request ring slots (a power of two).
    pub ring_capacity: u32,
    /// Bytes of one row of every input, together.
    pub in_row: u32,
    /// Bytes of one row of every output, together.
    pub out_row: u32,
    /// Most rows one request may carry.
    pub max_rows: u32,
    /// Bytes of the metadata.
    pub meta_len: u32,
}

/// Where everything lies, from a [`SegmentConfig`] (checked arithmetic:
/// `Layout::new` refuses what does not fit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub config: SegmentConfig,
    meta: usize,
    ring: usize,
    clients: usize,
    client_stride: usize,
    completion_capacity: usize,
    entries: usize,
    inputs: usize,
    outputs: usize,
    pub total: usize,
}

impl Layout {
    pub fn new(config: SegmentConfig) -> Result<Layout, ShmError> {
        let bad = |m: String| Err(ShmError::Config(m));
        if config.clients == 0 || config.clients > MAX_CLIENTS {
            return bad(format!(
                "max_clients must be in 1..={MAX_CLIENTS}, got {}",
                config.clients
            ));
        }
        if config.cells == 0 || config.cells > MAX_CELLS {
            return bad(format!(
                "rows per client must be in 1..={MAX_CELLS}, got {}",
                config.cells
            ));
        }
        if !config.ring_capacity.is_power_of_two()
            || !(2..=MAX_RING).contains(&config.ring_capacity)
        {
            return bad(format!(
                "ring_size must be a power of two from 2 to {MAX_RING}, got {}",
                config.ring_capacity
            ));
        }
        if config.max_rows == 0 {
            return bad("max_rows must be at least 1".into());
        }
        let too_big = || ShmError::Config("the shared segment would be too large".into());
        let cells = config.cells as usize;
        let meta = HEADER;
        let ring = round_up(meta + config.meta_len as usize).ok_or_else(too_big)?;
        let clients = ring
            .checked_add(Ring::bytes(config.ring_capacity as usize).ok_or_else(too_big)?)
            .and_then(round_up)
            .ok_or_else(too_big)?;
        let completion_capacity = cells.next_power_of_two().max(2);
        let entries = round_up(
            client_at::COMPLETIONS + Ring::bytes(completion_capacity).ok_or_else(too_big)?,
        )
        .ok_or_else(too_big)?;
        let inputs = cells
            .checked_mul(ENTRY)
            .and_then(|n| n.checked_add(entries))
            .ok_or_else(too_big)?;
        let outputs = cells
            .checked_mul(config.in_row as usize)
            .and_then(|n| n.checked_add(inputs))
            .and_then(round_up)
            .ok_or_else(too_big)?;
        let client_stride = cells
            .checked_mul(config.out_row as usize)
            .and_then(|n| n.checked_add(outputs))
            .and_then(round_up)
            .ok_or_else(too_big)?;
        let total = client_stride
            .checked_mul(config.clients as usize)
            .and_then(|n| n.checked_add(clients))
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(too_big)?;
        Ok(Layout {
            config,
            meta,
            ring,
            clients,
            client_stride,
            completion_capacity,
            entries,
            inputs,
            outputs,
            total,
        })
    }
}

/// Where segments live, and what their file names start with.
const SEGMENT_DIR: &str = "/dev/shm";
pub(crate) const SEGMENT_PREFIX: &str = "ferrobatch.";

/// The file behind a shared name.
pub fn segment_path(name: &str) -> Result<PathBuf, ShmError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with('.');
    if !ok {
        return Err(ShmError::Config(format!(
            "a shared name is 1 to 200 letters, digits, '.', '_' or '-' (not starting with '.'), got {name:?}"
        )));
    }
    Ok(Path::new(SEGMENT_DIR).join(format!("{SEGMENT_PREFIX}{name}")))
}

/// A mapped segment. Unmapped when dropped; the file is removed by
/// [`Segment::unlink`] (the server's stop) or by the next server sharing
/// the name once this one is dead.
#[derive(Debug)]
pub struct Segment {
    ptr: *mut u8,
    layout: Layout,
    path: PathBuf,
    /// `(device, inode)` of the file mapped: `unlink` removes only that one.
    file: (u64, u64),
}

// SAFETY: the mapping is process-wide and lives until drop; every shared
// access goes through atomics, or through raw bytes whose ownership the
// entry protocol hands over (the module docs of `shm`).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn io(what: String) -> impl FnOnce(std::io::Error) -> ShmError {
    move |e| ShmError::Io(what, e)
}

/// Maps `len` bytes of `file` shared, read-write.
fn map(file: &File, len: usize) -> Result<*mut u8, ShmError> {
    // SAFETY: a fresh shared mapping of a file we hold open; the kernel
    // checks the length and the access; we check the result below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(ShmError::Io(
            "cannot map the shared segment".into(),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(ptr.cast())
}

/// Removes the segments this user's ferrobatch servers left behind when
/// they were killed before their stop could remove them (each would keep
/// its memory in `/dev/shm` until the machine restarts). A segment whose
/// server runs, or that is not a complete ferrobatch segment yet (being
/// made now), is left; so is a file replaced meanwhile. Returns the names
/// removed.
pub fn remove_stale_segments() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(SEGMENT_DIR) else {
        return Vec::new();
    };
    let me = current_uid();
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let file_name = entry.file_name();
        let Some(name) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(SEGMENT_PREFIX))
        else {
            continue;
        };
        let path = entry.path();
        let Ok(before) = std::fs::metadata(&path) else {
            continue;
        };
        if before.uid() != me {
            continue;
        }
        let Some((server, _)) = read_owner(&path) else {
            continue;
        };
        let same_file = std::fs::metadata(&path)
            .is_ok_and(|now| (now.dev(), now.ino()) == (before.dev(), before.ino()));
        if !server.is_alive() && same_file && std::fs::remove_file(&path).is_ok() {
            removed.push(name.to_owned());
        }
    }
    removed
}

/// What an existing segment file says about its server: a watch on it
/// and its state, if it is a ferrobatch segment at all.
fn read_owner(path: &Path) -> Option<(Peer, u32)> {
    let mut head = [0u8; 64];
    File::open(path).ok()?.read_exact(&mut head).ok()?;
    let u32_at = |at: usize| u32::from_ne_bytes(head[at..at + 4].try_into().unwrap_or([0; 4]));
    let u64_at = |at: usize| u64::from_ne_bytes(head[at..at + 8].try_into().unwrap_or([0; 8]));
    (u64_at(at::MAGIC) == MAGIC).then(|| {
        let server = Peer::watch(u32_at(at::SERVER_PID), u64_at(at::SERVER_START));
        (server, u32_at(at::STATE))
    })
}

fn identity(file: &File, path: &Path) -> Result<(u64, u64), ShmError> {
    let meta = file
        .metadata()
        .map_err(io(format!("cannot stat {}", path.display())))?;
    Ok((meta.dev(), meta.ino()))
}

/// This process's effective user id.
pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

impl Segment {
    /// Makes the segment of `name` for the calling (server) process: a file
    /// of mode `mode` (exactly: the umask is not applied), with `meta`.
    /// A segment left by a server that died is replaced (the second value
    /// says so, for the log); one of a live server is an error.
    pub fn create(
        name: &str,
        config: SegmentConfig,
        meta: &[u8],
        mode: u32,
    ) -> Result<(Segment, Option<String>), ShmError> {
        let path = segment_path(name)?;
        let config = SegmentConfig {
            meta_len: u32::try_from(meta.len())
                .map_err(|_| ShmError::Config("metadata too large".into()))?,
            ..config
        };
        let layout = Layout::new(config)?;
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&path)
        };
        let mut replaced = None;
        let file = match open() {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let uid = std::fs::metadata(&path).map(|m| m.uid()).ok();
                match read_owner(&path) {
                    Some((server, state))
                        if server.is_alive() && state != server_state::STOPPED =>
                    {
                        let pid = server.pid();
                        return Err(ShmError::Config(match uid {
                            Some(uid) if uid != current_uid() => format!(
                                "'{name}' is taken by a process of another user (uid {uid}, pid {pid}): \
                                 share under another name"
                            ),
                            _ => format!("'{name}' is already shared by a running server (pid {pid})"),
                        }));
                    }
                    Some((server, _)) => {
                        let pid = server.pid();
                        replaced = Some(format!(
                            "replaced the stale shared segment '{name}' of server pid {pid}, which is gone"
                        ))
                    }
                    None => {
                        replaced = Some(format!(
                            "replaced '{}', which is not a complete ferrobatch segment",
                            path.display()
                        ))
                    }
                }
                std::fs::remove_file(&path)
                    .map_err(io(format!("cannot remove stale {}", path.display())))?;
                open().map_err(io(format!("cannot create {}", path.display())))?
            }
            Err(e) => return Err(io(format!("cannot create {}", path.display()))(e)),
        };
        let made = Segment::init(&file, &path, layout, meta, mode);
        if made.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        Ok((made?, replaced))
    }

    fn init(
        file: &File,
        path: &Path,
        layout: Layout,
        meta: &[u8],
        mode: u32,
    ) -> Result<Segment, ShmError> {
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io(format!("cannot set the mode of {}", path.display())))?;
        // Reserve the memory now: a tmpfs too small for it fails here,
        // cleanly, instead of with SIGBUS when a page is first touched.
        // SAFETY: fallocate on a file we hold open; the result is checked.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, layout.total as libc::off_t) };
        if r != 0 {
            return Err(ShmError::Io(
                format!(
                    "cannot reserve {} bytes for {} (see max_clients / rows_per_client)",
                    layout.total,
                    path.display()
                ),
                std::io::Error::from_raw_os_error(r),
            ));
        }
        let ptr = map(file, layout.total)?;
        let segment = Segment {
            ptr,
            layout,
            path: path.to_path_buf(),
            file: identity(file, path)?,
        };
        let c = layout.config;
        for (at, v) in [
            (at::LAYOUT, LAYOUT_VERSION),
            (at::SERVER_PID, super::current_pid()),
            (at::STATE, server_state::STARTING),
            (at::CLIENTS, c.clients),
            (at::CELLS, c.cells),
            (at::RING, c.ring_capacity),
            (at::IN_ROW, c.in_row),
            (at::OUT_ROW, c.out_row),
            (at::MAX_ROWS, c.max_rows),
            (at::META_LEN, c.meta_len),
        ] {
            segment.u32_at(at).store(v, Ordering::Relaxed);
        }
        segment
            .u64_at(at::TOTAL)
            .store(layout.total as u64, Ordering::Relaxed);
        segment
            .u64_at(at::SERVER_START)
            .store(Peer::me().1, Ordering::Relaxed);
        let mut version = [0u8; 32];
        let v = CRATE_VERSION.as_bytes();
        version[..v.len().min(32)].copy_from_slice(&v[..v.len().min(32)]);
        for (i, chunk) in version.chunks_exact(8).enumerate() {
            let word = u64::from_ne_bytes(chunk.try_into().unwrap_or([0; 8]));
            segment
                .u64_at(at::VERSION + 8 * i)
                .store(word, Ordering::Relaxed);
        }
        // SAFETY: the metadata region is `meta.len()` bytes inside the
        // mapping (the layout), and nobody else maps the file yet.
        unsafe {
            std::ptr::copy_nonoverlapping(meta.as_ptr(), ptr.add(layout.meta), meta.len());
        }
        // SAFETY: in bounds and aligned per the layout; nobody else maps it yet.
        unsafe { Ring::init(ptr.add(layout.ring), c.ring_capacity as usize) };
        for client in 0..c.clients {
            let base = segment.client_base(client);
            // SAFETY: as above, per client area.
            unsafe { Ring::init(base.add(client_at::COMPLETIONS), layout.completion_capacity) };
        }
        // Published last: a client that sees the magic sees all of the above.
        segment.u64_at(at::MAGIC).store(MAGIC, Ordering::Release);
        Ok(segment)
    }

    /// Maps the segment of `name` (a client), after checking that its file
    /// belongs to user `owner` (None: this process's user; anyone who may
    /// write the segment sees every request and writes every answer) and
    /// that a server of this very version made it.
    pub fn open(name: &str, owner: Option<u32>) -> Result<Segment, ShmError> {
        let path = segment_path(name)?;
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ShmError::NotFound(format!(
                    "no server shares '{name}' ({} does not exist)",
                    path.display()
                )))
            }
            Err(e) => return Err(io(format!("cannot open {}", path.display()))(e)),
        };
        let stat = file
            .metadata()
            .map_err(io(format!("cannot stat {}", path.display())))?;
        let expected = owner.unwrap_or_else(current_uid);
        if stat.uid() != expected {
            return Err(ShmError::Owner(format!(
                "'{name}' ({}) belongs to uid {}, not to {}: refusing to send it requests, as \
                 another user may have taken the name; pass owner={} to connect if you trust them",
                path.display(),
                stat.uid(),
                match owner {
                    Some(uid) => format!("uid {uid}"),
                    None => format!("this user (uid {expected})"),
                },
                stat.uid()
            )));
        }
        let size = stat.len();
        if size < HEADER as u64 {
            return Err(ShmError::NotFound(format!(
                "'{name}' is not ready yet (or not a ferrobatch segment)"
            )));
        }
        let header = map(&file, HEADER)?;
        let peek = Segment {
            ptr: header,
            layout: Layout {
                total: HEADER,
                ..Layout::new(SegmentConfig {
                    clients: 1,
                    cells: 1,
                    ring_capacity: 2,
                    in_row: 0,
                    out_row: 0,
                    max_rows: 1,
                    meta_len: 0,
                })?
            },
            path: path.clone(),
            file: (stat.dev(), stat.ino()),
        };
        let magic = peek.u64_at(at::MAGIC).load(Ordering::Acquire);
        if magic == 0 {
            return Err(ShmError::NotFound(format!("'{name}' is not ready yet")));
        }
        let mut version = Vec::with_capacity(32);
        for i in 0..4 {
            let word = peek.u64_at(at::VERSION + 8 * i).load(Ordering::Relaxed);
            version.extend_from_slice(&word.to_ne_bytes());
        }
        let version = String::from_utf8_lossy(&version)
            .trim_end_matches('\0')
            .to_string();
        let layout_version = peek.u32_at(at::LAYOUT).load(Ordering::Relaxed);
        if magic != MAGIC {
            return Err(ShmError::Version(format!(
                "{} is not a ferrobatch shared segment",
                path.display()
            )));
        }
        if layout_version != LAYOUT_VERSION || version != CRATE_VERSION {
            return Err(ShmError::Version(format!(
                "'{name}' is shared by ferrobatch {version} (shared-memory layout {layout_version}); \
                 this process runs ferrobatch {CRATE_VERSION} (layout {LAYOUT_VERSION}): \
                 client and server must run the same ferrobatch version"
            )));
        }
        let get = |at: usize| peek.u32_at(at).load(Ordering::Relaxed);
        let config = SegmentConfig {
            clients: get(at::CLIENTS),
            cells: get(at::CELLS),
            ring_capacity: get(at::RING),
            in_row: get(at::IN_ROW),
            out_row: get(at::OUT_ROW),
            max_rows: get(at::MAX_ROWS),
            meta_len: get(at::META_LEN),
        };
        let total = peek.u64_at(at::TOTAL).load(Ordering::Relaxed);
        drop(peek);
        let layout = Layout::new(config)?;
        if layout.total as u64 != total || size < total {
            return Err(ShmError::Version(format!(
                "'{name}': the segment's sizes disagree with its header"
            )));
        }
        let ptr = map(&file, layout.total)?;
        Ok(Segment {
            ptr,
            layout,
            path,
            file: (stat.dev(), stat.ino()),
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn config(&self) -> SegmentConfig {
        self.layout.config
    }

    /// The bytes of the request ring, or of client slot `client`'s area
    /// (its state, doorbell, completion ring, entries and cells): where
    /// clients write. None for a client out of range.
    pub fn region(&self, client: Option<u32>) -> Option<std::ops::Range<usize>> {
        match client {
            None => Some(self.layout.ring..self.layout.clients),
            Some(c) if c < self.layout.config.clients => {
                let start = self.layout.clients + c as usize * self.layout.client_stride;
                Some(start..start + self.layout.client_stride)
            }
            Some(_) => None,
        }
    }

    /// Stores `value` at byte `offset` (rounded down to a word) atomically:
    /// what any process mapping the segment can do, for chaos tests and
    /// fuzzing. False if the offset lies outside the segment.
    pub fn scribble(&self, offset: usize, value: u64) -> bool {
        let offset = offset & !7;
        match offset.checked_add(8) {
            Some(end) if end <= self.layout.total => {}
            _ => return false,
        }
        self.u64_at(offset).store(value, Ordering::SeqCst);
        true
    }

    /// Removes the file (mappings stay valid until dropped), unless the
    /// name now holds another segment (a new server's).
    pub fn unlink(&self) {
        let same = std::fs::metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.file);
        if same {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % 4 == 0 && offset + 4 <= self.layout.total);
        // SAFETY: callers pass aligned offsets inside the mapping (the
        // layout), valid while `self` is; shared words are only ever
        // accessed atomically, by every process.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU32) }
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= self.layout.total);
        // SAFETY: as in `u32_at`.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU64) }
    }

    pub fn server_pid(&self) -> u32 {
        self.u32_at(at::SERVER_PID).load(Ordering::Acquire)
    }

    /// A watch on the server's process (see `liveness`).
    pub fn server(&self) -> Peer {
        Peer::watch(
            self.server_pid(),
            self.u64_at(at::SERVER_START).load(Ordering::Acquire),
        )
    }

    pub fn state(&self) -> u32 {
        self.u32_at(at::STATE).load(Ordering::Acquire)
    }

    /// Counts a request a client refused before queueing it (its caller
    /// saw `outcome`), for the server's `stats()`. Other outcomes are the
    /// server's to count.
    pub fn count_refusal(&self, outcome: Outcome) {
        if let Some(i) = REFUSALS.iter().position(|&o| o == outcome) {
            self.u64_at(at::REFUSED + 8 * i)
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The requests clients refused before queueing them, by outcome.
    pub fn refusals(&self) -> [(Outcome, u64); 3] {
        let mut counts = REFUSALS.map(|outcome| (outcome, 0));
        for (i, (_, n)) in counts.iter_mut().enumerate() {
            *n = self.u64_at(at::REFUSED + 8 * i).load(Ordering::Relaxed);
        }
        counts
    }

    pub fn set_state(&self, state: u32) {
        self.u32_at(at::STATE).store(state, Ordering::SeqCst);
    }

    /// The server's doorbell: (word, sleeping).
    pub fn server_doorbell(&self) -> (&AtomicU32, &AtomicU32) {
        (
            self.u32_at(at::SERVER_WORD),
            self.u32_at(at::SERVER_SLEEPING),
        )
    }

    /// A copy of the metadata the server wrote.
    pub fn meta(&self) -> Vec<u8> {
        let len = self.layout.config.meta_len as usize;
        let mut out = vec![0u8; len];
        // SAFETY: the metadata region lies inside the mapping (the layout)
        // and is written once, before the magic this mapping was checked by.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(self.layout.meta), out.as_mut_ptr(), len)
        };
        out
    }

    /// The request ring.
    pub fn ring(&self) -> Ring {
        // SAFETY: made by `init` at this offset, inside the mapping, which
        // outlives the view as long as callers keep `self` alive (they hold
        // the segment in an Arc beside the view).
        unsafe {
            Ring::attach(
                self.ptr.add(self.layout.ring),
                self.layout.config.ring_capacity as usize,
            )
        }
    }

    fn client_base(&self, client: u32) -> *mut u8 {
        assert!(client < self.layout.config.clients, "client out of range");
        // SAFETY: client < clients, so the area lies inside the mapping.
        unsafe {
            self.ptr
                .add(self.layout.clients + client as usize * self.layout.client_stride)
        }
    }

    fn client_u32(&self, client: u32, offset: usize) -> &AtomicU32 {
        let base = self.client_base(client) as usize - self.ptr as usize;
        self.u32_at(base + offset)
    }

    /// Client slot `client`'s state (`client_state`).
    pub fn client_status(&self, client: u32) -> &AtomicU32 {
        self.client_u32(client, client_at::STATUS)
    }

    pub fn client_owner(&self, client: u32) -> &AtomicU32 {
        self.client_u32(client, client_at::OWNER_PID)
    }

    /// The start time of the slot's owner (see `liveness`).
    pub fn client_owner_start(&self, client: u32) -> &AtomicU64 {
        let base = self.client_base(client) as usize - self.ptr as usize;
        self.u64_at(base + client_at::OWNER_START)
    }

    /// The next tag of the slot: it carries on across owners, so a stale
    /// descriptor of a dead owner never names a live request.
    pub fn client_next_tag(&self, client: u32) -> &AtomicU32 {
        self.client_u32(client, client_at::NEXT_TAG)
    }

    /// The client's doorbell: (word, sleeping).
    pub fn client_doorbell(&self, client: u32) -> (&AtomicU32, &AtomicU32) {
        (
            self.client_u32(client, client_at::WORD),
            self.client_u32(client, client_at::SLEEPING),
        )
    }

    /// The client's completion ring (cells of finished requests).
    pub fn completions(&self, client: u32) -> Ring {
        // SAFETY: made by `init` inside this client's area (see `ring`).
        unsafe {
            Ring::attach(
                self.client_base(client).add(client_at::COMPLETIONS),
                self.layout.completion_capacity,
            )
        }
    }

    /// Entry `cell` of client `client`.
    pub fn entry(&self, client: u32, cell: u32) -> Entry<'_> {
        assert!(cell < self.layout.config.cells, "cell out of range");
        // SAFETY: cell < cells: the entry lies inside the client's area.
        let base = unsafe {
            self.client_base(client)
                .add(self.layout.entries + cell as usize * ENTRY)
        };
        Entry {
            base,
            _segment: std::marker::PhantomData,
        }
    }

    /// The input bytes of a request of `rows` rows at `cell`: input `i`'s
    /// rows lie back to back at `rows * (bytes of a row of inputs < i)`.
    /// None if the cells run past the client's area.
    pub fn inputs(&self, client: u32, cell: u32, rows: u32) -> Option<*mut u8> {
        self.cells(
            client,
            cell,
            rows,
            self.layout.inputs,
            self.layout.config.in_row,
        )
    }

    /// The output bytes of a request at `cell`, laid out as its inputs are.
    pub fn outputs(&self, client: u32, cell: u32, rows: u32) -> Option<*mut u8> {
        self.cells(
            client,
            cell,
            rows,
            self.layout.outputs,
            self.layout.config.out_row,
        )
    }

    fn cells(&self, client: u32, cell: u32, rows: u32, region: usize, row: u32) -> Option<*mut u8> {
        let end = cell.checked_add(rows)?;
        if rows == 0 || end > self.layout.config.cells || client >= self.layout.config.clients {
            return None;
        }
        // SAFETY: cell + rows <= cells: the bytes lie inside the region of
        // the client's area (the layout sized it for `cells` rows).
        Some(unsafe {
            self.client_base(client)
                .add(region + cell as usize * row as usize)
        })
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr` was mapped with this length by `map`, and nothing
        // borrowed from `self` outlives it (views are used under an Arc of
        // the segment).
        unsafe { libc::munmap(self.ptr.cast(), self.layout.total) };
    }
}

/// One cell's entry: the state word of the request at that cell, its rows,
/// deadline, and outcome (see the protocol in [`crate::shm`]).
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    base: *mut u8,
    _segment: std::marker::PhantomData<&'a Segment>,
}

impl Entry<'_> {
    fn u32_at(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is an aligned field offset inside the entry, which
        // lies in the mapping the borrow of the segment keeps alive.
        unsafe { &*(self.base.add(at) as *const AtomicU32) }
    }

    fn u64_at(&self, at: usize) -> &AtomicU64 {
        // SAFETY: as in `u32_at`.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    /// `(tag << 32) | state`.
    pub fn word(&self) -> &AtomicU64 {
        self.u64_at(entry_at::WORD)
    }

    pub fn rows(&self) -> &AtomicU32 {
        self.u32_at(entry_at::ROWS)
    }

    /// Cells the request takes (a varying model's; see `shm::varying`).
    pub fn span(&self) -> &AtomicU32 {
        self.u32_at(entry_at::SPAN)
    }

    pub fn code(&self) -> &AtomicU32 {
        self.u32_at(entry_at::CODE)
    }

    /// The request's timeout in nanoseconds (`u64::MAX`: none).
    pub fn timeout_ns(&self) -> &AtomicU64 {
        self.u64_at(entry_at::TIMEOUT_NS)
    }

    /// Writes an error message (cut at a character boundary to fit).
    /// Call only while owning the entry's bytes.
    pub fn set_message(&self, message: &str) {
        let mut len = message.len().min(MESSAGE_BYTES);
        while !message.is_char_boundary(len) {
            len -= 1;
        }
        // SAFETY: the message field has MESSAGE_BYTES bytes inside the
        // entry; the caller owns the entry's bytes now (the protocol).
        unsafe {
            std::ptr::copy_nonoverlapping(message.as_ptr(), self.base.add(entry_at::MESSAGE), len)
        };
        self.u32_at(entry_at::MESSAGE_LEN)
            .store(len as u32, Ordering::Relaxed);
    }

    /// The request's priority level (0: the server's default).
    pub fn priority(&self) -> &AtomicU32 {
        self.u32_at(entry_at::PRIORITY)
    }

    /// Bit `i` set: the request left out optional input `i` (its cells hold
    /// zeros in its place). The server checks it against the model's
    /// optional inputs before use.
    pub fn absent(&self) -> &AtomicU64 {
        self.u64_at(entry_at::ABSENT)
    }

    /// Writes the request's parameters (a JSON object's text; empty: none).
    /// False, writing nothing, if longer than `PARAMETERS_BYTES`. Call only
    /// while owning the entry's bytes.
    pub fn set_parameters(&self, parameters: &str) -> bool {
        let len = parameters.len();
        if len > PARAMETERS_BYTES {
            return false;
        }
        // SAFETY: the parameters field has PARAMETERS_BYTES bytes inside
        // the entry, `len` fits; the caller owns the entry's bytes now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                parameters.as_ptr(),
                self.base.add(entry_at::PARAMETERS),
                len,
            )
        };
        self.u32_at(entry_at::PARAMETERS_LEN)
            .store(len as u32, Ordering::Relaxed);
        true
    }

    /// The request's parameters: None if it has none, `Err` if its length
    /// word is out of range or the bytes are not a JSON object's UTF-8 text
    /// ([`crate::request::check_parameters`]). Call only while
    /// owning the entry's bytes.
    pub fn parameters(&self) -> Result<Option<Box<str>>, String> {
        let len = self
            .u32_at(entry_at::PARAMETERS_LEN)
            .load(Ordering::Relaxed) as usize;
        if len == 0 {
            return Ok(None);
        }
        if len > PARAMETERS_BYTES {
            return Err(format!(
                "parameters of {len} bytes; at most {PARAMETERS_BYTES} fit a cell"
            ));
        }
        let mut out = vec![0u8; len];
        // SAFETY: `len` <= PARAMETERS_BYTES bytes lie inside the entry; the
        // caller owns the entry's bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(entry_at::PARAMETERS),
                out.as_mut_ptr(),
                len,
            )
        };
        let text =
            String::from_utf8(out).map_err(|_| "parameters that are not UTF-8".to_string())?;
        crate::request::check_parameters(&text)?;
        Ok(Some(text.into_boxed_str()))
    }

    /// The error message. Call only while owning the entry's bytes.
    pub fn message(&self) -> String {
        let len = (self.u32_at(entry_at::MESSAGE_LEN).load(Ordering::Relaxed) as usize)
            .min(MESSAGE_BYTES);
        let mut out = vec![0u8; len];
        // SAFETY: as in `set_message`, reading.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(entry_at::MESSAGE), out.as_mut_ptr(), len)
        };
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// `(tag << 32) | state`.
pub fn word(tag: u32, state: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(state)
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;
    use crate::shm::{client_state, ShmError};

    fn config() -> SegmentConfig {
        SegmentConfig {
            clients: 2,
            cells: 8,
            ring_capacity: 16,
            in_row: 12,
            out_row: 4,
            max_rows: 4,
            meta_len: 0,
        }
    }

    fn name(test: &str) -> String {
        format!("test-{test}-{}", std::process::id())
    }

    #[test]
    fn a_client_sees_what_the_server_made() {
        let n = name("made");
        let (server, replaced) = Segment::create(&n, config(), b"{\"m\":1}", 0o600).unwrap();
        assert!(replaced.is_none());
        let client = Segment::open(&n, None).unwrap();
        assert_eq!(client.config(), server.config());
        assert_eq!(client.meta(), b"{\"m\":1}");
        assert_eq!(client.server_pid(), std::process::id());
        client.ring().push(42).unwrap();
        assert_eq!(server.ring().pop(), Ok(Some(42)));
        client
            .client_status(1)
            .store(client_state::ACTIVE, Ordering::SeqCst);
        assert_eq!(server.client_status(1).load(Ordering::SeqCst), 1);
        let entry = client.entry(1, 7);
        entry.set_message("é".repeat(150).as_str());
        assert_eq!(server.entry(1, 7).message().chars().count(), 100);
        assert!(client.inputs(1, 6, 2).is_some());
        assert!(client.inputs(1, 7, 2).is_none(), "past the area");
        let mode = std::fs::metadata(segment_path(&n).unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        server.unlink();
        assert!(matches!(
            Segment::open(&n, None),
            Err(ShmError::NotFound(_))
        ));
    }

    #[test]
    fn a_live_servers_name_is_refused_and_a_dead_ones_replaced() {
        let n = name("stale");
        let (first, _) = Segment::create(&n, config(), b"", 0o600).unwrap();
        let err = Segment::create(&n, config(), b"", 0o600).unwrap_err();
        assert!(err.to_string().contains("already shared"), "{err}");
        // A server that died: its pid no longer exists.
        first
            .u32_at(at::SERVER_PID)
            .store(1 << 30, Ordering::SeqCst);
        let (second, replaced) = Segment::create(&n, config(), b"", 0o644).unwrap();
        assert!(replaced.unwrap().contains("stale"));
        assert_eq!(second.server_pid(), std::process::id());
        second.unlink();
    }

    #[test]
    fn another_version_is_refused_with_both_versions_named() {
        let n = name("version");
        let (server, _) = Segment::create(&n, config(), b"", 0o600).unwrap();
        server
            .u32_at(at::LAYOUT)
            .store(LAYOUT_VERSION + 1, Ordering::SeqCst);
        let err = Segment::open(&n, None).unwrap_err();
        assert!(matches!(err, ShmError::Version(_)));
        assert!(err.to_string().contains("same ferrobatch version"), "{err}");
        server.unlink();
    }

    #[test]
    fn sizes_are_checked_before_anything_is_made() {
        let too_many = SegmentConfig {
            clients: MAX_CLIENTS + 1,
            ..config()
        };
        assert!(Layout::new(too_many).is_err());
        let huge = SegmentConfig {
            cells: MAX_CELLS,
            in_row: u32::MAX,
            out_row: u32::MAX,
            clients: MAX_CLIENTS,
            ..config()
        };
        assert!(Layout::new(huge).is_err());
        assert!(Layout::new(SegmentConfig {
            ring_capacity: 3,
            ..config()
        })
        .is_err());
        assert!(segment_path("../x").is_err());
        assert!(segment_path("ok.name-1_2").is_ok());
    }
}
