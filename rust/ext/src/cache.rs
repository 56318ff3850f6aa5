//! `ResponseCache`: the core's response cache as a Python object, shared
//! by the servers given it (one namespace each). What it keeps per result
//! is a Python object ([`CachedResult`]): the request's rows of the batch's
//! outputs, cut and joined by the server's own code (`_cache.py`), so every
//! output kind a model may return is kept as it was answered.

use std::sync::Arc;

use ferrobatch_core::{ResponseCache as CoreCache, SharedCache};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A bounded, least-recently-used cache of model results, by the bytes of
/// their requests' inputs (Triton's response cache). Give one to several
/// servers (`Server(response_cache=...)`) to share its bytes between them.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct ResponseCache {
    pub(crate) core: Arc<SharedCache>,
}

/// One kept result: what `_cache.py` cut out of a batch's outputs for one
/// request, read back only by the same code.
pub(crate) struct CachedResult {
    pub value: Py<PyAny>,
}

#[pymethods]
impl ResponseCache {
    #[new]
    fn new(max_bytes: usize) -> PyResult<ResponseCache> {
        if max_bytes == 0 {
            return Err(PyValueError::new_err(
                "a response cache needs max_bytes > 0",
            ));
        }
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
    fn forget(&self, namespace: u64) {
        self.core.forget(namespace)
    }

    /// Drops every entry.
    fn clear(&self) {
        self.core.clear()
    }

    /// `{entries, bytes, max_bytes, evictions, too_large}`: what it holds
    /// now, entries dropped for room, and results never kept (larger than
    /// the whole cache).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
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
