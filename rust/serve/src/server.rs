//! The listeners: a tokio runtime of its own, hyper serving HTTP/1.1 and
//! HTTP/2 cleartext (h2c, prior knowledge) on one port and gRPC (HTTP/2) on
//! another, bounded in connections, streams, header and body time; graceful
//! drain on stop.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::time::Sleep;

use crate::grpc::{self, ResponseCompression};
use crate::http::{handle, Fallback};
use crate::metadata::{Catalog, ModelMetadata, ServerMetadata};
use crate::model::ServedModel;
use crate::outbox::{Outbox, Sending};
use crate::restrict::Restrictions;
use crate::tls::Tls;

/// Where a front-end listens: HTTP, gRPC, or both (one runtime).
#[derive(Debug, Clone, Default)]
pub struct Listen {
    pub http: Option<SocketAddr>,
    pub grpc: Option<SocketAddr>,
    /// What gRPC's metadata RPCs answer, and the models it knows.
    pub catalog: Catalog,
}

impl From<SocketAddr> for Listen {
    /// HTTP only, on `addr`.
    fn from(addr: SocketAddr) -> Listen {
        Listen {
            http: Some(addr),
            ..Listen::default()
        }
    }
}

/// What a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http,
    Grpc,
}

/// What the listener allows.
#[derive(Debug, Clone)]
pub struct Config {
    /// Threads of the front-end's runtime (network I/O, decode; encoding
    /// runs on the model's workers).
    pub threads: usize,
    pub max_body_size: usize,
    /// The most bytes a gzip or deflate request body may inflate to (413
    /// beyond, found without allocating more).
    pub max_decompressed_size: usize,
    /// Connections open at once; more are closed on accept.
    pub max_connections: usize,
    /// HTTP/2 streams in flight per connection.
    pub max_streams: u32,
    /// Time for a request's headers to arrive (slowloris), and for a new
    /// connection's first bytes (HTTP/1 or the HTTP/2 preface).
    pub header_timeout: Duration,
    /// Time for a request's body to arrive.
    pub body_timeout: Duration,
    /// A connection with no request in flight for this long is closed
    /// (HTTP/2: GOAWAY, then closed once its streams are done).
    pub idle_timeout: Duration,
    /// HTTP/2 connections are pinged this often while idle, and closed when a
    /// ping is not answered within `keepalive_timeout` (`None`: no pings).
    pub keepalive_interval: Option<Duration>,
    /// How long a ping may go unanswered before its connection is closed
    /// (`None`: as long as `keepalive_interval`).
    pub keepalive_timeout: Option<Duration>,
    /// HTTP request headers whose (lowercase) names match join the request's
    /// parameters, for models that ask for them (Triton's
    /// `--http-header-forward-pattern`); `None`: none.
    pub http_header_forward_pattern: Option<regex::Regex>,
    /// The same for gRPC metadata (`--grpc-header-forward-pattern`).
    pub grpc_header_forward_pattern: Option<regex::Regex>,
    /// HTTP APIs answered only to requests with a header and value
    /// (Triton's `--http-restricted-api`); 403 to the others. Default: none.
    pub http_restricted_api: Restrictions,
    /// The same for gRPC (`--grpc-restricted-protocol`): UNAVAILABLE.
    pub grpc_restricted_protocol: Restrictions,
    /// The most bytes of a decoupled model's responses one
    /// `ModelStreamInfer` stream holds unread by its client; a response past
    /// them fails its request (RESOURCE_EXHAUSTED) instead of being held.
    pub max_stream_backlog: usize,
    /// Triton's `--strict-readiness`: the server is ready only while every
    /// model it serves is (true, the default); false: ready while it is
    /// itself, whatever its models' readiness.
    pub strict_readiness: bool,
    /// gRPC over TLS (Triton's `--grpc-use-ssl`); `None`: plaintext h2c.
    /// Its handshake is a new connection's first bytes: bounded by
    /// `header_timeout`.
    pub grpc_tls: Option<Tls>,
    /// gRPC responses compressed for calls that accept it (Triton's
    /// `--grpc-infer-response-compression-level`); default: none.
    pub grpc_response_compression: ResponseCompression,
}

/// The most runtime threads a front-end may have.
pub const MAX_THREADS: usize = 1024;
/// The most connections a front-end may hold open at once.
pub const MAX_CONNECTIONS: usize = 1 << 20;

impl Config {
    /// What is wrong with these numbers (each bounded before anything is
    /// started or allocated), or nothing.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_THREADS).contains(&self.threads) {
            return Err(format!(
                "threads must be from 1 to {MAX_THREADS}, got {}",
                self.threads
            ));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            return Err(format!(
                "max_connections must be from 1 to {MAX_CONNECTIONS}, got {}",
                self.max_connections
            ));
        }
        if self.max_streams == 0 {
            return Err("max_streams must be at least 1".into());
        }
        Ok(())
    }
}

