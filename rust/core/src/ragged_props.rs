//! Property tests of variable-length collation: random requests (rows,
//! lengths, inner sizes), padded or jagged, go through a batcher with a
//! token budget; every batch stays within the budget and the slot, every
//! request is taken once and in order, and every row of every request is
//! found exactly, at its place, with its length (and, padded, pad bytes
//! after it). The same for BYTES rows of a variable number of elements
//! (each of its own length): every element of every row back, in order,
//! with its row's length. And rows padded along several variable
//! dimensions, anywhere in their shape: each element at its place in the
//! batch's box, pad elsewhere, each row's lengths.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use crate::bytes::{self, BytesLimits};
use crate::{
    Batcher, BatcherConfig, Collated, DispatchRule, InputBytes, Layout, Padded, Ragged,
    RaggedBytes, Readiness, Sink, SlotBuffer, Worker,
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
            .submit(Sink::EventLoop(0), r.rows, [input], None)
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

/// BYTES rows: `(rows, length, element sizes)` per request; each row
/// `length` positions of `unit` elements, the elements' sizes cycling
/// through `sizes`.
fn run_bytes(
    shape: Vec<(usize, usize, Vec<usize>)>,
    unit: usize,
    padded: bool,
    budget: usize,
    max_rows: usize,
) {
    struct BytesReq {
        rows: usize,
        len: usize,
        elements: Vec<Vec<u8>>,
        data: Vec<u8>,
    }
    let reqs: Vec<BytesReq> = shape
        .into_iter()
        .enumerate()
        .map(|(i, (rows, len, sizes))| {
            let elements: Vec<Vec<u8>> = (0..rows * len * unit)
                .map(|k| vec![(i * 13 + k) as u8; sizes[k % sizes.len()]])
                .collect();
            let mut data = Vec::new();
            for e in &elements {
                bytes::push(&mut data, e).unwrap();
            }
            BytesReq {
                rows,
                len,
                elements,
                data,
            }
        })
        .filter(|r| r.rows * r.len * unit <= budget && r.rows <= max_rows)
        .collect();
    let config = BatcherConfig {
        rule: DispatchRule::new(max_rows, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![0],
        max_queue_size: 1024,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: vec![Layout::RaggedBytes(RaggedBytes {
            unit_elements: unit,
            padded,
        })],
        max_batch_elements: Some(budget),
        bytes_limits: BytesLimits::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    // No slot memory: BYTES are collated into memory each batch owns.
    let batcher = Arc::new(Batcher::new(config, vec![vec![]; 2]).unwrap());
    let mut ids = Vec::new();
    for r in &reqs {
        // SAFETY: `reqs` outlives every batch taken below.
        let input = unsafe { InputBytes::new(r.data.as_ptr(), r.data.len()) }.with_extent(r.len);
        let request = batcher
            .submit(Sink::EventLoop(0), r.rows, [input], None)
            .unwrap();
        ids.push(request.id);
    }
    batcher.close();
    let mut worker = Worker::new();
    let mut seen = 0usize;
    while let Some(batch) = batcher.next_batch(&mut worker) {
        let Collated::RaggedBytes { data, lengths } = &batch.collated[0] else {
            panic!("unexpected {:?}", batch.collated[0]);
        };
        assert_eq!(lengths.len(), batch.rows);
        let counted = if padded {
            batch.rows * lengths.iter().copied().max().unwrap_or(0)
        } else {
            lengths.iter().sum()
        };
        assert!(counted * unit <= budget, "batch over the budget");
        let got: Vec<&[u8]> = bytes::elements(data).collect();
        assert_eq!(
            got.len(),
            lengths.iter().sum::<usize>() * unit,
            "every element"
        );
        let mut at = 0usize;
        for request in &batch.requests {
            let r = &reqs[seen];
            assert_eq!(request.id, ids[seen], "taken in order");
            seen += 1;
            let start = batch
                .routes
                .groups
                .iter()
                .flat_map(|(_, routes)| routes.iter())
                .find(|route| route.id == request.id)
                .unwrap()
                .start as usize;
            for j in 0..r.rows {
                assert_eq!(lengths[start + j], r.len, "the row's own length");
            }
            let n = r.rows * r.len * unit;
            let mine: Vec<&[u8]> = r.elements.iter().map(Vec::as_slice).collect();
            assert_eq!(&got[at..at + n], mine.as_slice(), "the row's own elements");
            at += n;
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

    #[test]
    fn every_callers_bytes_row_is_exact(
        shape in proptest::collection::vec(
            (1usize..4, 0usize..10, proptest::collection::vec(0usize..7, 1..4)),
            1..20,
        ),
        unit in 1usize..3,
        padded in any::<bool>(),
        budget in 20usize..80,
        max_rows in 3usize..10,
    ) {
        run_bytes(shape, unit, padded, budget, max_rows);
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
        .submit(Sink::EventLoop(0), 1, [input], None)
        .unwrap_err();
    assert!(
        err.to_string().contains("exceeds max_batch_elements (8)"),
        "{err}"
    );
    // A length that disagrees with the bytes is refused too.
    let input = unsafe { InputBytes::new(data.as_ptr(), 9) }.with_extent(4);
    assert!(batcher
        .submit(Sink::EventLoop(0), 1, [input], None)
        .is_err());
    assert_eq!(batcher.queue_len(), 0);
}

#[test]
fn a_bytes_request_over_the_budget_or_miscounted_is_refused_at_submit() {
    let config = BatcherConfig {
        rule: DispatchRule::new(4, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![0],
        max_queue_size: 8,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: vec![Layout::RaggedBytes(RaggedBytes {
            unit_elements: 1,
            padded: true,
        })],
        max_batch_elements: Some(3),
        bytes_limits: BytesLimits::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    let batcher = Batcher::new(config, vec![vec![]]).unwrap();
    let mut data = Vec::new();
    for e in [&b"a"[..], b"bc", b"", b"d"] {
        bytes::push(&mut data, e).unwrap();
    }
    let submit = |len: usize, extent: usize| {
        // SAFETY: `data` outlives the batcher.
        let input = unsafe { InputBytes::new(data.as_ptr(), len) }.with_extent(extent);
        batcher.submit(Sink::EventLoop(0), 1, [input], None)
    };
    let err = submit(data.len(), 4).unwrap_err().to_string();
    assert!(err.contains("exceeds max_batch_elements (3)"), "{err}");
    // Four elements where the length says three (or two): refused.
    let err = submit(data.len(), 3).unwrap_err().to_string();
    assert!(err.contains("elements"), "{err}");
    assert!(submit(data.len() - 1, 3).is_err(), "truncated");
    assert_eq!(batcher.queue_len(), 0);
    // Three elements: queued.
    assert!(submit(4 + 1 + 4 + 2 + 4, 3).is_ok());
    // No max_batch_elements: refused at construction.
    let config = BatcherConfig {
        rule: DispatchRule::new(4, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![0],
        max_queue_size: 8,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: vec![Layout::RaggedBytes(RaggedBytes {
            unit_elements: 1,
            padded: false,
        })],
        max_batch_elements: None,
        bytes_limits: BytesLimits::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    assert!(Batcher::new(config, vec![vec![]]).is_err());
}

/// Rows padded along several variable dimensions: row shape `dims` (`None`
/// variable); each request `(rows, extents)`, its elements numbered so each
/// is unique. Every element of every row is found at its place in the
/// padded box, pad everywhere else, and the lengths are each row's own.
fn run_padded(
    dims: Vec<Option<usize>>,
    shape: Vec<(usize, Vec<usize>)>,
    budget: usize,
    max_rows: usize,
) {
    let k = dims.iter().filter(|d| d.is_none()).count();
    let padded = Padded {
        dims: dims.clone().into_boxed_slice(),
        itemsize: 2,
        pad: Box::new([0xFF, 0xFF]),
    };
    struct PadReq {
        rows: usize,
        extents: Vec<usize>,
        data: Vec<u8>,
    }
    let mut next = 0u16;
    let reqs: Vec<PadReq> = shape
        .into_iter()
        .map(|(rows, extents)| {
            let extents = extents[..k].to_vec();
            let n = rows * padded.row_elements(&extents).unwrap();
            let data = (0..n)
                .flat_map(|_| {
                    next += 1;
                    next.to_le_bytes()
                })
                .collect();
            PadReq {
                rows,
                extents,
                data,
            }
        })
        .filter(|r| r.rows * padded.row_bound(&r.extents).unwrap() <= budget && r.rows <= max_rows)
        .collect();
    let mut store: Vec<Vec<u8>> = (0..2)
        .map(|_| vec![0u8; budget * 2])
        .chain((0..2).map(|_| vec![0u8; max_rows * k * 8]))
        .collect();
    let (values, index) = store.split_at_mut(2);
    let slots = values
        .iter_mut()
        .zip(index.iter_mut())
        // SAFETY: `store` outlives the batcher (dropped at the end of `run_padded`).
        .map(|(v, i)| unsafe {
            vec![
                SlotBuffer::new(v.as_mut_ptr(), v.len()),
                SlotBuffer::new(i.as_mut_ptr(), i.len()),
            ]
        })
        .collect();
    let config = BatcherConfig {
        rule: DispatchRule::new(max_rows, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![0],
        max_queue_size: 1024,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: vec![Layout::Padded(padded.clone())],
        max_batch_elements: Some(budget),
        bytes_limits: BytesLimits::default(),
        priorities: crate::Priorities::NONE,
        default_priority: None,
    };
    let batcher = Arc::new(Batcher::new(config, slots).unwrap());
    let mut ids = Vec::new();
    for r in &reqs {
        // SAFETY: `reqs` outlives every batch taken below.
        let input = unsafe { InputBytes::new(r.data.as_ptr(), r.data.len()) }
            .with_extents(&r.extents)
            .unwrap();
        let request = batcher
            .submit(Sink::EventLoop(0), r.rows, [input], None)
            .unwrap();
        ids.push(request.id);
    }
    batcher.close();
    let mut worker = Worker::new();
    let mut seen = 0usize;
    while let Some(batch) = batcher.next_batch(&mut worker) {
        let Collated::PaddedNd { longest } = &batch.collated[0] else {
            panic!("unexpected {:?}", batch.collated[0]);
        };
        let out_shape = padded.row_shape(longest);
        let row_elements: usize = out_shape.iter().product();
        let bound = padded.row_bound(longest).unwrap();
        assert!(batch.rows * bound <= budget, "batch over the budget");
        let (b_values, b_index) = (&store[batch.slot.index()], &store[2 + batch.slot.index()]);
        let lengths = i64s(b_index, batch.rows * k);
        let element = |row: usize, at: usize| {
            let o = (row * row_elements + at) * 2;
            u16::from_le_bytes([b_values[o], b_values[o + 1]])
        };
        let mut row = 0usize;
        for request in &batch.requests {
            let r = &reqs[seen];
            assert_eq!(request.id, ids[seen], "taken in order");
            seen += 1;
            let own = padded.row_shape(&r.extents);
            let own_elements: usize = own.iter().product();
            for j in 0..r.rows {
                let got: Vec<usize> = lengths[row * k..(row + 1) * k]
                    .iter()
                    .map(|&n| n as usize)
                    .collect();
                assert_eq!(got, r.extents, "the row's own lengths");
                // Walk the padded box: inside the row's own box, its element; pad outside.
                let mut own_at = 0usize;
                for at in 0..row_elements {
                    let mut rest = at;
                    let mut index = vec![0usize; out_shape.len()];
                    for d in (0..out_shape.len()).rev() {
                        index[d] = rest % out_shape[d];
                        rest /= out_shape[d];
                    }
                    let inside = index.iter().zip(&own).all(|(i, n)| i < n);
                    let value = element(row, at);
                    if inside {
                        let o = (j * own_elements + own_at) * 2;
                        let want = u16::from_le_bytes([r.data[o], r.data[o + 1]]);
                        assert_eq!(value, want, "element {index:?} of row {j}");
                        own_at += 1;
                    } else {
                        assert_eq!(value, 0xFFFF, "padding at {index:?}");
                    }
                }
                assert_eq!(own_at, own_elements);
                row += 1;
            }
        }
    }
    assert_eq!(seen, reqs.len(), "every request taken exactly once");
}

fn padded_dims() -> impl Strategy<Value = Vec<Option<usize>>> {
    proptest::collection::vec(prop_oneof![Just(None), (1usize..4).prop_map(Some)], 1..4)
        .prop_filter("at least one variable dimension", |d| {
            d.iter().any(Option::is_none)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn every_callers_padded_box_is_exact(
        dims in padded_dims(),
        shape in proptest::collection::vec(
            (1usize..3, proptest::collection::vec(0usize..5, 4)),
            1..16,
        ),
        budget in 24usize..160,
        max_rows in 3usize..8,
    ) {
        run_padded(dims, shape, budget, max_rows);
    }
}
