//! A model input's declared name, dtype and per-row shape, and the checks
//! every front-end applies to what a caller sends for it (in process, the
//! Python front-ends, the native one): the same rules and the same messages.
//!
//! Rows are counted and bounded by `max_rows` from the shape alone, and the
//! byte count is checked arithmetic, before anything is allocated.

use std::fmt;

use smallvec::{smallvec, SmallVec};

use crate::request::MAX_VARIABLE_DIMS;
use crate::v2::Clipped;
use crate::{DType, Layout};

/// A value's lengths along its variable dimensions ([`Measured::extents`]):
/// inline, as a model's inputs have at most [`MAX_VARIABLE_DIMS`] of them
/// (a spec with more, refused by the batcher, spills to the heap).
pub type Extents = SmallVec<[usize; MAX_VARIABLE_DIMS]>;

/// One per tensor of a request (its inputs, the outputs it asks for), inline
/// for the few tensors models take.
pub type PerTensor<T> = SmallVec<[T; 4]>;

/// One declared model input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputSpec {
    pub name: String,
    pub dtype: DType,
    /// The shape of one row (without the batch dimension).
    pub shape: Vec<usize>,
    /// Bytes of one row: the shape's elements times the dtype's size.
    pub row_nbytes: usize,
    /// A request may leave it out: the model gets zeros (an empty row for
    /// a variable-length input) and is told which requests lacked it.
    pub optional: bool,
}

/// Most inputs a model with optional ones may have: which ones a request
/// left out is one bit each ([`Matched::absent`]).
pub const MAX_OPTIONAL_INPUTS: usize = 64;

/// A value refused for an input; its message names the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError(pub String);

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SpecError {}