/// A header-forwarding pattern: a regular expression found anywhere in a
/// header's name, ignoring case (header names are case-insensitive), as
/// Triton's `--http-header-forward-pattern` matches.
pub fn header_pattern(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(pattern)
        .case_insensitive(true)
        // Bounded compile: a pattern is configuration, but still bounded.
        .size_limit(1 << 20)
        .build()
        .map_err(|e| format!("invalid header forward pattern {pattern:?}: {e}"))
}

impl Default for Config {
    fn default() -> Self {
        Config {
            threads: 1,
            max_body_size: 64 << 20,
            max_decompressed_size: 64 << 20,
            max_connections: 10_000,
            max_streams: 1024,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(300),
            keepalive_interval: Some(Duration::from_secs(60)),
            keepalive_timeout: None,
            http_header_forward_pattern: None,
            grpc_header_forward_pattern: None,
            http_restricted_api: Restrictions::default(),
            grpc_restricted_protocol: Restrictions::default(),
            max_stream_backlog: 64 << 20,
            strict_readiness: true,
            grpc_tls: None,
            grpc_response_compression: ResponseCompression::None,
        }
    }
}

/// What every connection's handlers share.
pub(crate) struct Shared {
    pub config: Config,
    models: RwLock<Vec<Arc<ServedModel>>>,
    pub fallback: Arc<dyn Fallback>,
    /// Grows when a model is added while serving ([`Frontend::know`]).
    catalog: RwLock<Catalog>,
    ready: AtomicBool,
    pub draining: AtomicBool,
    /// One permit per open connection, up to `config.max_connections`.
    connections: Arc<Semaphore>,
    /// Connections beyond `max_connections`, for health checks only
    /// ([`HEADROOM`]).
    headroom: Arc<Semaphore>,
    /// Permits for CPU-heavy work on blocking threads ([`Shared::offload`]).
    offloaded: Arc<Semaphore>,
    /// Some once the front-end stops: open request streams take no more
    /// requests (those in flight are answered, then the stream ends).
    pub stopped: watch::Receiver<Option<Duration>>,
}

impl Shared {
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }

    /// The server's readiness: its own, and every model's with Triton's
    /// strict readiness ([`Config::strict_readiness`]).
    pub fn server_ready(&self) -> bool {
        if !self.config.strict_readiness {
            return self.is_ready();
        }
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        self.is_ready() && models.iter().all(|m| m.is_ready())
    }

    /// A served model's readiness: the server's own, and the model's.
    pub fn model_ready(&self, model: &ServedModel) -> bool {
        self.is_ready() && model.is_ready()
    }

    /// Model `name` at `version` ("" or "1"), if served.
    pub fn model(&self, name: &str, version: &str) -> Option<Arc<ServedModel>> {
        if !(version.is_empty() || version == ferrobatch_core::v2::MODEL_VERSION) {
            return None;
        }
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        models.iter().find(|m| &*m.name == name).cloned()
    }

    /// The metadata of model `name`, if known (served, warming up, or stopped).
    pub fn catalogued(&self, name: &str) -> Option<ModelMetadata> {
        let catalog = self.catalog.read().unwrap_or_else(|e| e.into_inner());
        catalog.model(name).cloned()
    }

    /// `read` of model `name`'s metadata, if known, read in place (no copy;
    /// the catalog is locked for reading meanwhile: keep `read` short).
    pub fn with_catalogued<R>(
        &self,
        name: &str,
        read: impl FnOnce(&ModelMetadata) -> R,
    ) -> Option<R> {
        let catalog = self.catalog.read().unwrap_or_else(|e| e.into_inner());
        catalog.model(name).map(read)
    }

    pub fn is_catalogued(&self, name: &str) -> bool {
        let catalog = self.catalog.read().unwrap_or_else(|e| e.into_inner());
        catalog.model(name).is_some()
    }

    pub fn server_metadata(&self) -> ServerMetadata {
        let catalog = self.catalog.read().unwrap_or_else(|e| e.into_inner());
        catalog.server.clone()
    }

    /// Runs `work` (CPU-heavy: inflating, compressing) on a blocking
    /// thread, at most [`offloaded`] at once (the others wait here, without
    /// holding a thread), so that the runtime's threads stay free for I/O.
    /// `None` if the work panicked (or the runtime is stopping).
    pub async fn offload<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let permit = self.offloaded.clone().acquire_owned().await.ok()?;
        tokio::task::spawn_blocking(move || {
            let done = work();
            drop(permit);
            done
        })
        .await
        .ok()
    }
}

/// Connections accepted beyond `max_connections` while it is reached:
/// they answer health and readiness checks only (anything else: 503, or
/// gRPC UNAVAILABLE), one request each, within the header timeout, so that
/// probes still see a full server as alive.
pub const HEADROOM: usize = 4;

/// CPU-heavy jobs (inflating, compressing) running at once on blocking
/// threads: half the machine's cores (at least one), so that they never
/// take every core from the runtime's threads; more wait for a permit.
pub fn offloaded() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// A running native front-end.
pub struct Frontend {
    runtime: Mutex<Option<Runtime>>,
    shared: Arc<Shared>,
    http_addr: Option<SocketAddr>,
    grpc_addr: Option<SocketAddr>,
    stop: watch::Sender<Option<Duration>>,
    /// One per listener: says when its connections are finished.
    done: Mutex<Vec<std::sync::mpsc::Receiver<()>>>,
}

