//! A ring of reusable staging slots that batches are collated into.
//!
//! A slot is one buffer per model input, each big enough for
//! `max_batch_size` rows. The memory belongs to the caller (pinned torch
//! tensors when CUDA is available, ordinary tensors otherwise); the ring only
//! records where it is and who may write it.
//!
//! # Ownership
//!
//! A slot is held through a [`HeldSlot`], the guard [`StagingRing::acquire`]
//! returns, and only through it: [`HeldSlot::collate`] is the one way to write
//! a slot, and the slot goes back to the ring when its guard is dropped (or
//! [`HeldSlot::release`]d), never by index. Invariant: each slot index is
//! either in the free list or owned by exactly one live guard. A guard is not
//! `Clone`, so a slot cannot be released twice nor handed out while a guard
//! for it exists, and a slot still in flight — its host-to-device copy not yet
//! complete — is never rewritten as long as its holder keeps the guard until
//! that copy is done.
//!
//! A guard owns an `Arc` of its ring, so it may outlive the call that made it
//! (the Python `Batch` owns one) and move to another thread (the CUDA path
//! releases a slot on the thread that waited for its copy).
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use ferrobatch_core::{SlotBuffer, StagingRing};
//!
//! let mut memory = vec![0u8; 2 * 8];
//! let (a, b) = memory.split_at_mut(8);
//! // SAFETY: `memory` outlives the ring, and nothing else touches it meanwhile.
//! let slots = unsafe {
//!     vec![vec![SlotBuffer::new(a.as_mut_ptr(), 8)], vec![SlotBuffer::new(b.as_mut_ptr(), 8)]]
//! };
//! let ring = Arc::new(StagingRing::new(vec![4], 2, slots).unwrap());
//! let held = ring.acquire();
//! assert_eq!(ring.free_slots(), 1);
//! drop(held); // the only way to give a slot back
//! assert_eq!(ring.free_slots(), 2);
//! ```

use std::fmt;
use std::sync::Arc;

use crate::sync::{Condvar, Mutex};
use crate::{CoreError, Request};

/// Where one input's staging buffer of one slot lives.
#[derive(Debug, Clone, Copy)]
pub struct SlotBuffer {
    ptr: *mut u8,
    capacity: usize,
}

impl SlotBuffer {
    /// # Safety
    /// `ptr` must be valid for writes of `capacity` bytes, and nothing but the
    /// ring's holder of the slot may access those bytes while it is held, for
    /// as long as the ring that takes this buffer exists.
    pub unsafe fn new(ptr: *mut u8, capacity: usize) -> SlotBuffer {
        SlotBuffer { ptr, capacity }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// The staging slots of one batcher and the list of those no guard holds.
///
/// Shared (`Arc`) by the batcher and every [`HeldSlot`]; see the module docs
/// for who may write a slot when.
pub struct StagingRing {
    /// Bytes per row of each input, in the model's input order (0 for
    /// inputs whose rows vary in size).
    row_nbytes: Box<[usize]>,
    /// How each input is collated.
    layouts: Box<[Layout]>,
    /// For each input, the index of its first buffer in a slot.
    first_buffer: Box<[usize]>,
    /// `slots[s][i]`: input `i`'s buffer in slot `s`. Written only through
    /// the one `HeldSlot` for `s`.
    slots: Box<[Box<[SlotBuffer]>]>,
    free: Mutex<FreeSlots>,
    /// Notified when a slot is given back while a worker is blocked in
    /// `acquire`.
    freed: Condvar,
}

#[derive(Debug)]
struct FreeSlots {
    /// Indices of the slots no guard holds; most recently released last (it
    /// is taken first: its memory is the likeliest to be in cache).
    indices: Vec<usize>,
    /// Threads blocked in `acquire`. A give-back notifies only when there
    /// is one: a notification is a futex call even with nobody waiting, and
    /// a slot is given back once per batch.
    waiters: usize,
}

// SAFETY: the raw pointers in `slots` are written only through `HeldSlot::collate`
// by the one guard that owns the slot (the module invariant, kept by `free`
// under its mutex), and `SlotBuffer::new`'s contract makes them valid for as
// long as the ring exists, whichever thread it is on.
unsafe impl Send for StagingRing {}
// SAFETY: shared access reads `row_nbytes` and the buffer addresses (never the
// bytes behind them) or goes through the mutex-protected free list.
unsafe impl Sync for StagingRing {}

impl fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingRing")
            .field("row_nbytes", &self.row_nbytes)
            .field("slots", &self.slots.len())
            .field("free_slots", &self.free_slots())
            .finish()
    }
}

