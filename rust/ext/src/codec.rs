//! The v2 codec (`ferrobatch_core::v2`) for the Python front-ends: one call
//! decodes a request body, one call encodes a response.
//!
//! Decoded inputs are [`V2Tensor`]s, exposing their bytes through the buffer
//! protocol without a copy (with the format character and shape of their
//! datatype), so `client.infer_batch` reads them as it reads numpy arrays.
//! A JSON input owns the buffer it was parsed into; a binary one is a view of
//! the request body (a `bytes` object, immutable, kept alive by the tensor).
//!
//! A codec given `regions` reads inputs from, and writes outputs into, the
//! shared-memory regions requests name (`ferrobatch_core::v2::regions`):
//! `V2Request.shared_memory` says a request names one (submit it
//! `uncached`), and `V2Codec.encode` writes its outputs there. The
//! registry itself, `SharedMemoryRegions`, is here too: the codec is what
//! reads it.
//!
//! Errors of the client's request raise `CodecError` (a `ValueError`) whose
//! `status` is the HTTP status (400, or 413 for a body over the limit); an
//! output that cannot be encoded raises `CodecError` with status 500.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use ferrobatch_core::bytes::{self, BytesLimits};
use ferrobatch_core::v2::generate::{self, GenerateInput};
use ferrobatch_core::v2::regions::{RegionError, RegionRange, SharedRegions};
use ferrobatch_core::v2::{
    self, Codec, Data, HeaderMemo, InferRequest, Limits, Output, OutputSpec, Shape, V2Error,
};
use ferrobatch_core::DType;
use ferrobatch_serve::{encoding, VaryingRows};
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple, PyType};
use pyo3::{ffi, intern};

use crate::errors::invalid_input;
use crate::without_gil;

/// Bodies and outputs at least this large are decoded and encoded with the
/// GIL released; below, releasing it costs more than it frees.
const RELEASE_GIL_BYTES: usize = 64 << 10;

/// `work` on `bytes` of data: with the GIL released when they are at least
/// [`RELEASE_GIL_BYTES`] (or `anyway`), else holding it.
fn sized_work<T: Send>(
    py: Python<'_>,
    bytes: usize,
    anyway: bool,
    work: impl Send + FnOnce() -> T,
) -> T {
    if anyway || bytes >= RELEASE_GIL_BYTES {
        without_gil(py, work)
    } else {
        work()
    }
}

pyo3::create_exception!(
    ferrobatch._core,
    CodecError,
    PyValueError,
    "A v2 request the codec refuses; ``status`` is its HTTP status."
);

fn codec_error(py: Python<'_>, err: V2Error) -> PyErr {
    let status = err.status();
    let err = CodecError::new_err(err.to_string());
    // Setting an attribute on a fresh exception instance cannot fail short of
    // memory; the class attribute (400) stands in if it does.
    let _ = err.value(py).setattr(intern!(py, "status"), status);
    err
}

pub(crate) fn status_error(py: Python<'_>, status: u16, message: String) -> PyErr {
    let err = CodecError::new_err(message);
    let _ = err.value(py).setattr(intern!(py, "status"), status);
    err
}

/// Undoes a request body's `Content-Encoding` (`gzip` or `deflate`;
/// `identity` or empty: the body as it is) with the native front-end's
/// rules and bound: at most `limit` inflated bytes. `CodecError` with
/// `status` 400 (an unsupported coding, a corrupt or truncated body) or
/// 413 (past the limit). Runs without the GIL.
#[pyfunction]
pub fn inflate<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyBytes>,
    coding: &str,
    limit: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let Ok(named) = encoding::content_coding_of(Some(coding.as_bytes())) else {
        let shown = v2::short(coding);
        let message = format!("unsupported Content-Encoding '{shown}'; use gzip or deflate");
        return Err(status_error(py, 400, message));
    };
    let Some(named) = named else {
        return Ok(body.clone());
    };
    let bytes = body.as_bytes();
    match without_gil(py, || encoding::inflate(bytes, named, limit)) {
        Ok(inflated) => Ok(PyBytes::new(py, &inflated)),
        Err(failure) => Err(status_error(py, failure.status, failure.message)),
    }
}

/// The coding of a response to a request whose `Accept-Encoding` is
/// `accept`: `"gzip"` when accepted, else `"deflate"`, else None.
#[pyfunction]
#[pyo3(signature = (accept=None))]
pub fn response_coding(accept: Option<&str>) -> Option<&'static str> {
    encoding::accepted_of(accept.map(str::as_bytes)).map(encoding::Coding::name)
}

/// `body` coded `coding` (`"gzip"` or `"deflate"`), without the GIL; None
/// for another coding.
#[pyfunction]
pub fn compress<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyBytes>,
    coding: &str,
) -> Option<Bound<'py, PyBytes>> {
    let named = encoding::content_coding_of(Some(coding.as_bytes())).ok()??;
    let bytes = body.as_bytes();
    let coded = without_gil(py, || encoding::compress(bytes, named))?;
    Some(PyBytes::new(py, &coded))
}

/// Every element type, as `(name, v2 datatype, v2 gRPC contents field)`:
/// the one table Python's specs and front-ends read theirs from.
#[pyfunction]
pub fn dtypes() -> Vec<(&'static str, &'static str, Option<&'static str>)> {
    DType::ALL
        .into_iter()
        .chain([DType::Bytes])
        .map(|d| (d.name(), d.v2_name(), d.v2_contents()))
        .collect()
}

fn dtype_of(name: &str) -> PyResult<DType> {
    DType::parse(name).ok_or_else(|| PyValueError::new_err(format!("unknown dtype '{name}'")))
}