/// Connections the kernel completes before the accept loop takes them.
/// `std`'s bind asks for 128: a burst of more clients than that (256 load
/// generator connections, a fleet restarting its clients) overflows it, and
/// the kernel drops their SYNs, so those clients connect only after their
/// one-second SYN retransmission. The kernel caps it at `net.core.somaxconn`
/// (4096 by default on Linux since 5.4).
const LISTEN_BACKLOG: i32 = 4096;

/// Binds `addr` now, so that a port in use fails at once; the error names
/// the protocol (`what`) and the address.
fn bind(addr: Option<SocketAddr>, what: &str) -> io::Result<Option<(StdListener, SocketAddr)>> {
    let Some(addr) = addr else { return Ok(None) };
    let named =
        |e: io::Error| io::Error::new(e.kind(), format!("{what}: cannot listen on {addr}: {e}"));
    let listener = listen(addr).map_err(named)?;
    let local = listener.local_addr().map_err(named)?;
    Ok(Some((listener, local)))
}

/// A non-blocking listener on `addr` with [`LISTEN_BACKLOG`], `SO_REUSEADDR`
/// set as `std` sets it (a restarted server rebinds past `TIME_WAIT`).
fn listen(addr: SocketAddr) -> io::Result<StdListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// The front-end's runtime: `threads` worker threads (at least one).
///
/// A reply is handed to its connection's task by the model's worker, a
/// thread outside the runtime, so its wake-up goes to the runtime's global
/// queue; by default a busy runtime thread looks there only about every
/// hundred polls (tokio tunes it), serving first the tasks that reading new
/// requests wakes on its own queue. A batch's replies then trickled out
/// over milliseconds while the thread kept reading: at 256 connections the
/// slowest tenth of requests took 3 times the median (p99 18 ms, p50
/// 3.2 ms). Looking on every poll answers the oldest work first (p99
/// 6–7 ms; benches/README.md, "Replies first").
fn runtime(threads: usize) -> io::Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name("ferrobatch-serve")
        .global_queue_interval(1)
        .enable_all()
        .build()
}

impl Frontend {
    /// Binds the addresses of `listen` (so a port in use fails here, at
    /// once) and starts serving: every HTTP request goes to `fallback`, and
    /// gRPC inference answers UNAVAILABLE, until [`Frontend::serve`] names
    /// the models served natively; readiness says not ready until
    /// [`Frontend::set_ready`].
    pub fn start(
        listen: impl Into<Listen>,
        config: Config,
        fallback: Arc<dyn Fallback>,
    ) -> io::Result<Frontend> {
        config
            .check()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listen = listen.into();
        let http = bind(listen.http, "HTTP")?;
        let grpc = bind(listen.grpc, "gRPC")?;
        let runtime = runtime(config.threads)?;
        let (stop, stopped) = watch::channel(None);
        let shared = Arc::new(Shared {
            models: RwLock::new(Vec::new()),
            fallback,
            catalog: RwLock::new(listen.catalog),
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            headroom: Arc::new(Semaphore::new(HEADROOM)),
            offloaded: Arc::new(Semaphore::new(offloaded())),
            config,
            stopped: stopped.clone(),
        });
        let mut done = Vec::new();
        let http_addr = http.as_ref().map(|(_, local)| *local);
        let grpc_addr = grpc.as_ref().map(|(_, local)| *local);
        for (bound, protocol) in [(http, Protocol::Http), (grpc, Protocol::Grpc)] {
            let Some((listener, _)) = bound else { continue };
            let listener = {
                let _guard = runtime.enter();
                TcpListener::from_std(listener)?
            };
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            runtime.spawn(accept(
                listener,
                protocol,
                shared.clone(),
                stopped.clone(),
                done_tx,
            ));
            done.push(done_rx);
        }
        Ok(Frontend {
            runtime: Mutex::new(Some(runtime)),
            shared,
            http_addr,
            grpc_addr,
            stop,
            done: Mutex::new(done),
        })
    }

