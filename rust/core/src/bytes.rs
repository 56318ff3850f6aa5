//! BYTES elements, serialized as Triton serializes them on the wire (the
//! binary extension, gRPC's `raw_input_contents`): each element a 4-byte
//! little-endian length, then that many bytes, back to back.
//!
//! A request's BYTES input is carried in this form from decoding (or from
//! the in-process caller's objects) to collation, and a batch's BYTES output
//! in the same form from the model to the encoder, so the binary wire format
//! passes through unchanged. [`check`] walks a buffer once, bounding every
//! element and the whole before anyone relies on it.

use std::fmt;

/// What a BYTES input may carry; checked before anything is allocated for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BytesLimits {
    /// Bytes of one element.
    pub max_element: usize,
    /// Bytes of one request's input, serialized (lengths included).
    pub max_request: usize,
}

impl Default for BytesLimits {
    /// 16 MiB per element, 64 MiB per request (the front-ends' body limit).
    fn default() -> Self {
        BytesLimits {
            max_element: 16 << 20,
            max_request: 64 << 20,
        }
    }
}

/// Why a serialized buffer was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BytesError {
    /// The buffer ends inside element `index` (its length or its bytes).
    Truncated { index: usize },
    /// Element `index` is `len` bytes, over `limit`.
    ElementTooLarge {
        index: usize,
        len: usize,
        limit: usize,
    },
    /// The buffer is `len` bytes, over `limit`.
    TooLarge { len: usize, limit: usize },
    /// It holds `got` elements (or more), not `expected`.
    Count { expected: usize, got: usize },
}

impl fmt::Display for BytesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BytesError::Truncated { index } => write!(
                f,
                "BYTES data ends inside element {index} (each element is a 4-byte \
                 little-endian length, then that many bytes)"
            ),
            BytesError::ElementTooLarge { index, len, limit } => write!(
                f,
                "BYTES element {index} is {len} bytes, over the limit of {limit}"
            ),
            BytesError::TooLarge { len, limit } => write!(
                f,
                "BYTES data of {len} bytes is over the limit of {limit} per request"
            ),
            BytesError::Count { expected, got } => write!(
                f,
                "BYTES data holds {got} elements, the shape needs {expected}"
            ),
        }
    }
}

impl std::error::Error for BytesError {}

/// Checks that `data` is exactly `count` serialized elements within `limits`.
pub fn check(data: &[u8], count: usize, limits: BytesLimits) -> Result<(), BytesError> {
    if data.len() > limits.max_request {
        return Err(BytesError::TooLarge {
            len: data.len(),
            limit: limits.max_request,
        });
    }
    let mut rest = data;
    let mut index = 0usize;
    while !rest.is_empty() {
        if index == count {
            return Err(BytesError::Count {
                expected: count,
                got: index + 1,
            });
        }
        let (element, tail) = split_first(rest).ok_or(BytesError::Truncated { index })?;
        if element.len() > limits.max_element {
            return Err(BytesError::ElementTooLarge {
                index,
                len: element.len(),
                limit: limits.max_element,
            });
        }
        rest = tail;
        index += 1;
    }
    if index != count {
        return Err(BytesError::Count {
            expected: count,
            got: index,
        });
    }
    Ok(())
}

/// The first element of `data` and the rest; None when `data` ends inside it.
fn split_first(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = data.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
    if len > rest.len() {
        return None;
    }
    Some(rest.split_at(len))
}

/// The elements of a serialized buffer, in order; stops at the first
/// malformed one (call [`check`] first to know there is none).
pub fn elements(data: &[u8]) -> Elements<'_> {
    Elements { rest: data }
}

/// Iterator of [`elements`].
#[derive(Debug, Clone)]
pub struct Elements<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Elements<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (element, rest) = split_first(self.rest)?;
        self.rest = rest;
        Some(element)
    }
}

/// Appends one element. `Err` (nothing appended) when it is longer than a
/// 4-byte length can say.
pub fn push(out: &mut Vec<u8>, element: &[u8]) -> Result<(), BytesError> {
    let len = u32::try_from(element.len()).map_err(|_| BytesError::ElementTooLarge {
        index: 0,
        len: element.len(),
        limit: u32::MAX as usize,
    })?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(element);
    Ok(())
}

/// The serialized size of elements of `lens` bytes, checked against
/// `limits` before anything is allocated (`index` in errors is the
/// element's position).
pub fn serialized_size(
    lens: impl IntoIterator<Item = usize>,
    limits: BytesLimits,
) -> Result<usize, BytesError> {
    let mut total = 0usize;
    for (index, len) in lens.into_iter().enumerate() {
        if len > limits.max_element {
            return Err(BytesError::ElementTooLarge {
                index,
                len,
                limit: limits.max_element,
            });
        }
        total = total
            .checked_add(len)
            .and_then(|t| t.checked_add(4))
            .filter(|&t| t <= limits.max_request)
            .ok_or(BytesError::TooLarge {
                len: total.saturating_add(len).saturating_add(4),
                limit: limits.max_request,
            })?;
    }
    Ok(total)
}

/// The byte offset where each of the first `count` elements starts, and the
/// end of the last: `count + 1` offsets into `data` (which [`check`] passed
/// for at least `count` elements).
pub fn boundaries(data: &[u8], count: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(count + 1);
    let mut at = 0usize;
    out.push(0);
    for element in elements(data).take(count) {
        at += 4 + element.len();
        out.push(at);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serialize(items: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for item in items {
            push(&mut out, item).unwrap();
        }
        out
    }

    #[test]
    fn round_trips_and_counts() {
        let data = serialize(&[b"ab", b"", b"xyz"]);
        assert_eq!(data.len(), 4 * 3 + 5);
        check(&data, 3, BytesLimits::default()).unwrap();
        let back: Vec<&[u8]> = elements(&data).collect();
        assert_eq!(back, vec![&b"ab"[..], b"", b"xyz"]);
        assert_eq!(boundaries(&data, 3), vec![0, 6, 10, 17]);
        assert_eq!(
            serialized_size([2, 0, 3], BytesLimits::default()),
            Ok(data.len())
        );
    }

    #[test]
    fn refuses_truncated_miscounted_and_oversized_data() {
        let limits = BytesLimits {
            max_element: 4,
            max_request: 64,
        };
        let data = serialize(&[b"ab", b"xyz"]);
        assert_eq!(
            check(&data[..data.len() - 1], 2, limits),
            Err(BytesError::Truncated { index: 1 })
        );
        assert_eq!(
            check(&data[..2], 1, limits),
            Err(BytesError::Truncated { index: 0 })
        );
        assert_eq!(
            check(&data, 1, limits),
            Err(BytesError::Count {
                expected: 1,
                got: 2
            })
        );
        assert_eq!(
            check(&data, 3, limits),
            Err(BytesError::Count {
                expected: 3,
                got: 2
            })
        );
        let big = serialize(&[b"12345"]);
        assert!(matches!(
            check(&big, 1, limits),
            Err(BytesError::ElementTooLarge { len: 5, .. })
        ));
        let mut huge_len = u32::MAX.to_le_bytes().to_vec();
        huge_len.push(0);
        assert_eq!(
            check(&huge_len, 1, BytesLimits::default()),
            Err(BytesError::Truncated { index: 0 })
        );
        assert!(matches!(
            serialized_size([4; 20], limits),
            Err(BytesError::TooLarge { .. })
        ));
        assert_eq!(check(&[], 0, limits), Ok(()));
    }
}
