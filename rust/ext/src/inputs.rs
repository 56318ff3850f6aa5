//! Turning the Python objects a caller passes into the bytes a request
//! carries.
//!
//! Torch CPU tensors and buffer-protocol objects (numpy arrays, `array`,
//! `memoryview`...) are read here, in any layout: contiguous, transposed,
//! sliced, negative or zero strides. Anything else goes through a Python
//! `coerce` hook (DLPack producers) that returns a tensor or a buffer-protocol
//! object, read the same way.
//!
//! # The request owns a copy of its inputs
//!
//! Every input is copied, in C order, into a buffer the request owns, at
//! submit: the caller may modify, resize or free its objects as soon as
//! `infer` has queued the request, and its pending entry holds no Python object of
//! the caller's. Holding the caller's object (or its storage) instead is not
//! sound: `tensor.resize_()` to a larger size reallocates the storage in
//! place, freeing the memory a queued request points at even while the
//! storage object is held (and `set_()` or `.data =` drop it); numpy's
//! `resize(refcheck=False)` frees an exported buffer too. The copy costs one
//! `memcpy` at submit, measured against holding the tensor: 1 KiB samples
//! about 0.1 us more per request (1.41-1.50 vs 1.53-1.66 us), 4 MiB samples
//! 0.26-0.31 ms instead of 2-3 us, against a request that can crash the
//! process.
//!
//! # Checks before copies
//!
//! A value's dtype, device and shape, and its row count against
//! `max_batch_size`, are checked before anything is allocated, so the copy is
//! at most `max_batch_size * row_nbytes` bytes. Every byte count and stride
//! offset is checked arithmetic: nothing here panics.
//!
//! # Errors
//!
//! Whatever a bad value makes fail (a sparse tensor's `data_ptr`, a DLPack
//! producer that raises, a class passed as a value) reaches the caller as
//! `InvalidInputError` naming the input, with the original as `__cause__`.

use std::ptr;
use std::sync::Mutex;

use ferrobatch_core::bytes::{self, BytesLimits};
use ferrobatch_core::{DType, Extents, InputBytes, Layout};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple, PyType};

use crate::errors::{invalid_input, is_ferrobatch_error};

/// One declared model input: the core's spec (rules and messages), and the
/// Python objects to check values against.
pub(crate) struct InputSpec {
    /// For a variable-length input, `shape` is the shape after its first
    /// (variable) dimension.
    pub core: ferrobatch_core::InputSpec,
    /// How its rows are collated (fixed, ragged, BYTES).
    pub layout: Layout,
    /// `name` as an interned Python string, for dict lookups without allocating.
    pub key: Py<PyString>,
    pub torch_dtype: Py<PyAny>,
}

impl std::ops::Deref for InputSpec {
    type Target = ferrobatch_core::InputSpec;

    fn deref(&self) -> &Self::Target {
        &self.core
    }
}

impl InputSpec {
    fn error(&self, py: Python<'_>, what: impl std::fmt::Display) -> PyErr {
        invalid_input(py, self.core.error(what).0)
    }

    /// Rows, bytes and extent (positions per row of a variable-length
    /// input; 0 otherwise) of a value of shape `actual`, bounded before
    /// anything is allocated.
    fn rows_for_shape(
        &self,
        py: Python<'_>,
        actual: &[usize],
        batched: bool,
        max_rows: usize,
        max_elements: Option<usize>,
    ) -> PyResult<(usize, usize, usize)> {
        self.rows_and_extents(py, actual, batched, max_rows, max_elements)
            .map(|(rows, nbytes, extents)| (rows, nbytes, extents.first().copied().unwrap_or(0)))
    }