/// The buffer-protocol format character of a dtype's elements (BF16: its raw
/// 16-bit words, as numpy has no bfloat16).
fn format_of(dtype: DType) -> &'static std::ffi::CStr {
    match dtype {
        DType::Bool => c"?",
        DType::Int8 => c"b",
        DType::Int16 => c"h",
        DType::Int32 => c"i",
        DType::Int64 => c"q",
        DType::UInt8 => c"B",
        DType::UInt16 | DType::BFloat16 => c"H",
        DType::UInt32 => c"I",
        DType::UInt64 => c"Q",
        DType::Float16 => c"e",
        DType::Float32 => c"f",
        DType::Float64 => c"d",
        // Never exported: a BYTES tensor has no buffer (`V2Tensor::serialized`).
        DType::Bytes => c"B",
    }
}

/// `torch.Tensor`, looked up once.
static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The v2 codec of one served model.
#[pyclass(frozen, module = "ferrobatch._core")]
pub(crate) struct V2Codec {
    core: Codec,
    /// Output names, interned, for lookups in the results dict.
    output_keys: Vec<Py<PyString>>,
    /// The torch dtype of each output (what a result must be, or becomes).
    output_dtypes: Vec<Py<PyAny>>,
    /// Binary requests' headers decoded lately, as the native front-end
    /// keeps them; a decode that finds it in use decodes afresh.
    headers: Mutex<HeaderMemo>,
}

enum Storage {
    Owned(Box<[u8]>),
    /// A buffer of a decoded gRPC message (`raw_input_contents`).
    Shared(::bytes::Bytes),
    /// `len` bytes of `body` from `start`.
    Body {
        body: Py<PyBytes>,
        start: usize,
        len: usize,
    },
}

/// One decoded input: its bytes through the buffer protocol (read-only,
/// C-contiguous, the datatype's format and the input's shape).
#[pyclass(frozen, module = "ferrobatch._core")]
pub(crate) struct V2Tensor {
    dtype: DType,
    shape: Vec<isize>,
    strides: Vec<isize>,
    storage: Storage,
}

impl V2Tensor {
    /// A client's error (400), as the checks against the model's spec that
    /// follow would give: never a plain `ValueError`, which the Python
    /// front-ends would answer as the model's failure (500).
    fn new(py: Python<'_>, dtype: DType, shape: &[u64], storage: Storage) -> PyResult<V2Tensor> {
        let too_large = || status_error(py, 400, format!("input shape {shape:?} is too large"));
        let dims: Vec<isize> = shape
            .iter()
            .map(|&d| isize::try_from(d).map_err(|_| too_large()))
            .collect::<PyResult<_>>()?;
        // The data was checked against the shape: with elements, every
        // stride is within its length; without (a 0 among the dimensions),
        // none is ever used, so any value will do.
        let empty = dims.contains(&0);
        let mut strides = vec![0isize; dims.len()];
        let mut stride = isize::try_from(dtype.itemsize()).map_err(|_| too_large())?;
        for (i, (s, &d)) in strides.iter_mut().zip(&dims).enumerate().rev() {
            *s = stride;
            if i > 0 {
                stride = match stride.checked_mul(d) {
                    Some(next) => next,
                    None if empty => isize::MAX,
                    None => return Err(too_large()),
                };
            }
        }
        let shape = dims;
        Ok(V2Tensor {
            dtype,
            shape,
            strides,
            storage,
        })
    }

    fn bytes<'a>(&'a self, py: Python<'a>) -> &'a [u8] {
        match &self.storage {
            Storage::Owned(data) => data,
            Storage::Shared(data) => data,
            Storage::Body { body, start, len } => body
                .bind(py)
                .as_bytes()
                .get(*start..start + len)
                .unwrap_or(&[]),
        }
    }
}

impl V2Tensor {
    /// A decoded input whose bytes are `data` (checked against its dtype
    /// and shape already).
    pub(crate) fn from_bytes(
        py: Python<'_>,
        dtype: DType,
        shape: &[u64],
        data: ::bytes::Bytes,
    ) -> PyResult<V2Tensor> {
        V2Tensor::new(py, dtype, shape, Storage::Shared(data))
    }

    pub(crate) fn datatype_name(&self) -> &'static str {
        self.dtype.name()
    }

    /// A BYTES tensor's elements, serialized (see `ferrobatch_core::bytes`),
    /// and its shape; None for other datatypes.
    pub(crate) fn serialized<'a>(&'a self, py: Python<'a>) -> Option<(&'a [u8], &'a [isize])> {
        (self.dtype == DType::Bytes).then(|| (self.bytes(py), self.shape.as_slice()))
    }
}

#[pymethods]
impl V2Tensor {
    /// The v2 datatype ("FP32").
    #[getter]
    fn datatype(&self) -> &'static str {
        self.dtype.v2_name()
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    #[getter]
    fn nbytes(&self, py: Python<'_>) -> usize {
        self.bytes(py).len()
    }

