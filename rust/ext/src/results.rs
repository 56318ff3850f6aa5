//! What callers of a finished batch get, for every way in that answers
//! with Python objects (event loops, blocked threads) or words a failure
//! from them (the native front-end, shared memory): a batch's outcome, the
//! `ModelError` of a failed batch or row, and each request's rows of the
//! outputs.

use std::sync::Arc;

use ferrobatch_core::{Outcome, Route};
use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice, PyTuple};

use crate::errors::{describe, error_class, ferrobatch_error};

/// What a caller that got `error` saw.
pub(crate) fn outcome_of_error(py: Python<'_>, error: &Bound<'_, PyAny>) -> Outcome {
    let classes = [
        ("InvalidInputError", Outcome::InvalidInput),
        ("QueueFullError", Outcome::QueueFull),
        ("DeadlineExceededError", Outcome::DeadlineExceeded),
        ("ServerClosedError", Outcome::ServerClosed),
    ];
    for (class, outcome) in classes {
        if error_class(py, class).is_ok_and(|c| error.is_instance(&c).unwrap_or(false)) {
            return outcome;
        }
    }
    Outcome::ModelError
}

/// The class of the error a caller who saw `outcome` gets.
fn error_class_of(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::InvalidInput => "InvalidInputError",
        Outcome::QueueFull => "QueueFullError",
        Outcome::DeadlineExceeded => "DeadlineExceededError",
        Outcome::ServerClosed => "ServerClosedError",
        _ => "ModelError",
    }
}

/// What the callers of a batch (or of a request) whose model call raised
/// `error` get: a `ModelError` naming the model, caused by `error` (unless
/// it is one already); or, when `error` is another of ferrobatch's errors
/// (a model that forwards requests, whose downstream refused them), an
/// error of that class with its words, counted under its outcome. `what`
/// says how the batch failed ("raised", or why its rows could not be
/// delivered: always a `ModelError`). The message is made once, and cannot
/// raise.
pub(crate) struct ModelFailure {
    outcome: Outcome,
    message: String,
    cause: Option<Py<PyAny>>,
}

impl ModelFailure {
    /// The failure of callers whose model call raised `error`.
    pub(crate) fn raised(
        py: Python<'_>,
        model_name: &str,
        error: &Bound<'_, PyAny>,
    ) -> ModelFailure {
        let outcome = outcome_of_error(py, error);
        if outcome == Outcome::ModelError {
            return ModelFailure::new(py, model_name, error, "raised");
        }
        let message = match error.str() {
            Ok(own) => own.to_string(),
            Err(_) => describe(py, &PyErr::from_value(error.clone())),
        };
        ModelFailure {
            outcome,
            message,
            cause: Some(error.clone().unbind()),
        }
    }

    /// A `ModelError`: the model's call `what` (raised, or returned what
    /// could not be delivered) `error`.
    pub(crate) fn new(
        py: Python<'_>,
        model_name: &str,
        error: &Bound<'_, PyAny>,
        what: &str,
    ) -> ModelFailure {
        let is_model_error =
            error_class(py, "ModelError").is_ok_and(|c| error.is_instance(&c).unwrap_or(false));
        let text = describe(py, &PyErr::from_value(error.clone()));
        if is_model_error {
            // Its own words, which name the model already (not "model 'm':
            // ModelError: model 'm': ...").
            let named = format!("model '{model_name}'");
            let message = match error.str().map(|t| t.to_string()) {
                Ok(own) if own.starts_with(&named) => own,
                Ok(own) => format!("{named}: {own}"),
                Err(_) => format!("{named}: {text}"),
            };
            ModelFailure {
                outcome: Outcome::ModelError,
                message,
                cause: None,
            }
        } else {
            ModelFailure {
                outcome: Outcome::ModelError,
                message: format!("model '{model_name}' {what} {text}"),
                cause: Some(error.clone().unbind()),
            }
        }
    }

    /// What its callers saw.
    pub(crate) fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// The message every caller of the failed batch gets.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// A fresh error for one caller: one instance raised in many tasks or
    /// threads would collect all their tracebacks.
    pub(crate) fn error(&self, py: Python<'_>) -> PyErr {
        let err = ferrobatch_error(py, error_class_of(self.outcome), self.message.clone());
        if let Some(cause) = &self.cause {
            err.set_cause(py, Some(PyErr::from_value(cause.bind(py).clone())));
        }
        err
    }
}

/// A finished batch's outcome: its `outputs` (`{name: batch tensor}`) or the
/// error its model call raised.
pub(crate) type BatchOutcome = Result<Py<PyDict>, Py<PyAny>>;

/// Requests of a batch that failed alone, by their first row (sorted):
/// each gets `ModelError` caused by its exception.
pub(crate) type FailedRows = Arc<Vec<(u32, Py<PyAny>)>>;

/// The error of the request whose rows start at `start`, if it failed alone.
pub(crate) fn failed_alone(failed: Option<&FailedRows>, start: u32) -> Option<&Py<PyAny>> {
    let failed = failed?;
    let i = failed
        .binary_search_by_key(&start, |(first, _)| *first)
        .ok()?;
    Some(&failed[i].1)
}