    /// Where HTTP listens (None: it does not).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// Where gRPC listens (None: it does not).
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc_addr
    }

    /// Serves `models` natively from now on (instead of those before).
    pub fn serve(&self, models: Vec<ServedModel>) {
        let models = models.into_iter().map(Arc::new).collect();
        *self
            .shared
            .models
            .write()
            .unwrap_or_else(|e| e.into_inner()) = models;
    }

    /// Knows `models` from now on (replacing any of the same name): gRPC
    /// answers their metadata, and their inference is UNAVAILABLE (not
    /// NOT_FOUND) until [`Frontend::serve`] serves them. For a model added
    /// while serving; those known at start come with [`Listen::catalog`].
    pub fn know(&self, models: Vec<ModelMetadata>) {
        let mut catalog = self
            .shared
            .catalog
            .write()
            .unwrap_or_else(|e| e.into_inner());
        for model in models {
            catalog.models.retain(|known| known.name != model.name);
            catalog.models.push(model);
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.shared.ready.store(ready, Ordering::Relaxed);
    }

    /// Model `name`'s readiness (see [`ServedModel::set_ready`]); false if
    /// it is not served.
    pub fn set_model_ready(&self, name: &str, ready: bool) -> bool {
        let found = self.shared.model(name, "");
        if let Some(model) = &found {
            model.set_ready(ready);
        }
        found.is_some()
    }

    /// Readiness says 503 and responses carry `Connection: close`; requests
    /// are still served.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::Relaxed);
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        let config = &self.shared.config;
        let pooled = config.max_connections
            - self
                .shared
                .connections
                .available_permits()
                .min(config.max_connections);
        pooled + (HEADROOM - self.shared.headroom.available_permits().min(HEADROOM))
    }

    /// Closes the listeners, asks every connection to close once its
    /// requests are answered, and waits for that for at most `grace`.
    /// Connections still open go on answering (whatever answers their
    /// requests, e.g. the server stopping) until [`Frontend::stop`].
    /// Blocks; call without the GIL.
    pub fn close(&self, grace: Duration) {
        self.drain();
        let _ = self.stop.send(Some(grace));
        let done = std::mem::take(&mut *self.done.lock().unwrap_or_else(|e| e.into_inner()));
        // A grace too long to represent as an instant has no end.
        let until = std::time::Instant::now()
            .checked_add(grace)
            .and_then(|t| t.checked_add(Duration::from_secs(1)));
        for done in done {
            // Each accept task says when its connections are finished (or the grace is over).
            let _ = match until {
                Some(until) => done
                    .recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
                    .ok(),
                None => done.recv().ok(),
            };
        }
    }

    /// [`Frontend::close`], then waits up to `grace` more for the open
    /// connections to write their answers, and stops the runtime. Blocks.
    pub fn stop(&self, grace: Duration) {
        self.close(grace);
        let until = std::time::Instant::now().checked_add(grace);
        while self.open_connections() > 0 && until.map_or(true, |u| std::time::Instant::now() < u) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let runtime = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
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

/// Waits after an accept error that is the process's or the system's, not
/// the connection's: out of file descriptors or memory. Retrying at once
/// would spin (the pending connection stays in the backlog); the first time
/// it happens, says so on stderr.
async fn accept_failed(error: &io::Error, logged: &mut bool) {
    /// EMFILE, ENFILE, ENOBUFS, ENOMEM (Linux and the BSDs agree on these).
    const EXHAUSTED: [i32; 4] = [24, 23, 105, 12];
    /// ENOBUFS on the BSDs and macOS.
    const ENOBUFS_BSD: i32 = 55;
    let exhausted = error.raw_os_error().is_some_and(|code| {
        EXHAUSTED.contains(&code) || (cfg!(not(target_os = "linux")) && code == ENOBUFS_BSD)
    });
    if !exhausted {
        return; // that connection's problem (reset, aborted): go on
    }
    if !std::mem::replace(logged, true) {
        eprintln!(
            "ferrobatch serve: cannot accept connections: {error}; retrying every {} ms \
             (raise the open files limit, `ulimit -n`, or lower --max-connections)",
            ACCEPT_BACKOFF.as_millis()
        );
    }
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// Pause after an accept error for want of file descriptors or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What one connection is doing, for its watchdog ([`until_idle`]) and its
/// header clock ([`FirstBytes`]). A request only updates counters: nothing
/// is woken and no timer is set per request; the watchdog looks when its
/// own deadline comes.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    /// Requests so far (the watchdog may first look after one is done).
    requests: AtomicU64,
    /// When the last request ended, in nanoseconds since `opened`.
    ended_at: AtomicU64,
    opened: Instant,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            ended_at: AtomicU64::new(0),
            opened: Instant::now(),
        })
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Acquire)
    }

    /// When the last request ended (meaningful once one has).
    fn ended_at(&self) -> Instant {
        later(
            self.opened,
            Duration::from_nanos(self.ended_at.load(Ordering::Acquire)),
        )
    }
}

/// `at + by`, with `by` (a timeout the user set) at most a century, so the
/// sum never overflows.
fn later(at: Instant, by: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    at.checked_add(by.min(CENTURY)).unwrap_or(at)
}