    /// # Safety
    ///
    /// Called by the interpreter with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null view"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("decoded v2 tensors are read-only"));
        }
        let py = slf.py();
        let this = slf.get();
        if this.dtype == DType::Bytes {
            return Err(PyBufferError::new_err(
                "a BYTES tensor has no buffer of fixed-size elements",
            ));
        }
        let data = this.bytes(py);
        let len = isize::try_from(data.len()).map_err(|_| PyBufferError::new_err("too large"))?;
        let itemsize = this.dtype.itemsize() as isize;
        // SAFETY: `view` is non-null and the interpreter's to fill. Every
        // pointer stored in it stays valid while the view exists: `obj` holds
        // a strong reference to this (frozen, so never mutated) object, which
        // owns `shape`, `strides` and the bytes (its own buffer, or the
        // immutable `bytes` body it holds); `format` points at a static C
        // string the consumer only reads. The buffer is exported read-only.
        unsafe {
            (*view).buf = data.as_ptr() as *mut c_void;
            (*view).len = len;
            (*view).readonly = 1;
            (*view).itemsize = itemsize;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                format_of(this.dtype).as_ptr() as *mut c_char
            } else {
                std::ptr::null_mut()
            };
            if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                (*view).ndim = this.shape.len() as c_int;
                (*view).shape = this.shape.as_ptr() as *mut isize;
            } else {
                (*view).ndim = 1;
                (*view).shape = std::ptr::null_mut();
            }
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                this.strides.as_ptr() as *mut isize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// A decoded request: its inputs, id, timeout and the outputs to send.
#[pyclass(frozen, module = "ferrobatch._core")]
pub(crate) struct V2Request {
    id: Option<String>,
    timeout: Option<f64>,
    priority: Option<u32>,
    parameters: Option<String>,
    inputs: Py<PyDict>,
    bf16: bool,
    /// `(output index, as binary)`, in response order.
    selected: ferrobatch_core::PerTensor<(usize, bool)>,
    /// The shared-memory range of each of `selected` that names one
    /// (aligned; empty: none).
    regions: Vec<Option<RegionRange>>,
    /// How many classes each of `selected` is answered with (Triton's
    /// classification extension; empty: none asks for classes).
    classes: Vec<Option<u32>>,
    /// A tensor names a shared-memory region.
    shared_memory: bool,
}

#[pymethods]
impl V2Request {
    #[getter]
    fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The `timeout` parameter in seconds (`None`: no deadline).
    #[getter]
    fn timeout(&self) -> Option<f64> {
        self.timeout
    }

    /// The `priority` parameter (1: most urgent; `None`: the default).
    #[getter]
    fn priority(&self) -> Option<u32> {
        self.priority
    }

    /// The request's `parameters` object as JSON text (`None`: none).
    #[getter]
    fn parameters(&self) -> Option<&str> {
        self.parameters.as_deref()
    }

    /// Input name -> [`V2Tensor`], in the request's order.
    #[getter]
    fn inputs<'py>(&self, py: Python<'py>) -> Bound<'py, PyDict> {
        self.inputs.bind(py).clone()
    }

    /// Whether an input is BF16 (whose buffer is raw 16-bit words: view it
    /// as `torch.bfloat16` before use).
    #[getter]
    fn has_bf16(&self) -> bool {
        self.bf16
    }

    /// The outputs to send, as bits of their indices: what a model built
    /// with its requests is told (every output when the request named none).
    #[getter]
    fn requested_outputs(&self) -> u64 {
        ferrobatch_core::v2::output_bits(self.selected.iter().map(|&(i, _)| i))
    }

    /// Whether a tensor names a shared-memory region: submit it
    /// `uncached` (its result is not its body's alone). Its outputs in
    /// regions are written there by `V2Codec.encode`.
    #[getter]
    fn shared_memory(&self) -> bool {
        self.shared_memory
    }

    /// The names of the outputs to send, in order (of `codec`'s outputs).
    fn output_names(&self, codec: &V2Codec) -> Vec<String> {
        let outputs = codec.core.outputs();
        self.selected
            .iter()
            .filter_map(|&(i, _)| outputs.get(i).map(|o| o.name.clone()))
            .collect()
    }
}

/// An output tensor's bytes, read in place: keeps the (possibly converted)
/// tensor alive while `data` is in use.
pub(crate) struct Readable<'py> {
    _owner: Bound<'py, PyAny>,
    pub shape: Vec<u64>,
    pub ptr: usize,
    pub len: usize,
    /// A BYTES output's elements, serialized here (`ptr` points into it).
    _serialized: Option<Box<[u8]>>,
    /// Where each row is when rows differ in size (BYTES, variable length).
    pub rows: Option<VaryingRows>,
}

/// The `len` bytes at `ptr` (none when `len` is 0).
///
/// # Safety
/// `ptr` must be valid for reads of `len` bytes while the slice is used.
pub(crate) unsafe fn bytes_at<'a>(ptr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller vouches for ptr and len.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
}

