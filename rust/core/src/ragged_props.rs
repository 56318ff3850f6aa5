//! Property tests of variable-length collation: random requests (rows,
//! lengths, inner sizes), padded or jagged, go through a batcher with a
//! token budget; every batch stays within the budget and the slot, every
//! request is taken once and in order, and every row of every request is
//! found exactly, at its place, with its length (and, padded, pad bytes
//! after it).

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use crate::bytes::BytesLimits;
use crate::{
    Batcher, BatcherConfig, Collated, DispatchRule, InputBytes, Layout, Ragged, Readiness, Sink,
    SlotBuffer, Worker,
};

/// One request: rows of `len` positions of `unit` bytes each, all filled
/// with a byte pattern unique to the request and row.
#[derive(Debug, Clone)]
struct Req {
    rows: usize,
    len: usize,
    data: Vec<u8>,
}

fn requests(unit: usize) -> impl Strategy<Value = Vec<(usize, usize)>> {
    let _ = unit;
    proptest::collection::vec((1usize..4, 0usize..12), 1..24)
}

fn i64s(bytes: &[u8], n: usize) -> Vec<i64> {
    bytes[..n * 8]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn run(shape: Vec<(usize, usize)>, unit: usize, padded: bool, budget: usize, max_rows: usize) {
    let pad_byte = 0xEEu8;
    let reqs: Vec<Req> = shape
        .iter()
        .enumerate()
        .map(|(i, &(rows, len))| Req {
            rows,
            len,
            data: (0..rows * len * unit)
                .map(|k| ((i * 31 + k / (len * unit).max(1) * 7 + k) % 200) as u8)
                .collect(),
        })
        .filter(|r| r.rows * r.len <= budget && r.rows <= max_rows)
        .collect();
    let values_cap = budget * unit;
    let index_cap = (max_rows + 1) * 8;
    let mut store: Vec<Vec<u8>> = (0..4)
        .map(|_| vec![0u8; values_cap.max(1)])
        .chain((0..4).map(|_| vec![0u8; index_cap]))
        .collect();
    let (values, index) = store.split_at_mut(4);
    let slots = values
        .iter_mut()
        .zip(index.iter_mut())
        // SAFETY: `store` outlives the batcher (dropped at the end of `run`).
        .map(|(v, i)| unsafe {
            vec![
                SlotBuffer::new(v.as_mut_ptr(), v.len()),
                SlotBuffer::new(i.as_mut_ptr(), i.len()),
            ]
        })
        .collect();
    let layout = Layout::Ragged(Ragged {
        unit_nbytes: unit,
        unit_elements: 1,
        pad: padded.then(|| vec![pad_byte; unit].into_boxed_slice()),
    });
    let config = BatcherConfig {
        rule: DispatchRule::new(max_rows, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![0],
        max_queue_size: 1024,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: vec![layout],
        max_batch_elements: Some(budget),
        bytes_limits: BytesLimits::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    let batcher = Arc::new(Batcher::new(config, slots).unwrap());
    let mut ids = Vec::new();
    for r in &reqs {
        // SAFETY: `reqs` outlives every batch taken below.
        let input = unsafe { InputBytes::new(r.data.as_ptr(), r.data.len()) }.with_extent(r.len);
        let request = batcher
            .submit(Sink::EventLoop(0), r.rows, Box::new([input]), None)
            .unwrap();
        ids.push(request.id);
    }
    batcher.close();
    let mut worker = Worker::new();
    let mut seen = 0usize;
    while let Some(batch) = batcher.next_batch(&mut worker) {
        let (b_values, b_index) = (&store[batch.slot.index()], &store[4 + batch.slot.index()]);
        let mut routes: Vec<_> = batch
            .routes
            .groups
            .iter()
            .flat_map(|(_, r)| r.clone())
            .collect();
        routes.sort_by_key(|r| r.start);
        let rows = batch.rows;
        assert!(rows <= max_rows);
        match &batch.collated[0] {
            Collated::Padded { max_len } => {
                assert!(padded);
                assert!(rows * max_len <= budget, "padded batch over the budget");
                let lengths = i64s(b_index, rows);
                for route in &routes {
                    let r = &reqs[seen];
                    assert_eq!(route.id, ids[seen], "taken in order");
                    seen += 1;
                    for j in 0..r.rows {
                        let row = route.start as usize + j;
                        assert_eq!(lengths[row], r.len as i64);
                        let at = row * max_len * unit;
                        let got = &b_values[at..at + r.len * unit];
                        assert_eq!(got, &r.data[j * r.len * unit..(j + 1) * r.len * unit]);
                        let padding = &b_values[at + r.len * unit..at + max_len * unit];
                        assert!(
                            padding.iter().all(|&b| b == pad_byte),
                            "padded with the pad value"
                        );
                    }
                }
                assert_eq!(
                    *max_len,
                    lengths.iter().copied().max().unwrap_or(0) as usize
                );
            }
            Collated::Jagged { total } => {
                assert!(!padded);
                assert!(*total <= budget, "jagged batch over the budget");
                let offsets = i64s(b_index, rows + 1);
                assert_eq!(offsets[0], 0);
                assert_eq!(offsets[rows], *total as i64);
                for route in &routes {
                    let r = &reqs[seen];
                    assert_eq!(route.id, ids[seen], "taken in order");
                    seen += 1;
                    for j in 0..r.rows {
                        let row = route.start as usize + j;
                        let (a, b) = (offsets[row] as usize, offsets[row + 1] as usize);
                        assert_eq!(b - a, r.len);
                        assert_eq!(
                            &b_values[a * unit..b * unit],
                            &r.data[j * r.len * unit..(j + 1) * r.len * unit]
                        );
                    }
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, reqs.len(), "every request taken exactly once");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn every_callers_row_is_exact(
        shape in requests(1),
        unit in 1usize..9,
        padded in any::<bool>(),
        budget in 12usize..80,
        max_rows in 3usize..10,
    ) {
        run(shape, unit, padded, budget, max_rows);
    }
}

#[test]
fn a_request_over_the_budget_is_refused_at_submit() {
    let mut v = vec![0u8; 8];
    let mut i = vec![0u8; 40];
    // SAFETY: `v` and `i` outlive the batcher.
    let slots = vec![unsafe {
        vec![
            SlotBuffer::new(v.as_mut_ptr(), v.len()),
            SlotBuffer::new(i.as_mut_ptr(), i.len()),
        ]
    }];
    let config = BatcherConfig {
        rule: DispatchRule::new(4, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![0],
        max_queue_size: 8,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: vec![Layout::Ragged(Ragged {
            unit_nbytes: 1,
            unit_elements: 1,
            pad: None,
        })],
        max_batch_elements: Some(8),
        bytes_limits: BytesLimits::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    let batcher = Batcher::new(config, slots).unwrap();
    let data = [1u8; 9];
    // SAFETY: `data` outlives the batcher.
    let input = unsafe { InputBytes::new(data.as_ptr(), 9) }.with_extent(9);
    let err = batcher
        .submit(Sink::EventLoop(0), 1, Box::new([input]), None)
        .unwrap_err();
    assert!(
        err.to_string().contains("exceeds max_batch_elements (8)"),
        "{err}"
    );
    // A length that disagrees with the bytes is refused too.
    let input = unsafe { InputBytes::new(data.as_ptr(), 9) }.with_extent(4);
    assert!(batcher
        .submit(Sink::EventLoop(0), 1, Box::new([input]), None)
        .is_err());
    assert_eq!(batcher.queue_len(), 0);
}