/// Counts a request of a connection in flight while it lives.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: &Arc<Activity>) -> InFlight {
        activity.requests.fetch_add(1, Ordering::AcqRel);
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let since = u64::try_from(self.0.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // Stored before the count drops: a watchdog that sees none in flight sees when.
        self.0.ended_at.fetch_max(since, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The shortest time between two looks of a watchdog (a headroom
/// connection's idle time is zero).
const LOOK_AT_LEAST: Duration = Duration::from_millis(5);

/// Returns once the connection has had no request in flight for `first`
/// (before its first request: the header timeout, for HTTP/2 as for
/// HTTP/1) or `idle` (after one), never while a request is in flight. It
/// looks at the connection's [`Activity`] at its deadline, and at least
/// every `idle` (a request may have come and gone before `first`).
async fn until_idle(activity: Arc<Activity>, first: Duration, idle: Duration) {
    let look = idle.max(LOOK_AT_LEAST);
    let mut deadline = later(activity.opened, first);
    loop {
        tokio::time::sleep_until(deadline.min(later(Instant::now(), look)).into()).await;
        let now = Instant::now();
        deadline = if activity.in_flight() > 0 {
            later(now, look)
        } else if activity.requests() == 0 {
            later(activity.opened, first)
        } else {
            later(activity.ended_at(), idle)
        };
        if deadline <= now {
            return;
        }
    }
}

/// Why a connection is told to close.
enum Close {
    /// No request in flight for its idle time ([`until_idle`]).
    Idle,
    /// The front-end stops.
    Stopping,
}

/// Watches one connection, in a task of its own, for a reason to close it
/// ([`Close`]), and tells its task; returns without telling once the
/// connection has ended. The connection's task then polls one oneshot per
/// wake-up, where it polled the idle timer and the stop signal on every
/// one (1.3 % of a binary request's server CPU, in `Sleep::poll` and the
/// watch's `Notified`).
async fn watch_connection(
    idle: impl Future<Output = ()>,
    mut stopped: watch::Receiver<Option<Duration>>,
    mut tell: oneshot::Sender<Close>,
) {
    let stopping = async {
        loop {
            match stopped.changed().await {
                Ok(()) if stopped.borrow().is_none() => {}
                _ => return,
            }
        }
    };
    let why = tokio::select! {
        () = idle => Close::Idle,
        () = stopping => Close::Stopping,
        () = tell.closed() => return,
    };
    let _ = tell.send(why);
}

/// Serves one connection until it ends: closed gracefully (HTTP/2: GOAWAY;
/// HTTP/1: after the response in progress) when it is idle ([`until_idle`];
/// then it has a second to go) or the front-end stops (then it goes on
/// answering what it has in flight until the runtime stops).
async fn drive<C: GracefulConnection>(
    connection: C,
    outbox: Arc<Outbox>,
    idle: impl Future<Output = ()> + Send + 'static,
    stopped: watch::Receiver<Option<Duration>>,
) {
    let (tell, told) = oneshot::channel();
    tokio::spawn(watch_connection(idle, stopped, tell));
    let mut connection = std::pin::pin!(connection);
    let sending = Sending {
        connection: connection.as_mut(),
        outbox: &outbox,
    };
    let idled = tokio::select! {
        // In this order: no random pick on each of the connection's polls.
        biased;
        _ = sending => return,
        // Without an answer the watcher is gone: the runtime stops.
        why = told => matches!(why, Ok(Close::Idle)),
    };
    connection.as_mut().graceful_shutdown();
    let sending = Sending {
        connection: connection.as_mut(),
        outbox: &outbox,
    };
    if idled {
        let _ = tokio::time::timeout(IDLE_CLOSE, sending).await;
    } else {
        let _ = sending.await;
    }
}

/// Time an idle connection has to close once told to.
const IDLE_CLOSE: Duration = Duration::from_secs(1);

async fn accept(
    listener: TcpListener,
    protocol: Protocol,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<Option<Duration>>,
    done: std::sync::mpsc::Sender<()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    if protocol == Protocol::Grpc {
        builder = builder.http2_only();
    }
    let grpc = grpc::server(shared.clone());
    let config = &shared.config;
    // Not hyper's header timer: it restarts when a response ends, so it would
    // close an idle keep-alive connection after the header timeout instead
    // of the idle timeout. `FirstBytes` times each request's head instead.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None);
    let mut http2 = builder.http2();
    http2
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.max_streams)
        // gRPC sends no `Date` (gRPC's own servers do not): one header less
        // to encode per call. HTTP responses keep it, as HTTP asks.
        .auto_date_header(protocol != Protocol::Grpc);
    if protocol == Protocol::Grpc {
        // A call over the metadata limit is refused alone (see grpc::MAX_METADATA).
        http2.max_header_list_size(grpc::MAX_HEADER_BLOCK);
    }
    if let Some(interval) = config.keepalive_interval {
        http2
            .keep_alive_interval(interval)
            .keep_alive_timeout(config.keepalive_timeout.unwrap_or(interval));
    }
    let header_timeout = config.header_timeout;
    let idle_timeout = config.idle_timeout;
    // A gRPC connection's service: each call counted in flight on the
    // connection's `Activity` while it runs.
    let grpc_service = |pooled: bool, activity: Arc<Activity>| {
        let (grpc, shared) = (grpc.clone(), shared.clone());
        service_fn(move |request| {
            let in_flight = InFlight::new(&activity);
            // Boxed: hyper moves a stream's future several
            // times as it spawns it (see `grpc::handle`).
            let answer = Box::pin(grpc::handle(&grpc, &shared, pooled, request));
            async move {
                let answer = answer.await;
                drop(in_flight);
                Ok::<_, Infallible>(answer)
            }
        })
    };
    let tls: Option<Tls> = match protocol {
        Protocol::Grpc => config.grpc_tls.clone(),
        Protocol::Http => None,
    };
    // Every connection task holds a clone; all dropped: all connections are done.
    let (open, mut finished) = tokio::sync::mpsc::channel::<()>(1);
    let mut logged = false;
    let grace = loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(error) => {
                        accept_failed(&error, &mut logged).await;
                        continue;
                    }
                };
                let (permit, pooled) = match shared.connections.clone().try_acquire_owned() {
                    Ok(permit) => (permit, true),
                    Err(_) => match shared.headroom.clone().try_acquire_owned() {
                        Ok(permit) => (permit, false),
                        // Over max_connections and the headroom: dropping the stream closes it.
                        Err(_) => continue,
                    },
                };
                let _ = stream.set_nodelay(true);
                let activity = Activity::new();
                // A headroom connection answers one probe, then closes.
                let idle = until_idle(
                    activity.clone(),
                    header_timeout,
                    if pooled { idle_timeout } else { Duration::ZERO },
                );
                let stopped = stopped.clone();
                let open = open.clone();
                let (reader, writer) = stream.into_split();
                let outbox = Outbox::new(writer);
                let io = FirstBytes::new(
                    reader,
                    outbox.clone(),
                    header_timeout,
                    activity.clone(),
                    tls.is_some(),
                );
                if let Some(tls) = &tls {
                    let service = grpc_service(pooled, activity);
                    let (tls, builder) = (tls.clone(), builder.clone());
                    tokio::spawn(async move {
                        // The handshake is the connection's first bytes:
                        // bounded as a plaintext preface is. Its records,
                        // and h2's after it, are gathered per poll as h2c's.
                        let handshake = std::pin::pin!(tls.acceptor().accept(io));
                        let sending = Sending {
                            connection: handshake,
                            outbox: &outbox,
                        };
                        if let Ok(Ok(stream)) = tokio::time::timeout(header_timeout, sending).await {
                            let connection = builder.serve_connection(TokioIo::new(stream), service);
                            drive(connection.into_owned(), outbox, idle, stopped).await;
                        }
                        drop((permit, open));
                    });
                    continue;
                }
                let io = TokioIo::new(io);
                match protocol {
                    Protocol::Http => {
                        let shared = shared.clone();
                        let service = service_fn(move |request| {
                            let in_flight = InFlight::new(&activity);
                            handle(shared.clone(), pooled, request, in_flight)
                        });
                        let connection = builder.serve_connection(io, service).into_owned();
                        tokio::spawn(async move {
                            drive(connection, outbox, idle, stopped).await;
                            drop((permit, open));
                        });
                    }
                    Protocol::Grpc => {
                        let service = grpc_service(pooled, activity);
                        let connection = builder.serve_connection(io, service).into_owned();
                        tokio::spawn(async move {
                            drive(connection, outbox, idle, stopped).await;
                            drop((permit, open));
                        });
                    }
                }
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
    drop(open);
    // Each connection was told to close by the same signal.
    let _ = tokio::time::timeout(grace, finished.recv()).await;
    let _ = done.send(());
}

/// A connection whose requests must each begin within the header timeout.
///
/// Its first bytes (a client that connects and sends nothing, or part of
/// the HTTP/2 preface, is cut off) and, on HTTP/1, each request's head:
/// the clock starts at the connection or at the first byte read while no
/// request is in flight, and stops when a request starts (the connection's
/// [`Activity`] counts one more). An HTTP/1 connection that sends nothing
/// between requests is the idle timeout's ([`until_idle`]). HTTP/2 frames
/// (pings, settings) come between requests: after its preface, HTTP/2 is
/// timed by [`until_idle`] alone.
struct FirstBytes {
    stream: OwnedReadHalf,
    /// Where its writes go (gathered per poll of the connection).
    outbox: Arc<Outbox>,
    timeout: Duration,
    read: usize,
    /// The connection's first bytes, to tell HTTP/2's preface ("PRI").
    start: [u8; 3],
    http2: bool,
    /// The header clock (one allocation per connection, not per request);
    /// it counts only while `armed`, and runs out at `deadline`. The timer
    /// is set again only when it fires before `deadline`: not once per
    /// request (`Sleep::reset`, a timer-wheel update, was 0.3–0.5 % of a
    /// binary request's samples).
    clock: Pin<Box<Sleep>>,
    deadline: tokio::time::Instant,
    armed: bool,
    /// Requests started when the deadline was set.
    armed_at: u64,
    activity: Arc<Activity>,
}

impl FirstBytes {
    /// `http2`: known to be HTTP/2 whatever its first bytes (TLS records
    /// carry its preface): only those first bytes are timed here.
    fn new(
        stream: OwnedReadHalf,
        outbox: Arc<Outbox>,
        timeout: Duration,
        activity: Arc<Activity>,
        http2: bool,
    ) -> FirstBytes {
        let clock = Box::pin(tokio::time::sleep(timeout));
        FirstBytes {
            stream,
            outbox,
            timeout,
            read: 0,
            start: [0; 3],
            http2,
            deadline: clock.deadline(),
            clock,
            armed: true,
            armed_at: 0,
            activity,
        }
    }

    /// Bytes `new` just arrived: note the protocol, and on HTTP/1 start
    /// the clock if they begin a request's head.
    fn arrived(&mut self, new: &[u8]) {
        for &b in new.iter().take(self.start.len().saturating_sub(self.read)) {
            self.start[self.read] = b;
            self.read += 1;
        }
        if self.read >= self.start.len() && &self.start == b"PRI" {
            self.http2 = true;
        }
        let (in_flight, requests) = (self.activity.in_flight(), self.activity.requests());
        if self.http2 {
            if self.read >= self.start.len() {
                self.armed = false; // the preface's first bytes came: until_idle times the rest
            }
        } else if requests != self.armed_at || in_flight > 0 {
            // A request started since the clock was set, or one is in flight
            // (these bytes are its body, or pipelined): stop it.
            self.armed = false;
            self.armed_at = requests;
            if in_flight == 0 && !new.is_empty() {
                self.arm();
            }
        } else if !self.armed && !new.is_empty() {
            self.arm();
        }
    }

    /// Starts the header clock: `timeout` from now (about 30 years, as
    /// tokio's `sleep` takes it, for a timeout past what an instant holds).
    fn arm(&mut self) {
        let now = tokio::time::Instant::now();
        let at = now
            .checked_add(self.timeout)
            .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30));
        self.deadline = at;
        if self.clock.deadline() > at {
            self.clock.as_mut().reset(at);
        }
        self.armed = true;
    }

    /// Whether the connection speaks HTTP/1 (its first bytes came, and are
    /// not HTTP/2's preface).
    fn http1(&self) -> bool {
        self.read >= self.start.len() && !self.http2
    }

    /// True once the deadline passed with no request started.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let started = self.activity.requests() != self.armed_at || self.activity.in_flight() > 0;
        if started && !self.http2 {
            self.armed = false;
            return false;
        }
        if !self.armed || self.clock.as_mut().poll(cx).is_pending() {
            return false;
        }
        if tokio::time::Instant::now() < self.deadline {
            // Set for an earlier request's head: on to this one's deadline.
            self.clock.as_mut().reset(self.deadline);
            return self.clock.as_mut().poll(cx).is_ready();
        }
        true
    }
}

