//! Triton's classification extension: an output asked for with the
//! `classification` parameter (a count `k`) is answered as its top `k`
//! classes instead of its values.
//!
//! Each batch entry of the output (the whole output for a model served
//! without batching) is ranked by value, highest first, compared in the
//! output's own datatype; the answer is a BYTES tensor of shape `[rows,
//! min(k, n)]` (`[min(k, n)]` without batching), `n` the entry's element
//! count, whose elements read `"<value>:<index>"`: the value as C++'s
//! `std::to_string` prints it (integers exactly, floats with six decimals)
//! and the element's index in its entry, then `":<label>"` where the output
//! has a label for that index ([`Codec::with_output_labels`]). Equal values rank by index, lower
//! first; NaN ranks last. Only integer, FP32 and FP64 outputs can be
//! classified (Triton's rule), and an entry of at most
//! [`MAX_CLASSIFIED_ELEMENTS`] elements.

use super::{Codec, Shape, V2Error};
use crate::DType;

/// The most elements one batch entry of a classified output may have
/// (Triton's bound: ranking costs memory and CPU per element).
pub const MAX_CLASSIFIED_ELEMENTS: usize = 1_000_000;

/// Whether outputs of `dtype` can be classified.
pub fn classifiable(dtype: DType) -> bool {
    !matches!(
        dtype,
        DType::Bool | DType::Bytes | DType::Float16 | DType::BFloat16
    )
}

/// The error a request gets for classifying output `name` of `dtype`, if
/// that datatype cannot be (checked before the model runs).
pub fn check_classifiable(name: &str, dtype: DType) -> Result<(), V2Error> {
    if classifiable(dtype) {
        return Ok(());
    }
    Err(V2Error::Invalid(format!(
        "output '{}': class result not available for output due to unsupported type '{}'",
        super::Clipped(name),
        dtype.v2_name()
    )))
}

impl Codec {
    /// Output `index` of a request's answer (`shape`, `data`: its rows as
    /// the answer would carry them) as its top `count` classes: the BYTES
    /// tensor's shape and wire bytes (each element's 4-byte little-endian
    /// length, then its bytes). A 400 for an entry too large to rank or a
    /// datatype that cannot be; a 500 for bytes that are not the shape's.
    pub fn classify(
        &self,
        index: usize,
        count: u32,
        shape: &[u64],
        data: &[u8],
    ) -> Result<(Shape, Vec<u8>), V2Error> {
        let spec = self.outputs.get(index).ok_or_else(|| {
            V2Error::Output(format!("output index {index} is not one of the model's"))
        })?;
        check_classifiable(&spec.name, spec.dtype)?;
        let (rows, entry_dims): (u64, &[u64]) = match shape.split_first() {
            Some((&rows, rest)) if self.batching => (rows, rest),
            _ => (1, shape),
        };
        let entry = entry_dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
        let itemsize = spec.dtype.itemsize();
        let whole = usize::try_from(rows)
            .ok()
            .zip(entry)
            .and_then(|(r, e)| r.checked_mul(e)?.checked_mul(itemsize));
        let (Some(entry), Some(whole)) = (entry, whole) else {
            return Err(V2Error::Output(format!(
                "output '{}': shape {shape:?} is too large",
                spec.name
            )));
        };
        if whole != data.len() {
            return Err(V2Error::Output(format!(
                "output '{}': shape {shape:?} needs {whole} bytes of {}, got {}",
                spec.name,
                spec.dtype.v2_name(),
                data.len()
            )));
        }
        if entry > MAX_CLASSIFIED_ELEMENTS {
            return Err(V2Error::Invalid(format!(
                "output '{}': classification output tensor too large ({entry} elements per \
                 batch entry, at most {MAX_CLASSIFIED_ELEMENTS})",
                spec.name
            )));
        }
        let kept = entry.min(count as usize);
        let labels = self.output_labels(index).unwrap_or_default();
        let mut out = Vec::new();
        if entry > 0 {
            for row in data.chunks_exact(entry * itemsize) {
                top_classes(spec.dtype, row, kept, labels, &mut out)
                    .map_err(|e| V2Error::Output(format!("output '{}': {e}", spec.name)))?;
            }
        }
        let mut classified = Shape::new();
        if self.batching && !shape.is_empty() {
            classified.push(rows);
        }
        classified.push(kept as u64);
        Ok((classified, out))
    }
}

