//! A model input's declared name, dtype and per-row shape, and the checks
//! every front-end applies to what a caller sends for it (in process, the
//! Python front-ends, the native one): the same rules and the same messages.
//!
//! Rows are counted and bounded by `max_rows` from the shape alone, and the
//! byte count is checked arithmetic, before anything is allocated.

use std::fmt;

use crate::v2::Clipped;
use crate::DType;

/// One declared model input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputSpec {
    pub name: String,
    pub dtype: DType,
    /// The shape of one row (without the batch dimension).
    pub shape: Vec<usize>,
    /// Bytes of one row: the shape's elements times the dtype's size.
    pub row_nbytes: usize,
}

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
    ) -> Result<(usize, Vec<usize>, usize), SpecError> {
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
        let extents: Vec<usize> = per_row
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
}

/// A request's tensors, matched to the model's inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// Rows the request carries (every input agrees).
    pub rows: usize,
    /// For each spec, in the model's order: the index of its tensor among
    /// those sent.
    pub order: Vec<usize>,
}

/// The error for a tensor `name` that is none of `specs`.
fn unexpected(specs: &[InputSpec], name: &str) -> SpecError {
    let known: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    SpecError(format!(
        "unexpected input '{}'; the model takes: {}",
        Clipped(name),
        known.join(", ")
    ))
}

/// Checks one tensor of a batched request against `specs`, as
/// [`match_inputs`] does (its name among them, its dtype, its row shape and
/// rows at most `max_rows`), from its header alone: a front-end refuses it
/// before decoding its data.
pub fn check_input(
    specs: &[InputSpec],
    name: &str,
    dtype: DType,
    shape: &[usize],
    max_rows: usize,
) -> Result<(), SpecError> {
    let Some(spec) = specs.iter().find(|s| s.name == name) else {
        return Err(unexpected(specs, name));
    };
    if dtype != spec.dtype {
        return Err(spec.dtype_error(dtype.name()));
    }
    spec.rows_for_shape(shape, true, max_rows).map(|_| ())
}

/// Matches the tensors of a batched request (`(name, dtype, shape)` each,
/// the shape with its leading batch dimension) to `specs`: every input
/// once, nothing else, dtypes and row shapes as declared, the same number
/// of rows in each, at most `max_rows`.
pub fn match_inputs(
    specs: &[InputSpec],
    tensors: &[(&str, DType, &[usize])],
    max_rows: usize,
) -> Result<Matched, SpecError> {
    if let Some((name, ..)) = tensors
        .iter()
        .find(|(name, ..)| !specs.iter().any(|s| s.name == *name))
    {
        return Err(unexpected(specs, name));
    }
    let mut order = Vec::with_capacity(specs.len());
    let mut rows: Option<usize> = None;
    for spec in specs {
        let mut found = tensors.iter().enumerate().filter(|(_, t)| t.0 == spec.name);
        let Some((index, &(_, dtype, shape))) = found.next() else {
            return Err(spec.error("missing"));
        };
        if found.next().is_some() {
            return Err(spec.error("given more than once"));
        }
        if dtype != spec.dtype {
            return Err(spec.dtype_error(dtype.name()));
        }
        let (n, _) = spec.rows_for_shape(shape, true, max_rows)?;
        if n == 0 {
            return Err(spec.error("a request must carry at least one row, got none"));
        }
        match rows {
            Some(r) if r != n => {
                return Err(spec.error(format_args!("{n} rows, but the other inputs have {r}")))
            }
            _ => rows = Some(n),
        }
        order.push(index);
    }
    Ok(Matched {
        rows: rows.unwrap_or(0),
        order,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize]) -> InputSpec {
        InputSpec::new(name, DType::Float32, shape.to_vec()).unwrap()
    }

    #[test]
    fn matches_inputs_in_the_models_order_and_counts_rows() {
        let specs = [spec("a", &[3]), spec("b", &[])];
        let m = match_inputs(
            &specs,
            &[("b", DType::Float32, &[2]), ("a", DType::Float32, &[2, 3])],
            8,
        )
        .unwrap();
        assert_eq!(
            m,
            Matched {
                rows: 2,
                order: vec![1, 0]
            }
        );
    }

    #[test]
    fn padded_shapes_give_their_lengths_or_say_what_was_expected() {
        let s = spec("g", &[]);
        let dims = [Some(3), None, None];
        let ok = s.padded_rows_for_shape(&dims, &[2, 3, 4, 5], true, 8, 1000);
        assert_eq!(ok, Ok((2, vec![4, 5], 120)));
        let one = s.padded_rows_for_shape(&dims, &[3, 0, 7], false, 8, 1000);
        assert_eq!(one, Ok((1, vec![0, 7], 0)));
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
            match_inputs(&specs, tensors, 8).unwrap_err().to_string()
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