impl StagingRing {
    /// Builds a ring over `slots`, each holding one buffer per input, for
    /// inputs of `row_nbytes[i]` bytes per row and at most `max_rows` rows.
    pub fn new(
        row_nbytes: Vec<usize>,
        max_rows: usize,
        slots: Vec<Vec<SlotBuffer>>,
    ) -> Result<StagingRing, CoreError> {
        let layouts = vec![Layout::Fixed; row_nbytes.len()];
        StagingRing::with_layouts(row_nbytes, layouts, max_rows, None, slots)
    }

    /// Builds a ring for inputs collated as `layouts` say. A slot holds, per
    /// input in order: one buffer of `max_rows * row_nbytes[i]` bytes for a
    /// [`Layout::Fixed`] input; two for a [`Layout::Ragged`] one (its values,
    /// room for `max_elements` elements, and its index, `max_rows + 1`
    /// int64); none for [`Layout::Bytes`] and [`Layout::RaggedBytes`]
    /// (collated into memory of the batch's own, [`Collated::Bytes`] and
    /// [`Collated::RaggedBytes`]).
    pub fn with_layouts(
        row_nbytes: Vec<usize>,
        layouts: Vec<Layout>,
        max_rows: usize,
        max_elements: Option<usize>,
        slots: Vec<Vec<SlotBuffer>>,
    ) -> Result<StagingRing, CoreError> {
        if slots.is_empty() {
            return Err(CoreError::InvalidConfig(
                "the staging ring needs at least one slot".into(),
            ));
        }
        if layouts.len() != row_nbytes.len() {
            return Err(CoreError::InvalidConfig(format!(
                "{} layouts for {} inputs",
                layouts.len(),
                row_nbytes.len()
            )));
        }
        let overflow = |i: usize| {
            CoreError::InvalidConfig(format!("staging input {i}: its size overflows usize"))
        };
        // Bytes each buffer of a slot needs, input by input.
        let mut needs: Vec<(usize, usize)> = Vec::new();
        let mut first_buffer = Vec::with_capacity(layouts.len());
        for (i, (layout, &row)) in layouts.iter().zip(&row_nbytes).enumerate() {
            first_buffer.push(needs.len());
            match layout {
                Layout::Fixed => {
                    needs.push((i, row.checked_mul(max_rows).ok_or_else(|| overflow(i))?))
                }
                Layout::Ragged(r) => {
                    let Some(max_elements) = max_elements else {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i} has a variable-length dimension: max_batch_elements is needed"
                        )));
                    };
                    if r.unit_elements == 0 {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i}: a variable-length dimension needs non-empty inner dimensions"
                        )));
                    }
                    let positions = max_elements / r.unit_elements;
                    let values = positions
                        .checked_mul(r.unit_nbytes)
                        .ok_or_else(|| overflow(i))?;
                    let index = max_rows
                        .checked_add(1)
                        .and_then(|n| n.checked_mul(8))
                        .ok_or_else(|| overflow(i))?;
                    if r.pad.as_ref().is_some_and(|p| p.len() != r.unit_nbytes) {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i}: the pad value must be one position's bytes ({})",
                            r.unit_nbytes
                        )));
                    }
                    needs.push((i, values));
                    needs.push((i, index));
                }
                Layout::Bytes { .. } => {}
                Layout::Padded(p) => {
                    let Some(max_elements) = max_elements else {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i} has a variable-length dimension: max_batch_elements is needed"
                        )));
                    };
                    let k = p.variable_dims();
                    if k == 0 || k > crate::request::MAX_VARIABLE_DIMS {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i}: padding needs 1 to {} variable dimensions, got {k}",
                            crate::request::MAX_VARIABLE_DIMS
                        )));
                    }
                    if p.pad.len() != p.itemsize {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i}: the pad value must be one element's bytes ({})",
                            p.itemsize
                        )));
                    }
                    let values = max_elements
                        .checked_mul(p.itemsize)
                        .ok_or_else(|| overflow(i))?;
                    let index = max_rows
                        .checked_mul(k)
                        .and_then(|n| n.checked_mul(8))
                        .ok_or_else(|| overflow(i))?;
                    needs.push((i, values));
                    needs.push((i, index));
                }
                Layout::RaggedBytes(r) => {
                    if max_elements.is_none() {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i} has a variable-length dimension: max_batch_elements is needed"
                        )));
                    }
                    if r.unit_elements == 0 {
                        return Err(CoreError::InvalidConfig(format!(
                            "input {i}: a variable-length dimension needs non-empty inner dimensions"
                        )));
                    }
                }
            }
        }
        for (s, buffers) in slots.iter().enumerate() {
            if buffers.len() != needs.len() {
                return Err(CoreError::InvalidConfig(format!(
                    "staging slot {s} has {} buffers for {} inputs (needing {})",
                    buffers.len(),
                    row_nbytes.len(),
                    needs.len()
                )));
            }
            for (buf, &(i, needed)) in buffers.iter().zip(&needs) {
                if buf.capacity < needed {
                    let row = row_nbytes[i];
                    return Err(CoreError::InvalidConfig(match layouts[i] {
                        Layout::Fixed => format!(
                            "staging slot {s}, input {i}: {} bytes cannot hold {max_rows} rows of {row} bytes",
                            buf.capacity
                        ),
                        _ => format!(
                            "staging slot {s}, input {i}: {} bytes cannot hold {needed} bytes",
                            buf.capacity
                        ),
                    }));
                }
            }
        }
        // Reversed, so slot 0 is handed out first.
        let free = (0..slots.len()).rev().collect();
        Ok(StagingRing {
            row_nbytes: row_nbytes.into(),
            layouts: layouts.into(),
            first_buffer: first_buffer.into(),
            slots: slots.into_iter().map(Vec::into_boxed_slice).collect(),
            free: Mutex::new(FreeSlots {
                indices: free,
                waiters: 0,
            }),
            freed: Condvar::new(),
        })
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn row_nbytes(&self) -> &[usize] {
        &self.row_nbytes
    }

    pub fn layouts(&self) -> &[Layout] {
        &self.layouts
    }

    /// Takes a free slot, blocking until a guard gives one back.
    pub fn acquire(self: &Arc<Self>) -> HeldSlot {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(index) = free.indices.pop() {
                return HeldSlot {
                    ring: Arc::clone(self),
                    index,
                };
            }
            free.waiters += 1;
            free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
            free.waiters -= 1;
        }
    }

    /// Takes a free slot if there is one, without blocking.
    pub fn try_acquire(self: &Arc<Self>) -> Option<HeldSlot> {
        let index = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .indices
            .pop()?;
        Some(HeldSlot {
            ring: Arc::clone(self),
            index,
        })
    }

    /// Slots no guard holds now.
    pub fn free_slots(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .indices
            .len()
    }

    /// Whether a guard holds slot `index` now (false for an index out of range).
    pub fn is_held(&self, index: usize) -> bool {
        index < self.slots.len()
            && !self
                .free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .indices
                .contains(&index)
    }

    /// Called by `HeldSlot::drop` alone, once per guard: puts `index` back.
    fn give_back(&self, index: usize) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        debug_assert!(
            !free.indices.contains(&index),
            "slot {index} given back while free"
        );
        free.indices.push(index);
        let waiting = free.waiters > 0;
        drop(free);
        // After the unlock, as the queue's doorbell: the waiter counted
        // itself under the lock before it began to wait.
        if waiting {
            self.freed.notify_one();
        }
    }
}

