//! `ferrobatch._core`: thin pyo3 bindings over `ferrobatch-core`.
//!
//! This crate converts: Python objects to byte views and ids, core results
//! to Python objects, `CoreError` to the `ferrobatch.errors` hierarchy; and
//! it holds the part of fan-out that needs Python objects: each event loop's
//! mailbox of finished batches (`fanout.rs`) and the waiters of callers
//! blocked in plain threads (`threads.rs`). The GIL is released in one
//! place, [`without_gil`]. `native.rs` starts the native front-end
//! (`ferrobatch-serve`) and hands it the batches of the requests it submitted.

mod batcher;
mod codec;
mod errors;
mod fanout;
mod inputs;
mod loops;
mod native;
mod shm;
mod submit;
mod threads;

use pyo3::prelude::*;

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
    m.add_class::<batcher::Batcher>()?;
    m.add_class::<batcher::Ticket>()?;
    m.add_class::<batcher::Worker>()?;
    m.add_class::<batcher::Batch>()?;
    m.add_class::<loops::LoopRegistry>()?;
    m.add_class::<fanout::LoopMailbox>()?;
    m.add_class::<submit::Submitter>()?;
    m.add_function(wrap_pyfunction!(submit::after_fork_in_child, m)?)?;
    m.add_function(wrap_pyfunction!(codec::check_json, m)?)?;
    m.add_function(wrap_pyfunction!(codec::encode_parameters, m)?)?;
    codec::register(m)?;
    native::register(m)?;
    shm::register(m)?;
    Ok(())
}