/// `(3,)`, `(2, 3)`, `()`: shapes as Python prints tuples.
pub fn describe_dims(dims: &[usize]) -> String {
    match dims {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            dims.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl InputSpec {
    /// A spec of rows of `shape` in `dtype`; `None` when a row's byte size
    /// overflows.
    pub fn new(name: &str, dtype: DType, shape: Vec<usize>) -> Option<InputSpec> {
        let row_nbytes = shape
            .iter()
            .try_fold(dtype.itemsize(), |n, &d| n.checked_mul(d))?;
        Some(InputSpec {
            name: name.to_owned(),
            dtype,
            shape,
            row_nbytes,
            optional: false,
        })
    }

    /// This spec, optional (see [`InputSpec::optional`]).
    pub fn optional(mut self, optional: bool) -> InputSpec {
        self.optional = optional;
        self
    }

    /// What stands for this input in a request of `rows` rows that left it
    /// out, collated as `layout`: its bytes (zeros: zero values, or BYTES
    /// elements of length zero) and its lengths along the variable
    /// dimensions (all zero: empty rows). `None` when the bytes would
    /// overflow (`rows` is bounded by `max_batch_size` before this).
    pub fn absent(&self, layout: &Layout, rows: usize) -> Option<(Vec<u8>, Extents)> {
        Some(match layout {
            Layout::Fixed => (vec![0; rows.checked_mul(self.row_nbytes)?], smallvec![0]),
            // Each element a 4-byte length of zero.
            Layout::Bytes { elements_per_row } => {
                let elements = rows.checked_mul(*elements_per_row)?;
                (vec![0; elements.checked_mul(4)?], smallvec![0])
            }
            Layout::Padded(p) => (
                Vec::new(),
                smallvec![0; p.dims.iter().filter(|d| d.is_none()).count()],
            ),
            Layout::Ragged(_) | Layout::RaggedBytes(_) => (Vec::new(), smallvec![0]),
        })
    }

    /// An error about this input: `input 'name': what`.
    pub fn error(&self, what: impl fmt::Display) -> SpecError {
        SpecError(format!("input '{}': {what}", self.name))
    }

    /// The shape a value must have: `(3,)` for one sample, `(n, 3)` for a
    /// batch of rows.
    pub fn describe_shape(&self, batched: bool) -> String {
        if !batched {
            return describe_dims(&self.shape);
        }
        let dims: Vec<String> = self.shape.iter().map(usize::to_string).collect();
        match dims.len() {
            0 => "(n,)".into(),
            _ => format!("(n, {})", dims.join(", ")),
        }
    }

    /// Rows carried by a value of shape `actual` (with a leading batch
    /// dimension when `batched`, else one row) and their size in bytes, or
    /// an error naming both shapes. Refuses more than `max_rows` rows (and a
    /// batch of none), so the byte count is bounded before anything is
    /// allocated.
    pub fn rows_for_shape(
        &self,
        actual: &[usize],
        batched: bool,
        max_rows: usize,
    ) -> Result<(usize, usize), SpecError> {
        let (rows, per_row) = if batched {
            match actual.split_first() {
                Some((&n, rest)) => (n, rest),
                None => (0, actual),
            }
        } else {
            (1, actual)
        };
        if per_row != self.shape.as_slice() || (batched && actual.is_empty()) {
            return Err(self.error(format_args!(
                "expected shape {}, got {}",
                self.describe_shape(batched),
                describe_dims(actual)
            )));
        }
        if rows > max_rows {
            return Err(self.error(format_args!(
                "a request of {rows} rows exceeds max_batch_size ({max_rows})"
            )));
        }
        let nbytes = rows
            .checked_mul(self.row_nbytes)
            .ok_or_else(|| self.error("the input is too large"))?;
        Ok((rows, nbytes))
    }

    /// For a variable-length input (`shape` is what follows its first,
    /// variable, dimension): the rows of a value of shape `actual` and their
    /// length along that dimension, or an error naming both shapes. Refuses
    /// more than `max_rows` rows and more than `max_elements` elements, so
    /// the byte count is bounded before anything is allocated.
    pub fn ragged_rows_for_shape(
        &self,
        actual: &[usize],
        batched: bool,
        max_rows: usize,
        max_elements: usize,
    ) -> Result<(usize, usize), SpecError> {
        let (rows, per_row) = match (batched, actual.split_first()) {
            (true, Some((&n, rest))) => (n, rest),
            (true, None) => (0, actual),
            (false, _) => (1, actual),
        };
        let expected = |batched: bool| {
            let inner: Vec<String> = self.shape.iter().map(usize::to_string).collect();
            let lead = if batched { "n, L" } else { "L" };
            match inner.len() {
                0 if !batched => "(L,)".to_string(),
                0 => format!("({lead})"),
                _ => format!("({lead}, {})", inner.join(", ")),
            }
        };
        let Some((&length, inner)) = per_row.split_first() else {
            return Err(self.error(format_args!(
                "expected shape {} (L: any length), got {}",
                expected(batched),
                describe_dims(actual)
            )));
        };
        if inner != self.shape.as_slice() || (batched && actual.is_empty()) {
            return Err(self.error(format_args!(
                "expected shape {} (L: any length), got {}",
                expected(batched),
                describe_dims(actual)
            )));
        }
        if rows > max_rows {
            return Err(self.error(format_args!(
                "a request of {rows} rows exceeds max_batch_size ({max_rows})"
            )));
        }
        let unit: usize = self.shape.iter().product();
        let elements = rows
            .checked_mul(length)
            .and_then(|n| n.checked_mul(unit.max(1)));
        if !elements.is_some_and(|e| e <= max_elements) {
            return Err(self.error(format_args!(
                "a request of {rows} rows of length {length} exceeds max_batch_elements ({max_elements})"
            )));
        }
        Ok((rows, length))
    }

    /// For an input padded along variable dimensions anywhere in its row
    /// shape (`dims`, `None` for a variable one): the rows of a value of
    /// shape `actual`, its lengths along the variable dimensions and its
    /// elements, or an error naming both shapes. Refuses more than
    /// `max_rows` rows and more than `max_elements` elements, so the byte
    /// count is bounded before anything is allocated.
    pub fn padded_rows_for_shape(
        &self,
        dims: &[Option<usize>],
        actual: &[usize],
        batched: bool,
        max_rows: usize,
        max_elements: usize,
    ) -> Result<(usize, Extents, usize), SpecError> {
        let (rows, per_row) = match (batched, actual.split_first()) {
            (true, Some((&n, rest))) => (n, rest),
            (true, None) => (0, actual),
            (false, _) => (1, actual),
        };
        let k = dims.iter().filter(|d| d.is_none()).count();
        let mut variable = 0;
        let mut names: Vec<String> = Vec::with_capacity(dims.len() + 1);
        if batched {
            names.push("n".into());
        }
        for d in dims {
            names.push(match d {
                Some(n) => n.to_string(),
                None if k == 1 => "L".into(),
                None => {
                    variable += 1;
                    format!("L{variable}")
                }
            });
        }
        let expected = match names.as_slice() {
            [one] => format!("({one},)"),
            _ => format!("({})", names.join(", ")),
        };
        let fits = per_row.len() == dims.len()
            && per_row
                .iter()
                .zip(dims)
                .all(|(&a, d)| d.map_or(true, |d| d == a))
            && !(batched && actual.is_empty());
        if !fits {
            return Err(self.error(format_args!(
                "expected shape {expected} (L: any length), got {}",
                describe_dims(actual)
            )));
        }
        if rows > max_rows {
            return Err(self.error(format_args!(
                "a request of {rows} rows exceeds max_batch_size ({max_rows})"
            )));
        }
        let extents: Extents = per_row
            .iter()
            .zip(dims)
            .filter(|(_, d)| d.is_none())
            .map(|(&a, _)| a)
            .collect();
        // Empty dimensions count as 1 against the budget (as the batcher
        // counts them), so every product of the dimensions is bounded.
        let bound = per_row
            .iter()
            .try_fold(rows, |n, &d| n.checked_mul(d.max(1)))
            .filter(|&e| e <= max_elements);
        let elements = bound.map(|_| rows * per_row.iter().product::<usize>());
        let Some(elements) = elements else {
            return Err(self.error(format_args!(
                "a request of {rows} rows of shape {} exceeds max_batch_elements ({max_elements})",
                describe_dims(per_row)
            )));
        };
        Ok((rows, extents, elements))
    }

    /// The error for a value of dtype `got`.
    pub fn dtype_error(&self, got: impl fmt::Display) -> SpecError {
        self.error(format_args!(
            "expected dtype {}, got {got}",
            self.dtype.name()
        ))
    }

    /// Measures a value of shape `actual` for this input collated as
    /// `layout`: its rows, its byte count and its lengths along the
    /// variable dimensions, or an error naming both shapes. Every way in
    /// measures its values here, so the rules and messages are the same
    /// for all; rows are bounded by `max_rows` and a variable-length
    /// input's elements by `max_elements` (`max_batch_elements`) before
    /// anything is allocated.
    pub fn measure(
        &self,
        layout: &Layout,
        actual: &[usize],
        batched: bool,
        max_rows: usize,
        max_elements: usize,
    ) -> Result<Measured, SpecError> {
        let (rows, nbytes, extents) = match layout {
            Layout::Padded(p) => {
                let (rows, extents, elements) =
                    self.padded_rows_for_shape(&p.dims, actual, batched, max_rows, max_elements)?;
                (rows, elements * p.itemsize, extents)
            }
            Layout::Ragged(r) => {
                let (rows, extent) =
                    self.ragged_rows_for_shape(actual, batched, max_rows, max_elements)?;
                // Bounded: at most `max_elements` elements of a position's bytes.
                (rows, rows * extent * r.unit_nbytes, smallvec![extent])
            }
            // The byte count of BYTES is checked as they are serialized.
            Layout::RaggedBytes(_) => {
                let (rows, extent) =
                    self.ragged_rows_for_shape(actual, batched, max_rows, max_elements)?;
                (rows, 0, smallvec![extent])
            }
            Layout::Fixed | Layout::Bytes { .. } => {
                let (rows, nbytes) = self.rows_for_shape(actual, batched, max_rows)?;
                (rows, nbytes, smallvec![0])
            }
        };
        let elements = match layout {
            Layout::Bytes { elements_per_row } => rows * elements_per_row,
            // Bounded by `max_elements` above.
            Layout::RaggedBytes(r) => rows * extents[0] * r.unit_elements,
            _ => 0,
        };
        Ok(Measured {
            rows,
            nbytes,
            extents,
            elements,
        })
    }
}

/// What a value's shape says, measured by [`InputSpec::measure`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    pub rows: usize,
    /// Bytes of its data (0 for BYTES, whose size is their elements').
    pub nbytes: usize,
    /// Its lengths along the variable dimensions: one for a variable first
    /// dimension, one per variable dimension of a padded input, `[0]` for
    /// a fixed shape.
    pub extents: Extents,
    /// Elements of a BYTES input (what its serialized data must hold).
    pub elements: usize,
}

/// A request's tensors, matched to the model's inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// Rows the request carries (every input agrees).
    pub rows: usize,
    /// For each spec, in the model's order: the index of its tensor among
    /// those sent; `None` for an optional input the request left out.
    pub order: PerTensor<Option<usize>>,
    /// For each spec, in the model's order: its tensor's lengths along its
    /// variable dimensions ([`Measured::extents`]).
    pub extents: PerTensor<Extents>,
    /// Bit `i` set: the request left out optional input `i`.
    pub absent: u64,
}