impl AsyncRead for FirstBytes {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(done) => {
                let new = buf.filled().get(before..).unwrap_or(&[]);
                this.arrived(new);
                Poll::Ready(done)
            }
            Poll::Pending => {
                if this.expired(cx) {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the request did not begin within the header timeout",
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for FirstBytes {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.http1() {
            self.outbox.poll_write_through(cx, bufs)
        } else {
            self.outbox.poll_write_vectored(cx, bufs)
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.outbox.poll_flush()
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.outbox.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_past_their_bounds_are_refused_before_the_front_end_starts() {
        assert_eq!(Config::default().check(), Ok(()));
        let cases = [
            (
                Config {
                    threads: 0,
                    ..Config::default()
                },
                "threads must be from 1 to 1024, got 0",
            ),
            (
                Config {
                    threads: 1_000_000_000,
                    ..Config::default()
                },
                "threads must be from 1 to 1024, got 1000000000",
            ),
            (
                // tokio's semaphore would panic past its MAX_PERMITS.
                Config {
                    max_connections: 1 << 63,
                    ..Config::default()
                },
                "max_connections must be from 1 to 1048576, got 9223372036854775808",
            ),
            (
                Config {
                    max_streams: 0,
                    ..Config::default()
                },
                "max_streams must be at least 1",
            ),
        ];
        for (config, message) in cases {
            assert_eq!(config.check(), Err(message.to_owned()));
            let refused = Frontend::start(Listen::default(), config, Arc::new(Nothing)).err();
            assert_eq!(refused.map(|e| e.to_string()), Some(message.to_owned()));
        }
    }

    /// A fallback never called: the front-end does not start.
    struct Nothing;

    impl Fallback for Nothing {
        fn call(
            &self,
            _: crate::http::FallbackRequest,
            _: oneshot::Sender<crate::http::FallbackResponse>,
        ) -> Option<crate::http::Withdraw> {
            None
        }
    }

    /// A task busy with local work: it wakes itself on every poll (as a
    /// connection whose reads keep coming does), counting its polls.
    struct Busy {
        polls: Arc<AtomicUsize>,
        stop: Arc<AtomicBool>,
    }

    impl Future for Busy {
        type Output = ();

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.stop.load(Ordering::Relaxed) {
                return Poll::Ready(());
            }
            self.polls.fetch_add(1, Ordering::Relaxed);
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[test]
    fn a_reply_from_outside_the_runtime_is_taken_before_more_local_work() {
        // The runtime's one thread is kept busy; a thread outside it (the
        // model's worker) answers a waiting task, as a batch answers a
        // connection. Counted in polls of the busy task between the answer
        // and the waiting task's run, not in time. With tokio's default
        // interval the gap is about a hundred polls.
        let runtime = runtime(1).unwrap();
        let polls = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let busy = runtime.spawn(Busy {
            polls: polls.clone(),
            stop: stop.clone(),
        });
        let mut gaps = Vec::new();
        for _ in 0..20 {
            let (tx, rx) = oneshot::channel::<usize>();
            let waiting = Arc::new(AtomicBool::new(false));
            let answered = runtime.spawn({
                let (polls, waiting) = (polls.clone(), waiting.clone());
                async move {
                    waiting.store(true, Ordering::Release);
                    let sent_at = rx.await.unwrap_or(0);
                    polls.load(Ordering::Relaxed).saturating_sub(sent_at)
                }
            });
            while !waiting.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            let before = polls.load(Ordering::Relaxed);
            while polls.load(Ordering::Relaxed) < before + 1000 {
                std::hint::spin_loop(); // the busy task is well into its run
            }
            tx.send(polls.load(Ordering::Relaxed)).unwrap();
            gaps.push(runtime.block_on(answered).unwrap());
        }
        stop.store(true, Ordering::Relaxed);
        runtime.block_on(busy).unwrap();
        gaps.sort_unstable();
        assert!(
            gaps[gaps.len() / 2] <= 16,
            "polls of local work before the reply ran: {gaps:?}"
        );
    }

    #[test]
    fn a_burst_of_connections_larger_than_stds_backlog_connects_before_any_accept() {
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        // Twice `std`'s 128: past it the kernel drops SYNs and a client waits
        // a second for the retransmission. (A kernel capping backlogs lower
        // than that, `net.core.somaxconn`, caps what can be asked.)
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|text| text.trim().parse::<usize>().ok())
            .unwrap_or(256);
        let burst = cap.min(256);
        let clients: Vec<_> = (0..burst)
            .map(|n| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
                    .unwrap_or_else(|e| panic!("connection {n} did not complete: {e}"))
            })
            .collect();
        assert_eq!(clients.len(), burst);
    }

    #[tokio::test]
    async fn a_connection_whose_request_ended_before_its_watchdog_looked_is_idle_after_the_idle_timeout(
    ) {
        let activity = Activity::new();
        let watchdog = until_idle(
            activity.clone(),
            Duration::from_secs(30),
            Duration::from_millis(20),
        );
        drop(InFlight::new(&activity)); // a request came and went
        let began = std::time::Instant::now();
        let idled = tokio::time::timeout(Duration::from_secs(5), watchdog).await;
        assert!(
            idled.is_ok(),
            "waited for the header timeout, not the idle one"
        );
        assert!(began.elapsed() >= Duration::from_millis(20));
    }

    #[tokio::test]
    async fn a_connection_with_a_request_in_flight_is_never_idle() {
        let activity = Activity::new();
        let in_flight = InFlight::new(&activity);
        let watchdog = until_idle(
            activity.clone(),
            Duration::from_millis(10),
            Duration::from_millis(10),
        );
        let mut watchdog = std::pin::pin!(watchdog);
        let early = tokio::time::timeout(Duration::from_millis(100), watchdog.as_mut()).await;
        assert!(early.is_err(), "idle with a request in flight");
        drop(in_flight);
        let idled = tokio::time::timeout(Duration::from_secs(5), watchdog).await;
        assert!(idled.is_ok());
    }

    #[tokio::test]
    async fn a_connection_with_no_request_is_idle_after_the_header_timeout() {
        let activity = Activity::new();
        let began = std::time::Instant::now();
        let watchdog = until_idle(
            activity.clone(),
            Duration::from_millis(30),
            Duration::from_secs(30),
        );
        assert!(tokio::time::timeout(Duration::from_secs(5), watchdog)
            .await
            .is_ok());
        assert!(began.elapsed() >= Duration::from_millis(30));
    }

    /// The header clock is set lazily (only when it fires before the
    /// deadline of the head in progress): a head that begins late still
    /// gets its whole timeout, and no more.
    #[tokio::test(start_paused = true)]
    async fn a_request_head_gets_the_header_timeout_from_its_own_first_byte() {
        use std::io::Write;
        use tokio::io::AsyncReadExt;
        let timeout = Duration::from_secs(10);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let (reader, writer) = stream.into_split();
        let activity = Activity::new();
        let began = tokio::time::Instant::now();
        let mut first = FirstBytes::new(
            reader,
            Outbox::new(writer),
            timeout,
            activity.clone(),
            false,
        );
        let mut buf = [0u8; 16];
        client.write_all(b"G").unwrap();
        assert_eq!(first.read(&mut buf).await.unwrap(), 1);
        drop(InFlight::new(&activity)); // that request came and went
        tokio::time::advance(Duration::from_secs(6)).await;
        client.write_all(b"P").unwrap(); // the next head's first byte, at 6 s
        assert_eq!(first.read(&mut buf).await.unwrap(), 1);
        let refused = first.read(&mut buf).await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::TimedOut);
        assert_eq!(began.elapsed(), Duration::from_secs(16));
    }
}
