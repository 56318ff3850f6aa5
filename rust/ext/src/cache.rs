//! `ResponseCache`: the core's response cache as a Python object, shared
//! by the servers given it (one namespace each), and what it keeps per
//! result ([`CachedResult`]): a request's rows of the batch's outputs.
//! Fixed-shape tensor outputs are kept as their rows' bytes, copied here
//! (no Python object per entry: thousands of them would cost the cycle
//! collector); any other kind as a Python object that the server's own code
//! (`_cache.py`) cut out and joins back.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr::NonNull;
use std::sync::Arc;

use ferrobatch_core::{ResponseCache as CoreCache, SharedCache};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList};

use crate::without_gil;

/// A bounded, least-recently-used cache of model results, by the bytes of
/// their requests' inputs (Triton's response cache). Give one to several
/// servers (`Server(response_cache=...)`) to share its bytes between them.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct ResponseCache {
    pub(crate) core: Arc<SharedCache>,
}

/// One kept result.
pub(crate) enum CachedResult {
    /// Each output's rows' bytes, in the order of `CachedRows.fixed`.
    Rows(Vec<SystemBytes>),
    /// What `CachedRows.cut` made, read back only by `CachedRows.join`.
    Object(Py<PyAny>),
}

/// Bytes kept in memory from the system's allocator rather than this
/// module's mimalloc: mimalloc asks for transparent huge pages, and a cache
/// filling or turning over with large results then waited on the kernel
/// zeroing (and compacting for) a fresh 2 MiB page again and again (16 KiB
/// results, all misses: 0.08x the requests per second without a cache; see
/// benches/README.md).
pub(crate) struct SystemBytes {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: it owns its bytes alone (as a Box<[u8]> would); nothing aliases them.
unsafe impl Send for SystemBytes {}
// SAFETY: shared access only reads the bytes.
unsafe impl Sync for SystemBytes {}

impl SystemBytes {
    /// A copy of `data`; `None` if the system cannot allocate it.
    fn copy_of(data: &[u8]) -> Option<SystemBytes> {
        if data.is_empty() {
            return Some(SystemBytes {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        let layout = Layout::array::<u8>(data.len()).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { System.alloc(layout) })?;
        // SAFETY: `ptr` is a fresh allocation of `data.len()` bytes, which
        // cannot overlap `data`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.as_ptr(), data.len()) };
        Some(SystemBytes {
            ptr,
            len: data.len(),
        })
    }
}

impl std::ops::Deref for SystemBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialized bytes (or is dangling with
        // `len` 0), owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SystemBytes {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if let Ok(layout) = Layout::array::<u8>(self.len) {
            // SAFETY: allocated by `System` with this very layout in `copy_of`.
            unsafe { System.dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// A batch's outputs as contiguous CPU tensors, in the order of `names`
/// (the `fixed` outputs of the server's `CachedRows`), kept alive while
/// their bytes are read ([`FixedColumns::bytes`]).
pub(crate) struct FixedColumns<'py> {
    tensors: Vec<Bound<'py, PyAny>>,
    /// Each one's `(address, length, bytes per row)`.
    layout: Vec<(usize, usize, usize)>,
}

/// The bytes of [`FixedColumns`], readable without the GIL for as long as
/// the columns live.
pub(crate) struct ColumnBytes<'a> {
    layout: &'a [(usize, usize, usize)],
}

impl<'py> FixedColumns<'py> {
    /// `outputs` (of a batch of `rows` rows) as fixed columns; `None` when
    /// one is not a contiguous CPU tensor with `rows` rows (its rows are
    /// then cut in Python).
    pub(crate) fn read(
        outputs: &Bound<'py, PyDict>,
        names: &[Py<PyAny>],
        rows: usize,
    ) -> PyResult<Option<FixedColumns<'py>>> {
        let py = outputs.py();
        if names.is_empty() || outputs.len() != names.len() || rows == 0 {
            return Ok(None);
        }
        let mut tensors = Vec::with_capacity(names.len());
        let mut layout = Vec::with_capacity(names.len());
        for name in names {
            let Some(tensor) = outputs.get_item(name.bind(py))? else {
                return Ok(None);
            };
            if !tensor.hasattr(intern!(py, "data_ptr"))?
                || !tensor
                    .call_method0(intern!(py, "is_contiguous"))?
                    .extract::<bool>()?
                || tensor
                    .getattr(intern!(py, "device"))?
                    .getattr(intern!(py, "type"))?
                    .extract::<String>()?
                    != "cpu"
            {
                return Ok(None);
            }
            let ptr: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
            let len: usize = tensor.getattr(intern!(py, "nbytes"))?.extract()?;
            let leading: usize = tensor
                .getattr(intern!(py, "shape"))?
                .get_item(0)
                .and_then(|d| d.extract())
                .unwrap_or(0);
            if leading != rows || len % rows != 0 {
                return Ok(None);
            }
            tensors.push(tensor);
            layout.push((ptr, len, len / rows));
        }
        Ok(Some(FixedColumns { tensors, layout }))
    }

    pub(crate) fn bytes(&self) -> ColumnBytes<'_> {
        debug_assert_eq!(self.tensors.len(), self.layout.len());
        ColumnBytes {
            layout: &self.layout,
        }
    }
}

impl ColumnBytes<'_> {
    /// Rows `start..start + rows` of every column, copied; with their bytes.
    pub(crate) fn rows(&self, start: usize, rows: usize) -> Option<(CachedResult, usize)> {
        let mut kept = Vec::with_capacity(self.layout.len());
        let mut nbytes = 0usize;
        for (ptr, len, row_nbytes) in self.layout {
            let from = start.checked_mul(*row_nbytes)?;
            let to = from.checked_add(rows.checked_mul(*row_nbytes)?)?;
            // SAFETY: (ptr, len) is a contiguous CPU tensor's memory; the
            // `FixedColumns` this borrows from keeps the tensor alive, and a
            // finished batch's outputs are no longer written.
            let all = unsafe { crate::codec::bytes_at(*ptr, *len) };
            let part = SystemBytes::copy_of(all.get(from..to)?)?;
            // Its bytes as the allocator rounds them, and its slot in the list.
            let held = part
                .len()
                .div_ceil(16)
                .saturating_mul(16)
                .saturating_add(16);
            nbytes = nbytes.saturating_add(held);
            kept.push(part);
        }
        Some((CachedResult::Rows(kept), nbytes))
    }
}