impl Readable<'_> {
    pub(crate) fn data(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` is the data pointer of a contiguous CPU tensor of
        // `len` bytes (its dtype's itemsize times its element count, checked
        // in `read_output`), kept alive by `_owner` as long as `self`; nothing
        // resizes a result tensor handed to the front-end.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl V2Codec {
    pub(crate) fn core(&self) -> &Codec {
        &self.core
    }

    /// [`Codec::decode`] through the memo: a header seen with a body of the
    /// same length is not read again (its request copied out of the memo).
    fn decode_remembered(
        &self,
        body: &[u8],
        header_length: Option<&str>,
    ) -> Result<InferRequest, V2Error> {
        let mut accept = |_: &str, _: DType, _: &[u64]| Ok(());
        match self.headers.try_lock() {
            Ok(mut memo) => self
                .core
                .decode_remembered(&mut memo, body, header_length, &mut accept)
                .map(std::borrow::Cow::into_owned),
            // In use by another thread's decode (or poisoned): decode afresh.
            Err(_) => self.core.decode(body, header_length),
        }
    }

    /// Reads every output of a batch's `outputs` (`{name: tensor}`), in the
    /// codec's order; a missing one is an error.
    pub(crate) fn read_outputs<'py>(
        &self,
        py: Python<'py>,
        outputs: &Bound<'py, PyDict>,
    ) -> PyResult<Vec<Readable<'py>>> {
        (0..self.output_keys.len())
            .map(|index| {
                let key = self.output_keys[index].bind(py);
                let value = outputs.get_item(key)?.ok_or_else(|| {
                    codec_error(
                        py,
                        V2Error::Output(format!("the model returned no output '{key}'")),
                    )
                })?;
                self.read_output(py, index, value)
            })
            .collect()
    }

    /// Reads result `value` for output `index`: a torch tensor (converted to
    /// the output's dtype, contiguous, on the CPU when it is not already).
    pub(crate) fn read_output<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        value: Bound<'py, PyAny>,
    ) -> PyResult<Readable<'py>> {
        let spec = &self.core.outputs()[index];
        // A variable-length output (`_variable.RaggedOutput`, `PaddedOutput`);
        // a plain tensor, the usual result, is not asked: a missing attribute
        // costs an exception raised and dropped, per output per batch.
        let packed = if value.get_type().is(TENSOR.import(py, "torch", "Tensor")?) {
            None
        } else {
            value.getattr_opt(intern!(py, "packed"))?
        };
        if let Some(packed) = packed {
            let dtype = self.output_dtypes[index].bind(py);
            return read_packed(py, &spec.name, spec.dtype, dtype, packed.call0()?);
        }
        if spec.dtype == DType::Bytes {
            return read_bytes_output(py, &spec.name, value);
        }
        let tensor = host_contiguous(py, value, self.output_dtypes[index].bind(py))?;
        let shape: Vec<u64> = tensor.getattr(intern!(py, "shape"))?.extract()?;
        let count = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| n.checked_mul(spec.dtype.itemsize()));
        let len = count.ok_or_else(|| {
            codec_error(
                py,
                V2Error::Output(format!("output '{}' is too large", spec.name)),
            )
        })?;
        let ptr: usize = if len == 0 {
            0
        } else {
            tensor.call_method0(intern!(py, "data_ptr"))?.extract()?
        };
        Ok(Readable {
            _owner: tensor,
            shape,
            ptr,
            len,
            _serialized: None,
            rows: None,
        })
    }
}

/// A BYTES output (a numpy object array, or a list, of `bytes` or `str`),
/// its elements serialized.
fn read_bytes_output<'py>(
    py: Python<'py>,
    name: &str,
    value: Bound<'py, PyAny>,
) -> PyResult<Readable<'py>> {
    let array = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "asarray"), (&value, intern!(py, "object")))?;
    let shape: Vec<u64> = array.getattr(intern!(py, "shape"))?.extract()?;
    let flat = array.call_method0(intern!(py, "ravel"))?;
    let count = flat.len()?;
    let refuse = |m: String| codec_error(py, V2Error::Output(format!("output '{name}': {m}")));
    let unbounded = BytesLimits {
        max_element: u32::MAX as usize,
        max_request: usize::MAX,
    };
    let serialized = serialize_elements(py, &flat, count, unbounded, refuse)?.into_boxed_slice();
    // Rows of one shape, but not of one size: each row's elements' bounds.
    let row_shape = shape.get(1..).unwrap_or(&[]).to_vec();
    let batch_rows = shape.first().map_or(0, |&n| n as usize);
    let per_row = count.checked_div(batch_rows).unwrap_or(0);
    let starts: Vec<usize> = (0..batch_rows).map(|i| i * per_row).collect();
    let shapes = vec![row_shape; batch_rows];
    let rows = bytes_rows(&serialized, count, &starts, shapes, Vec::new())
        .ok_or_else(|| refuse("its elements do not match its shape".into()))?;
    Ok(Readable {
        _owner: array,
        shape,
        ptr: serialized.as_ptr() as usize,
        len: serialized.len(),
        _serialized: Some(serialized),
        rows: Some(rows),
    })
}

/// Where each row of serialized BYTES (`count` elements) is: row `i` the
/// elements from `starts[i]` on, as many as `shapes[i]` holds. `None` when
/// a row is out of the data.
fn bytes_rows(
    data: &[u8],
    count: usize,
    starts: &[usize],
    shapes: Vec<Vec<u64>>,
    pad: Vec<u8>,
) -> Option<VaryingRows> {
    let bounds = bytes::boundaries(data, count);
    let ranges = starts
        .iter()
        .zip(&shapes)
        .map(|(&start, shape)| {
            let n = shape_elements(shape)?;
            let from = *bounds.get(start)?;
            let to = *bounds.get(start.checked_add(n)?)?;
            Some(from..to)
        })
        .collect::<Option<_>>()?;
    Some(VaryingRows {
        ranges,
        shapes,
        itemsize: None,
        pad,
    })
}

/// Elements of `shape` (`None` when the count overflows).
fn shape_elements(shape: &[u64]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
}

/// A variable-length output, as its `packed()` gives it: `(values, starts,
/// shapes, pad)`, every row's elements back to back in the flat `values`
/// (a tensor, or an object array of BYTES), row `i` from element
/// `starts[i]` on, of shape `shapes[i]`, and `pad` one element's bytes.
fn read_packed<'py>(
    py: Python<'py>,
    name: &str,
    dtype: DType,
    torch_dtype: &Bound<'py, PyAny>,
    packed: Bound<'py, PyAny>,
) -> PyResult<Readable<'py>> {
    let refuse = |m: String| codec_error(py, V2Error::Output(format!("output '{name}': {m}")));
    let (values, starts, shapes, pad): (Bound<'py, PyAny>, Vec<usize>, Vec<Vec<u64>>, Vec<u8>) =
        packed.extract()?;
    if starts.len() != shapes.len() {
        return Err(refuse(
            "its rows' starts and shapes differ in number".into(),
        ));
    }
    let batch_rows = vec![starts.len() as u64];
    if dtype == DType::Bytes {
        let flat = values.call_method0(intern!(py, "ravel"))?;
        let count = flat.len()?;
        let unbounded = BytesLimits {
            max_element: u32::MAX as usize,
            max_request: usize::MAX,
        };
        let serialized =
            serialize_elements(py, &flat, count, unbounded, refuse)?.into_boxed_slice();
        let rows = bytes_rows(&serialized, count, &starts, shapes, pad)
            .ok_or_else(|| refuse("a row lies outside its values".into()))?;
        return Ok(Readable {
            _owner: values,
            shape: batch_rows,
            ptr: serialized.as_ptr() as usize,
            len: serialized.len(),
            _serialized: Some(serialized),
            rows: Some(rows),
        });
    }
    let itemsize = dtype.itemsize();
    if pad.len() != itemsize {
        return Err(refuse(format!(
            "its pad is {} bytes, not one element",
            pad.len()
        )));
    }
    let tensor = host_contiguous(py, values, torch_dtype)?;
    let numel: usize = tensor.call_method0(intern!(py, "numel"))?.extract()?;
    let len = numel
        .checked_mul(itemsize)
        .ok_or_else(|| refuse("it is too large".into()))?;
    let ranges = starts
        .iter()
        .zip(&shapes)
        .map(|(&start, shape)| {
            let from = start.checked_mul(itemsize)?;
            let to = from.checked_add(shape_elements(shape)?.checked_mul(itemsize)?)?;
            (to <= len).then_some(from..to)
        })
        .collect::<Option<_>>()
        .ok_or_else(|| refuse("a row lies outside its values".into()))?;
    let ptr: usize = if len == 0 {
        0
    } else {
        tensor.call_method0(intern!(py, "data_ptr"))?.extract()?
    };
    Ok(Readable {
        _owner: tensor,
        shape: batch_rows,
        ptr,
        len,
        _serialized: None,
        rows: Some(VaryingRows {
            ranges,
            shapes,
            itemsize: Some(itemsize),
            pad,
        }),
    })
}

/// `count` BYTES elements from an iterable of `bytes` / `str` (UTF-8) /
/// anything with the buffer protocol, serialized; sizes are checked
/// against the default limits before the buffer is allocated.
pub(crate) fn serialize_elements(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    count: usize,
    limits: BytesLimits,
    refuse: impl Fn(String) -> PyErr,
) -> PyResult<Vec<u8>> {
    let mut items: Vec<Bound<'_, PyAny>> = Vec::with_capacity(count.min(1 << 16));
    for value in values.try_iter()? {
        if items.len() == count {
            return Err(refuse(format!(
                "BYTES data holds more than the {count} elements its shape needs"
            )));
        }
        items.push(element_bytes(&value?).map_err(|e| refuse(e.value(py).to_string()))?);
    }
    if items.len() != count {
        return Err(refuse(format!(
            "BYTES data holds {} elements, the shape needs {count}",
            items.len()
        )));
    }
    let slices: Vec<&[u8]> = items
        .iter()
        .map(|b| b.cast::<PyBytes>().map(|b| b.as_bytes()).unwrap_or(&[]))
        .collect();
    let size = bytes::serialized_size(slices.iter().map(|s| s.len()), limits)
        .map_err(|e| refuse(e.to_string()))?;
    let mut out = Vec::new();
    out.try_reserve_exact(size)
        .map_err(|_| pyo3::exceptions::PyMemoryError::new_err("cannot allocate BYTES data"))?;
    for s in slices {
        bytes::push(&mut out, s).map_err(|e| refuse(e.to_string()))?;
    }
    Ok(out)
}

/// One BYTES element as a `bytes` object: `bytes` as is, `str` encoded
/// UTF-8, `bytearray`/`memoryview`/`np.bytes_` copied.
pub(crate) fn element_bytes<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    if value.is_instance_of::<PyBytes>() {
        return Ok(value.clone());
    }
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(PyBytes::new(py, text.to_str()?.as_bytes()).into_any());
    }
    if value.is_instance_of::<pyo3::types::PyByteArray>()
        || value.is_instance_of::<pyo3::types::PyMemoryView>()
    {
        return py
            .get_type::<PyBytes>()
            .call1((value,))
            .map(Bound::into_any);
    }
    Err(PyValueError::new_err(format!(
        "BYTES elements must be bytes or str, got {}",
        value.get_type().name()?
    )))
}

