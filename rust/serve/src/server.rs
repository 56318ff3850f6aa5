//! The listener: a tokio runtime of its own, hyper serving HTTP/1.1 and
//! HTTP/2 cleartext (h2c, prior knowledge) on one port, bounded in
//! connections, streams, header and body time; graceful drain on stop.

use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::{watch, Semaphore};

use crate::http::{handle, Fallback};
use crate::model::ServedModel;

/// What the listener allows.
#[derive(Debug, Clone)]
pub struct Config {
    /// Threads of the front-end's runtime (network I/O, decode; encoding
    /// runs on the model's workers).
    pub threads: usize,
    pub max_body_size: usize,
    /// Connections open at once; more are closed on accept.
    pub max_connections: usize,
    /// HTTP/2 streams in flight per connection.
    pub max_streams: u32,
    /// Time for a request's headers to arrive (slowloris).
    pub header_timeout: Duration,
    /// Time for a request's body to arrive.
    pub body_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            threads: 1,
            max_body_size: 64 << 20,
            max_connections: 10_000,
            max_streams: 1024,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
        }
    }
}

/// What every connection's handlers share.
pub(crate) struct Shared {
    pub config: Config,
    models: RwLock<Vec<Arc<ServedModel>>>,
    pub fallback: Arc<dyn Fallback>,
    ready: AtomicBool,
    pub draining: AtomicBool,
    /// One permit per open connection, up to `config.max_connections`.
    connections: Arc<Semaphore>,
}

impl Shared {
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }

    /// Model `name` at `version` ("" or "1"), if served.
    pub fn model(&self, name: &str, version: &str) -> Option<Arc<ServedModel>> {
        if !(version.is_empty() || version == ferrobatch_core::v2::MODEL_VERSION) {
            return None;
        }
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        models.iter().find(|m| m.name == name).cloned()
    }
}

/// A running native front-end.
pub struct Frontend {
    runtime: Mutex<Option<Runtime>>,
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    stop: watch::Sender<Option<Duration>>,
    done: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl Frontend {
    /// Binds `addr` (so a port in use fails here, at once) and starts
    /// serving: every request goes to `fallback` until [`Frontend::serve`]
    /// names the models served natively, and readiness answers 503 until
    /// [`Frontend::set_ready`].
    pub fn start(
        addr: SocketAddr,
        config: Config,
        fallback: Arc<dyn Fallback>,
    ) -> io::Result<Frontend> {
        let listener = StdListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("ferrobatch-serve")
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared {
            models: RwLock::new(Vec::new()),
            fallback,
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            config,
        });
        let (stop, stopped) = watch::channel(None);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let listener = {
            let _guard = runtime.enter();
            TcpListener::from_std(listener)?
        };
        runtime.spawn(accept(listener, shared.clone(), stopped, done_tx));
        Ok(Frontend {
            runtime: Mutex::new(Some(runtime)),
            shared,
            local_addr,
            stop,
            done: Mutex::new(Some(done_rx)),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves `models` natively from now on (instead of those before).
    pub fn serve(&self, models: Vec<ServedModel>) {
        let models = models.into_iter().map(Arc::new).collect();
        *self.shared.models.write().unwrap_or_else(|e| e.into_inner()) = models;
    }

    pub fn set_ready(&self, ready: bool) {
        self.shared.ready.store(ready, Ordering::Relaxed);
    }

    /// Readiness says 503 and responses carry `Connection: close`; requests
    /// are still served.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::Relaxed);
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        let config = &self.shared.config;
        config.max_connections - self.shared.connections.available_permits().min(config.max_connections)
    }

    /// Closes the listener, asks every connection to close once its
    /// requests are answered, and waits for that for at most `grace`.
    /// Connections still open go on answering (whatever answers their
    /// requests, e.g. the server stopping) until [`Frontend::stop`].
    /// Blocks; call without the GIL.
    pub fn close(&self, grace: Duration) {
        self.drain();
        let _ = self.stop.send(Some(grace));
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(done) = done {
            // The accept task says when connections are finished (or the grace is over).
            let _ = done.recv_timeout(grace + Duration::from_secs(1));
        }
    }

    /// [`Frontend::close`], then waits up to `grace` more for the open
    /// connections to write their answers, and stops the runtime. Blocks.
    pub fn stop(&self, grace: Duration) {
        self.close(grace);
        let until = std::time::Instant::now() + grace;
        while self.open_connections() > 0 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        let runtime = self.runtime.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(runtime) = runtime {
            runtime.shutdown_timeout(Duration::from_millis(100));
        }
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

async fn accept(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<Option<Duration>>,
    done: std::sync::mpsc::Sender<()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(shared.config.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(shared.config.max_streams);
    let connections = shared.connections.clone();
    let graceful = GracefulShutdown::new();
    let grace = loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(permit) = connections.clone().try_acquire_owned() else {
                    continue; // over max_connections: dropping the stream closes it
                };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let service = service_fn(move |request| handle(shared.clone(), request));
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    let _ = connection.await;
                    drop(permit);
                });
            }
            changed = stopped.changed() => {
                let grace = *stopped.borrow();
                match (changed, grace) {
                    (Ok(()), Some(grace)) => break grace,
                    (Err(_), _) => break Duration::ZERO,
                    _ => {}
                }
            }
        }
    };
    drop(listener);
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
    let _ = done.send(());
}