/// Appends the `kept` highest elements of `row` (little-endian `dtype`
/// values), highest first, as BYTES elements `"<value>:<index>"`, with
/// `":<label>"` where `labels` has one for the index.
fn top_classes(
    dtype: DType,
    row: &[u8],
    kept: usize,
    labels: &[String],
    out: &mut Vec<u8>,
) -> Result<(), crate::bytes::BytesError> {
    macro_rules! ranked {
        ($t:ty, $n:literal, $write:expr) => {{
            let values: Vec<$t> = row
                .chunks_exact($n)
                .map(|b| <$t>::from_le_bytes(b.try_into().unwrap_or([0; $n])))
                .collect();
            for i in top_indices(&values, kept) {
                let mut text = format!("{}:{i}", $write(values[i]));
                if let Some(label) = labels.get(i) {
                    text.push(':');
                    text.push_str(label);
                }
                crate::bytes::push(out, text.as_bytes())?;
            }
        }};
    }
    let int = |v: i128| v.to_string();
    match dtype {
        DType::Int8 => ranked!(i8, 1, |v: i8| int(v.into())),
        DType::Int16 => ranked!(i16, 2, |v: i16| int(v.into())),
        DType::Int32 => ranked!(i32, 4, |v: i32| int(v.into())),
        DType::Int64 => ranked!(i64, 8, |v: i64| int(v.into())),
        DType::UInt8 => ranked!(u8, 1, |v: u8| int(v.into())),
        DType::UInt16 => ranked!(u16, 2, |v: u16| int(v.into())),
        DType::UInt32 => ranked!(u32, 4, |v: u32| int(v.into())),
        DType::UInt64 => ranked!(u64, 8, |v: u64| int(v.into())),
        DType::Float32 => ranked!(f32, 4, |v: f32| fixed6(v.into())),
        DType::Float64 => ranked!(f64, 8, fixed6),
        // Refused by `check_classifiable` before this is reached.
        DType::Bool | DType::Bytes | DType::Float16 | DType::BFloat16 => {}
    }
    Ok(())
}

/// The indices of the `kept` highest of `values`, highest first: equal
/// ones by index, incomparable ones (NaN) after every other.
fn top_indices<T: PartialOrd + Copy>(values: &[T], kept: usize) -> Vec<usize> {
    let rank = |a: &usize, b: &usize| {
        let (x, y) = (values[*a], values[*b]);
        // A NaN is not equal to itself: it goes after every number.
        let (x_nan, y_nan) = (x.partial_cmp(&x).is_none(), y.partial_cmp(&y).is_none());
        x_nan
            .cmp(&y_nan)
            .then_with(|| y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal))
            .then(a.cmp(b))
    };
    let mut order: Vec<usize> = (0..values.len()).collect();
    if kept == 0 {
        return Vec::new();
    }
    if kept < order.len() {
        order.select_nth_unstable_by(kept - 1, rank);
        order.truncate(kept);
    }
    order.sort_unstable_by(rank);
    order
}