#[pymethods]
impl V2Codec {
    /// `outputs`: `(name, dtype name, torch dtype)` per model output, in
    /// order. `decoupled`: the model streams its responses (gRPC
    /// `ModelStreamInfer` only). `regions`: the server's shared-memory
    /// regions, which requests may then name (None: refused).
    /// `output_row_bytes`: per output, in order, the bytes of one row (of
    /// the whole output when not `batching`), or None where the model
    /// decides its size (BYTES, variable shapes); an output a request puts
    /// in a shared-memory range too small for it is then refused (400) as
    /// the request is decoded, before the model runs. None: not checked
    /// until the response is written. `ValueError` when its length is not
    /// the outputs'. `output_labels`: per output, in order, its class
    /// labels (Triton's classification extension answers a class with its
    /// label), or None.
    #[new]
    #[pyo3(signature = (model, outputs, *, max_body_size, max_elements, batching=true, decoupled=false, regions=None, output_row_bytes=None, output_labels=None))]
    #[allow(clippy::too_many_arguments)] // Python's keywords
    fn new(
        py: Python<'_>,
        model: &str,
        outputs: Vec<(String, String, Py<PyAny>)>,
        max_body_size: usize,
        max_elements: usize,
        batching: bool,
        decoupled: bool,
        regions: Option<PyRef<'_, SharedMemoryRegions>>,
        output_row_bytes: Option<Vec<Option<usize>>>,
        output_labels: Option<Vec<Option<Vec<String>>>>,
    ) -> PyResult<V2Codec> {
        let mut specs = Vec::with_capacity(outputs.len());
        let mut output_keys = Vec::with_capacity(outputs.len());
        let mut output_dtypes = Vec::with_capacity(outputs.len());
        for (name, dtype, torch_dtype) in outputs {
            output_keys.push(PyString::intern(py, &name).unbind());
            specs.push(OutputSpec {
                name,
                dtype: dtype_of(&dtype)?,
            });
            output_dtypes.push(torch_dtype);
        }
        let limits = Limits {
            max_body_size,
            max_elements,
        };
        let mut core = Codec::new(model, specs, limits);
        if !batching {
            core = core.without_batching();
        }
        if decoupled {
            core = core.decoupled_responses();
        }
        if let Some(regions) = regions {
            core = core.with_regions(regions.core.clone());
        }
        if let Some(labels) = output_labels {
            core = core.with_output_labels(labels);
        }
        if let Some(row_bytes) = output_row_bytes {
            if row_bytes.len() != core.outputs().len() {
                return Err(PyValueError::new_err(format!(
                    "output_row_bytes has {} entries but the model has {} outputs; give one \
                     per output, in order",
                    row_bytes.len(),
                    core.outputs().len()
                )));
            }
            core = core.with_output_row_bytes(row_bytes);
        }
        Ok(V2Codec {
            core,
            output_keys,
            output_dtypes,
            headers: Mutex::new(HeaderMemo::new()),
        })
    }

