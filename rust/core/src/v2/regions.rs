//! Triton's system shared-memory extension: regions of POSIX shared memory
//! (`/dev/shm` files) that clients register by name, then name in infer
//! requests instead of sending a tensor's bytes, or to receive an output's.
//!
//! One [`SharedRegions`] serves a whole server (every model's [`Codec`],
//! every front-end): a region registered over HTTP is named over gRPC too.
//! Registering maps the region once; a request that names it takes an
//! `Arc` of it, so unregistering while a request reads or writes only
//! unmaps after that request is done with it.
//!
//! Reads copy the region's bytes into the request (the client may write
//! the region again once it has its response; the copy is what the model
//! sees). Writes go straight into the region. Before each, the file's size
//! is checked against the range: a client that shrinks its file while the
//! region is registered gets an error, not a server killed by `SIGBUS`
//! (the window between that check and the copy remains; shrinking a file
//! that a server maps is the client's fault in Triton too).
//!
//! [`Codec`]: super::Codec

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use super::error::Clipped;

/// Regions one server holds at most (each is a mapping and a file
/// descriptor): registering past it is refused.
pub const MAX_REGIONS: usize = 4096;
/// Bytes of a region's name or key at most.
pub const MAX_REGION_NAME: usize = 255;

/// Why a register, unregister or status call, or a request naming a
/// region, is refused: the message is the client's (a 400; gRPC
/// INVALID_ARGUMENT, or NOT_FOUND for [`RegionError::NotFound`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionError {
    /// No region of that name is registered.
    NotFound(String),
    /// Anything else the client asked that cannot be done.
    Invalid(String),
}

impl std::fmt::Display for RegionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegionError::NotFound(message) | RegionError::Invalid(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for RegionError {}

/// A registered region as status calls report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStatus {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
}

/// The registry of a server's regions; clones share it.
#[derive(Debug, Clone, Default)]
pub struct SharedRegions {
    regions: Arc<Mutex<BTreeMap<String, Arc<Region>>>>,
}

