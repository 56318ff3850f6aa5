//! Binding of the native front-end (`ferrobatch-serve`): start and stop it
//! from Python, and hand it the batches whose requests it submitted.
//!
//! A model served natively gets a [`NativeSink`] in its `LoopRegistry`
//! (see `native_sink.rs`), to which its batches' `Sink::Connection` rows go.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrobatch_serve::restrict::Protocol;
use ferrobatch_serve::{
    Catalog, Config, Fallback, FallbackCall, FallbackReply, FallbackRequest, FallbackResponse,
    Frontend, Listen, ModelMetadata, Replies, ResponseCompression, ServedModel, ServerMetadata,
    TensorMetadata, Tls, TlsFiles, Withdraw,
};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::sync::oneshot;

use crate::batcher::Batcher;
use crate::codec::V2Codec;
use crate::loops::LoopRegistry;
use crate::native_sink::NativeSink;
use crate::restrict;
use crate::without_gil;

/// gRPC's status code INTERNAL.
const GRPC_INTERNAL: i32 = 13;
/// gRPC's status code UNIMPLEMENTED.
const GRPC_UNIMPLEMENTED: i32 = 12;

/// Calls the Python handlers for what the native routes do not answer:
/// `http(method, path, headers, body, answer) -> cancel` and
/// `grpc(method, request, answer) -> cancel` (None: gRPC's fallback calls
/// are UNIMPLEMENTED). Each starts the answer on the event loop and returns
/// at once; the handlers call `answer` (a [`FallbackAnswer`]) once with
/// `(status, headers, body)` (gRPC: `(code, message, response)`), or None
/// when answering failed (they log why); `cancel()` stops it (its client
/// went away).
struct PyFallback {
    http: Py<PyAny>,
    grpc: Option<Py<PyAny>>,
}

/// Where a fallback call's answer goes.
enum Waiting {
    Http(oneshot::Sender<FallbackResponse>),
    Grpc(&'static str, oneshot::Sender<FallbackReply>),
}

/// The callable the Python handlers answer a fallback call with: once, with
/// the answer, or None (answering failed).
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct FallbackAnswer {
    waiting: Mutex<Option<Waiting>>,
}

#[pymethods]
impl FallbackAnswer {
    #[pyo3(signature = (answer, /))]
    fn __call__(&self, answer: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let waiting = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match waiting {
            None => Ok(()), // answered already
            Some(Waiting::Http(tx)) => {
                let answered = answer.map(|a| a.extract::<HttpAnswer>()).transpose();
                let internal = || FallbackResponse {
                    status: 500,
                    headers: vec![("content-type".into(), "application/json".into())],
                    body: br#"{"error":"internal error"}"#.to_vec(),
                };
                let response = match answered {
                    Ok(Some((status, headers, body))) => FallbackResponse {
                        status,
                        headers,
                        body,
                    },
                    Ok(None) => internal(),
                    Err(err) => {
                        let _ = tx.send(internal());
                        return Err(err);
                    }
                };
                let _ = tx.send(response);
                Ok(())
            }
            Some(Waiting::Grpc(method, tx)) => {
                let answered = answer
                    .map(|a| a.extract::<(i32, String, Vec<u8>)>())
                    .transpose();
                let internal =
                    || Err((GRPC_INTERNAL, format!("internal error answering {method}")));
                let reply = match answered {
                    Ok(Some((0, _, response))) => Ok(response),
                    Ok(Some((code, message, _))) => Err((code, message)),
                    Ok(None) => internal(),
                    Err(err) => {
                        let _ = tx.send(internal());
                        return Err(err);
                    }
                };
                let _ = tx.send(reply);
                Ok(())
            }
        }
    }
}

/// An HTTP fallback answer: `(status, headers, body)`.
type HttpAnswer = (u16, Vec<(String, String)>, Vec<u8>);

impl PyFallback {
    /// Calls `handler(*args, answer)`; the `cancel` it returns withdraws the
    /// call. A handler that raises answers "internal error" at once.
    fn start<'py>(
        py: Python<'py>,
        handler: &Py<PyAny>,
        args: Vec<Bound<'py, PyAny>>,
        waiting: Waiting,
    ) -> Option<Withdraw> {
        let answer = match Py::new(
            py,
            FallbackAnswer {
                waiting: Mutex::new(Some(waiting)),
            },
        ) {
            Ok(answer) => answer,
            Err(err) => {
                err.print(py);
                return None; // the waiting sender is dropped: "internal error"
            }
        };
        let mut args = args;
        args.push(answer.clone_ref(py).into_bound(py).into_any());
        let started =
            pyo3::types::PyTuple::new(py, args).and_then(|args| handler.bind(py).call1(args));
        match started {
            Ok(cancel) if !cancel.is_none() => {
                let cancel = cancel.unbind();
                Some(Box::new(move || {
                    Python::attach(|py| {
                        if let Err(err) = cancel.bind(py).call0() {
                            err.print(py);
                        }
                    })
                }))
            }
            Ok(_) => None,
            Err(err) => {
                err.print(py);
                let _ = answer.get().__call__(None);
                None
            }
        }
    }
}