    /// [`InputSpec::rows_for_shape`], with the lengths along every variable
    /// dimension (one, or those of an input padded along several): the
    /// core's rule ([`ferrobatch_core::InputSpec::measure`]).
    fn rows_and_extents(
        &self,
        py: Python<'_>,
        actual: &[usize],
        batched: bool,
        max_rows: usize,
        max_elements: Option<usize>,
    ) -> PyResult<(usize, usize, Extents)> {
        self.core
            .measure(
                &self.layout,
                actual,
                batched,
                max_rows,
                max_elements.unwrap_or(0),
            )
            .map(|m| (m.rows, m.nbytes, m.extents))
            .map_err(|e| invalid_input(py, e.0))
    }

    fn dtype_error(&self, py: Python<'_>, got: impl std::fmt::Display) -> PyErr {
        invalid_input(py, self.core.dtype_error(got).0)
    }
}

/// What keeps a request's input bytes alive until it is resolved: the
/// request's own copy of them (see the module docs).
#[derive(Default)]
pub(crate) struct Keep(Box<[u8]>);

impl Keep {
    /// Keeps `bytes` (the zeros standing in for an optional input left out).
    pub(crate) fn new(bytes: Vec<u8>) -> Keep {
        Keep(bytes.into_boxed_slice())
    }

    /// The copied bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Keep {
    fn drop(&mut self) {
        recycle(std::mem::take(&mut self.0));
    }
}

/// Copies of large inputs, kept for reuse by the next request of the same
/// size. A fresh multi-MiB allocation is a fresh `mmap`, page-faulted in as
/// it is written and unmapped when freed: 2.4 ms per 4 MiB sample at submit,
/// against 0.26 ms for the copy into memory already mapped (measured with
/// 16 requests in flight).
static RECYCLED: Mutex<Vec<Box<[u8]>>> = Mutex::new(Vec::new());
/// Smaller copies come from malloc's own free lists.
const RECYCLE_MIN_BYTES: usize = 1 << 16;
/// The most memory kept for reuse.
const RECYCLE_MAX_BYTES: usize = 64 << 20;

fn recycle(copy: Box<[u8]>) {
    if copy.len() < RECYCLE_MIN_BYTES {
        return;
    }
    let mut recycled = RECYCLED.lock().unwrap_or_else(|e| e.into_inner());
    let kept: usize = recycled.iter().map(|b| b.len()).sum();
    if kept.saturating_add(copy.len()) <= RECYCLE_MAX_BYTES {
        recycled.push(copy);
    }
}

/// An empty vector with room for exactly `nbytes`: a recycled copy of that
/// size if there is one, else a new allocation (an error, not an abort, if
/// that fails).
fn allocate(nbytes: usize) -> PyResult<Vec<u8>> {
    if nbytes >= RECYCLE_MIN_BYTES {
        let mut recycled = RECYCLED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = recycled.iter().rposition(|b| b.len() == nbytes) {
            let mut reused = recycled.swap_remove(i).into_vec();
            reused.clear();
            return Ok(reused);
        }
    }
    let mut out = Vec::new();
    out.try_reserve_exact(nbytes).map_err(|_| {
        PyMemoryError::new_err(format!("cannot allocate {nbytes} bytes for an input"))
    })?;
    Ok(out)
}

pub(crate) struct Converted {
    pub bytes: InputBytes,
    pub rows: usize,
    pub keep: Keep,
}

impl Converted {
    fn with_extents(copy: Box<[u8]>, rows: usize, extents: &[usize]) -> Converted {
        let mut converted = Converted::with_extent(copy, rows, 0);
        // At most MAX_VARIABLE_DIMS: the batcher refuses specs with more.
        if let Some(bytes) = converted.bytes.with_extents(extents) {
            converted.bytes = bytes;
        }
        converted
    }

    fn with_extent(copy: Box<[u8]>, rows: usize, extent: usize) -> Converted {
        // SAFETY: the view covers exactly the boxed slice, whose heap memory
        // does not move when the box does; the box is the returned `Keep`,
        // which the request's pending entry holds until no batch can read it.
        let bytes = unsafe { InputBytes::new(copy.as_ptr(), copy.len()) }.with_extent(extent);
        Converted {
            bytes,
            rows,
            keep: Keep(copy),
        }
    }
}

