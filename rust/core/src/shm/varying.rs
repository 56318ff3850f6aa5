//! How a request of a model with BYTES or variable-length tensors lies in
//! its cells. A fixed-shape model's request of `r` rows takes `r` cells, each
//! input's rows back to back (see [`crate::shm`]); such a model's request
//! may be of any size, so it takes as many consecutive cells as its bytes
//! need (its `span`, at least its rows), and says what it holds:
//!
//! ```text
//! inputs  (client writes):  per input  [len u64][extents u64 x MAX_VARIABLE_DIMS]
//!                           then each input's bytes, from an 8-byte boundary
//! outputs (server writes):  per output [len u64][pad u32][rank u32][rows u32][0 u32]
//!                                      [rows x rank dims u64][pad bytes][bytes]
//!                                      (pad and bytes each from an 8-byte boundary)
//! ```
//!
//! Everything is little-endian. Both sides read what the other wrote as
//! hostile: every length is checked against the region (checked arithmetic)
//! before anything is sliced, and nothing here panics. The server reads a
//! request from its own copy of the region ([`used_len`] says how much to
//! copy), so a client that writes its cells after queueing them changes
//! nothing the batcher checked.

use std::ops::Range;

use crate::request::MAX_VARIABLE_DIMS;

/// Bytes of one input's header: its length and its extents.
pub const INPUT_HEADER: usize = 8 * (1 + MAX_VARIABLE_DIMS);
/// Bytes of one output's fixed header (before its dims).
pub const OUTPUT_HEADER: usize = 24;
/// The longest pad element an output may name.
pub const MAX_PAD: usize = 64;
/// The highest rank of an output's rows.
pub const MAX_RANK: usize = 32;

fn align(n: usize) -> Option<usize> {
    n.checked_add(7).map(|n| n & !7)
}

fn u64_at(region: &[u8], at: usize) -> Option<u64> {
    let bytes = region.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

fn u32_at(region: &[u8], at: usize) -> Option<u32> {
    let bytes = region.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

fn usize_at(region: &[u8], at: usize) -> Option<usize> {
    usize::try_from(u64_at(region, at)?).ok()
}

/// One input of a request: its bytes' place in the region, and its extents
/// (as [`crate::InputBytes::with_extents`] takes them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputPlace {
    pub range: Range<usize>,
    pub extents: [usize; MAX_VARIABLE_DIMS],
}

/// Bytes the inputs of lengths `lens` take in a region (None: overflow).
pub fn inputs_len(lens: &[usize]) -> Option<usize> {
    let mut total = lens.len().checked_mul(INPUT_HEADER)?;
    for &len in lens {
        total = align(total.checked_add(len)?)?;
    }
    Some(total)
}

/// Writes `inputs` (bytes, extents) into `region`; false if they do not fit.
pub fn write_inputs(region: &mut [u8], inputs: &[(&[u8], [usize; MAX_VARIABLE_DIMS])]) -> bool {
    let lens: Vec<usize> = inputs.iter().map(|(b, _)| b.len()).collect();
    match inputs_len(&lens) {
        Some(total) if total <= region.len() => {}
        _ => return false,
    }
    let mut data = inputs.len() * INPUT_HEADER;
    for (i, (bytes, extents)) in inputs.iter().enumerate() {
        let head = i * INPUT_HEADER;
        region[head..head + 8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        for (d, &e) in extents.iter().enumerate() {
            let at = head + 8 * (d + 1);
            region[at..at + 8].copy_from_slice(&(e as u64).to_le_bytes());
        }
        region[data..data + bytes.len()].copy_from_slice(bytes);
        // Checked by `inputs_len` above.
        data = align(data + bytes.len()).unwrap_or(region.len());
    }
    true
}

/// How many bytes of a region of `region_len` bytes the `count` inputs
/// its `header` (the region's first `count * INPUT_HEADER` bytes) describes
/// take, checked to fit.
pub fn used_len(header: &[u8], count: usize, region_len: usize) -> Result<usize, String> {
    let head = count
        .checked_mul(INPUT_HEADER)
        .filter(|&h| h <= region_len && h <= header.len())
        .ok_or("the request's cells cannot hold its inputs' header")?;
    let mut total = head;
    for i in 0..count {
        let len = usize_at(header, i * INPUT_HEADER).ok_or("a truncated input header")?;
        total = total
            .checked_add(len)
            .and_then(align)
            .filter(|&t| t <= region_len)
            .ok_or_else(|| format!("input {i}'s {len} bytes run past the request's cells"))?;
    }
    Ok(total)
}

/// Where each of `count` inputs lies in `region` (the server's copy of it).
pub fn read_inputs(region: &[u8], count: usize) -> Result<Vec<InputPlace>, String> {
    let used = used_len(region, count, region.len())?;
    let mut places = Vec::with_capacity(count);
    let mut data = count * INPUT_HEADER; // <= used: checked by `used_len`
    for i in 0..count {
        let head = i * INPUT_HEADER;
        let len = usize_at(region, head).ok_or("a truncated input header")?;
        let mut extents = [0usize; MAX_VARIABLE_DIMS];
        for (d, e) in extents.iter_mut().enumerate() {
            *e = usize_at(region, head + 8 * (d + 1))
                .ok_or_else(|| format!("input {i}: an extent too large"))?;
        }
        let end = data
            .checked_add(len)
            .filter(|&e| e <= used)
            .ok_or("an input past its region")?;
        places.push(InputPlace {
            range: data..end,
            extents,
        });
        data = align(end).ok_or("an input past its region")?;
    }
    Ok(places)
}

/// A request's rows of one output, as the server writes them: each row's
/// bytes (in order) and shape, and one pad element (for a caller of several
/// rows of different shapes).
#[derive(Debug, Clone, Copy)]
pub struct OutputRows<'a> {
    pub rows: &'a [&'a [u8]],
    pub shapes: &'a [&'a [u64]],
    pub pad: &'a [u8],
}

