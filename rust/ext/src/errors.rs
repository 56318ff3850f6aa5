//! The one mapping from `CoreError` to the Python exceptions of
//! `ferrobatch.errors` (defined in Python so they can subclass builtins).

use ferrobatch_core::CoreError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

pub(crate) fn error_class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let module =
        ERRORS.get_or_try_init(py, || py.import("ferrobatch.errors").map(Bound::unbind))?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

/// A `ferrobatch.errors.<name>` exception carrying `message`.
pub(crate) fn ferrobatch_error(py: Python<'_>, name: &str, message: String) -> PyErr {
    match error_class(py, name) {
        Ok(cls) => PyErr::from_type(cls, message),
        Err(e) => e,
    }
}

pub(crate) fn invalid_input(py: Python<'_>, message: String) -> PyErr {
    ferrobatch_error(py, "InvalidInputError", message)
}

pub(crate) fn to_pyerr(py: Python<'_>, err: CoreError) -> PyErr {
    let message = err.to_string();
    match err {
        CoreError::InvalidInput(_) => invalid_input(py, message),
        CoreError::QueueFull { .. } => ferrobatch_error(py, "QueueFullError", message),
        CoreError::Closed => ferrobatch_error(py, "ServerClosedError", message),
        CoreError::InvalidConfig(_) => pyo3::exceptions::PyValueError::new_err(message),
    }
}

/// True for the exceptions of `ferrobatch.errors` (what a failed submit counts).
pub(crate) fn is_ferrobatch_error(py: Python<'_>, err: &PyErr) -> bool {
    error_class(py, "FerrobatchError").is_ok_and(|cls| err.is_instance(py, &cls))
}

/// `str(error)` for a message, even when the exception's `__str__` raises.
pub(crate) fn describe(py: Python<'_>, error: &PyErr) -> String {
    let value = error.value(py);
    let kind = value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "exception".into());
    match value.str() {
        Ok(text) => format!("{kind}: {text}"),
        Err(_) => format!("{kind} (whose str() raised)"),
    }
}