impl Fallback for PyFallback {
    fn call(
        &self,
        request: FallbackRequest,
        answer: oneshot::Sender<FallbackResponse>,
    ) -> Option<Withdraw> {
        Python::attach(|py| {
            let args = (
                request.method,
                request.path,
                request.headers,
                PyBytes::new(py, &request.body),
            );
            let args = match args.into_pyobject(py) {
                Ok(args) => args.iter().collect(),
                Err(err) => {
                    err.print(py);
                    return None;
                }
            };
            PyFallback::start(py, &self.http, args, Waiting::Http(answer))
        })
    }

    fn call_grpc(
        &self,
        call: FallbackCall,
        answer: oneshot::Sender<FallbackReply>,
    ) -> Option<Withdraw> {
        let Some(grpc) = &self.grpc else {
            let _ = answer.send(Err((
                GRPC_UNIMPLEMENTED,
                format!("{} is not implemented", call.method),
            )));
            return None;
        };
        Python::attach(|py| {
            let args = vec![
                pyo3::types::PyString::new(py, call.method).into_any(),
                PyBytes::new(py, &call.request).into_any(),
            ];
            PyFallback::start(py, grpc, args, Waiting::Grpc(call.method, answer))
        })
    }
}

/// `(name, datatype, shape)` of a tensor in a model's metadata.
type TensorMeta = (String, String, Vec<i64>);
/// `(name, platform, inputs, outputs)`: a model's metadata.
type ModelMeta = (String, String, Vec<TensorMeta>, Vec<TensorMeta>);
/// `(name, version, extensions)`: the server's metadata.
type ServerMeta = (String, String, Vec<String>);

fn metadata_of((name, platform, inputs, outputs): ModelMeta) -> ModelMetadata {
    let tensors = |tensors: Vec<TensorMeta>| {
        tensors
            .into_iter()
            .map(|(name, datatype, shape)| TensorMetadata {
                name,
                datatype,
                shape,
            })
            .collect()
    };
    ModelMetadata {
        name,
        platform,
        inputs: tensors(inputs),
        outputs: tensors(outputs),
    }
}

fn catalog(server: Option<ServerMeta>, models: Vec<ModelMeta>) -> Catalog {
    let server = server.map_or_else(
        || ServerMetadata {
            name: "ferrobatch".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: Vec::new(),
        },
        |(name, version, extensions)| ServerMetadata {
            name,
            version,
            extensions,
        },
    );
    let models = models.into_iter().map(metadata_of).collect();
    Catalog { server, models }
}

/// The native front-end of a set of models (HTTP, gRPC or both), listening
/// until `stop()`.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct NativeFrontend {
    frontend: Frontend,
}