/// The guard of one staging slot: while it lives, its holder alone may write
/// the slot (through [`HeldSlot::collate`]); dropping it gives the slot back
/// to its ring.
///
/// `Send`, so a slot may be collated on one thread and given back on another,
/// once whatever reads its bytes (a host-to-device copy) is done. Not `Clone`.
///
/// A guard cannot be copied, so its slot cannot be given back twice:
///
/// ```compile_fail
/// # use std::sync::Arc;
/// # use ferrobatch_core::{SlotBuffer, StagingRing};
/// # let mut memory = [0u8; 1];
/// # // SAFETY: `memory` outlives the ring.
/// # let slots = vec![vec![unsafe { SlotBuffer::new(memory.as_mut_ptr(), 1) }]];
/// # let ring = Arc::new(StagingRing::new(vec![1], 1, slots).unwrap());
/// let held = ring.acquire();
/// let twice = held.clone();
/// ```
#[must_use = "dropping the guard gives the slot back at once"]
pub struct HeldSlot {
    ring: Arc<StagingRing>,
    index: usize,
}

impl fmt::Debug for HeldSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldSlot")
            .field("index", &self.index)
            .finish()
    }
}

impl HeldSlot {
    /// Which slot of the ring this is (to pick the staging tensors that view it).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Copies the inputs of `requests`, in order, back to back into this
    /// slot; returns the rows. For rings of fixed-size inputs only (else see
    /// [`HeldSlot::collate_all`]).
    ///
    /// # Safety
    /// As [`HeldSlot::collate_all`].
    ///
    /// # Panics
    /// As [`HeldSlot::collate_all`].
    pub unsafe fn collate(&mut self, requests: &[Arc<Request>]) -> usize {
        // SAFETY: the caller upholds `collate_all`'s contract.
        unsafe { self.collate_all(requests).0 }
    }