/// A model's inputs as a front-end checks requests against them: each
/// one's spec and collation, and the bounds of one request.
#[derive(Debug, Clone, Copy)]
pub struct InputRules<'a> {
    pub specs: &'a [InputSpec],
    /// One per spec: how its rows are collated (fixed, variable-length, BYTES).
    pub layouts: &'a [Layout],
    /// `max_batch_size`.
    pub max_rows: usize,
    /// `max_batch_elements` (0 when the model has no variable-length input).
    pub max_elements: usize,
    /// Tensors carry a leading batch dimension; false: one sample each,
    /// shaped as declared (a model served without batching).
    pub batched: bool,
}

impl InputRules<'_> {
    /// The error for a tensor `name` that is none of the inputs.
    fn unexpected(&self, name: &str) -> SpecError {
        let known: Vec<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
        SpecError(format!(
            "unexpected input '{}'; the model takes: {}",
            Clipped(name),
            known.join(", ")
        ))
    }

    fn measure(&self, index: usize, dtype: DType, shape: &[usize]) -> Result<Measured, SpecError> {
        let spec = &self.specs[index];
        if dtype != spec.dtype {
            return Err(spec.dtype_error(dtype.name()));
        }
        let layout = self.layouts.get(index).unwrap_or(&Layout::Fixed);
        spec.measure(
            layout,
            shape,
            self.batched,
            self.max_rows,
            self.max_elements,
        )
    }

    /// Checks one tensor of a batched request as [`InputRules::match_tensors`]
    /// does (its name among the inputs, its dtype, its shape, its rows and
    /// elements within bounds), from its header alone: a front-end refuses
    /// it before decoding its data.
    pub fn check(&self, name: &str, dtype: DType, shape: &[usize]) -> Result<(), SpecError> {
        let Some(index) = self.specs.iter().position(|s| s.name == name) else {
            return Err(self.unexpected(name));
        };
        self.measure(index, dtype, shape).map(|_| ())
    }

    /// Matches the tensors of a batched request (`(name, dtype, shape)` each,
    /// the shape with its leading batch dimension) to the inputs: every
    /// input once, nothing else, dtypes and shapes as declared, the same
    /// number of rows in each, at least one and at most `max_rows`.
    pub fn match_tensors(&self, tensors: &[(&str, DType, &[usize])]) -> Result<Matched, SpecError> {
        if let Some((name, ..)) = tensors
            .iter()
            .find(|(name, ..)| !self.specs.iter().any(|s| s.name == *name))
        {
            return Err(self.unexpected(name));
        }
        let mut order = PerTensor::with_capacity(self.specs.len());
        let mut extents = PerTensor::with_capacity(self.specs.len());
        let mut absent = 0u64;
        let mut rows: Option<usize> = None;
        for (i, spec) in self.specs.iter().enumerate() {
            let mut found = tensors.iter().enumerate().filter(|(_, t)| t.0 == spec.name);
            let Some((index, &(_, dtype, shape))) = found.next() else {
                if !spec.optional || i >= MAX_OPTIONAL_INPUTS {
                    return Err(spec.error("missing"));
                }
                let layout = self.layouts.get(i).unwrap_or(&Layout::Fixed);
                absent |= 1 << i;
                order.push(None);
                // Zero lengths: the rows the request does carry come from the others.
                extents.push(spec.absent(layout, 0).map(|(_, e)| e).unwrap_or_default());
                continue;
            };
            if found.next().is_some() {
                return Err(spec.error("given more than once"));
            }
            let measured = self.measure(i, dtype, shape)?;
            let n = measured.rows;
            if n == 0 {
                return Err(spec.error("a request must carry at least one row, got none"));
            }
            match rows {
                Some(r) if r != n => {
                    return Err(spec.error(format_args!("{n} rows, but the other inputs have {r}")))
                }
                _ => rows = Some(n),
            }
            order.push(Some(index));
            extents.push(measured.extents);
        }
        let rows = match rows {
            Some(rows) => rows,
            None if absent == 0 => 0, // a model of no inputs (refused as a request of no rows)
            None => {
                return Err(SpecError(
                    "a request must carry at least one of the model's inputs, got none".into(),
                ))
            }
        };
        Ok(Matched {
            rows,
            order,
            extents,
            absent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize]) -> InputSpec {
        InputSpec::new(name, DType::Float32, shape.to_vec()).unwrap()
    }

    const FIXED: [Layout; 2] = [Layout::Fixed, Layout::Fixed];

    fn rules(specs: &[InputSpec]) -> InputRules<'_> {
        InputRules {
            specs,
            layouts: &FIXED[..specs.len()],
            max_rows: 8,
            max_elements: 0,
            batched: true,
        }
    }

    #[test]
    fn an_optional_input_may_be_left_out_and_is_named_in_absent() {
        let specs = [spec("a", &[3]), spec("w", &[]).optional(true)];
        let m = rules(&specs)
            .match_tensors(&[("a", DType::Float32, &[2, 3])])
            .unwrap();
        assert_eq!(
            (m.rows, m.order.clone(), m.absent),
            (2, smallvec![Some(0), None], 0b10)
        );
        let (zeros, extents) = specs[1].absent(&Layout::Fixed, m.rows).unwrap();
        assert_eq!((zeros, extents), (vec![0u8; 8], smallvec![0]));
        let err = |t: &[(&str, DType, &[usize])]| rules(&specs).match_tensors(t).unwrap_err().0;
        assert_eq!(err(&[("w", DType::Float32, &[2])]), "input 'a': missing");
        let only_optional = [spec("w", &[]).optional(true)];
        let none = rules(&only_optional).match_tensors(&[]).unwrap_err().0;
        assert!(
            none.contains("at least one of the model's inputs"),
            "{none}"
        );
    }

    #[test]
    fn matches_inputs_in_the_models_order_and_counts_rows() {
        let specs = [spec("a", &[3]), spec("b", &[])];
        let m = rules(&specs)
            .match_tensors(&[("b", DType::Float32, &[2]), ("a", DType::Float32, &[2, 3])])
            .unwrap();
        assert_eq!(
            m,
            Matched {
                rows: 2,
                order: smallvec![Some(1), Some(0)],
                extents: smallvec![smallvec![0], smallvec![0]],
                absent: 0,
            }
        );
    }

    #[test]
    fn padded_shapes_give_their_lengths_or_say_what_was_expected() {
        let s = spec("g", &[]);
        let dims = [Some(3), None, None];
        let ok = s.padded_rows_for_shape(&dims, &[2, 3, 4, 5], true, 8, 1000);
        assert_eq!(ok, Ok((2, smallvec![4, 5], 120)));
        let one = s.padded_rows_for_shape(&dims, &[3, 0, 7], false, 8, 1000);
        assert_eq!(one, Ok((1, smallvec![0, 7], 0)));
        // An empty dimension counts as 1: no huge box of zero elements.
        let huge = s.padded_rows_for_shape(&dims, &[3, 0, usize::MAX], false, 8, 1000);
        assert!(huge.is_err());
        let err = |actual: &[usize], max: usize| {
            s.padded_rows_for_shape(&dims, actual, true, 8, max)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(&[2, 4, 4, 5], 1000),
            "input 'g': expected shape (n, 3, L1, L2) (L: any length), got (2, 4, 4, 5)"
        );
        assert!(err(&[2, 3, 4], 1000).contains("expected shape"));
        assert!(err(&[9, 3, 1, 1], 1000).contains("exceeds max_batch_size (8)"));
        assert_eq!(
            err(&[2, 3, 4, 5], 119),
            "input 'g': a request of 2 rows of shape (3, 4, 5) exceeds max_batch_elements (119)"
        );
        assert!(err(&[2, 3, usize::MAX, 2], usize::MAX).contains("max_batch_elements"));
    }

    #[test]
    fn refuses_what_the_model_does_not_take_with_the_inputs_name() {
        let specs = [spec("a", &[3]), spec("b", &[])];
        let err = |tensors: &[(&str, DType, &[usize])]| {
            rules(&specs)
                .match_tensors(tensors)
                .unwrap_err()
                .to_string()
        };
        let a: &[usize] = &[1, 3];
        let b: &[usize] = &[1];
        assert_eq!(err(&[("a", DType::Float32, a)]), "input 'b': missing");
        assert!(err(&[
            ("a", DType::Float32, a),
            ("b", DType::Float32, b),
            ("c", DType::Float32, b)
        ])
        .starts_with("unexpected input 'c'"));
        assert_eq!(
            err(&[("a", DType::Int64, a), ("b", DType::Float32, b)]),
            "input 'a': expected dtype float32, got int64"
        );
        assert_eq!(
            err(&[("a", DType::Float32, &[1, 4]), ("b", DType::Float32, b)]),
            "input 'a': expected shape (n, 3), got (1, 4)"
        );
        assert_eq!(
            err(&[("a", DType::Float32, &[9, 3]), ("b", DType::Float32, &[9])]),
            "input 'a': a request of 9 rows exceeds max_batch_size (8)"
        );
        assert_eq!(
            err(&[("a", DType::Float32, &[2, 3]), ("b", DType::Float32, b)]),
            "input 'b': 1 rows, but the other inputs have 2"
        );
        assert_eq!(
            err(&[("a", DType::Float32, &[0, 3]), ("b", DType::Float32, &[0])]),
            "input 'a': a request must carry at least one row, got none"
        );
    }
}