pub(crate) struct Converter {
    pub specs: Vec<InputSpec>,
    pub tensor_type: Py<PyType>,
    /// `coerce(value, input_index, batched)`: a torch tensor or a
    /// buffer-protocol object for a value that is neither; raises
    /// `InvalidInputError` for what it cannot read.
    pub coerce: Py<PyAny>,
    /// The most rows a request may carry (the batcher's `max_batch_size`).
    pub max_rows: usize,
    /// The most elements of a variable-length input a request may carry
    /// (the batcher's `max_batch_elements`).
    pub max_elements: Option<usize>,
    /// What a BYTES input of one request may carry.
    pub bytes_limits: BytesLimits,
}

impl Converter {
    /// Copies input `index` of a request out of `value`, or raises
    /// `InvalidInputError` naming the input.
    pub fn convert(
        &self,
        py: Python<'_>,
        index: usize,
        value: &Bound<'_, PyAny>,
        batched: bool,
    ) -> PyResult<Converted> {
        let spec = &self.specs[index];
        self.convert_value(py, spec, index, value, batched)
            .map_err(|err| name_the_input(py, spec, value, err))
    }

    fn convert_value(
        &self,
        py: Python<'_>,
        spec: &InputSpec,
        index: usize,
        value: &Bound<'_, PyAny>,
        batched: bool,
    ) -> PyResult<Converted> {
        match spec.layout {
            Layout::Bytes { elements_per_row } => {
                return self.read_bytes(py, spec, value, batched, elements_per_row)
            }
            Layout::RaggedBytes(ref r) => {
                return self.read_bytes(py, spec, value, batched, r.unit_elements)
            }
            _ => {}
        }
        let tensor_type = self.tensor_type.bind(py);
        if value.is_instance(tensor_type)? {
            return self.read_tensor(py, spec, value, batched);
        }
        if let Ok(decoded) = value.cast::<crate::codec::V2Tensor>() {
            // A BYTES tensor from the wire has no buffer: named as the wire named it.
            if decoded.get().serialized(py).is_some() {
                return Err(spec.dtype_error(py, decoded.get().datatype_name()));
            }
        }
        if let Ok(buffer) = PyUntypedBuffer::get(value) {
            return self.read_buffer(py, spec, &buffer, batched);
        }
        let coerced = self.coerce.bind(py).call1((value, index, batched))?;
        if coerced.is_instance(tensor_type)? {
            return self.read_tensor(py, spec, &coerced, batched);
        }
        let buffer = PyUntypedBuffer::get(&coerced)?;
        self.read_buffer(py, spec, &buffer, batched)
    }