impl SharedRegions {
    pub fn new() -> SharedRegions {
        SharedRegions::default()
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Region>>> {
        // The map is whole between statements: a panic elsewhere cannot
        // leave it half-changed.
        self.regions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `byte_size` bytes of the shared-memory object `key` (as
    /// `shm_open` names it: `/name`), from `offset`, as region `name`.
    pub fn register(
        &self,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<(), RegionError> {
        if name.is_empty() {
            return Err(RegionError::Invalid(
                "'region name' is necessary to register system shared memory region".into(),
            ));
        }
        if name.len() > MAX_REGION_NAME {
            return Err(RegionError::Invalid(format!(
                "shared memory region name '{}' is longer than {MAX_REGION_NAME} bytes",
                Clipped(name)
            )));
        }
        if self.locked().contains_key(name) {
            return Err(already(name));
        }
        let region = Region::map(name, key, offset, byte_size)?;
        let mut regions = self.locked();
        if regions.contains_key(name) {
            return Err(already(name)); // registered meanwhile
        }
        if regions.len() >= MAX_REGIONS {
            return Err(RegionError::Invalid(format!(
                "failed to register shared memory region '{}': {MAX_REGIONS} regions are registered already",
                Clipped(name)
            )));
        }
        regions.insert(name.to_owned(), Arc::new(region));
        Ok(())
    }

    /// Unregisters region `name`, or every region when `name` is empty. A
    /// name not registered is no error (as in Triton).
    pub fn unregister(&self, name: &str) {
        let mut regions = self.locked();
        if name.is_empty() {
            regions.clear();
        } else {
            regions.remove(name);
        }
    }

    /// Region `name`'s status, or every region's when `name` is empty.
    pub fn status(&self, name: &str) -> Result<Vec<RegionStatus>, RegionError> {
        let regions = self.locked();
        if name.is_empty() {
            return Ok(regions.values().map(|r| r.status()).collect());
        }
        match regions.get(name) {
            Some(region) => Ok(vec![region.status()]),
            None => Err(RegionError::NotFound(format!(
                "Unable to find system shared memory region: '{}'",
                Clipped(name)
            ))),
        }
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.locked().is_empty()
    }

    /// `byte_size` bytes of region `name` from `offset` (within the region).
    pub fn range(
        &self,
        name: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<RegionRange, RegionError> {
        let region = self.locked().get(name).cloned().ok_or_else(|| {
            RegionError::Invalid(format!(
                "Unable to find shared memory region: '{}'",
                Clipped(name)
            ))
        })?;
        let end = offset.checked_add(byte_size);
        if end.map_or(true, |end| end > region.byte_size) {
            return Err(RegionError::Invalid(format!(
                "Invalid offset + byte size for shared memory region: '{}'",
                Clipped(name)
            )));
        }
        let (Ok(start), Ok(len)) = (usize::try_from(offset), usize::try_from(byte_size)) else {
            return Err(RegionError::Invalid(format!(
                "Invalid offset + byte size for shared memory region: '{}'",
                Clipped(name)
            )));
        };
        Ok(RegionRange { region, start, len })
    }
}

fn already(name: &str) -> RegionError {
    RegionError::Invalid(format!(
        "shared memory region '{}' already in manager",
        Clipped(name)
    ))
}

/// A mapped region.
#[derive(Debug)]
struct Region {
    name: String,
    key: String,
    offset: u64,
    byte_size: u64,
    /// Kept open to check the file's size before each access.
    file: File,
    /// The mapping, `offset` rounded down to a page.
    mapped: *mut u8,
    mapped_len: usize,
    /// Where the region starts within the mapping.
    skip: usize,
}

// SAFETY: the mapping is plain shared bytes owned by this value until it is
// dropped; `Region` hands out no references into it, only copies in and out
// through `RegionRange`, so sharing it between threads is sound.
unsafe impl Send for Region {}
// SAFETY: as above; no method takes `&mut self`.
unsafe impl Sync for Region {}

impl Region {
    fn map(name: &str, key: &str, offset: u64, byte_size: u64) -> Result<Region, RegionError> {
        let cannot = |why: &str| {
            RegionError::Invalid(format!(
                "failed to register shared memory region '{}': {why}",
                Clipped(name)
            ))
        };
        let path = key_path(key).ok_or_else(|| {
            cannot(&format!(
                "the key '{}' is not a shared-memory object's name ('/name', no other '/')",
                Clipped(key)
            ))
        })?;
        // Reserved, as Triton reserves its backends': a client writing into
        // a segment of `server.share` would corrupt other callers' requests.
        if key
            .trim_start_matches('/')
            .starts_with(crate::shm::SEGMENT_PREFIX)
        {
            return Err(cannot(&format!(
                "the key '{}' names one of ferrobatch's own segments ('/{}*' is reserved)",
                Clipped(key),
                crate::shm::SEGMENT_PREFIX
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| {
                cannot(&format!(
                    "unable to open shared memory key '{}': {e}",
                    Clipped(key)
                ))
            })?;
        let metadata = file.metadata().map_err(|e| {
            cannot(&format!(
                "unable to read the size of '{}': {e}",
                Clipped(key)
            ))
        })?;
        if !metadata.is_file() {
            return Err(cannot(&format!(
                "'{}' is not a shared-memory object",
                Clipped(key)
            )));
        }
        let end = offset
            .checked_add(byte_size)
            .filter(|&end| end <= metadata.len())
            .ok_or_else(|| {
                cannot(&format!(
                    "offset {offset} + byte_size {byte_size} is past the {} bytes of '{}'",
                    metadata.len(),
                    Clipped(key)
                ))
            })?;
        let page = page_size();
        let start = offset - offset % page;
        let too_large = || cannot("the region does not fit in this machine's address space");
        let mapped_len = usize::try_from(end - start).map_err(|_| too_large())?;
        let skip = usize::try_from(offset - start).map_err(|_| too_large())?;
        let file_offset = libc::off_t::try_from(start).map_err(|_| too_large())?;
        let mapped = if mapped_len == 0 {
            std::ptr::null_mut()
        } else {
            // SAFETY: a fresh shared mapping of an open file's range that
            // the size check above found within the file; nothing else
            // refers to the returned address.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    mapped_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    file_offset,
                )
            };
            if ptr == libc::MAP_FAILED {
                let e = std::io::Error::last_os_error();
                return Err(cannot(&format!("unable to map '{}': {e}", Clipped(key))));
            }
            ptr.cast::<u8>()
        };
        Ok(Region {
            name: name.to_owned(),
            key: key.to_owned(),
            offset,
            byte_size,
            file,
            mapped,
            mapped_len,
            skip,
        })
    }

    fn status(&self) -> RegionStatus {
        RegionStatus {
            name: self.name.clone(),
            key: self.key.clone(),
            offset: self.offset,
            byte_size: self.byte_size,
        }
    }

    /// Whether the file still holds `start..start + len` of the region.
    fn still_holds(&self, start: usize, len: usize) -> bool {
        let needed = self
            .offset
            .checked_add(start as u64)
            .and_then(|n| n.checked_add(len as u64));
        match (needed, self.file.metadata()) {
            (Some(needed), Ok(metadata)) => needed <= metadata.len(),
            _ => false,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if !self.mapped.is_null() {
            // SAFETY: mapped with this length in `Region::map`; no copy
            // into or out of it is running (they hold an `Arc` of `self`).
            unsafe { libc::munmap(self.mapped.cast(), self.mapped_len) };
        }
    }
}

/// `byte_size` bytes of a region, checked within it, holding the region
/// mapped until dropped.
#[derive(Debug, Clone)]
pub struct RegionRange {
    region: Arc<Region>,
    start: usize,
    len: usize,
}

/// The same bytes of the same mapping (a region registered again under
/// the same name is another mapping).
impl PartialEq for RegionRange {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.region, &other.region)
            && self.start == other.start
            && self.len == other.len
    }
}

impl Eq for RegionRange {}

impl RegionRange {
    /// The range's size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's name.
    pub fn region(&self) -> &str {
        &self.region.name
    }

    fn shrunk(&self) -> RegionError {
        RegionError::Invalid(format!(
            "shared memory region '{}' no longer holds its registered bytes (its file shrank)",
            Clipped(&self.region.name)
        ))
    }

    /// A copy of the range's bytes.
    pub fn read(&self) -> Result<Vec<u8>, RegionError> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        if !self.region.still_holds(self.start, self.len) {
            return Err(self.shrunk());
        }
        let mut bytes = vec![0u8; self.len];
        // SAFETY: `skip + start + len <= mapped_len` (checked in
        // `SharedRegions::range` against the registered size, which the
        // mapping covers), the mapping lives while `self.region` does, and
        // the destination is a fresh buffer of `len` bytes. Another process
        // may write the source meanwhile: the bytes are plain data, any
        // value is valid, and the copy is what the request keeps.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.region.mapped.add(self.region.skip + self.start),
                bytes.as_mut_ptr(),
                self.len,
            );
        }
        Ok(bytes)
    }

    /// Writes `bytes` at the range's start; `what` names the output in the
    /// error when they do not fit (Triton's message).
    pub fn write(&self, what: &str, bytes: &[u8]) -> Result<(), RegionError> {
        if bytes.len() > self.len {
            return Err(RegionError::Invalid(output_too_small(
                what,
                self.len,
                bytes.len(),
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        if !self.region.still_holds(self.start, bytes.len()) {
            return Err(self.shrunk());
        }
        // SAFETY: as in `read`: the destination lies within the mapping,
        // which lives while `self.region` does; the source is a slice of
        // `bytes.len() <= len` bytes that cannot overlap a mapping this
        // process made for itself only here.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.region.mapped.add(self.region.skip + self.start),
                bytes.len(),
            );
        }
        Ok(())
    }
}

/// Writes each output's bytes into its range (`(output name, bytes, range)`),
/// every size checked before any is written: one that does not fit fails
/// the whole answer with Triton's message, every region untouched.
pub fn write_all(writes: &[(&str, &[u8], &RegionRange)]) -> Result<(), RegionError> {
    if let Some(&(name, bytes, range)) = writes.iter().find(|(_, b, r)| b.len() > r.len()) {
        return range.write(name, bytes); // refused before copying anything
    }
    writes
        .iter()
        .try_for_each(|&(name, bytes, range)| range.write(name, bytes))
}

/// Why output `output` does not fit its shared-memory range: `have`
/// bytes, `need` to hold the results (Triton's words). Said when the
/// output is written ([`RegionRange::write`]), or as the request is
/// decoded when its size is known from the request
/// ([`super::Codec::with_output_row_bytes`]).
pub fn output_too_small(output: &str, have: usize, need: usize) -> String {
    format!(
        "shared memory size specified with the request for output '{}' ({have} bytes) \
         should be at least {need} bytes to hold the results",
        Clipped(output)
    )
}

/// The `/dev/shm` file of the shared-memory object `key` (`shm_open`'s
/// names: one leading `/`, then a name without `/`, not `.` or `..`).
fn key_path(key: &str) -> Option<PathBuf> {
    let name = key.strip_prefix('/').unwrap_or(key);
    let valid = !name.is_empty()
        && name.len() <= MAX_REGION_NAME
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0');
    valid.then(|| PathBuf::from("/dev/shm").join(name))
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A `/dev/shm` object of `size` bytes (0, 1, 2, ...), removed on drop.
    struct Object {
        key: String,
        path: PathBuf,
    }

    impl Object {
        fn new(tag: &str, size: usize) -> Object {
            let name = format!("ferrobatch-regions-test-{}-{tag}", std::process::id());
            let path = PathBuf::from("/dev/shm").join(&name);
            let mut file = File::create(&path).unwrap();
            let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            file.write_all(&bytes).unwrap();
            Object {
                key: format!("/{name}"),
                path,
            }
        }
    }

    impl Drop for Object {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    #[test]
    fn write_all_writes_nothing_when_one_output_does_not_fit() {
        let object = Object::new("all", 100);
        let regions = SharedRegions::new();
        regions.register("r", &object.key, 0, 100).unwrap();
        let (first, second) = (
            regions.range("r", 0, 4).unwrap(),
            regions.range("r", 10, 2).unwrap(),
        );
        let err = write_all(&[("y", &[9; 4], &first), ("z", &[9; 3], &second)]).unwrap_err();
        assert_eq!(err.to_string(), output_too_small("z", 2, 3));
        let before: Vec<u8> = (0..100).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            std::fs::read(&object.path).unwrap(),
            before,
            "nothing written"
        );
        write_all(&[("y", &[9; 4], &first), ("z", &[8; 2], &second)]).unwrap();
        let file = std::fs::read(&object.path).unwrap();
        assert_eq!((&file[..4], &file[10..12]), (&[9u8; 4][..], &[8u8; 2][..]));
    }

    #[test]
    fn a_registered_range_reads_and_writes_the_objects_bytes() {
        let object = Object::new("rw", 10_000);
        let regions = SharedRegions::new();
        regions.register("r", &object.key, 5000, 4000).unwrap();
        let range = regions.range("r", 100, 8).unwrap();
        let expected: Vec<u8> = (5100..5108).map(|i| (i % 251) as u8).collect();
        assert_eq!(range.read().unwrap(), expected);
        range.write("y", &[7, 7, 7]).unwrap();
        let file = std::fs::read(&object.path).unwrap();
        assert_eq!(&file[5100..5104], &[7, 7, 7, (5103 % 251) as u8]);
        let status = regions.status("r").unwrap();
        assert_eq!(
            status,
            vec![RegionStatus {
                name: "r".into(),
                key: object.key.clone(),
                offset: 5000,
                byte_size: 4000
            }]
        );
    }

    #[test]
    fn ranges_past_the_region_and_outputs_too_large_are_refused() {
        let object = Object::new("bounds", 64);
        let regions = SharedRegions::new();
        regions.register("r", &object.key, 0, 32).unwrap();
        assert!(regions.range("r", 0, 32).is_ok());
        for (offset, size) in [(1, 32), (32, 1), (u64::MAX, 2), (0, u64::MAX)] {
            let e = regions.range("r", offset, size).unwrap_err();
            assert!(e.to_string().contains("Invalid offset + byte size"), "{e}");
        }
        let e = regions
            .range("r", 0, 4)
            .unwrap()
            .write("y", &[0; 5])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "shared memory size specified with the request for output 'y' (4 bytes) \
             should be at least 5 bytes to hold the results"
        );
        let e = regions.range("other", 0, 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unable to find shared memory region: 'other'"
        );
    }

    #[test]
    fn registering_checks_the_key_the_range_and_the_name() {
        let object = Object::new("register", 64);
        let regions = SharedRegions::new();
        for key in [
            "",
            "/",
            "/..",
            "/a/b",
            "../etc/passwd",
            "/no-such-object-here",
        ] {
            let e = regions.register("r", key, 0, 1).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with("failed to register shared memory region 'r'"),
                "{key}: {e}"
            );
        }
        let e = regions
            .register("r", "/ferrobatch.model", 0, 1)
            .unwrap_err();
        assert!(e.to_string().contains("is reserved"), "{e}");
        let e = regions.register("r", &object.key, 60, 5).unwrap_err();
        assert!(e.to_string().contains("past the 64 bytes"), "{e}");
        let e = regions.register("r", &object.key, u64::MAX, 5).unwrap_err();
        assert!(e.to_string().contains("past the 64 bytes"), "{e}");
        assert!(regions.register("", &object.key, 0, 1).is_err());
        regions.register("r", &object.key, 0, 64).unwrap();
        let e = regions.register("r", &object.key, 0, 64).unwrap_err();
        assert_eq!(e.to_string(), "shared memory region 'r' already in manager");
        assert!(regions.status("").unwrap().len() == 1);
    }

    #[test]
    fn unregistering_keeps_a_range_in_use_mapped() {
        let object = Object::new("unregister", 64);
        let regions = SharedRegions::new();
        regions.register("a", &object.key, 0, 64).unwrap();
        regions.register("b", &object.key, 0, 8).unwrap();
        let range = regions.range("a", 0, 4).unwrap();
        regions.unregister("a");
        assert_eq!(range.read().unwrap(), vec![0, 1, 2, 3]);
        assert!(matches!(regions.status("a"), Err(RegionError::NotFound(_))));
        regions.unregister("never-registered");
        regions.unregister("");
        assert!(regions.is_empty());
    }

    #[test]
    fn a_file_that_shrank_is_an_error_not_a_crash() {
        let object = Object::new("shrink", 8192);
        let regions = SharedRegions::new();
        regions.register("r", &object.key, 0, 8192).unwrap();
        let range = regions.range("r", 4096, 4096).unwrap();
        File::options()
            .write(true)
            .open(&object.path)
            .unwrap()
            .set_len(10)
            .unwrap();
        assert!(range.read().unwrap_err().to_string().contains("shrank"));
        assert!(range
            .write("y", &[1])
            .unwrap_err()
            .to_string()
            .contains("shrank"));
    }
}