    /// Decodes a request body; `header_length` is the value of
    /// `Inference-Header-Content-Length` when the client sent one.
    #[pyo3(signature = (body, header_length=None))]
    fn decode(
        &self,
        py: Python<'_>,
        body: Bound<'_, PyBytes>,
        header_length: Option<&str>,
    ) -> PyResult<V2Request> {
        let bytes = body.as_bytes();
        // A small body may name regions of megabytes: copied without the GIL too.
        let regions = self.core.regions().is_some_and(|r| !r.is_empty());
        let decoded = sized_work(py, bytes.len(), regions, || {
            self.decode_remembered(bytes, header_length)
        });
        let request = decoded.map_err(|e| codec_error(py, e))?;
        self.request(py, request, &body)
    }

    /// The binary headers remembered now (at most
    /// `v2::REMEMBERED_HEADERS`; 0 while another thread decodes).
    fn remembered_headers(&self) -> usize {
        self.headers.try_lock().map_or(0, |memo| memo.len())
    }

    /// The response to `request`: `(body, header_length)`, `header_length`
    /// (for `Inference-Header-Content-Length`) `None` when the body is all
    /// JSON. `results`: output name -> tensor.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        request: &V2Request,
        results: &Bound<'py, PyDict>,
    ) -> PyResult<(Bound<'py, PyBytes>, Option<usize>)> {
        self.with_outputs(py, request, results, |outputs| {
            self.encoded(py, request, outputs)
        })
    }

    /// Triton's generate answer to `request` (the v2 request a generate
    /// request stood for): `results` written flat in one pass (see
    /// `ferrobatch_core::v2::Codec::encode_generate`); `as_event`: as one
    /// Server-Sent Event.
    #[pyo3(signature = (request, results, *, as_event=false))]
    fn encode_generate<'py>(
        &self,
        py: Python<'py>,
        request: &V2Request,
        results: &Bound<'py, PyDict>,
        as_event: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.with_outputs(py, request, results, |outputs| {
            let id = request.id.as_deref();
            let total: usize = outputs.iter().map(|o| o.data.len()).sum();
            let answer = sized_work(py, total, false, || self.core.encode_generate(id, outputs));
            let answer = answer.map_err(|e| codec_error(py, e))?;
            Ok(PyBytes::new(
                py,
                &if as_event {
                    generate::event(&answer)
                } else {
                    answer
                },
            ))
        })
    }
}