impl OutputRows<'_> {
    fn rank(&self) -> usize {
        self.shapes.first().map_or(0, |s| s.len())
    }

    /// Bytes it takes in a region; None: overflow, or rows of different
    /// ranks, or a pad or rank beyond the bounds.
    pub fn encoded_len(&self) -> Option<usize> {
        let rank = self.rank();
        if self.shapes.len() != self.rows.len()
            || self.shapes.iter().any(|s| s.len() != rank)
            || rank > MAX_RANK
            || self.pad.len() > MAX_PAD
        {
            return None;
        }
        let data = self
            .rows
            .iter()
            .try_fold(0usize, |n, r| n.checked_add(r.len()))?;
        let dims = self.rows.len().checked_mul(rank)?.checked_mul(8)?;
        OUTPUT_HEADER
            .checked_add(dims)
            .and_then(|n| n.checked_add(self.pad.len()))
            .and_then(align)
            .and_then(|n| n.checked_add(data))
            .and_then(align)
    }
}

/// Writes `output` into `region` at `at`: the end of what it wrote, or the
/// bytes it would need in all when it does not fit.
pub fn write_output(region: &mut [u8], at: usize, output: &OutputRows<'_>) -> Result<usize, usize> {
    let len = output.encoded_len().ok_or(usize::MAX)?;
    let end = at.checked_add(len).ok_or(usize::MAX)?;
    if end > region.len() {
        return Err(end);
    }
    let data: usize = output.rows.iter().map(|r| r.len()).sum();
    let rank = output.rank();
    let mut put = |at: usize, bytes: &[u8]| region[at..at + bytes.len()].copy_from_slice(bytes);
    put(at, &(data as u64).to_le_bytes());
    put(at + 8, &(output.pad.len() as u32).to_le_bytes());
    put(at + 12, &(rank as u32).to_le_bytes());
    put(at + 16, &(output.rows.len() as u32).to_le_bytes());
    put(at + 20, &0u32.to_le_bytes());
    let mut cursor = at + OUTPUT_HEADER;
    for shape in output.shapes {
        for &d in *shape {
            put(cursor, &d.to_le_bytes());
            cursor += 8;
        }
    }
    put(cursor, output.pad);
    cursor = align(cursor + output.pad.len()).unwrap_or(end);
    for row in output.rows {
        put(cursor, row);
        cursor += row.len();
    }
    Ok(end)
}