    /// Copies the inputs of `requests`, in order, into this slot, each
    /// input as its [`Layout`] says; returns the rows and what each input
    /// became ([`Collated`]).
    ///
    /// # Safety
    /// The caller must have won [`Request::take`] for every request in
    /// `requests` and not yet resolved any of them: then each submitter keeps
    /// the input bytes alive (the contract of [`crate::InputBytes::new`]),
    /// and no other worker reads or resolves them meanwhile. Each request's
    /// inputs must be what [`crate::Batcher::submit`] checks (sizes agree
    /// with rows, extents and layouts).
    ///
    /// # Panics
    /// If the requests do not fit (more than `max_rows` rows, or more
    /// elements of a ragged input than the slot holds), before writing
    /// past the slot.
    pub unsafe fn collate_all(&mut self, requests: &[Arc<Request>]) -> (usize, Vec<Collated>) {
        let ring = &*self.ring;
        let buffers = &ring.slots[self.index];
        let rows: usize = requests.iter().map(|r| r.rows as usize).sum();
        let mut collated = Vec::with_capacity(ring.layouts.len());
        for (i, layout) in ring.layouts.iter().enumerate() {
            let first = ring.first_buffer[i];
            let inputs = requests.iter().map(|r| (r.rows as usize, &r.inputs()[i]));
            collated.push(match layout {
                Layout::Fixed => {
                    let buf = buffers[first];
                    let mut offset = 0usize;
                    for (n, input) in inputs {
                        // SAFETY: the caller won `take()` for every request and
                        // has not resolved it, so its submitter keeps the bytes alive.
                        let src = unsafe { input.as_slice() };
                        debug_assert_eq!(src.len(), n * ring.row_nbytes[i]);
                        // SAFETY: `self` is the one guard of this slot.
                        unsafe { write_at(buf, offset, src, self.index) };
                        offset += src.len();
                    }
                    Collated::Fixed
                }
                Layout::Ragged(r) => {
                    let (values, index) = (buffers[first], buffers[first + 1]);
                    // SAFETY: as above (taken, unresolved requests; the one guard).
                    unsafe { collate_ragged(r, values, index, inputs, rows, self.index) }
                }
                Layout::Padded(p) => {
                    let (values, index) = (buffers[first], buffers[first + 1]);
                    // SAFETY: as above (taken, unresolved requests; the one guard).
                    unsafe { collate_padded(p, values, index, inputs, self.index) }
                }
                Layout::Bytes { .. } => {
                    let total: usize = requests.iter().map(|r| r.inputs()[i].len()).sum();
                    let mut out = Vec::with_capacity(total);
                    for (_, input) in inputs {
                        // SAFETY: as above.
                        out.extend_from_slice(unsafe { input.as_slice() });
                    }
                    Collated::Bytes(out)
                }
                Layout::RaggedBytes(_) => {
                    let total: usize = requests.iter().map(|r| r.inputs()[i].len()).sum();
                    let mut data = Vec::with_capacity(total);
                    let mut lengths = Vec::with_capacity(rows);
                    for (n, input) in inputs {
                        // SAFETY: as above.
                        data.extend_from_slice(unsafe { input.as_slice() });
                        lengths.extend(std::iter::repeat(input.extent()).take(n));
                    }
                    Collated::RaggedBytes { data, lengths }
                }
            });
        }
        (rows, collated)
    }

    /// Gives the slot back now (the same as dropping the guard).
    pub fn release(self) {}
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        self.ring.give_back(self.index);
    }
}

/// How one input's rows are collated into a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Every row is the same size: rows back to back.
    Fixed,
    /// Rows vary in length along their first dimension (a request's
    /// [`crate::InputBytes::extent`] positions per row).
    Ragged(Ragged),
    /// BYTES: each row `elements_per_row` serialized elements
    /// ([`crate::bytes`]), concatenated.
    Bytes { elements_per_row: usize },
    /// BYTES with a variable-length first dimension: each row of a request
    /// [`crate::InputBytes::extent`] positions of `unit_elements` serialized
    /// elements, concatenated into memory the batch owns (as [`Layout::Bytes`]),
    /// with each row's length.
    RaggedBytes(RaggedBytes),
    /// Variable-length along any of its dimensions (a request's
    /// [`crate::InputBytes::extents`], one per variable dimension), padded
    /// along each to the batch's longest.
    Padded(Padded),
}