impl V2Codec {
    /// The outputs `request` selects, read from `results` (each asked for
    /// as classes: its top classes, BYTES), handed to `write`.
    fn with_outputs<'py, T>(
        &self,
        py: Python<'py>,
        request: &V2Request,
        results: &Bound<'py, PyDict>,
        write: impl FnOnce(&[Output<'_>]) -> PyResult<T>,
    ) -> PyResult<T> {
        let mut read = Vec::with_capacity(request.selected.len());
        for &(index, _) in &request.selected {
            let Some(key) = self.output_keys.get(index) else {
                // Decoded by another model's codec, with more outputs.
                let message = format!("output {index} is not one of this model's outputs");
                return Err(codec_error(py, V2Error::Output(message)));
            };
            let key = key.bind(py);
            let value = results.get_item(key)?.ok_or_else(|| {
                codec_error(
                    py,
                    V2Error::Output(format!("the model returned no output '{key}'")),
                )
            })?;
            read.push(self.read_output(py, index, value)?);
        }
        // Each output asked for as classes: its top classes (BYTES).
        let mut classified: Vec<Option<(Shape, Vec<u8>)>> = Vec::new();
        for (i, (&(index, _), r)) in request.selected.iter().zip(&read).enumerate() {
            if let Some(&Some(count)) = request.classes.get(i) {
                classified.resize(i, None);
                let classes = classify(py, &self.core, index, count, &r.shape, r.data());
                classified.push(Some(classes.map_err(|e| codec_error(py, e))?));
            }
        }
        let in_region = |i: usize| matches!(request.regions.get(i), Some(Some(_)));
        let outputs: Vec<Output<'_>> = request
            .selected
            .iter()
            .zip(&read)
            .enumerate()
            .map(|(i, (&(index, binary), r))| {
                let classes = classified.get(i).and_then(Option::as_ref);
                Output {
                    index,
                    shape: classes.map_or(&r.shape[..], |(shape, _)| &shape[..]),
                    data: classes.map_or(r.data(), |(_, data)| &data[..]),
                    // Written into its region, never among the binary bytes.
                    binary: binary && !in_region(i),
                    classified: classes.is_some(),
                }
            })
            .collect();
        write(&outputs)
    }

    /// [`V2Codec::encode`]'s answer for `outputs`, read from its results.
    fn encoded<'py>(
        &self,
        py: Python<'py>,
        request: &V2Request,
        outputs: &[Output<'_>],
    ) -> PyResult<(Bound<'py, PyBytes>, Option<usize>)> {
        let total: usize = outputs.iter().map(|o| o.data.len()).sum();
        let id = request.id.as_deref();
        let regions = &request.regions;
        let header = sized_work(py, total, false, || {
            self.core
                .encode_header_with_regions(id, outputs, regions, 0)
        });
        let (header, binary_bytes) = header.map_err(|e| codec_error(py, e))?;
        if !outputs.iter().any(|o| o.binary) {
            return Ok((PyBytes::new(py, &header), None));
        }
        let size = header
            .len()
            .checked_add(binary_bytes)
            .ok_or_else(|| codec_error(py, V2Error::Output("response too large".into())))?;
        let body = PyBytes::new_with(py, size, |buf| {
            let (head, mut rest) = buf.split_at_mut(header.len());
            head.copy_from_slice(&header);
            for o in outputs.iter().filter(|o| o.binary) {
                let (part, tail) = rest.split_at_mut(o.data.len());
                part.copy_from_slice(o.data);
                rest = tail;
            }
            Ok(())
        })?;
        Ok((body, Some(header.len())))
    }
}

/// [`Codec::classify`], without the GIL for an output large enough that
/// ranking it would hold other threads up.
pub(crate) fn classify(
    py: Python<'_>,
    codec: &Codec,
    index: usize,
    count: u32,
    shape: &[u64],
    data: &[u8],
) -> Result<(Shape, Vec<u8>), V2Error> {
    sized_work(py, data.len(), false, || {
        codec.classify(index, count, shape, data)
    })
}

impl V2Codec {
    fn request(
        &self,
        py: Python<'_>,
        request: InferRequest,
        body: &Bound<'_, PyBytes>,
    ) -> PyResult<V2Request> {
        let selected = request.selected_outputs(&self.core);
        let regions = request.output_regions();
        let classes = request.output_classes();
        let shared_memory = request.shared_memory;
        let inputs = PyDict::new(py);
        let mut bf16 = false;
        for input in request.inputs {
            bf16 |= input.dtype == DType::BFloat16;
            let storage = match input.data {
                Data::Owned(bytes) => Storage::Owned(bytes.into_boxed_slice()),
                Data::Body(range) => Storage::Body {
                    body: body.clone().unbind(),
                    start: range.start,
                    len: range.len(),
                },
            };
            let tensor = V2Tensor::new(py, input.dtype, &input.shape, storage)?;
            inputs.set_item(input.name, Py::new(py, tensor)?)?;
        }
        Ok(V2Request {
            id: request.id,
            timeout: request.timeout,
            priority: request.priority,
            parameters: request
                .parameters
                .and_then(|span| body.as_bytes().get(span))
                .map(|text| String::from_utf8_lossy(text).into_owned()),
            inputs: inputs.unbind(),
            bf16,
            selected,
            regions,
            classes,
            shared_memory,
        })
    }
}

// -- Triton's system shared-memory regions, which the codecs read and write --

/// The registry; its errors are `CodecError`s with the HTTP status to answer
/// (400; 404 for a region not registered).
#[pyclass(module = "ferrobatch._core", frozen)]
pub(crate) struct SharedMemoryRegions {
    pub(crate) core: SharedRegions,
}

fn region_error(py: Python<'_>, err: RegionError) -> PyErr {
    let status = match err {
        RegionError::NotFound(_) => 404,
        RegionError::Invalid(_) => 400,
    };
    status_error(py, status, err.to_string())
}

#[pymethods]
impl SharedMemoryRegions {
    #[new]
    fn new() -> SharedMemoryRegions {
        SharedMemoryRegions {
            core: SharedRegions::new(),
        }
    }

    /// Registers `byte_size` bytes of the shared-memory object `key`
    /// (`/name`), from `offset`, as region `name` (maps it).
    fn register(
        &self,
        py: Python<'_>,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> PyResult<()> {
        self.core
            .register(name, key, offset, byte_size)
            .map_err(|e| region_error(py, e))
    }

    /// Unregisters region `name` (empty: every region); an unknown name is
    /// no error.
    fn unregister(&self, name: &str) {
        self.core.unregister(name);
    }

    /// `(name, key, offset, byte_size)` of region `name`, or of every region
    /// for an empty name, by name.
    fn status(&self, py: Python<'_>, name: &str) -> PyResult<Vec<(String, String, u64, u64)>> {
        let regions = self.core.status(name).map_err(|e| region_error(py, e))?;
        Ok(regions
            .into_iter()
            .map(|r| (r.name, r.key, r.offset, r.byte_size))
            .collect())
    }

    fn __len__(&self) -> usize {
        self.core.status("").map_or(0, |all| all.len())
    }
}

/// Adds the codec's classes and `CodecError` to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let error = py.get_type::<CodecError>();
    error.setattr("status", 400)?;
    m.add("CodecError", error)?;
    m.add_class::<V2Codec>()?;
    m.add_class::<V2Request>()?;
    m.add_class::<V2Tensor>()?;
    m.add_class::<SharedMemoryRegions>()?;
    Ok(())
}

/// `tensor` as `dtype`, on the CPU and contiguous: an output's bytes as the
/// wire (or a shared-memory client) takes them; each step only when needed.
pub(crate) fn host_contiguous<'py>(
    py: Python<'py>,
    mut tensor: Bound<'py, PyAny>,
    dtype: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    if !tensor.getattr(intern!(py, "dtype"))?.is(dtype) {
        tensor = tensor.call_method1(intern!(py, "to"), (dtype,))?;
    }
    if !tensor.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        tensor = tensor.call_method0(intern!(py, "cpu"))?;
    }
    if !tensor
        .call_method0(intern!(py, "is_contiguous"))?
        .is_truthy()?
    {
        tensor = tensor.call_method0(intern!(py, "contiguous"))?;
    }
    Ok(tensor)
}

