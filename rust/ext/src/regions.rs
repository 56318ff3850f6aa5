//! `SharedMemoryRegions`: a server's registry of Triton system shared-memory
//! regions ([`ferrobatch_core::v2::regions`]), for the Python handlers of
//! the register, unregister and status calls, and for each model's
//! `V2Codec` (which reads and writes the regions requests name).

use ferrobatch_core::v2::regions::{RegionError, SharedRegions};
use pyo3::prelude::*;

use crate::codec::status_error;

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