/// An input padded along one or more variable-length dimensions, any of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Padded {
    /// The shape of one row: `None` for a variable-length dimension.
    pub dims: Box<[Option<usize>]>,
    /// Bytes of one element.
    pub itemsize: usize,
    /// One element's bytes, written wherever a row is shorter than the batch.
    pub pad: Box<[u8]>,
}

impl Padded {
    /// How many dimensions are variable.
    pub fn variable_dims(&self) -> usize {
        self.dims.iter().filter(|d| d.is_none()).count()
    }

    /// The shape of a row whose variable dimensions are `extents` long.
    pub fn row_shape(&self, extents: &[usize]) -> Vec<usize> {
        let mut variable = extents.iter();
        self.dims
            .iter()
            .map(|d| d.unwrap_or_else(|| variable.next().copied().unwrap_or(0)))
            .collect()
    }

    /// Elements of a row whose variable dimensions are `extents` long;
    /// `None` when the count overflows.
    pub fn row_elements(&self, extents: &[usize]) -> Option<usize> {
        self.row_shape(extents)
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// What such a row counts against `max_batch_elements`: its elements,
    /// an empty dimension counted as 1, so that every product of its
    /// dimensions (and of a batch's box, its strides) is bounded by it;
    /// `None` when it overflows.
    pub fn row_bound(&self, extents: &[usize]) -> Option<usize> {
        self.row_shape(extents)
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d.max(1)))
    }
}

/// A BYTES input with a variable-length first dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaggedBytes {
    /// Elements of one position (the product of the inner dimensions).
    pub unit_elements: usize,
    /// Counted padded against `max_batch_elements` (rows times the longest
    /// row, what the model gets), else jagged (the sum of the rows).
    pub padded: bool,
}

impl Layout {
    /// For an input whose rows vary in length: the elements of one position
    /// and whether the batch is counted padded against `max_batch_elements`.
    pub fn variable(&self) -> Option<(usize, bool)> {
        match self {
            Layout::Ragged(r) => Some((r.unit_elements, r.pad.is_some())),
            Layout::RaggedBytes(r) => Some((r.unit_elements, r.padded)),
            Layout::Fixed | Layout::Bytes { .. } | Layout::Padded(_) => None,
        }
    }
}

/// A variable-length input: rows of `extent` positions of `unit_nbytes`
/// bytes (`unit_elements` elements) each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ragged {
    pub unit_nbytes: usize,
    pub unit_elements: usize,
    /// `Some(one position's bytes)`: padded to the longest row with it, and
    /// the index holds each row's length (`[B]` int64). `None`: jagged, the
    /// rows' values back to back and the index their offsets (`[B + 1]`
    /// int64, in positions).
    pub pad: Option<Box<[u8]>>,
}

/// What one input of a batch became in its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Collated {
    /// `rows` rows at the start of its buffer.
    Fixed,
    /// `[rows, max_len, ...]` padded values, and `rows` lengths in the index.
    Padded { max_len: usize },
    /// `[total, ...]` values, and `rows + 1` offsets in the index.
    Jagged { total: usize },
    /// The rows' serialized elements, back to back.
    Bytes(Vec<u8>),
    /// `[rows, *shape]` padded values (`shape`: the row shape with each
    /// variable dimension at the batch's longest, `longest`), and `rows x k`
    /// lengths in the index.
    PaddedNd { longest: Vec<usize> },
    /// The rows' serialized elements, back to back, and each row's length
    /// (positions of `unit_elements` elements; `rows` of them).
    RaggedBytes { data: Vec<u8>, lengths: Vec<usize> },
}

/// Writes `src` at `offset` of `buf`.
///
/// # Safety
/// The caller holds the one guard of the slot `buf` belongs to.
///
/// # Panics
/// If `src` does not fit from `offset`, before writing.
unsafe fn write_at(buf: SlotBuffer, offset: usize, src: &[u8], slot: usize) {
    assert!(
        offset <= buf.capacity && src.len() <= buf.capacity - offset,
        "batch overflows staging slot {slot}"
    );
    if src.is_empty() {
        return;
    }
    // SAFETY: the caller holds the one guard of this slot (module
    // invariant), so this is the one write through it; `buf` is valid for
    // `capacity` bytes (`SlotBuffer::new`) and `offset + src.len() <=
    // capacity` was checked just above. Source and destination never
    // overlap: slot memory is never request input.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), buf.ptr.add(offset), src.len()) };
}

