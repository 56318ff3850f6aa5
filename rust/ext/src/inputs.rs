//! Turning the Python objects a caller passes into byte views the core can
//! collate: torch CPU tensors and C-contiguous buffer-protocol objects on the
//! fast path; anything else (DLPack, strided buffers) through a Python
//! `coerce` hook that returns a contiguous torch tensor or raises.

use ferrobatch_core::{DType, InputBytes};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple, PyType};

use crate::errors::invalid_input;

/// One declared model input.
pub(crate) struct InputSpec {
    pub name: String,
    /// `name` as an interned Python string, for dict lookups without allocating.
    pub key: Py<PyString>,
    pub dtype: DType,
    pub torch_dtype: Py<PyAny>,
    pub shape: Vec<usize>,
    pub row_nbytes: usize,
}

impl InputSpec {
    fn describe_shape(&self, batched: bool) -> String {
        let dims: Vec<String> = self.shape.iter().map(usize::to_string).collect();
        match (batched, dims.len()) {
            (true, 0) => "(n,)".into(),
            (true, _) => format!("(n, {})", dims.join(", ")),
            (false, 1) => format!("({},)", dims[0]),
            (false, _) => format!("({})", dims.join(", ")),
        }
    }

    /// Rows carried by a value of shape `actual`, or an error naming both shapes.
    fn rows_for_shape(&self, py: Python<'_>, actual: &[usize], batched: bool) -> PyResult<usize> {
        let (rows, per_row) = if batched {
            match actual.split_first() {
                Some((&n, rest)) => (n, rest),
                None => (0, actual),
            }
        } else {
            (1, actual)
        };
        if per_row == self.shape.as_slice() && (!batched || !actual.is_empty()) {
            return Ok(rows);
        }
        let got = match actual.len() {
            1 => format!("({},)", actual[0]),
            _ => format!(
                "({})",
                actual
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        Err(invalid_input(
            py,
            format!(
                "input '{}': expected shape {}, got {got}",
                self.name,
                self.describe_shape(batched)
            ),
        ))
    }
}

/// What keeps a request's input bytes alive until it is resolved.
pub(crate) enum Keep {
    Object(#[allow(dead_code)] Py<PyAny>),
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
}

pub(crate) struct Converted {
    pub bytes: InputBytes,
    pub rows: usize,
    pub keep: Keep,
}

pub(crate) struct Converter {
    pub specs: Vec<InputSpec>,
    pub tensor_type: Py<PyType>,
    /// `coerce(value, input_index, batched) -> torch.Tensor` (contiguous, CPU).
    pub coerce: Py<PyAny>,
}

impl Converter {
    pub fn convert(
        &self,
        py: Python<'_>,
        index: usize,
        value: &Bound<'_, PyAny>,
        batched: bool,
    ) -> PyResult<Converted> {
        let spec = &self.specs[index];
        if value.is_instance(self.tensor_type.bind(py))? {
            return self.convert_tensor(py, spec, value.clone(), batched);
        }
        if let Ok(buffer) = PyUntypedBuffer::get(value) {
            if buffer.is_c_contiguous() {
                return from_buffer(py, spec, buffer, batched);
            }
        }
        let tensor = self.coerce.bind(py).call1((value, index, batched))?;
        self.convert_tensor(py, spec, tensor, batched)
    }

    fn convert_tensor(
        &self,
        py: Python<'_>,
        spec: &InputSpec,
        tensor: Bound<'_, PyAny>,
        batched: bool,
    ) -> PyResult<Converted> {
        let dtype = tensor.getattr(intern!(py, "dtype"))?;
        if !dtype.is(spec.torch_dtype.bind(py)) {
            return Err(invalid_input(
                py,
                format!(
                    "input '{}': expected dtype {}, got {dtype}",
                    spec.name,
                    spec.dtype.name()
                ),
            ));
        }
        if !tensor.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            let device = tensor.getattr(intern!(py, "device"))?;
            return Err(invalid_input(
                py,
                format!(
                    "input '{}': tensor is on device '{device}'; inputs must be in host (CPU) memory",
                    spec.name
                ),
            ));
        }
        let shape = tensor.getattr(intern!(py, "shape"))?;
        let shape = shape.cast::<PyTuple>()?;
        let dims = shape
            .iter()
            .map(|d| d.extract::<usize>())
            .collect::<PyResult<Vec<_>>>()?;
        let rows = spec.rows_for_shape(py, &dims, batched)?;
        let tensor = if tensor
            .call_method0(intern!(py, "is_contiguous"))?
            .is_truthy()?
        {
            tensor
        } else {
            tensor.call_method0(intern!(py, "contiguous"))?
        };
        let ptr: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
        // SAFETY: `tensor` is contiguous, in host memory and holds `rows` rows of
        // `row_nbytes` bytes at `ptr`; the returned `Keep` owns a reference to it,
        // and the ticket holding that `Keep` lives until the request is resolved.
        let bytes = unsafe { InputBytes::new(ptr as *const u8, rows * spec.row_nbytes) };
        Ok(Converted {
            bytes,
            rows,
            keep: Keep::Object(tensor.unbind()),
        })
    }
}

fn from_buffer(
    py: Python<'_>,
    spec: &InputSpec,
    buffer: PyUntypedBuffer,
    batched: bool,
) -> PyResult<Converted> {
    let format = buffer.format().to_string_lossy();
    if !spec.dtype.matches_buffer_format(&format) {
        let got = DType::ALL
            .iter()
            .find(|d| d.matches_buffer_format(&format))
            .map_or_else(
                || format!("buffer format '{format}'"),
                |d| d.name().to_string(),
            );
        return Err(invalid_input(
            py,
            format!(
                "input '{}': expected dtype {}, got {got}",
                spec.name,
                spec.dtype.name()
            ),
        ));
    }
    let rows = spec.rows_for_shape(py, buffer.shape(), batched)?;
    // SAFETY: the buffer is C-contiguous with `rows` rows of `row_nbytes` bytes
    // (its format's item size equals the dtype's); the exporter keeps that
    // memory valid and unresized until the buffer is released, which happens
    // when the returned `Keep` drops, after the request is resolved.
    let bytes = unsafe { InputBytes::new(buffer.buf_ptr() as *const u8, rows * spec.row_nbytes) };
    Ok(Converted {
        bytes,
        rows,
        keep: Keep::Buffer(buffer),
    })
}