    fn read_tensor(
        &self,
        py: Python<'_>,
        spec: &InputSpec,
        tensor: &Bound<'_, PyAny>,
        batched: bool,
    ) -> PyResult<Converted> {
        let dtype = tensor.getattr(intern!(py, "dtype"))?;
        if !dtype.is(spec.torch_dtype.bind(py)) {
            return Err(spec.dtype_error(py, dtype));
        }
        if !tensor.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            let device = tensor.getattr(intern!(py, "device"))?;
            return Err(spec.error(
                py,
                format_args!("tensor is on device '{device}'; inputs must be in host (CPU) memory"),
            ));
        }
        let shape = tensor.getattr(intern!(py, "shape"))?;
        let dims = shape
            .cast::<PyTuple>()?
            .iter()
            .map(|d| d.extract::<usize>())
            .collect::<PyResult<Vec<_>>>()?;
        let (rows, nbytes, extents) =
            spec.rows_and_extents(py, &dims, batched, self.max_rows, self.max_elements)?;
        let itemsize = spec.dtype.itemsize();
        // Contiguous strided tensors, the common case, take two calls here;
        // the rest are checked for what raw bytes would misread. A lazily
        // negated view (`z.conj().imag`, `as_strided` of one) may be
        // contiguous too: its bytes are not its values.
        let contiguous = tensor
            .call_method0(intern!(py, "is_contiguous"))?
            .is_truthy()?;
        if contiguous && tensor.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
            let resolved = tensor.call_method0(intern!(py, "resolve_neg"))?;
            return self.read_tensor(py, spec, &resolved, batched);
        }
        let strides = if contiguous {
            None
        } else {
            let layout = tensor.getattr(intern!(py, "layout"))?;
            if layout.str()?.to_str()? != "torch.strided" {
                return Err(spec.error(
                    py,
                    format_args!("{layout} tensors are not supported; pass a dense tensor"),
                ));
            }
            if tensor.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
                // A lazily negated view (`z.conj().imag`): its bytes are not
                // its values. Materialised (its size is checked above), then
                // read as any tensor.
                let resolved = tensor.call_method0(intern!(py, "resolve_neg"))?;
                return self.read_tensor(py, spec, &resolved, batched);
            }
            let strides = tensor
                .call_method0(intern!(py, "stride"))?
                .extract::<Vec<isize>>()?;
            let strides = strides
                .into_iter()
                .map(|s| s.checked_mul(itemsize as isize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| spec.error(py, "tensor strides are too large"))?;
            Some(strides)
        };
        let ptr: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
        if ptr == 0 && nbytes != 0 {
            return Err(spec.error(py, "tensor has no data (its storage was freed)"));
        }
        // SAFETY: torch guarantees that a dense CPU tensor of shape `dims` and
        // element strides `strides` (of `itemsize`-byte elements: the dtype
        // was checked) has every element inside its storage, starting at
        // `data_ptr`; the GIL is held and `tensor` referenced throughout, so
        // nothing frees that storage meanwhile.
        let copy = unsafe {
            gather(
                py,
                ptr as *const u8,
                &dims,
                strides.as_deref(),
                itemsize,
                nbytes,
            )
        }?;
        Ok(Converted::with_extents(copy, rows, &extents))
    }

    fn read_buffer(
        &self,
        py: Python<'_>,
        spec: &InputSpec,
        buffer: &PyUntypedBuffer,
        batched: bool,
    ) -> PyResult<Converted> {
        let format = buffer.format().to_string_lossy();
        if !spec.dtype.matches_buffer_format(&format) || buffer.item_size() != spec.dtype.itemsize()
        {
            return Err(spec.dtype_error(py, describe_format(&format, buffer.item_size())));
        }
        if buffer
            .suboffsets()
            .is_some_and(|s| s.iter().any(|&o| o >= 0))
        {
            return Err(spec.error(py, "indirect buffers (with suboffsets) are not supported"));
        }
        let dims = buffer.shape();
        let (rows, nbytes, extents) =
            spec.rows_and_extents(py, dims, batched, self.max_rows, self.max_elements)?;
        let strides = (!buffer.is_c_contiguous()).then(|| buffer.strides());
        // SAFETY: the buffer protocol guarantees that every element of a
        // buffer of this shape and these byte strides (of `itemsize` bytes:
        // checked above), with no suboffsets, lies at `buf + sum(i * stride)`
        // and stays valid until the buffer is released, after the copy.
        let copy = unsafe {
            gather(
                py,
                buffer.buf_ptr() as *const u8,
                dims,
                strides,
                spec.dtype.itemsize(),
                nbytes,
            )
        }?;
        Ok(Converted::with_extents(copy, rows, &extents))
    }
}