/// Collates one ragged input of a batch: `inputs` yields each request's
/// rows and bytes (`rows * extent * unit_nbytes` of them).
///
/// # Safety
/// As [`HeldSlot::collate_all`]; `values` and `index` are that slot's.
unsafe fn collate_ragged<'a>(
    r: &Ragged,
    values: SlotBuffer,
    index: SlotBuffer,
    inputs: impl Iterator<Item = (usize, &'a crate::InputBytes)> + Clone,
    rows: usize,
    slot: usize,
) -> Collated {
    let unit = r.unit_nbytes;
    let mut entries: Vec<u8> = Vec::with_capacity((rows + 1) * 8);
    match &r.pad {
        Some(pad) => {
            let max_len = inputs.clone().map(|(_, b)| b.extent()).max().unwrap_or(0);
            let stride = max_len * unit;
            let mut row = 0usize;
            for (n, input) in inputs {
                // SAFETY: the caller's contract: taken, unresolved requests.
                let src = unsafe { input.as_slice() };
                let len = input.extent() * unit;
                debug_assert_eq!(src.len(), n * len);
                for chunk in src.chunks_exact(len.max(1)).take(n) {
                    let at = row * stride;
                    // SAFETY: the one guard of this slot (the caller's).
                    unsafe { write_at(values, at, &chunk[..len], slot) };
                    for p in input.extent()..max_len {
                        // SAFETY: as above.
                        unsafe { write_at(values, at + p * unit, pad, slot) };
                    }
                    entries.extend_from_slice(&(input.extent() as i64).to_le_bytes());
                    row += 1;
                }
                if len == 0 {
                    // Empty rows: padding only.
                    for _ in 0..n {
                        for p in 0..max_len {
                            // SAFETY: as above.
                            unsafe { write_at(values, row * stride + p * unit, pad, slot) };
                        }
                        entries.extend_from_slice(&0i64.to_le_bytes());
                        row += 1;
                    }
                }
            }
            // SAFETY: as above.
            unsafe { write_at(index, 0, &entries, slot) };
            Collated::Padded { max_len }
        }
        None => {
            let mut offset = 0usize;
            let mut total = 0usize;
            entries.extend_from_slice(&0i64.to_le_bytes());
            for (n, input) in inputs {
                // SAFETY: the caller's contract: taken, unresolved requests.
                let src = unsafe { input.as_slice() };
                // SAFETY: the one guard of this slot (the caller's).
                unsafe { write_at(values, offset, src, slot) };
                offset += src.len();
                for _ in 0..n {
                    total += input.extent();
                    entries.extend_from_slice(&(total as i64).to_le_bytes());
                }
            }
            // SAFETY: as above.
            unsafe { write_at(index, 0, &entries, slot) };
            Collated::Jagged { total }
        }
    }
}