/// Checks that `body` is one JSON document by the v2 codec's rules (its
/// syntax and its nesting limit, `MAX_DEPTH`): `ValueError` with the
/// codec's message otherwise. For bodies that are not inference requests.
#[pyfunction]
pub fn check_json(body: &[u8]) -> PyResult<()> {
    let mut parser = ferrobatch_core::v2::json::Parser::new(body);
    parser.skip_value().and_then(|_| parser.end()).map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "malformed JSON: {} (at byte {})",
            e.message, e.offset
        ))
    })
}

/// The v2 JSON inference request a generate request `body` stands for (see
/// `ferrobatch_core::v2::generate`), for a model whose inputs are `inputs`,
/// `(name, datatype, shape)` as its metadata gives them; `CodecError` 400
/// with Triton's words otherwise.
#[pyfunction]
pub fn generate_request<'py>(
    py: Python<'py>,
    body: &[u8],
    inputs: Vec<(String, String, Vec<i64>)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let inputs: Vec<GenerateInput<'_>> = inputs
        .iter()
        .map(|(name, datatype, shape)| GenerateInput {
            name,
            datatype,
            shape,
        })
        .collect();
    let request = generate::infer_request(body, &inputs).map_err(|e| codec_error(py, e))?;
    Ok(PyBytes::new(py, &request))
}

/// The event that ends a `generate_stream` failed after its first response
/// (see `ferrobatch_core::v2::generate::error_event`).
#[pyfunction]
pub fn generate_error_event<'py>(py: Python<'py>, message: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &generate::error_event(message))
}

/// A request's `parameters` as a caller gives them to `submit`: a JSON
/// object's text, checked ([`ferrobatch_core::request::check_parameters`]),
/// or a mapping encoded by [`encode_parameters`]
/// (here, where a refusal is counted with the request's other refusals).
pub(crate) fn parameters_text(
    py: Python<'_>,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<String>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    if let Ok(text) = value.cast::<PyString>() {
        let text = text.to_str()?;
        ferrobatch_core::request::check_parameters(text).map_err(|e| invalid_input(py, e))?;
        return Ok(Some(text.to_owned()));
    }
    if let Ok(dict) = value.cast::<PyDict>() {
        return encode_parameters(py, dict).map(Some);
    }
    let mapping = py
        .import(intern!(py, "collections.abc"))?
        .getattr(intern!(py, "Mapping"))?;
    if value.is_instance(&mapping)? {
        let dict = py.get_type::<PyDict>().call1((value,))?;
        return encode_parameters(py, dict.cast::<PyDict>()?).map(Some);
    }
    let kind = value.get_type().name()?;
    Err(invalid_input(
        py,
        format!("parameters must be a mapping of name to value, got {kind}"),
    ))
}

/// A caller's parameters (a dict) as a JSON object's text, checked as the
/// v2 protocol has them: string names; bool, int, finite float or string
/// values (`InvalidInputError` otherwise). Floats keep a fraction or an
/// exponent, so they come back as floats.
#[pyfunction]
pub fn encode_parameters(py: Python<'_>, parameters: &Bound<'_, PyDict>) -> PyResult<String> {
    use pyo3::types::{PyBool, PyFloat, PyInt};
    let mut out = Vec::with_capacity(2 + 24 * parameters.len());
    out.push(b'{');
    for (i, (name, value)) in parameters.iter().enumerate() {
        let Ok(name) = name.cast::<PyString>() else {
            return Err(invalid_input(
                py,
                format!(
                    "parameter names must be strings, got {}",
                    clipped_repr(&name)
                ),
            ));
        };
        let not_text = |what: &str| {
            invalid_input(
                py,
                format!("parameter {what} is not valid text (a lone surrogate?)"),
            )
        };
        let shown = clipped_repr(name.as_any());
        let name = name
            .to_str()
            .map_err(|_| not_text(&format!("name {shown}")))?;
        if i > 0 {
            out.push(b',');
        }
        ferrobatch_core::v2::write_json_string(&mut out, name);
        out.push(b':');
        if let Ok(flag) = value.cast::<PyBool>() {
            out.extend_from_slice(if flag.is_true() { b"true" } else { b"false" });
        } else if value.is_instance_of::<PyInt>() {
            match value.extract::<i64>() {
                Ok(v) => out.extend_from_slice(v.to_string().as_bytes()),
                // Any size, by int's own repr (as json.dumps writes it): a
                // subclass's __str__ or __repr__ may say anything.
                Err(_) => {
                    let digits = py
                        .get_type::<PyInt>()
                        .call_method1(intern!(py, "__repr__"), (&value,))?;
                    out.extend_from_slice(digits.str()?.to_str()?.as_bytes());
                }
            }
        } else if let Some(v) = value
            .cast::<PyFloat>()
            .ok()
            .map(|f| f.value())
            .filter(|v| v.is_finite())
        {
            // `{:?}` keeps "1.0" a float ("1" would come back an int).
            out.extend_from_slice(format!("{v:?}").as_bytes());
        } else if let Ok(text) = value.cast::<PyString>() {
            let text = text.to_str().map_err(|_| not_text(&format!("'{name}'")))?;
            ferrobatch_core::v2::write_json_string(&mut out, text);
        } else {
            let kind = value.get_type().name()?;
            return Err(invalid_input(
                py,
                format!(
                    "parameter {} must be a bool, int, finite float or str, got {kind} {}",
                    clipped_repr(&name.into_pyobject(py)?.into_any()),
                    clipped_repr(&value)
                ),
            ));
        }
    }
    out.push(b'}');
    // Only JSON punctuation, digits and serde_json's escaped strings: UTF-8.
    String::from_utf8(out).map_err(|_| PyValueError::new_err("parameters are not UTF-8"))
}

/// `repr(value)`, cut to what an error message may echo.
fn clipped_repr(value: &Bound<'_, PyAny>) -> String {
    let text = value
        .repr()
        .and_then(|r| r.to_str().map(str::to_owned))
        .unwrap_or_else(|_| "?".to_owned());
    ferrobatch_core::v2::Clipped(&text).to_string()
}