#[pymethods]
impl NativeFrontend {
    /// Binds `host:port` for HTTP and `host:grpc_port` for gRPC (0: any
    /// free port; None: not that one). HTTP requests are answered with
    /// `fallback(method, path, headers, body, answer) -> cancel`, which
    /// returns at once and calls `answer((status, headers, body))` later
    /// (see [`PyFallback`]), and gRPC inference UNAVAILABLE, until `serve()` names the models
    /// served natively. gRPC's metadata RPCs answer `server_metadata`
    /// (`(name, version, extensions)`) and `model_metadata` (`(name,
    /// platform, inputs, outputs)` per model, each tensor `(name, datatype,
    /// shape)`); a model not in it is unknown to gRPC until served.
    /// `ModelConfig`, `ModelStatistics` and `RepositoryIndex` are answered by
    /// `grpc_fallback(method, request, answer) -> cancel`: the RPC's name and
    /// request message as protobuf bytes; `answer((code, message,
    /// response))`, code 0 and the response message's bytes, or a gRPC
    /// status code and its message (None: UNIMPLEMENTED).
    /// `http_restricted_api` and `grpc_restricted_protocol`: Triton's groups
    /// (`<apis>:<key>=<value>`), a request to a restricted API refused 403
    /// (gRPC: UNAVAILABLE) without its header; a bad group raises
    /// `ValueError`. Raises `OSError` when an address cannot be bound.
    /// `strict_readiness` (Triton's): the server is ready only while every
    /// model it serves is; false: while it is itself.
    /// `grpc_server_cert` and `grpc_server_key` (PEM files): gRPC over TLS
    /// (Triton's `--grpc-use-ssl`); with `grpc_use_ssl_mutual`, clients
    /// must present a certificate that `grpc_root_cert` signs. A file that
    /// cannot be read or used raises `ValueError` naming it.
    /// `grpc_response_compression` (Triton's
    /// `--grpc-infer-response-compression-level`): `none`, `low`, `medium`
    /// or `high`.
    #[new]
    #[pyo3(signature = (
        host, port, fallback, *, grpc_port=None, server_metadata=None, model_metadata=Vec::new(), grpc_fallback=None,
        threads=1, max_body_size=64 << 20, max_decompressed_size=64 << 20, max_connections=10_000, max_streams=1024,
        header_timeout=30.0, body_timeout=60.0, idle_timeout=300.0, keepalive_interval=60.0, keepalive_timeout=None,
        http_header_forward_pattern=None, grpc_header_forward_pattern=None, max_stream_backlog=64 << 20,
        http_restricted_api=Vec::new(), grpc_restricted_protocol=Vec::new(), strict_readiness=true,
        grpc_server_cert=None, grpc_server_key=None, grpc_root_cert=None, grpc_use_ssl_mutual=false,
        grpc_response_compression="none",
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: &str,
        port: Option<u16>,
        fallback: Py<PyAny>,
        grpc_port: Option<u16>,
        server_metadata: Option<ServerMeta>,
        model_metadata: Vec<ModelMeta>,
        grpc_fallback: Option<Py<PyAny>>,
        threads: usize,
        max_body_size: usize,
        max_decompressed_size: usize,
        max_connections: usize,
        max_streams: u32,
        header_timeout: f64,
        body_timeout: f64,
        idle_timeout: f64,
        keepalive_interval: f64,
        keepalive_timeout: Option<f64>,
        http_header_forward_pattern: Option<&str>,
        grpc_header_forward_pattern: Option<&str>,
        max_stream_backlog: usize,
        http_restricted_api: Vec<String>,
        grpc_restricted_protocol: Vec<String>,
        strict_readiness: bool,
        grpc_server_cert: Option<PathBuf>,
        grpc_server_key: Option<PathBuf>,
        grpc_root_cert: Option<PathBuf>,
        grpc_use_ssl_mutual: bool,
        grpc_response_compression: &str,
    ) -> PyResult<NativeFrontend> {
        let pattern = |p: Option<&str>| {
            p.map(ferrobatch_serve::header_pattern)
                .transpose()
                .map_err(PyValueError::new_err)
        };
        let ip: IpAddr = match host {
            "localhost" => IpAddr::from([127, 0, 0, 1]),
            _ => host.parse().map_err(|_| {
                PyValueError::new_err(format!("host must be an IP address, got {host:?}"))
            })?,
        };
        let seconds = |what: &str, s: f64| {
            Duration::try_from_secs_f64(s)
                .map_err(|_| PyValueError::new_err(format!("{what} must be >= 0 seconds, got {s}")))
        };
        let grpc_tls = match (grpc_server_cert, grpc_server_key) {
            (None, None) if !grpc_use_ssl_mutual => None,
            (Some(cert), Some(key)) => {
                let files = TlsFiles {
                    cert,
                    key,
                    root: grpc_root_cert,
                    mutual: grpc_use_ssl_mutual,
                };
                Some(without_gil(py, || Tls::from_files(&files)).map_err(PyValueError::new_err)?)
            }
            _ => {
                return Err(PyValueError::new_err(
                    "gRPC over TLS needs both grpc_server_cert and grpc_server_key",
                ))
            }
        };
        let config = Config {
            threads,
            max_body_size,
            max_decompressed_size,
            max_connections,
            max_streams,
            header_timeout: seconds("header_timeout", header_timeout)?,
            body_timeout: seconds("body_timeout", body_timeout)?,
            idle_timeout: seconds("idle_timeout", idle_timeout)?,
            // 0: no pings.
            keepalive_interval: Some(seconds("keepalive_interval", keepalive_interval)?)
                .filter(|d| !d.is_zero()),
            keepalive_timeout: keepalive_timeout
                .map(|s| seconds("keepalive_timeout", s))
                .transpose()?,
            http_header_forward_pattern: pattern(http_header_forward_pattern)?,
            grpc_header_forward_pattern: pattern(grpc_header_forward_pattern)?,
            max_stream_backlog,
            http_restricted_api: restrict::parse(&http_restricted_api, Protocol::Http)?,
            grpc_restricted_protocol: restrict::parse(&grpc_restricted_protocol, Protocol::Grpc)?,
            strict_readiness,
            grpc_tls,
            grpc_response_compression: ResponseCompression::named(grpc_response_compression)
                .ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "grpc_response_compression must be 'none', 'low', 'medium' or 'high', got {grpc_response_compression:?}"
                    ))
                })?,
        };
        config.check().map_err(PyValueError::new_err)?;
        let listen = Listen {
            http: port.map(|port| SocketAddr::new(ip, port)),
            grpc: grpc_port.map(|port| SocketAddr::new(ip, port)),
            catalog: catalog(server_metadata, model_metadata),
        };
        let fallback = Arc::new(PyFallback {
            http: fallback,
            grpc: grpc_fallback,
        });
        let frontend = without_gil(py, || Frontend::start(listen, config, fallback))
            .map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok(NativeFrontend { frontend })
    }

    /// Serves `models` natively from now on: each a `(batcher, registry,
    /// codec, describe)` of a started server, where `describe(error) -> str`
    /// words a model failure for remote clients.
    #[allow(clippy::type_complexity)]
    fn serve(
        &self,
        models: Vec<(
            Bound<'_, Batcher>,
            Bound<'_, LoopRegistry>,
            Bound<'_, V2Codec>,
            Py<PyAny>,
        )>,
    ) {
        let mut served = Vec::with_capacity(models.len());
        for (batcher, registry, codec, describe) in models {
            let core_codec = codec.get().core().clone();
            let name = core_codec.model().to_owned();
            let replies = Arc::new(Replies::new(core_codec, batcher.get().core().clone()));
            registry.get().attach_native(NativeSink::new(
                replies.clone(),
                codec.unbind(),
                describe,
            ));
            served.push(ServedModel::new(
                &name,
                batcher.get().input_specs(),
                replies,
            ));
        }
        self.frontend.serve(served);
    }

    /// Knows `models` (each `(name, platform, inputs, outputs)`, as
    /// `model_metadata` at start) from now on: a model added while serving,
    /// before `serve` serves it (gRPC answers its metadata, and UNAVAILABLE
    /// to its inference until then).
    fn know(&self, model_metadata: Vec<ModelMeta>) {
        self.frontend
            .know(model_metadata.into_iter().map(metadata_of).collect());
    }

    /// The port HTTP listens on (None: no HTTP).
    #[getter]
    fn port(&self) -> Option<u16> {
        self.frontend.local_addr().map(|a| a.port())
    }

    /// The port gRPC listens on (None: no gRPC).
    #[getter]
    fn grpc_port(&self) -> Option<u16> {
        self.frontend.grpc_addr().map(|a| a.port())
    }

    /// Readiness answers 200 once ready (and not draining), 503 before.
    fn set_ready(&self, ready: bool) {
        self.frontend.set_ready(ready)
    }

    /// Model `name`'s readiness (and the server's) says whether its
    /// instances can run batches; false if the model is not served.
    fn set_model_ready(&self, name: &str, ready: bool) -> bool {
        self.frontend.set_model_ready(name, ready)
    }

    /// Readiness says 503 and responses ask clients to close; requests are
    /// still served.
    fn drain(&self) {
        self.frontend.drain()
    }

    /// Stops listening and asks connections to close once answered; waits
    /// for that at most `grace` seconds. Open connections still write the
    /// answers their requests get later (the server stopping answers them).
    /// Blocks (without the GIL).
    fn close(&self, py: Python<'_>, grace: f64) {
        let grace = grace_period(grace);
        without_gil(py, || self.frontend.close(grace));
    }

    /// `close(grace)`, then up to `grace` more seconds for open connections
    /// to write their answers, then stops. Blocks (without the GIL).
    #[pyo3(signature = (grace=5.0))]
    fn stop(&self, py: Python<'_>, grace: f64) {
        let grace = grace_period(grace);
        without_gil(py, || self.frontend.stop(grace));
    }
}

/// A grace period in seconds: none for NaN or a negative one, no end for
/// one too long to represent (`inf`: wait as long as it takes).
fn grace_period(seconds: f64) -> Duration {
    if seconds.is_nan() || seconds <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
}

/// `text`, a client's string, as error messages echo it: cut to 80
/// characters, with "..." when cut (the core's one rule, for the Python
/// handlers' messages too).
#[pyfunction]
fn clipped(text: &str) -> String {
    ferrobatch_core::v2::short(text)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(clipped, m)?)?;
    m.add_class::<NativeFrontend>()?;
    m.add_class::<FallbackAnswer>()?;
    Ok(())
}