/// Collates one input padded along several variable dimensions: each
/// request's rows (`rows * row_elements(extents)` elements) into boxes of the
/// batch's longest extents, padded with `p.pad`; each row's extents (k
/// int64) into `index`.
///
/// # Safety
/// As [`HeldSlot::collate_all`]; `values` and `index` are that slot's.
unsafe fn collate_padded<'a>(
    p: &Padded,
    values: SlotBuffer,
    index: SlotBuffer,
    inputs: impl Iterator<Item = (usize, &'a crate::InputBytes)> + Clone,
    slot: usize,
) -> Collated {
    let k = p.variable_dims();
    let mut longest = vec![0usize; k];
    for (_, input) in inputs.clone() {
        for (m, &e) in longest.iter_mut().zip(input.extents()) {
            *m = (*m).max(e);
        }
    }
    let item = p.itemsize;
    let out_shape = p.row_shape(&longest);
    // Byte strides of a padded row, last dimension fastest. Every product of
    // its dimensions is at most `row_bound(longest)`, which `gather` kept
    // within the budget, and so the slot.
    let mut strides = vec![item; out_shape.len()];
    for d in (0..out_shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * out_shape[d + 1];
    }
    let row_bytes = out_shape.iter().product::<usize>() * item;
    let pad_row: Vec<u8> = p.pad.iter().copied().cycle().take(row_bytes).collect();
    let mut entries: Vec<u8> = Vec::new();
    let mut row = 0usize;
    for (n, input) in inputs {
        let extents = &input.extents()[..k];
        let shape = p.row_shape(extents);
        // SAFETY: the caller's contract: taken, unresolved requests.
        let src = unsafe { input.as_slice() };
        let own = shape.iter().product::<usize>() * item;
        debug_assert_eq!(src.len(), n * own);
        // Innermost runs: the last dimension's own length, copied whole.
        let (run, outer) = match shape.split_last() {
            Some((&last, outer)) => (last * item, outer),
            None => (item, &[][..]),
        };
        for r in 0..n {
            let base = row * row_bytes;
            if shape != out_shape {
                // SAFETY: the one guard of this slot (the caller's).
                unsafe { write_at(values, base, &pad_row, slot) };
            }
            let src_row = &src[r * own..(r + 1) * own];
            if own > 0 {
                let mut at = vec![0usize; outer.len()];
                for chunk in src_row.chunks_exact(run.max(1)) {
                    let offset: usize = at.iter().zip(&strides).map(|(i, s)| i * s).sum();
                    // SAFETY: as above.
                    unsafe { write_at(values, base + offset, chunk, slot) };
                    // Next outer index, last fastest.
                    for d in (0..outer.len()).rev() {
                        at[d] += 1;
                        if at[d] < outer[d] {
                            break;
                        }
                        at[d] = 0;
                    }
                }
            }
            for &e in extents {
                entries.extend_from_slice(&(e as i64).to_le_bytes());
            }
            row += 1;
        }
    }
    // SAFETY: as above.
    unsafe { write_at(index, 0, &entries, slot) };
    Collated::PaddedNd { longest }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::InputBytes;
    use crate::Sink;

    fn ring(store: &mut [Vec<u8>], row: usize, max_rows: usize) -> Arc<StagingRing> {
        let slots = store
            .iter_mut()
            // SAFETY: the vectors outlive the ring in every test below.
            .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
            .collect();
        Arc::new(StagingRing::new(vec![row], max_rows, slots).unwrap())
    }

    fn taken(id: u64, bytes: &[u8], rows: u32) -> Arc<Request> {
        // SAFETY: every caller's bytes outlive the requests it makes.
        let input = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
        let r = Arc::new(Request::new(id, Sink::EventLoop(0), rows, [input], None));
        assert!(r.take());
        r
    }

    #[test]
    fn collates_requests_back_to_back() {
        let mut store = vec![vec![0u8; 16]];
        let ring = ring(&mut store, 4, 4);
        let a = [1u8, 1, 1, 1];
        let b = [2u8, 2, 2, 2, 3, 3, 3, 3];
        let reqs = [taken(0, &a, 1), taken(1, &b, 2)];
        let mut slot = ring.acquire();
        // SAFETY: this test took both requests and resolves neither.
        assert_eq!(unsafe { slot.collate(&reqs) }, 3);
        slot.release();
        drop(ring);
        assert_eq!(&store[0][..12], &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
    }

    #[test]
    fn a_held_slot_is_never_handed_out_again_until_its_guard_is_dropped() {
        let mut store = vec![vec![0u8; 4], vec![0u8; 4]];
        let ring = ring(&mut store, 4, 1);
        let first = ring.acquire();
        let second = ring.acquire();
        assert_ne!(first.index(), second.index());
        assert!(ring.is_held(first.index()) && ring.is_held(second.index()));
        assert!(ring.try_acquire().is_none(), "both slots are held");
        let index = first.index();
        drop(first);
        assert!(!ring.is_held(index));
        assert_eq!(ring.free_slots(), 1);
        let again = ring.acquire();
        assert_eq!(again.index(), index);
        assert!(!ring.is_held(7), "out of range is never held");
    }

    #[test]
    fn a_slot_given_back_on_another_thread_wakes_a_blocked_acquire() {
        let mut store = vec![vec![0u8; 4]];
        let ring = ring(&mut store, 4, 1);
        let held = ring.acquire();
        let waiter = {
            let ring = ring.clone();
            std::thread::spawn(move || ring.acquire().index())
        };
        // The guard moves to a third thread (as the CUDA path's complete
        // thread) and is given back there.
        std::thread::spawn(move || held.release()).join().unwrap();
        assert_eq!(waiter.join().unwrap(), 0);
        assert_eq!(ring.free_slots(), 1, "the waiter's guard was dropped");
    }

    #[test]
    #[should_panic(expected = "batch overflows staging slot 0")]
    fn collating_more_rows_than_fit_panics_before_writing_past_the_slot() {
        let mut store = vec![vec![0u8; 4]];
        let ring = ring(&mut store, 4, 1);
        let bytes = [5u8; 8];
        let reqs = [taken(0, &bytes, 2)];
        let mut slot = ring.acquire();
        // SAFETY: this test took the request and never resolves it.
        unsafe { slot.collate(&reqs) };
    }

    #[test]
    fn rejects_slots_too_small_for_a_full_batch() {
        let mut v = vec![0u8; 7];
        // SAFETY: never written: construction fails.
        let slots = vec![vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }]];
        let err = StagingRing::new(vec![4], 2, slots).unwrap_err();
        assert!(err.to_string().contains("cannot hold 2 rows"));
        // SAFETY: as above.
        let slots = vec![vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }]];
        let err = StagingRing::new(vec![usize::MAX], 2, slots).unwrap_err();
        assert!(err.to_string().contains("overflow"));
    }
}