/// `v` as C's `%f` (and so C++'s `std::to_string`) prints it: six
/// decimals, `inf`, `nan`.
fn fixed6(v: f64) -> String {
    if v.is_nan() {
        return if v.is_sign_negative() { "-nan" } else { "nan" }.to_owned();
    }
    format!("{v:.6}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v2::{Limits, OutputSpec};
    use proptest::prelude::*;

    fn codec(dtype: DType) -> Codec {
        let outputs = vec![OutputSpec {
            name: "y".into(),
            dtype,
        }];
        Codec::new("m", outputs, Limits::default())
    }

    fn strings(data: &[u8]) -> Vec<String> {
        crate::bytes::elements(data)
            .map(|e| String::from_utf8(e.to_vec()).unwrap())
            .collect()
    }

    fn f32s(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn each_batch_entry_is_answered_with_its_top_classes_as_triton_words_them() {
        // Triton's documented example: [1.1, 3.3, 0.5, 2.4], top 2.
        let data = f32s(&[1.1, 3.3, 0.5, 2.4, 9.0, -1.0, 4.0, 4.0]);
        let (shape, out) = codec(DType::Float32)
            .classify(0, 2, &[2, 4], &data)
            .unwrap();
        assert_eq!(&shape[..], &[2, 2]);
        assert_eq!(
            strings(&out),
            ["3.300000:1", "2.400000:3", "9.000000:0", "4.000000:2"]
        );
    }

    #[test]
    fn a_count_past_the_entry_keeps_every_element_and_the_shape_says_so() {
        let data: Vec<u8> = [7i64, -3, 12]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let (shape, out) = codec(DType::Int64).classify(0, 10, &[1, 3], &data).unwrap();
        assert_eq!(&shape[..], &[1, 3]);
        assert_eq!(strings(&out), ["12:2", "7:0", "-3:1"]);
    }

    #[test]
    fn without_batching_the_whole_output_is_one_entry() {
        let data = f32s(&[0.25, 0.5, 0.125, 0.0]);
        let (shape, out) = codec(DType::Float32)
            .without_batching()
            .classify(0, 1, &[2, 2], &data)
            .unwrap();
        assert_eq!(&shape[..], &[1]);
        assert_eq!(strings(&out), ["0.500000:1"]);
    }

    #[test]
    fn a_class_with_a_label_is_answered_with_it() {
        let labels = vec![Some(vec!["cat".to_owned(), "dog".to_owned()])];
        let data = f32s(&[0.25, 0.5, 0.125]);
        let (_, out) = codec(DType::Float32)
            .with_output_labels(labels)
            .classify(0, 3, &[1, 3], &data)
            .unwrap();
        // Class 2 has no label: Triton's "<value>:<index>".
        assert_eq!(
            strings(&out),
            ["0.500000:1:dog", "0.250000:0:cat", "0.125000:2"]
        );
    }

    #[test]
    fn nan_ranks_last_and_prints_as_c_prints_it() {
        let data = f32s(&[f32::NAN, f32::NEG_INFINITY, 1.0, f32::INFINITY]);
        let (_, out) = codec(DType::Float32)
            .classify(0, 4, &[1, 4], &data)
            .unwrap();
        assert_eq!(strings(&out), ["inf:3", "1.000000:2", "-inf:1", "nan:0"]);
    }

    #[test]
    fn unsupported_datatypes_and_entries_too_large_are_the_clients_400() {
        for dtype in [DType::Bool, DType::Bytes, DType::Float16, DType::BFloat16] {
            let err = codec(dtype).classify(0, 1, &[1, 2], &[0; 4]).unwrap_err();
            assert_eq!(err.status(), 400, "{dtype:?}");
            assert!(err.to_string().contains("unsupported type"), "{err}");
        }
        let n = MAX_CLASSIFIED_ELEMENTS + 1;
        let data = vec![0u8; n];
        let err = codec(DType::UInt8)
            .classify(0, 1, &[1, n as u64], &data)
            .unwrap_err();
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("too large"), "{err}");
    }

    #[test]
    fn bytes_that_are_not_the_shape_s_are_the_servers_500() {
        let err = codec(DType::Float32)
            .classify(0, 1, &[2, 4], &[0; 12])
            .unwrap_err();
        assert_eq!(err.status(), 500);
        let err = codec(DType::Float32)
            .classify(0, 1, &[u64::MAX, u64::MAX], &[])
            .unwrap_err();
        assert_eq!(err.status(), 500);
    }

    proptest! {
        /// The top classes are a full sort's first `k` (by value, then index).
        #[test]
        fn the_top_classes_are_a_full_sorts_first(
            values in prop::collection::vec(-50i32..50, 1..200),
            k in 1u32..250,
        ) {
            let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let (shape, out) = codec(DType::Int32)
                .classify(0, k, &[1, values.len() as u64], &data)
                .unwrap();
            let mut sorted: Vec<(i32, usize)> =
                values.iter().enumerate().map(|(i, &v)| (-v, i)).collect();
            sorted.sort();
            let expected: Vec<String> = sorted
                .iter()
                .take(k as usize)
                .map(|&(v, i)| format!("{}:{i}", -v))
                .collect();
            prop_assert_eq!(shape[1], expected.len() as u64);
            prop_assert_eq!(strings(&out), expected);
        }
    }
}