impl Converter {
    /// A BYTES input: a decoded v2 BYTES tensor (its serialized elements
    /// checked and copied), one `bytes`/`str` for a one-element sample, or
    /// anything numpy reads as an object array of `bytes`/`str` (a list, a
    /// nested list, an object or `np.bytes_` array) of the declared shape.
    fn read_bytes(
        &self,
        py: Python<'_>,
        spec: &InputSpec,
        value: &Bound<'_, PyAny>,
        batched: bool,
        elements_per_row: usize,
    ) -> PyResult<Converted> {
        if let Ok(tensor) = value.cast::<crate::codec::V2Tensor>() {
            let tensor = tensor.get();
            let Some((data, shape)) = tensor.serialized(py) else {
                let got = tensor.datatype_name();
                return Err(spec.dtype_error(py, got));
            };
            let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
            let (rows, _, extent) =
                spec.rows_for_shape(py, &dims, batched, self.max_rows, self.max_elements)?;
            // A variable-length row is `extent` positions of `elements_per_row`.
            let count = rows * extent.max(fixed_row(spec)) * elements_per_row;
            bytes::check(data, count, self.bytes_limits).map_err(|e| spec.error(py, e))?;
            let mut copy = allocate(data.len())?;
            copy.extend_from_slice(data);
            return Ok(Converted::with_extent(
                copy.into_boxed_slice(),
                rows,
                extent,
            ));
        }
        let single =
            value.is_instance_of::<pyo3::types::PyBytes>() || value.is_instance_of::<PyString>();
        let max = self.max_elements;
        let (rows, extent, flat) = if single {
            let (rows, _, extent) = spec
                .rows_for_shape(py, &[], batched, self.max_rows, max)
                .or_else(|_| spec.rows_for_shape(py, &[1], batched, self.max_rows, max))?;
            (
                rows,
                extent,
                pyo3::types::PyList::new(py, [value])?.into_any(),
            )
        } else {
            let array = py
                .import(intern!(py, "numpy"))?
                .call_method1(intern!(py, "asarray"), (value, intern!(py, "object")))?;
            let dims: Vec<usize> = array.getattr(intern!(py, "shape"))?.extract()?;
            let (rows, _, extent) = spec.rows_for_shape(py, &dims, batched, self.max_rows, max)?;
            (rows, extent, array.call_method0(intern!(py, "ravel"))?)
        };
        // Bounded by the shape checks above (max_batch_size rows, or
        // max_batch_elements elements of a variable-length input).
        let count = rows * extent.max(fixed_row(spec)) * elements_per_row;
        let data = crate::codec::serialize_elements(py, &flat, count, self.bytes_limits, |m| {
            spec.error(py, m)
        })?;
        Ok(Converted::with_extent(
            data.into_boxed_slice(),
            rows,
            extent,
        ))
    }
}

/// Positions per row that multiply a BYTES row's elements: 1 for a fixed
/// shape (its row is `elements_per_row`), 0 for a variable-length one (its
/// row is `extent` positions).
fn fixed_row(spec: &InputSpec) -> usize {
    usize::from(matches!(spec.layout, Layout::Bytes { .. }))
}

/// A dtype name for a buffer format ("float64", "big-endian float32"), or the
/// format itself.
fn describe_format(format: &str, item_size: usize) -> String {
    let known = |code: &str| {
        DType::ALL
            .iter()
            .find(|d| d.matches_buffer_format(code) && d.itemsize() == item_size)
            .map(|d| d.name())
    };
    if let Some(name) = known(format) {
        return name.to_string();
    }
    if let Some(code) = format.strip_prefix(['>', '!']) {
        if let Some(name) = known(code) {
            return format!(
                "big-endian {name} (non-native byte order; convert with .astype('={}'))",
                code
            );
        }
    }
    format!("buffer format '{format}'")
}

/// Turns an error raised while reading `value` into `InvalidInputError`
/// naming the input (with the original as `__cause__`). Errors of
/// ferrobatch's own, `MemoryError` and what is not an `Exception`
/// (`KeyboardInterrupt`...) pass through.
fn name_the_input(py: Python<'_>, spec: &InputSpec, value: &Bound<'_, PyAny>, err: PyErr) -> PyErr {
    if is_ferrobatch_error(py, &err)
        || !err.is_instance_of::<PyException>(py)
        || err.is_instance_of::<PyMemoryError>(py)
    {
        return err;
    }
    let type_name = value
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    let kind = err
        .get_type(py)
        .name()
        .map_or_else(|_| "error".to_string(), |n| n.to_string());
    let wrapped = spec.error(
        py,
        format_args!("cannot read a {type_name}: {kind}: {}", err.value(py)),
    );
    wrapped.set_cause(py, Some(err));
    wrapped
}