/// Loom models (`make loom`): every interleaving of a few threads.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::thread;

    /// A ring of `n` one-byte slots over leaked memory (loom runs the model
    /// body many times; a few bytes per run).
    fn ring(n: usize) -> Arc<StagingRing> {
        let slots = (0..n)
            .map(|_| {
                let ptr = Box::leak(Box::new(0u8)) as *mut u8;
                // SAFETY: leaked, so valid for the program's life; only the ring writes it.
                vec![unsafe { SlotBuffer::new(ptr, 1) }]
            })
            .collect();
        Arc::new(StagingRing::new(vec![1], 1, slots).unwrap())
    }

    /// Stands for the slots' memory: `busy[s]` is raised by whoever holds
    /// slot `s` (a second holder at once fails the model in any
    /// interleaving), and each write goes to a loom cell, so a holder's write
    /// not ordered after the previous holder's fails it too.
    struct Memory {
        busy: Box<[AtomicBool]>,
        bytes: Box<[UnsafeCell<u32>]>,
    }

    // SAFETY: `bytes[s]` is accessed by the holder of slot `s` alone (what
    // the model checks).
    unsafe impl Sync for Memory {}

    impl Memory {
        fn new(n: usize) -> Arc<Memory> {
            Arc::new(Memory {
                busy: (0..n).map(|_| AtomicBool::new(false)).collect(),
                bytes: (0..n).map(|_| UnsafeCell::new(0)).collect(),
            })
        }

        /// What a holder does with its slot, then lets go of it.
        fn write(&self, held: &HeldSlot) {
            let s = held.index();
            assert!(
                !self.busy[s].swap(true, Ordering::AcqRel),
                "slot {s} held twice"
            );
            // SAFETY: `held` is the guard of slot `s`; loom checks that no
            // other access to the cell races this one.
            self.bytes[s].with_mut(|p| unsafe { *p += 1 });
            self.busy[s].store(false, Ordering::Release);
        }

        fn total(&self) -> u32 {
            // SAFETY: every writer was joined.
            self.bytes.iter().map(|c| c.with(|p| unsafe { *p })).sum()
        }
    }

    #[test]
    fn loom_one_slot_two_workers_never_share_it() {
        loom::model(|| {
            let ring = ring(1);
            let memory = Memory::new(1);
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (ring, memory) = (ring.clone(), memory.clone());
                    thread::spawn(move || {
                        let held = ring.acquire();
                        memory.write(&held);
                        drop(held);
                    })
                })
                .collect();
            for w in workers {
                w.join().unwrap();
            }
            assert_eq!(memory.total(), 2);
            assert_eq!(ring.free_slots(), 1);
        });
    }

    #[test]
    fn loom_three_workers_two_slots_each_slot_one_holder() {
        loom::model(|| {
            let ring = ring(2);
            let memory = Memory::new(2);
            let workers: Vec<_> = (0..3)
                .map(|_| {
                    let (ring, memory) = (ring.clone(), memory.clone());
                    thread::spawn(move || memory.write(&ring.acquire()))
                })
                .collect();
            for w in workers {
                w.join().unwrap();
            }
            assert_eq!(memory.total(), 3);
            assert_eq!(ring.free_slots(), 2);
        });
    }

    /// The CUDA path: a launch thread collates into a slot and hands the
    /// guard to a complete thread, which gives it back; meanwhile another
    /// worker waits for a slot of a ring of two.
    #[test]
    fn loom_a_guard_given_back_on_another_thread_frees_its_slot_once() {
        loom::model(|| {
            let ring = ring(2);
            let memory = Memory::new(2);
            let first = ring.acquire();
            memory.write(&first);
            let complete = thread::spawn(move || first.release());
            let other = {
                let (ring, memory) = (ring.clone(), memory.clone());
                thread::spawn(move || {
                    let a = ring.acquire();
                    memory.write(&a);
                    let b = ring.acquire(); // needs `first`'s slot back
                    memory.write(&b);
                    assert_ne!(a.index(), b.index());
                })
            };
            complete.join().unwrap();
            other.join().unwrap();
            assert_eq!(memory.total(), 3);
            assert_eq!(ring.free_slots(), 2);
        });
    }
}
