//! Binding of the access-restricted APIs (`ferrobatch_serve::restrict`)
//! for the Python front-ends: the groups parsed, a path's or a method's
//! category and the refusal's words are the native front-end's, so both
//! refuse alike. Only the lookup of a header in Python's headers or gRPC
//! metadata is here.

use ferrobatch_serve::restrict::{grpc_api, http_api, Protocol, Restriction};
use ferrobatch_serve::Restrictions;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

/// Parses Triton's `--http-restricted-api` or `--grpc-restricted-protocol`
/// groups; a bad one is a `ValueError` with the parser's message.
pub(crate) fn parse(groups: &[String], protocol: Protocol) -> PyResult<Restrictions> {
    Restrictions::parse(groups, protocol).map_err(PyValueError::new_err)
}

/// The restricted APIs of the Python front-ends (Triton's
/// `--http-restricted-api` and `--grpc-restricted-protocol` groups, each
/// `<apis>:<key>=<value>`).
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct ApiRestrictions {
    http: Restrictions,
    grpc: Restrictions,
}

#[pymethods]
impl ApiRestrictions {
    #[new]
    #[pyo3(signature = (http_restricted_api=Vec::new(), grpc_restricted_protocol=Vec::new()))]
    fn new(
        http_restricted_api: Vec<String>,
        grpc_restricted_protocol: Vec<String>,
    ) -> PyResult<ApiRestrictions> {
        Ok(ApiRestrictions {
            http: parse(&http_restricted_api, Protocol::Http)?,
            grpc: parse(&grpc_restricted_protocol, Protocol::Grpc)?,
        })
    }

    /// The refusal's message for an HTTP request to `path` when its API is
    /// restricted and `headers` (a mapping; names in any case) lack the
    /// header or its value; None when it may go on.
    fn http_refusal(&self, path: &str, headers: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
        let Some(restriction) = http_api(path).and_then(|api| self.http.get(api)) else {
            return Ok(None);
        };
        refusal(restriction, headers.call_method0("items")?)
    }

    /// The same for a gRPC call to `method` (its path,
    /// `/inference.GRPCInferenceService/<Method>`) and its invocation
    /// metadata, `(key, value)` pairs (a value `str` or `bytes`).
    fn grpc_refusal(&self, method: &str, metadata: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
        let Some(restriction) = grpc_api(method).and_then(|api| self.grpc.get(api)) else {
            return Ok(None);
        };
        refusal(restriction, metadata.clone())
    }

    /// Whether any API is restricted.
    fn __bool__(&self) -> bool {
        !(self.http.is_empty() && self.grpc.is_empty())
    }
}

/// `restriction`'s refusal when the first of `pairs` (`(name, value)`)
/// named as its header, ignoring case, is missing or has another value.
fn refusal(restriction: &Restriction, pairs: Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let mut given = None;
    for pair in pairs.try_iter()? {
        let (name, value) = pair?.extract::<(Bound<'_, PyString>, Bound<'_, PyAny>)>()?;
        if name.to_str()?.eq_ignore_ascii_case(restriction.header()) {
            given = Some(value);
            break;
        }
    }
    let admitted = match &given {
        None => false,
        Some(value) => {
            if let Ok(text) = value.cast::<PyString>() {
                restriction.admits(Some(text.to_str()?.as_bytes()))
            } else {
                restriction.admits(Some(value.cast::<PyBytes>()?.as_bytes()))
            }
        }
    };
    Ok((!admitted).then(|| restriction.refusal().to_owned()))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ApiRestrictions>()
}