/// The outputs of a batch made of `parts` (each hit's rows and result,
/// back to back over `rows`), joined by `cached_rows` (the server's
/// `CachedRows`): each fixed column's bytes in one `bytearray` when every
/// result is kept as bytes, else each part as its Python object.
pub(crate) fn join<'py>(
    cached_rows: &Bound<'py, PyAny>,
    parts: &[(u32, &CachedResult)],
    rows: u32,
) -> PyResult<Bound<'py, PyDict>> {
    let py = cached_rows.py();
    let as_bytes: Option<Vec<&Vec<SystemBytes>>> = parts
        .iter()
        .map(|(_, kept)| match kept {
            CachedResult::Rows(columns) => Some(columns),
            CachedResult::Object(_) => None,
        })
        .collect();
    if let Some(all) = as_bytes {
        let width = all.first().map_or(0, |columns| columns.len());
        let columns = PyList::empty(py);
        for i in 0..width {
            let total: usize = all.iter().filter_map(|c| c.get(i)).map(|b| b.len()).sum();
            // Written straight into the bytearray the joined tensor views.
            let joined = PyByteArray::new_with(py, total, |buffer| {
                let mut at = 0;
                for part in all.iter().filter_map(|c| c.get(i)) {
                    if let Some(to) = buffer.get_mut(at..at + part.len()) {
                        to.copy_from_slice(part);
                    }
                    at += part.len();
                }
                Ok(())
            })?;
            columns.append(joined)?;
        }
        let joined = cached_rows.call_method1(intern!(py, "join_rows"), (columns, rows))?;
        return Ok(joined.cast_into::<PyDict>()?);
    }
    let objects = PyList::empty(py);
    let mut start = 0u32;
    for (n, kept) in parts {
        let value = match kept {
            CachedResult::Object(value) => value.clone_ref(py).into_bound(py),
            CachedResult::Rows(columns) => {
                let one = PyList::empty(py);
                for column in columns {
                    one.append(PyByteArray::new(py, column))?;
                }
                cached_rows.call_method1(intern!(py, "join_rows"), (one, *n))?
            }
        };
        objects.append((start, *n, value))?;
        start = start.saturating_add(*n);
    }
    let joined = cached_rows.call_method1(intern!(py, "join"), (objects, rows))?;
    Ok(joined.cast_into::<PyDict>()?)
}

#[pymethods]
impl ResponseCache {
    #[new]
    fn new(max_bytes: &Bound<'_, PyAny>) -> PyResult<ResponseCache> {
        let size = if max_bytes.is_instance_of::<pyo3::types::PyBool>() {
            None
        } else {
            max_bytes.extract::<usize>().ok().filter(|&n| n > 0)
        };
        let Some(max_bytes) = size else {
            return Err(PyValueError::new_err(format!(
                "a response cache needs max_bytes, an int > 0, got {max_bytes}"
            )));
        };
        Ok(ResponseCache {
            core: Arc::new(CoreCache::new(max_bytes)),
        })
    }

    /// The most bytes it keeps (results as sized when kept, keys included).
    #[getter]
    fn max_bytes(&self) -> usize {
        self.core.counts().max_bytes
    }

    /// A namespace of its own for one server's entries.
    fn namespace(&self) -> u64 {
        self.core.namespace()
    }

    /// Drops the entries of `namespace` (a server whose weights changed).
    /// Looked through without the GIL; what was kept is dropped with it.
    fn forget(&self, py: Python<'_>, namespace: u64) {
        let core = &self.core;
        drop(without_gil(py, || core.forget(namespace)));
    }

    /// Drops every entry (looked through without the GIL, as `forget`).
    fn clear(&self, py: Python<'_>) {
        let core = &self.core;
        drop(without_gil(py, || core.clear()));
    }

    /// `{entries, bytes, max_bytes, evictions, too_large}`: what it holds
    /// now, entries dropped for room, and results never kept (larger than
    /// the whole cache).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Its lock is never held by a thread waiting for the GIL (values
        // are dropped outside it), so taking it with the GIL is safe.
        let c = self.core.counts();
        let d = PyDict::new(py);
        d.set_item("entries", c.entries)?;
        d.set_item("bytes", c.bytes)?;
        d.set_item("max_bytes", c.max_bytes)?;
        d.set_item("evictions", c.evictions)?;
        d.set_item("too_large", c.too_large)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let c = self.core.counts();
        format!(
            "ResponseCache(max_bytes={}, entries={}, bytes={})",
            c.max_bytes, c.entries, c.bytes
        )
    }
}