/// A new buffer of `nbytes` bytes holding the elements of a strided array in
/// C order: `strides` in bytes, one per dimension, or None when the array is
/// C-contiguous.
///
/// # Safety
/// For every index `i` within `dims`, the `itemsize` bytes at
/// `ptr + sum(i[d] * strides[d])` (or, when `strides` is None, the `nbytes`
/// bytes at `ptr`) are readable for the duration of the call, and `nbytes`
/// is the product of `dims` and `itemsize`.
unsafe fn gather(
    py: Python<'_>,
    ptr: *const u8,
    dims: &[usize],
    strides: Option<&[isize]>,
    itemsize: usize,
    nbytes: usize,
) -> PyResult<Box<[u8]>> {
    let mut out = allocate(nbytes)?;
    let dst = out.as_mut_ptr();
    if nbytes == 0 {
        return Ok(out.into_boxed_slice());
    }
    let Some(strides) = strides else {
        // SAFETY: the caller guarantees `nbytes` readable bytes at `ptr`;
        // `dst` has capacity for `nbytes`, and the two cannot overlap (`out`
        // is new or recycled, memory no Python object ever views).
        unsafe {
            ptr::copy_nonoverlapping(ptr, dst, nbytes);
            out.set_len(nbytes);
        }
        return Ok(out.into_boxed_slice());
    };
    if strides.len() != dims.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "strides and shape differ in length",
        ));
    }
    // The innermost dimensions that are laid out densely are copied as one
    // run of `chunk` bytes; an odometer walks the outer ones.
    let mut inner = dims.len();
    let mut chunk = itemsize;
    while inner > 0
        && isize::try_from(chunk).is_ok_and(|c| c == strides[inner - 1] || dims[inner - 1] == 1)
    {
        inner -= 1;
        chunk = chunk
            .checked_mul(dims[inner])
            .ok_or_else(|| invalid_bytes(py))?;
    }
    let outer = &dims[..inner];
    let outer_strides = &strides[..inner];
    let mut index = vec![0usize; inner];
    let mut offset: isize = 0;
    let mut written = 0usize;
    loop {
        let end = written
            .checked_add(chunk)
            .ok_or_else(|| invalid_bytes(py))?;
        if end > nbytes {
            return Err(invalid_bytes(py));
        }
        // SAFETY: `index` is within `outer` (and the inner run within the
        // inner dims), so the caller guarantees `chunk` readable bytes at
        // `ptr + offset`; `written + chunk <= nbytes` fits `dst`'s capacity.
        unsafe {
            ptr::copy_nonoverlapping(ptr.wrapping_offset(offset), dst.add(written), chunk);
        }
        written = end;
        // Next index, last dimension fastest.
        let mut d = inner;
        loop {
            if d == 0 {
                if written != nbytes {
                    return Err(invalid_bytes(py));
                }
                // SAFETY: all `nbytes` bytes were written above.
                unsafe { out.set_len(nbytes) };
                return Ok(out.into_boxed_slice());
            }
            d -= 1;
            index[d] += 1;
            offset = offset
                .checked_add(outer_strides[d])
                .ok_or_else(|| invalid_bytes(py))?;
            if index[d] < outer[d] {
                break;
            }
            // Back to the start of dimension d; carry into the one before.
            let back = outer_strides[d]
                .checked_mul(outer[d] as isize)
                .ok_or_else(|| invalid_bytes(py))?;
            offset = offset.checked_sub(back).ok_or_else(|| invalid_bytes(py))?;
            index[d] = 0;
        }
    }
}

fn invalid_bytes(_py: Python<'_>) -> PyErr {
    pyo3::exceptions::PyValueError::new_err("the value's shape, strides and size disagree")
}
