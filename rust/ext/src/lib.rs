//! `ferrobatch._core`: thin pyo3 bindings over `ferrobatch-core`.
//!
//! This crate converts: Python objects to byte views and ids, core results
//! to Python objects, `CoreError` to the `ferrobatch.errors` hierarchy; and
//! it holds the ways in that answer callers with Python objects or need
//! them to word a failure. Its modules, in layers (each uses only those
//! above it, so there is no import circle):
//!
//! 1. `errors`, `codec`, `inputs`, `results`, `cache`: conversions, what
//!    the callers of a finished batch get, and the response cache;
//! 2. the ways in, each only how an answer is handed over: `mailbox` (event
//!    loops), `threads` (blocked threads), `native_sink` (the native
//!    front-end's connections), `shm_sink` (shared-memory clients);
//! 3. `loops`: a model's registry of them, which routes each batch's rows;
//! 4. `batcher`, `submit`, `native`, `shm`, `restrict`: the Python classes
//!    (`native` starts the native front-end, `ferrobatch-serve`; `restrict`
//!    gives the Python front-ends its access-restricted APIs).
//!
//! The GIL is released in one place, [`without_gil`].

mod batcher;
mod cache;
mod codec;
mod errors;
mod grpc_codec;
mod inputs;
mod loops;
mod mailbox;
mod native;
mod native_sink;
mod restrict;
mod results;
mod shm;
mod shm_sink;
mod submit;
mod threads;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// Rust's allocations of this module (requests, replies, the front-end's
/// buffers) come from mimalloc: glibc's malloc and free were 8 % of the
/// native front-end's samples, on per-request buffers of a few sizes.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs slow native work with the GIL released (the one place that does).
pub(crate) fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    py.detach(f)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "REQUEST_BOUNDS_US",
        PyTuple::new(m.py(), ferrobatch_core::REQUEST_BOUNDS_US)?,
    )?;
    // Bounds the Python checks share with the Rust ones (one number each).
    m.add("MAX_QUEUE_SIZE", ferrobatch_core::MAX_QUEUE_SIZE)?;
    m.add("MAX_FRONT_END_THREADS", ferrobatch_serve::MAX_THREADS)?;
    m.add("MAX_CONNECTIONS", ferrobatch_serve::MAX_CONNECTIONS)?;
    m.add("MAX_SHARED_CLIENTS", ferrobatch_core::shm::MAX_CLIENTS)?;
    m.add("MAX_SHARED_CELLS", ferrobatch_core::shm::MAX_CELLS)?;
    m.add("MAX_SHARED_RING", ferrobatch_core::shm::MAX_RING)?;
    m.add_class::<batcher::Batcher>()?;
    m.add_class::<batcher::Worker>()?;
    m.add_class::<batcher::Batch>()?;
    m.add_class::<cache::ResponseCache>()?;
    m.add_class::<loops::LoopRegistry>()?;
    m.add_class::<mailbox::LoopMailbox>()?;
    m.add_class::<submit::Submitter>()?;
    m.add_function(wrap_pyfunction!(submit::after_fork_in_child, m)?)?;
    m.add_function(wrap_pyfunction!(codec::check_json, m)?)?;
    m.add_function(wrap_pyfunction!(codec::generate_request, m)?)?;
    m.add_function(wrap_pyfunction!(codec::generate_error_event, m)?)?;
    m.add(
        "GENERATE_ONE_RESPONSE",
        ferrobatch_core::v2::generate::ONE_RESPONSE,
    )?;
    m.add_function(wrap_pyfunction!(codec::dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(codec::inflate, m)?)?;
    m.add_function(wrap_pyfunction!(codec::compress, m)?)?;
    m.add_function(wrap_pyfunction!(codec::response_coding, m)?)?;
    m.add_function(wrap_pyfunction!(codec::encode_parameters, m)?)?;
    codec::register(m)?;
    m.add_class::<grpc_codec::GrpcInferRequest>()?;
    m.add_function(wrap_pyfunction!(grpc_codec::grpc_response, m)?)?;
    m.add_function(wrap_pyfunction!(grpc_codec::grpc_stream_error, m)?)?;
    native::register(m)?;
    shm::register(m)?;
    restrict::register(m)?;
    Ok(())
}