/// A finished batch's outputs (`{name: batch tensor}`), cut into each
/// request's result: `{name: outputs[name][start:start + rows]}` for a
/// multi-row request, `{name: outputs[name].unbind(0)[start]}` for a
/// one-sample one (each output unbound at most once per batch, and only if
/// a one-sample request needs it). The one place every Python sink owner
/// (event loops, thread waiters) takes rows from.
pub(crate) struct ResultRows<'py> {
    py: Python<'py>,
    columns: Vec<Column<'py>>,
}

/// One output of a batch: its name, the batch tensor, and its rows once a
/// one-sample request needs them.
struct Column<'py> {
    name: Bound<'py, PyAny>,
    whole: Bound<'py, PyAny>,
    rows: Option<Bound<'py, PyTuple>>,
    kind: ColumnKind,
}

/// What a batch output is, so how a request's rows are taken from it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ColumnKind {
    /// A torch tensor: unbound once per batch for one-sample requests.
    Tensor,
    /// Anything with `request_rows(start, rows, batched)` (a
    /// variable-length output, which knows each row's length).
    Rows,
    /// Anything indexable by row (a numpy object array of BYTES).
    Indexed,
}

impl<'py> ResultRows<'py> {
    pub(crate) fn new(outputs: &Bound<'py, PyDict>) -> ResultRows<'py> {
        let py = outputs.py();
        let columns = outputs
            .iter()
            .map(|(name, whole)| {
                let has = |attr| whole.hasattr(attr).unwrap_or(false);
                let kind = if has(intern!(py, "unbind")) {
                    ColumnKind::Tensor
                } else if has(intern!(py, "request_rows")) {
                    ColumnKind::Rows
                } else {
                    ColumnKind::Indexed
                };
                Column {
                    name,
                    whole,
                    rows: None,
                    kind,
                }
            })
            .collect();
        ResultRows {
            py: outputs.py(),
            columns,
        }
    }

    /// The result of the request `route` routes (`batched`: a multi-row
    /// request, whose result keeps the batch dimension).
    pub(crate) fn result(&mut self, route: &Route, batched: bool) -> PyResult<Bound<'py, PyDict>> {
        let py = self.py;
        let result = PyDict::new(py);
        let start = route.start as usize;
        for column in &mut self.columns {
            let value = if column.kind == ColumnKind::Rows {
                column.whole.call_method1(
                    intern!(py, "request_rows"),
                    (start, route.rows as usize, batched),
                )?
            } else if batched {
                let end = start.saturating_add(route.rows as usize);
                let (Ok(start), Ok(end)) = (isize::try_from(start), isize::try_from(end)) else {
                    return Err(PyRuntimeError::new_err("row index out of range"));
                };
                column.whole.get_item(PySlice::new(py, start, end, 1))?
            } else if column.kind == ColumnKind::Indexed {
                column.whole.get_item(start)?
            } else {
                let rows = match &mut column.rows {
                    Some(rows) => rows,
                    none => none.insert(
                        column
                            .whole
                            .call_method1(intern!(py, "unbind"), (0,))?
                            .cast_into::<PyTuple>()?,
                    ),
                };
                rows.get_item(start)?
            };
            result.set_item(&column.name, value)?;
        }
        Ok(result)
    }
}

/// The answers of a finished batch's requests, for the ways in that answer
/// with Python objects (event loops, blocked threads): each request's rows
/// of the outputs, or the error of its batch or of its own rows (see
/// [`ModelFailure`]).
pub(crate) struct BatchAnswers<'a, 'py> {
    py: Python<'py>,
    model_name: &'a str,
    rows: Result<ResultRows<'py>, ModelFailure>,
    failed: Option<&'a FailedRows>,
}

impl<'a, 'py> BatchAnswers<'a, 'py> {
    pub(crate) fn new(
        py: Python<'py>,
        model_name: &'a str,
        outcome: &'a BatchOutcome,
        failed: Option<&'a FailedRows>,
    ) -> BatchAnswers<'a, 'py> {
        let rows = match outcome {
            Ok(outputs) => Ok(ResultRows::new(outputs.bind(py))),
            Err(error) => Err(ModelFailure::raised(py, model_name, error.bind(py))),
        };
        BatchAnswers {
            py,
            model_name,
            rows,
            failed,
        }
    }

    /// The answer of the request `route` routes (`batched`: a multi-row
    /// request): its result, or the error it gets with the outcome it is
    /// counted under.
    pub(crate) fn answer(
        &mut self,
        route: &Route,
        batched: bool,
    ) -> Result<Bound<'py, PyDict>, (PyErr, Outcome)> {
        let py = self.py;
        let rows = match &mut self.rows {
            Ok(rows) => rows,
            Err(failure) => return Err((failure.error(py), failure.outcome())),
        };
        if let Some(error) = failed_alone(self.failed, route.start) {
            let failure = ModelFailure::raised(py, self.model_name, error.bind(py));
            return Err((failure.error(py), failure.outcome()));
        }
        rows.result(route, batched).map_err(|err| {
            let what = "returned outputs its rows could not be taken from:";
            let failure = ModelFailure::new(py, self.model_name, err.value(py), what);
            (failure.error(py), Outcome::ModelError)
        })
    }
}
