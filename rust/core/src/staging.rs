//! A ring of reusable staging slots that batches are collated into.
//!
//! A slot is one buffer per model input, each big enough for
//! `max_batch_size` rows. The memory belongs to the caller (pinned torch
//! tensors when CUDA is available, ordinary tensors otherwise); the ring only
//! records where it is and who may write it.
//!
//! Invariant: a slot index is either in the free list or held by exactly one
//! worker (between [`StagingRing::acquire`] and [`StagingRing::release`]). Only
//! the holder writes the slot, so a slot still in flight — its host-to-device
//! copy not yet complete — is never rewritten: its holder releases it only
//! after that copy is done.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

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

#[derive(Debug)]
pub struct StagingRing {
    row_nbytes: Box<[usize]>,
    slots: Box<[Box<[SlotBuffer]>]>,
    in_flight: Box<[AtomicBool]>,
    free_tx: Sender<usize>,
    free_rx: Receiver<usize>,
}

// SAFETY: the raw pointers are only written through `collate`, by the one
// worker holding the slot (the invariant in the module docs).
unsafe impl Send for StagingRing {}
// SAFETY: as above; everything else is atomics and a channel.
unsafe impl Sync for StagingRing {}

impl StagingRing {
    /// Builds a ring over `slots`, each holding one buffer per input, for
    /// inputs of `row_nbytes[i]` bytes per row and at most `max_rows` rows.
    pub fn new(
        row_nbytes: Vec<usize>,
        max_rows: usize,
        slots: Vec<Vec<SlotBuffer>>,
    ) -> Result<StagingRing, CoreError> {
        if slots.is_empty() {
            return Err(CoreError::InvalidConfig(
                "the staging ring needs at least one slot".into(),
            ));
        }
        for (s, buffers) in slots.iter().enumerate() {
            if buffers.len() != row_nbytes.len() {
                return Err(CoreError::InvalidConfig(format!(
                    "staging slot {s} has {} buffers for {} inputs",
                    buffers.len(),
                    row_nbytes.len()
                )));
            }
            for (i, (buf, row)) in buffers.iter().zip(&row_nbytes).enumerate() {
                if buf.capacity < row * max_rows {
                    return Err(CoreError::InvalidConfig(format!(
                        "staging slot {s}, input {i}: {} bytes cannot hold {max_rows} rows of {row} bytes",
                        buf.capacity
                    )));
                }
            }
        }
        let (free_tx, free_rx) = crossbeam_channel::bounded(slots.len());
        for s in 0..slots.len() {
            free_tx.send(s).expect("free list has room for every slot");
        }
        Ok(StagingRing {
            row_nbytes: row_nbytes.into(),
            in_flight: slots.iter().map(|_| AtomicBool::new(false)).collect(),
            slots: slots.into_iter().map(Vec::into_boxed_slice).collect(),
            free_tx,
            free_rx,
        })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn row_nbytes(&self) -> &[usize] {
        &self.row_nbytes
    }

    /// Takes a free slot, blocking until one is released.
    pub fn acquire(&self) -> usize {
        let slot = self
            .free_rx
            .recv()
            .expect("the ring owns both ends of its free list");
        let was = self.in_flight[slot].swap(true, Ordering::AcqRel);
        debug_assert!(!was, "slot {slot} was in the free list while in flight");
        slot
    }

    /// Gives a slot back. False (and no effect) if it was not held.
    pub fn release(&self, slot: usize) -> bool {
        if slot >= self.slots.len() || !self.in_flight[slot].swap(false, Ordering::AcqRel) {
            return false;
        }
        self.free_tx
            .send(slot)
            .expect("free list has room for every slot");
        true
    }

    pub fn is_in_flight(&self, slot: usize) -> bool {
        self.in_flight[slot].load(Ordering::Acquire)
    }

    /// Copies the inputs of `requests`, in order, into `slot`; returns the rows.
    ///
    /// The caller must hold `slot` and must have won [`Request::take`] for
    /// every request, and the requests must fit (`sum(rows) <= max_rows`).
    pub fn collate(&self, slot: usize, requests: &[Arc<Request>]) -> usize {
        assert!(
            self.is_in_flight(slot),
            "collate into slot {slot}, which is not held"
        );
        let buffers = &self.slots[slot];
        for (i, (buf, &row_nbytes)) in buffers.iter().zip(self.row_nbytes.iter()).enumerate() {
            let mut offset = 0usize;
            for r in requests {
                let src = &r.inputs()[i];
                debug_assert_eq!(src.len(), r.rows as usize * row_nbytes);
                assert!(
                    offset + src.len() <= buf.capacity,
                    "batch overflows staging slot {slot}"
                );
                // SAFETY: the caller won `take()` for `r`, so its submitter keeps
                // the input bytes alive until this batch resolves it; the slot is
                // held by this worker alone (module invariant) and the bounds
                // were checked just above. Source and destination never overlap:
                // slot memory is never handed out as request input.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_slice().as_ptr(),
                        buf.ptr.add(offset),
                        src.len(),
                    );
                }
                offset += src.len();
            }
        }
        requests.iter().map(|r| r.rows as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InputBytes;

    fn ring(store: &mut [Vec<u8>], row: usize, max_rows: usize) -> StagingRing {
        let slots = store
            .iter_mut()
            // SAFETY: the vectors outlive the ring in every test below.
            .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
            .collect();
        StagingRing::new(vec![row], max_rows, slots).unwrap()
    }

    #[test]
    fn collates_requests_back_to_back() {
        let mut store = vec![vec![0u8; 16]];
        let ring = ring(&mut store, 4, 4);
        let a = [1u8, 1, 1, 1];
        let b = [2u8, 2, 2, 2, 3, 3, 3, 3];
        // SAFETY: `a` and `b` outlive the requests.
        let reqs: Vec<_> = [(&a[..], 1), (&b[..], 2)]
            .iter()
            .enumerate()
            .map(|(id, (bytes, rows))| {
                let input = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
                let r = Arc::new(Request::new(id as u64, 0, *rows, Box::new([input]), None));
                assert!(r.take());
                r
            })
            .collect();
        let slot = ring.acquire();
        assert_eq!(ring.collate(slot, &reqs), 3);
        assert!(ring.release(slot));
        drop(ring);
        assert_eq!(&store[0][..12], &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
    }

    #[test]
    fn a_held_slot_is_never_handed_out_again() {
        let mut store = vec![vec![0u8; 4], vec![0u8; 4]];
        let ring = ring(&mut store, 4, 1);
        let first = ring.acquire();
        let second = ring.acquire();
        assert_ne!(first, second);
        assert!(ring.is_in_flight(first) && ring.is_in_flight(second));
        assert!(ring.release(first));
        assert!(!ring.release(first), "double release is refused");
        assert_eq!(ring.acquire(), first);
    }

    #[test]
    fn rejects_slots_too_small_for_a_full_batch() {
        let mut v = vec![0u8; 7];
        // SAFETY: never written: construction fails.
        let slots = vec![vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }]];
        let err = StagingRing::new(vec![4], 2, slots).unwrap_err();
        assert!(err.to_string().contains("cannot hold 2 rows"));
    }
}