/// One output of a finished request, as the client reads it: every row's
/// bytes back to back, each row's shape, one pad element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputRead<'a> {
    pub data: &'a [u8],
    pub shapes: Vec<Vec<usize>>,
    pub pad: &'a [u8],
}

/// Reads `count` outputs of `rows` rows each from `region`.
pub fn read_outputs(
    region: &[u8],
    count: usize,
    rows: usize,
) -> Result<Vec<OutputRead<'_>>, String> {
    let bad = |i: usize| format!("output {i} of the shared answer is malformed");
    let mut out = Vec::with_capacity(count.min(64));
    let mut at = 0usize;
    for i in 0..count {
        let len = usize_at(region, at).ok_or_else(|| bad(i))?;
        let pad = u32_at(region, at + 8).ok_or_else(|| bad(i))? as usize;
        let rank = u32_at(region, at + 12).ok_or_else(|| bad(i))? as usize;
        let got_rows = u32_at(region, at + 16).ok_or_else(|| bad(i))? as usize;
        if got_rows != rows || rank > MAX_RANK || pad > MAX_PAD {
            return Err(bad(i));
        }
        let mut cursor = at + OUTPUT_HEADER;
        let mut shapes = Vec::with_capacity(rows);
        for _ in 0..rows {
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                shape.push(usize_at(region, cursor).ok_or_else(|| bad(i))?);
                cursor += 8;
            }
            shapes.push(shape);
        }
        let pad_bytes = region.get(cursor..cursor + pad).ok_or_else(|| bad(i))?;
        let from = align(cursor + pad).ok_or_else(|| bad(i))?;
        let to = from.checked_add(len).ok_or_else(|| bad(i))?;
        let data = region.get(from..to).ok_or_else(|| bad(i))?;
        out.push(OutputRead {
            data,
            shapes,
            pad: pad_bytes,
        });
        at = align(to).ok_or_else(|| bad(i))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_round_trip() {
        let a = [1u8, 2, 3];
        let b = [9u8; 16];
        let inputs = [(&a[..], [3, 0, 0, 0]), (&b[..], [2, 2, 0, 0])];
        let need = inputs_len(&[3, 16]).unwrap();
        assert_eq!(need, 2 * INPUT_HEADER + 8 + 16);
        let mut region = vec![0u8; need];
        assert!(write_inputs(&mut region, &inputs));
        assert!(!write_inputs(&mut region[..need - 1], &inputs));
        let places = read_inputs(&region, 2).unwrap();
        assert_eq!(&region[places[0].range.clone()], &a);
        assert_eq!(&region[places[1].range.clone()], &b);
        assert_eq!(places[1].extents, [2, 2, 0, 0]);
        assert_eq!(used_len(&region, 2, region.len()), Ok(need));
    }

    #[test]
    fn a_length_past_the_region_is_refused() {
        let mut region = vec![0u8; 2 * INPUT_HEADER + 8];
        region[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read_inputs(&region, 2).is_err());
        region[..8].copy_from_slice(&9u64.to_le_bytes());
        assert!(read_inputs(&region, 2).is_err());
        assert!(read_inputs(&region, 1 << 40).is_err());
    }

    #[test]
    fn outputs_round_trip() {
        let rows: [&[u8]; 2] = [&[1, 2, 3, 4], &[5, 6]];
        let shapes: [&[u64]; 2] = [&[2], &[1]];
        let one = OutputRows {
            rows: &rows,
            shapes: &shapes,
            pad: &[0, 0],
        };
        let len = one.encoded_len().unwrap();
        let mut region = vec![0u8; 2 * len];
        let end = write_output(&mut region, 0, &one).unwrap();
        assert_eq!(end, len);
        assert_eq!(
            write_output(&mut region[..len + 3], end, &one),
            Err(2 * len)
        );
        write_output(&mut region, end, &one).unwrap();
        let read = read_outputs(&region, 2, 2).unwrap();
        assert_eq!(read[1].data, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(read[1].shapes, vec![vec![2], vec![1]]);
        assert_eq!(read[0].pad, &[0, 0]);
        assert!(read_outputs(&region, 2, 3).is_err());
        assert!(read_outputs(&region[..len + 8], 2, 2).is_err());
    }
}
