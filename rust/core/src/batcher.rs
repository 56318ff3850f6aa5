//! The batcher: submit on one side, gather + collate + route on the other.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::bytes::BytesLimits;
use crate::cache::{CacheKey, CachedValue, KeyRules, SharedCache};
use crate::callers::BlockingCallers;
use crate::doorbell::GatherRole;
use crate::queue::{Admitted, Popped, Priorities};
use crate::request::Withdrawal;
use crate::unflushed::{Held, Readiness};
use crate::{
    Collated, CoreError, Decision, DispatchReason, DispatchRule, HeldSlot, Inputs, Layout, Request,
    RequestQueue, RequestState, Routes, Sink, SlotBuffer, StagingRing, Unflushed,
};

/// The most requests a batcher's queue may hold: its channels are sized
/// for them up front (twice over, for withdrawn ones).
pub const MAX_QUEUE_SIZE: usize = 1 << 20;

/// How long the batches every worker runs must take (or have run so far)
/// before requests are looked up in the response cache as they are
/// submitted, never queued: below it, lookups wait for a batch's release,
/// where the worker computes the digests without the GIL and answers the
/// hits together (quick batches: a hit waits little for it).
pub const HIT_WAIT_FOR_BUSY: Duration = Duration::from_millis(10);

#[derive(Debug, Clone)]
pub struct BatcherConfig {
    pub rule: DispatchRule,
    /// Bytes per row of each input, in the model's input order.
    pub row_nbytes: Vec<usize>,
    pub max_queue_size: usize,
    /// Worker threads that will call `next_batch` (one per model instance).
    pub workers: usize,
    /// When submitted rows may be taken: at once, or, submitted through an
    /// [`Unflushed`], once it flushes (an event loop, at the end of an iteration).
    pub readiness: Readiness,
    /// How each input is collated (empty: every input [`Layout::Fixed`]).
    pub layouts: Vec<Layout>,
    /// The most elements of each variable-length input a batch may hold
    /// (padded ones counted padded: rows times the longest row); needed
    /// when an input is [`Layout::Ragged`]. A request over it is refused.
    pub max_batch_elements: Option<usize>,
    /// What a BYTES input of one request may carry.
    pub bytes_limits: BytesLimits,
    /// Priority levels of the queue ([`Priorities::NONE`]: one FIFO).
    pub priorities: Priorities,
    /// Level (1: most urgent) of requests that name none; `None`: the least urgent.
    pub default_priority: Option<u32>,
}

/// What a submitter may say about a request besides its inputs.
#[derive(Debug, Clone, Default)]
pub struct Submission {
    /// How long it may wait to be taken (`None`: no limit).
    pub timeout: Option<Duration>,
    /// Priority level, 1 the most urgent; `None`: the batcher's default.
    pub priority: Option<u32>,
    /// Request parameters (a JSON object's text) handed to the model with its batch.
    pub parameters: Option<Box<str>>,
    /// Bit `i` set: the request left out optional input `i` (its bytes stand
    /// in for it; the model is told).
    pub absent: u64,
    /// Bit `i` set: the caller asked for output `i` (a v2 request's
    /// `outputs`, handed to a model that asks for its requests); 0: not said.
    pub requested_outputs: u64,
    /// The caller blocks until this request is answered, and is known by
    /// this key (a thread's); `None`: a caller that does not block. See
    /// [`crate::callers`].
    pub blocking_caller: Option<u64>,
    /// Never looked up in nor kept in the response cache (its result is not
    /// its inputs' alone: a v2 request naming a shared-memory region).
    pub uncached: bool,
}

/// Counters, updated with relaxed atomics (a snapshot may be torn across fields).
#[derive(Debug, Default)]
pub struct Stats {
    pub batches: AtomicU64,
    pub rows: AtomicU64,
    pub requests: AtomicU64,
    /// Requests a worker found cancelled / closed by their caller, and skipped.
    pub skipped_withdrawn: AtomicU64,
    /// Requests a worker found past their deadline, and skipped.
    pub skipped_expired: AtomicU64,
    /// Sum over taken requests of the time from submit to being taken.
    pub queue_ns: AtomicU64,
    /// The same over the requests their batch's model call did not fail
    /// (Triton's queue duration: successes only); added as batches finish.
    pub succeeded_queue_ns: AtomicU64,
    /// Batches by why they were released, in [`DispatchReason::ALL`] order.
    pub dispatch_reasons: [AtomicU64; DispatchReason::ALL.len()],
    /// Sum over batches of their oldest request's age when released.
    pub release_age_ns: AtomicU64,
    /// Requests answered from the response cache (not in `requests`).
    pub cache_hits: AtomicU64,
    /// Requests looked up in the response cache and run.
    pub cache_misses: AtomicU64,
}

/// A batch put down while it filled (its requests still queued).
#[derive(Debug)]
struct Parked {
    gathered: Vec<Arc<Request>>,
    /// When the worker that began it was free (`delay_from_free_worker`'s window).
    free_since: Instant,
}

/// An input as a refusal's message names it: `'name'`, or its index.
struct InputLabel<'a> {
    names: &'a [Arc<str>],
    index: usize,
}

impl fmt::Display for InputLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.names.get(self.index) {
            Some(name) => write!(f, "'{name}'"),
            None => write!(f, "{}", self.index),
        }
    }
}

/// A worker's own state between batches.
#[derive(Debug, Default)]
pub struct Worker {
    /// This worker has popped its close message: it only flushes the carry.
    closed: bool,
    /// Requests this worker found past the batcher's queue timeout and
    /// withdrew (`Expired`, never run). No caller's timer answers them: the
    /// worker's owner does ([`Worker::take_outstayed`]).
    outstayed: Vec<Arc<Request>>,
    /// Requests this worker took and found in the response cache, with the
    /// value kept for each: never collated nor run; the worker's owner
    /// answers them ([`Worker::take_cached`]).
    cached: Vec<(Arc<Request>, Arc<CachedValue>)>,
}

impl Worker {
    pub fn new() -> Worker {
        Worker::default()
    }

    /// The requests to answer with the queue timeout's error, gathered by
    /// the last [`Batcher::next_batch`]; each is handed out once.
    pub fn take_outstayed(&mut self) -> Vec<Arc<Request>> {
        std::mem::take(&mut self.outstayed)
    }

    /// The requests to answer from the response cache (each with its kept
    /// value), found by the last [`Batcher::next_batch`]; each is handed out
    /// once. They are taken: nobody else answers them.
    pub fn take_cached(&mut self) -> Vec<(Arc<Request>, Arc<CachedValue>)> {
        std::mem::take(&mut self.cached)
    }

    /// Whether this worker has seen the batcher close: a `None` from
    /// [`Batcher::next_batch`] then means it is done.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

/// A collated batch: `rows` rows of every input sit in the staging slot
/// that `slot` holds.
///
/// The batch owns its slot: nothing rewrites it until `slot` is dropped
/// (with the batch, or alone once whatever reads the slot is done: the model
/// call returned, or the host-to-device copy completed).
#[derive(Debug)]
pub struct Batch {
    /// The guard of the staging slot the rows were collated into.
    pub slot: HeldSlot,
    pub rows: usize,
    pub routes: Routes,
    /// The batch's requests, in row order (their rows and parameters).
    pub requests: Vec<Arc<Request>>,
    /// Why the batch was released.
    pub reason: DispatchReason,
    /// When it was taken: its requests' queue time ends here.
    pub taken_at: Instant,
    /// What each input became in the slot (its length, offsets, bytes).
    pub collated: Vec<Collated>,
    /// With a response cache, each request's key, in row order, for its
    /// result to be kept once the batch succeeded (`None`: an uncached
    /// request's, never kept); empty without one.
    pub cache_keys: Vec<Option<CacheKey>>,
}

/// The response cache a batcher looks its requests up in, and its own
/// namespace there (changed when the model's results change: see
/// [`Batcher::set_cache_namespace`]).
#[derive(Debug)]
struct CacheLink {
    cache: Arc<SharedCache>,
    namespace: AtomicU64,
    rules: KeyRules,
    /// Requests found in the cache as they were submitted, for
    /// [`Batcher::wait_found`]: never queued, answered at once whether or
    /// not a worker is free (as Triton answers hits before its queue).
    found: Mutex<Found>,
    found_ready: Condvar,
    /// Whether requests are looked up as they are submitted. Where they
    /// are looked up trades latency against the submitters' time: at
    /// submit, the digest is computed on the submitting thread (an event
    /// loop's, holding the GIL) and the hits go through the answering
    /// thread; as a batch is released, the digests are computed by the
    /// worker without the GIL and the hits answered together (a fast
    /// model's hits run 1.7 times as many requests a second that way). So
    /// lookups wait for release while a worker is free (it answers a hit
    /// within `max_delay`) or the batches are quick; once every worker is
    /// busy with a batch that takes, or has taken, [`HIT_WAIT_FOR_BUSY`]
    /// or more, a hit no longer waits behind the batches running.
    busy: BusyWorkers,
}

/// Workers gathering (inside [`Batcher::next_batch`]) and when one last
/// left it, for [`CacheLink::busy`].
#[derive(Debug)]
struct BusyWorkers {
    gathering: AtomicUsize,
    /// Nanoseconds since `epoch` when a worker last left `next_batch`.
    left_at: AtomicU64,
    /// How long the last worker back in `next_batch` was away (since any
    /// worker last left: exact with one worker, shorter with more).
    last_away: AtomicU64,
    epoch: Instant,
}

impl BusyWorkers {
    fn new() -> BusyWorkers {
        BusyWorkers {
            gathering: AtomicUsize::new(0),
            left_at: AtomicU64::new(0),
            last_away: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// No worker gathers, and either the last one back was away (ran its
    /// batch) at least [`HIT_WAIT_FOR_BUSY`] (a slow model: the batches
    /// running now likely take as long) or none left less than that ago.
    fn all_busy_for_a_while(&self) -> bool {
        if self.gathering.load(Ordering::Acquire) != 0 {
            return false;
        }
        let wait = HIT_WAIT_FOR_BUSY.as_nanos() as u64;
        self.last_away.load(Ordering::Relaxed) >= wait
            || self
                .now()
                .saturating_sub(self.left_at.load(Ordering::Acquire))
                >= wait
    }
}

/// Counts a worker as gathering while it lives (one `next_batch` call).
struct Gathering<'a>(Option<&'a BusyWorkers>);

impl<'a> Gathering<'a> {
    fn enter(busy: Option<&'a BusyWorkers>) -> Gathering<'a> {
        if let Some(b) = busy {
            b.gathering.fetch_add(1, Ordering::AcqRel);
            let left_at = b.left_at.load(Ordering::Acquire);
            if left_at != 0 {
                let away = b.now().saturating_sub(left_at);
                b.last_away.store(away, Ordering::Relaxed);
            }
        }
        Gathering(busy)
    }
}

impl Drop for Gathering<'_> {
    /// The worker leaves with a batch (busy from now), or with requests to
    /// answer (back soon): either way, busy since now.
    fn drop(&mut self) {
        if let Some(b) = self.0 {
            b.left_at.store(b.now(), Ordering::Release);
            b.gathering.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[derive(Debug, Default)]
struct Found {
    hits: Vec<(Arc<Request>, Arc<CachedValue>)>,
    /// The batcher closed: no hit is added; `wait_found` ends once empty.
    closed: bool,
}

/// What [`Batcher::wait_found`] hands out: requests found in the response
/// cache as they were submitted, each taken (nobody else answers it) with
/// what the cache kept for it.
pub type FoundInCache = Vec<(Arc<Request>, Arc<CachedValue>)>;

#[derive(Debug)]
pub struct Batcher {
    rule: DispatchRule,
    /// Rows of the last batch released: the adaptive window's target.
    last_rows: AtomicUsize,
    queue: RequestQueue,
    ring: Arc<StagingRing>,
    /// The request popped that did not fit the last batch (it leads the
    /// next). Locked only by the holder of the gatherer's role, so never
    /// contended.
    carry: Mutex<Option<Arc<Request>>>,
    /// A batch still filling when its gatherer went to answer requests that
    /// outstayed the queue (see [`Batcher::with_queue_timeout`]): the next
    /// gatherer goes on with it. Locked only by the gatherer's role holder.
    parked: Mutex<Option<Parked>>,
    workers: usize,
    /// Priority level of requests that name none (0-based lane).
    default_lane: u8,
    /// Requests keep their parameters for the model (it asked for them);
    /// otherwise they are dropped at submit and never travel with a batch.
    keep_parameters: bool,
    next_id: AtomicU64,
    stats: Stats,
    max_batch_elements: Option<usize>,
    bytes_limits: BytesLimits,
    /// Who may still add a row to the batch being gathered.
    callers: BlockingCallers,
    readiness: Readiness,
    /// The timeout of a request that gives none (see [`Batcher::with_default_timeout`]).
    default_timeout: Option<Duration>,
    /// How long a request may wait to be taken (see [`Batcher::with_queue_timeout`]).
    queue_timeout: Option<Duration>,
    /// The inputs' names, for messages (see [`Batcher::naming_inputs`]).
    input_names: Vec<Arc<str>>,
    /// Submitters that hold requests for this batcher ([`Unflushed`]):
    /// flushed as it closes.
    holders: Mutex<Vec<Weak<Held>>>,
    /// Where results are kept for requests with the same inputs (see
    /// [`Batcher::with_response_cache`]).
    cache: Option<CacheLink>,
}

impl Batcher {
    pub fn new(config: BatcherConfig, slots: Vec<Vec<SlotBuffer>>) -> Result<Batcher, CoreError> {
        if config.max_queue_size == 0 || config.max_queue_size > MAX_QUEUE_SIZE {
            return Err(CoreError::InvalidConfig(format!(
                "max_queue_size must be from 1 to {MAX_QUEUE_SIZE}, got {}",
                config.max_queue_size
            )));
        }
        if config.workers == 0 {
            return Err(CoreError::InvalidConfig(
                "at least one worker is needed".into(),
            ));
        }
        let layouts = if config.layouts.is_empty() {
            vec![Layout::Fixed; config.row_nbytes.len()]
        } else {
            config.layouts
        };
        let ring = StagingRing::with_layouts(
            config.row_nbytes,
            layouts,
            config.rule.max_batch_size,
            config.max_batch_elements,
            slots,
        )?;
        let levels = config.priorities.levels.max(1);
        let default_lane = match config.default_priority {
            None => levels - 1,
            Some(p) => u8::try_from(p)
                .ok()
                .filter(|&p| (1..=levels).contains(&p))
                .map(|p| p - 1)
                .ok_or_else(|| {
                    CoreError::InvalidConfig(format!(
                        "default_priority must be between 1 and {levels}, got {p}"
                    ))
                })?,
        };
        let max_delay = config.rule.max_delay;
        Ok(Batcher {
            queue: RequestQueue::with_priorities(
                config.max_queue_size,
                config.workers,
                config.priorities,
            ),
            default_lane,
            keep_parameters: false,
            rule: config.rule,
            last_rows: AtomicUsize::new(1),
            ring: Arc::new(ring),
            carry: Mutex::new(None),
            parked: Mutex::new(None),
            workers: config.workers,
            next_id: AtomicU64::new(1),
            stats: Stats::default(),
            max_batch_elements: config.max_batch_elements,
            bytes_limits: config.bytes_limits,
            callers: BlockingCallers::new(max_delay),
            readiness: config.readiness,
            default_timeout: None,
            queue_timeout: None,
            input_names: Vec::new(),
            holders: Mutex::new(Vec::new()),
            cache: None,
        })
    }

    pub fn readiness(&self) -> Readiness {
        self.readiness
    }

    pub fn rule(&self) -> &DispatchRule {
        &self.rule
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Live requests waiting at each priority level, most urgent first.
    pub fn queue_lens(&self) -> Vec<usize> {
        self.queue.lane_lens()
    }

    /// How each input's rows are collated, in input order.
    pub fn layouts(&self) -> &[Layout] {
        self.ring.layouts()
    }

    /// The most elements of a variable-length input one batch holds (0: no
    /// such input).
    pub fn max_batch_elements(&self) -> usize {
        self.max_batch_elements.unwrap_or(0)
    }

    /// This batcher, keeping each request's parameters for the model
    /// (`Batch::requests`) when `keep` (the model asked for them).
    pub fn keeping_parameters(mut self, keep: bool) -> Batcher {
        self.keep_parameters = keep;
        self
    }

    /// This batcher, with `timeout` for requests that give none. Each way in
    /// applies it where it arms the caller's timer ([`Batcher::default_timeout`]):
    /// a deadline nobody watches would leave a skipped request unanswered.
    pub fn with_default_timeout(mut self, timeout: Option<Duration>) -> Batcher {
        self.default_timeout = timeout;
        self
    }

    /// The timeout of a request that gives none (`None`: no limit).
    pub fn default_timeout(&self) -> Option<Duration> {
        self.default_timeout
    }

    /// This batcher, with requests that wait longer than `timeout` to be
    /// taken into a batch withdrawn (`Expired`) and never run; a request
    /// once taken runs to its end (only its own deadline bounds it), as
    /// Triton's queue policy. Checked where a worker gathers, so a request
    /// waiting while every worker is busy goes when one is free; the worker
    /// hands such requests to its owner to answer
    /// ([`Worker::take_outstayed`]), since no caller's timer watches this.
    pub fn with_queue_timeout(mut self, timeout: Option<Duration>) -> Batcher {
        self.queue_timeout = timeout;
        self
    }

    /// This batcher, answering from `cache` the requests whose inputs match
    /// a kept result, under `namespace` there (see [`crate::cache`]): a
    /// worker looks each request up as it releases its batch; a hit leaves
    /// the batch ([`Worker::take_cached`]), a miss runs and its key rides
    /// the batch ([`Batch::cache_keys`]).
    /// `rules`: what the model is told of a request besides its inputs.
    pub fn with_response_cache(
        mut self,
        cache: Option<(Arc<SharedCache>, u64, KeyRules)>,
    ) -> Batcher {
        self.cache = cache.map(|(cache, namespace, rules)| CacheLink {
            cache,
            namespace: AtomicU64::new(namespace),
            rules,
            found: Mutex::new(Found::default()),
            found_ready: Condvar::new(),
            busy: BusyWorkers::new(),
        });
        self
    }

    /// The response cache and this batcher's namespace there, if any.
    pub fn response_cache(&self) -> Option<(&Arc<SharedCache>, u64)> {
        self.cache
            .as_ref()
            .map(|link| (&link.cache, link.namespace.load(Ordering::Acquire)))
    }

    /// Looks requests up under `namespace` from now on (the model's weights
    /// changed: a fresh one from the cache, after which the old one's
    /// entries may be forgotten). A batch released before keeps the old
    /// namespace in its keys, so what it keeps is never found again: no
    /// result of the old weights answers a request looked up after this.
    pub fn set_cache_namespace(&self, namespace: u64) {
        if let Some(link) = &self.cache {
            link.namespace.store(namespace, Ordering::Release);
        }
    }

    /// How long a request may wait to be taken (`None`: no limit).
    pub fn queue_timeout(&self) -> Option<Duration> {
        self.queue_timeout
    }

    /// This batcher, naming its inputs `names` (in order) in the messages
    /// of the requests it refuses; unnamed, an input is its index.
    pub fn naming_inputs(mut self, names: Vec<Arc<str>>) -> Batcher {
        self.input_names = names;
        self
    }

    /// This batcher, numbering its requests from `first` on: a server
    /// started again numbers them on from its last run's batcher (its
    /// callers' tables outlive the run, keyed by request id).
    pub fn numbering_from(self, first: u64) -> Batcher {
        self.next_id.store(first.max(1), Ordering::Relaxed);
        self
    }

    /// The id the next request will get (see [`Batcher::numbering_from`]).
    pub fn next_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Whether requests keep their parameters (see [`Batcher::keeping_parameters`]).
    pub fn keeps_parameters(&self) -> bool {
        self.keep_parameters
    }

    /// Priority level (1: most urgent) of requests that name none.
    pub fn default_priority(&self) -> u32 {
        u32::from(self.default_lane) + 1
    }

    /// The queue lane of priority level `priority` (`None` or 0: the default).
    fn lane(&self, priority: Option<u32>) -> Result<u8, CoreError> {
        let levels = self.queue.levels();
        match priority {
            None | Some(0) => Ok(self.default_lane),
            // One level: priorities mean nothing, as in Triton without levels.
            Some(_) if levels == 1 => Ok(0),
            Some(p) => usize::try_from(p)
                .ok()
                .filter(|&p| p <= levels)
                .and_then(|p| u8::try_from(p - 1).ok())
                .ok_or_else(|| {
                    CoreError::InvalidInput(format!(
                        "priority must be between 1 (most urgent) and {levels}, got {p}"
                    ))
                }),
        }
    }

    /// Validates and enqueues a request of `rows` rows.
    ///
    /// The caller keeps the memory behind `inputs` alive until the request is
    /// resolved (the contract of [`Request`]).
    pub fn submit(
        &self,
        sink: Sink,
        rows: usize,
        inputs: impl Into<Inputs>,
        timeout: Option<Duration>,
    ) -> Result<Arc<Request>, CoreError> {
        self.submit_with(sink, rows, inputs, timeout, |_| ())
    }

    /// [`Batcher::submit`], calling `register` with the request just before
    /// it is queued: a worker may take and resolve it at once, so a sink
    /// owner that finds its requests by id registers it there. When this
    /// returns an error after `register` ran, the request was never queued.
    pub fn submit_with(
        &self,
        sink: Sink,
        rows: usize,
        inputs: impl Into<Inputs>,
        timeout: Option<Duration>,
        register: impl FnOnce(&Arc<Request>),
    ) -> Result<Arc<Request>, CoreError> {
        let submission = Submission {
            timeout,
            ..Submission::default()
        };
        self.submit_request(sink, rows, inputs, submission, register)
    }

    /// [`Batcher::submit_with`], with a priority level and parameters.
    pub fn submit_request(
        &self,
        sink: Sink,
        rows: usize,
        inputs: impl Into<Inputs>,
        submission: Submission,
        register: impl FnOnce(&Arc<Request>),
    ) -> Result<Arc<Request>, CoreError> {
        let (request, caller) = self.new_request(sink, rows, inputs.into(), submission)?;
        match self.look_up(&request) {
            Some(found) => self.hand_found(request, found, caller, register),
            None => self.enqueue(request, caller, register),
        }
    }

    /// [`Batcher::submit_request`] from a submitter that holds its requests
    /// until it flushes (an event loop; see [`crate::unflushed`]): with
    /// [`Readiness::OnFlush`] and a flush opened for this batcher, the
    /// request is admitted and held by `holder`; otherwise queued at once.
    pub fn submit_held(
        &self,
        holder: &Unflushed,
        sink: Sink,
        rows: usize,
        inputs: impl Into<Inputs>,
        submission: Submission,
        register: impl FnOnce(&Arc<Request>),
    ) -> Result<Arc<Request>, CoreError> {
        let (request, caller) = self.new_request(sink, rows, inputs.into(), submission)?;
        if let Some(found) = self.look_up(&request) {
            return self.hand_found(request, found, caller, register);
        }
        let mut register = Some(register);
        let mut registering = |r: &Arc<Request>| {
            if let Some(register) = register.take() {
                register(r);
            }
        };
        match holder.held().hold(self, &request, &mut registering) {
            Some(held) => {
                self.callers.arrive(caller, request.enqueued_at);
                held.map(|()| request)
            }
            None => self.enqueue(request, caller, registering),
        }
    }

    /// A checked request, not yet queued, and its blocking caller's key.
    fn new_request(
        &self,
        sink: Sink,
        rows: usize,
        inputs: Inputs,
        submission: Submission,
    ) -> Result<(Arc<Request>, Option<u64>), CoreError> {
        let lane = self.lane(submission.priority)?;
        let row_nbytes = self.ring.row_nbytes();
        if rows == 0 {
            return Err(CoreError::InvalidInput(
                "a request must carry at least one row".into(),
            ));
        }
        if rows > self.rule.max_batch_size {
            return Err(CoreError::InvalidInput(format!(
                "a request of {rows} rows exceeds max_batch_size ({})",
                self.rule.max_batch_size
            )));
        }
        if inputs.len() != row_nbytes.len() {
            return Err(CoreError::InvalidInput(format!(
                "expected {} inputs, got {}",
                row_nbytes.len(),
                inputs.len()
            )));
        }
        let layouts = self.ring.layouts();
        for (index, ((input, row), layout)) in
            inputs.iter().zip(row_nbytes).zip(layouts).enumerate()
        {
            // Formatted only into an error's message.
            let i = InputLabel {
                names: &self.input_names,
                index,
            };
            match layout {
                Layout::Fixed => {
                    // `rows * row` fits: a slot holds max_batch_size rows of `row`.
                    let expected = rows.saturating_mul(*row);
                    if input.len() != expected {
                        return Err(CoreError::InvalidInput(format!(
                            "input {i}: expected {expected} bytes ({rows} rows of {row}), got {}",
                            input.len()
                        )));
                    }
                }
                Layout::Ragged(r) => {
                    let elements = rows
                        .checked_mul(input.extent())
                        .and_then(|n| n.checked_mul(r.unit_elements));
                    let limit = self.max_batch_elements.unwrap_or(0);
                    match elements {
                        Some(n) if n <= limit => {}
                        _ => {
                            return Err(CoreError::InvalidInput(format!(
                                "input {i}: a request of {rows} rows of length {} exceeds \
                                 max_batch_elements ({limit})",
                                input.extent()
                            )))
                        }
                    }
                    // Fits: at most `limit` elements of `unit_nbytes / unit_elements` bytes.
                    let expected = rows * input.extent() * r.unit_nbytes;
                    if input.len() != expected {
                        return Err(CoreError::InvalidInput(format!(
                            "input {i}: expected {expected} bytes ({rows} rows of length {}), got {}",
                            input.extent(),
                            input.len()
                        )));
                    }
                }
                Layout::Bytes { elements_per_row } => {
                    // SAFETY: the caller keeps the bytes alive until the request
                    // resolves (this function's contract); it has not been queued.
                    let data = unsafe { input.as_slice() };
                    let count = rows.saturating_mul(*elements_per_row);
                    crate::bytes::check(data, count, self.bytes_limits)
                        .map_err(|e| CoreError::InvalidInput(format!("input {i}: {e}")))?;
                }
                Layout::Padded(p) => {
                    let extents = &input.extents()[..p.variable_dims()];
                    let limit = self.max_batch_elements.unwrap_or(0);
                    // Counted as the gather counts it (empty dimensions as 1),
                    // so a request admitted here fits a batch of its own.
                    let bound = p.row_bound(extents).and_then(|e| e.checked_mul(rows));
                    let elements = p.row_elements(extents).and_then(|e| e.checked_mul(rows));
                    let elements = match (bound, elements) {
                        (Some(b), Some(n)) if b <= limit => n,
                        _ => {
                            return Err(CoreError::InvalidInput(format!(
                                "input {i}: a request of {rows} rows of shape {:?} exceeds \
                                 max_batch_elements ({limit})",
                                p.row_shape(extents)
                            )))
                        }
                    };
                    // Fits: at most `limit` elements of `itemsize` bytes.
                    let expected = elements * p.itemsize;
                    if input.len() != expected {
                        return Err(CoreError::InvalidInput(format!(
                            "input {i}: expected {expected} bytes ({rows} rows of shape {:?}), got {}",
                            p.row_shape(extents),
                            input.len()
                        )));
                    }
                }
                Layout::RaggedBytes(r) => {
                    let elements = rows
                        .checked_mul(input.extent())
                        .and_then(|n| n.checked_mul(r.unit_elements));
                    let limit = self.max_batch_elements.unwrap_or(0);
                    let count = match elements {
                        Some(n) if n <= limit => n,
                        _ => {
                            return Err(CoreError::InvalidInput(format!(
                                "input {i}: a request of {rows} rows of length {} exceeds \
                                 max_batch_elements ({limit})",
                                input.extent()
                            )))
                        }
                    };
                    // SAFETY: as above.
                    let data = unsafe { input.as_slice() };
                    crate::bytes::check(data, count, self.bytes_limits)
                        .map_err(|e| CoreError::InvalidInput(format!("input {i}: {e}")))?;
                }
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // A timeout too long to represent as an instant is no deadline at all.
        let deadline = submission
            .timeout
            .and_then(|t| Instant::now().checked_add(t));
        let request = Request::new(id, sink, rows as u32, inputs, deadline)
            .in_lane(lane)
            .with_parameters(submission.parameters.filter(|_| self.keep_parameters))
            .with_absent(submission.absent)
            .with_requested_outputs(submission.requested_outputs)
            .blocking(submission.blocking_caller.is_some())
            .uncached(submission.uncached);
        Ok((Arc::new(request), submission.blocking_caller))
    }

    /// Queues `request`, ready for the workers at once.
    fn enqueue(
        &self,
        request: Arc<Request>,
        caller: Option<u64>,
        register: impl FnOnce(&Arc<Request>),
    ) -> Result<Arc<Request>, CoreError> {
        self.callers.arrive(caller, request.enqueued_at);
        register(&request);
        // A refused request was never seen by anyone: it is dropped here.
        self.queue.push(request.clone()).map_err(CoreError::from)?;
        if caller.is_some() {
            self.sent_blocking(request.enqueued_at);
        }
        Ok(request)
    }

    /// Blocking callers' requests were just sent: once every such caller
    /// has one in the batcher, the gatherer need not wait for more (see
    /// [`crate::callers`]; it waits for admitted requests until this nudge).
    fn sent_blocking(&self, now: Instant) {
        if self.callers.all_in(self.queue.blocking(), now) {
            self.queue.nudge();
        }
    }

    /// What the response cache kept for `request` (just made, not queued),
    /// if it has a cache, every worker has been busy a while (see
    /// [`CacheLink::busy`]) and the request is found there.
    fn look_up(&self, request: &Arc<Request>) -> Option<Arc<CachedValue>> {
        let link = self.cache.as_ref()?;
        if request.uncached || !link.busy.all_busy_for_a_while() {
            return None;
        }
        let namespace = link.namespace.load(Ordering::Acquire);
        // SAFETY: not queued yet, so nobody resolves it meanwhile; its
        // submitter keeps its inputs alive (the contract of `submit`).
        let key = unsafe { CacheKey::of(namespace, request, &link.rules) };
        link.cache.get(&key)
    }

    /// Hands `request`, found in the cache, to [`Batcher::wait_found`]
    /// instead of the queue (registered first, as a queued one is).
    fn hand_found(
        &self,
        request: Arc<Request>,
        found: Arc<CachedValue>,
        caller: Option<u64>,
        register: impl FnOnce(&Arc<Request>),
    ) -> Result<Arc<Request>, CoreError> {
        let Some(link) = &self.cache else {
            return Err(CoreError::Closed); // unreachable: found in no cache
        };
        // Never queued: nobody else can take it (nor withdraw it, once taken).
        if !request.take() {
            return Err(CoreError::Closed);
        }
        self.callers.arrive(caller, request.enqueued_at);
        register(&request);
        let first = {
            let mut waiting = link.found.lock().unwrap_or_else(|e| e.into_inner());
            if waiting.closed {
                return Err(CoreError::Closed);
            }
            waiting.hits.push((request.clone(), found));
            waiting.hits.len() == 1
        };
        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
        if first {
            link.found_ready.notify_one(); // the others join it, unwoken
        }
        Ok(request)
    }

    /// Blocks until requests found in the response cache as they were
    /// submitted wait (then hands them all out), or, once the batcher is
    /// closed, none is left (`None`; also at once without a cache). One
    /// thread answers them, beside the workers: a hit found at submit
    /// never waits for an instance.
    pub fn wait_found(&self) -> Option<FoundInCache> {
        let link = self.cache.as_ref()?;
        let mut waiting = link.found.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if !waiting.hits.is_empty() {
                return Some(std::mem::take(&mut waiting.hits));
            }
            if waiting.closed {
                return None;
            }
            waiting = link
                .found_ready
                .wait(waiting)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The blocking caller `key` is gone (its thread ended): batches no
    /// longer wait for it (see [`crate::callers`]).
    pub fn forget_caller(&self, key: u64) {
        self.callers.forget(key);
        self.queue.nudge();
    }

    /// Admits a request a holder keeps until it flushes ([`Unflushed`]).
    pub(crate) fn admit_held(&self, request: Arc<Request>) -> Result<Admitted, CoreError> {
        self.queue.admit(request).map_err(CoreError::from)
    }

    /// Sends what a holder kept to the workers, ringing once.
    pub(crate) fn send_held(&self, held: Vec<Admitted>) {
        let blocking = held.iter().any(Admitted::is_blocking);
        self.queue.send(held);
        if blocking {
            self.sent_blocking(Instant::now());
        }
    }

    /// Remembers a holder, to flush it as this batcher closes.
    pub(crate) fn register_holder(&self, holder: Weak<Held>) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        holders.retain(|h| h.strong_count() > 0 && !h.ptr_eq(&holder));
        holders.push(holder);
    }

    /// Gathers the next batch by the dispatch rule and collates it into a
    /// staging slot the caller then holds. Blocks; call it without any lock
    /// the submitters need. `None` once the batcher is closed and this worker
    /// has dispatched everything it was given ([`Worker::is_closed`]), or,
    /// with a queue timeout, when requests outstayed it while a batch filled
    /// (the batch is parked), or, with a response cache, when every request
    /// of the batch was found there: answer [`Worker::take_outstayed`] and
    /// [`Worker::take_cached`] and call again. After any call, those
    /// requests are the caller's to answer.
    ///
    /// One worker gathers at a time (it holds the gatherer's role; the
    /// others wait for it), so batches fill instead of being split between
    /// idle workers, and one sleeper at most waits for rows. Collation runs
    /// after the role is let go: the next worker gathers while this one copies.
    pub fn next_batch(&self, worker: &mut Worker) -> Option<Batch> {
        let _gathering = Gathering::enter(self.cache.as_ref().map(|link| &link.busy));
        let mut slot = self.ring.acquire();
        let mut gathered: Vec<Arc<Request>> = Vec::with_capacity(self.rule.max_batch_size);
        let (rows, reason) = {
            let role = self.queue.take_role();
            let mut carry = self.carry.lock().unwrap_or_else(|e| e.into_inner());
            let mut parked = self.parked.lock().unwrap_or_else(|e| e.into_inner());
            let mut free_since = Instant::now();
            if let Some(p) = parked.take() {
                gathered = p.gathered;
                free_since = p.free_since;
            }
            let gathered_by = loop {
                let Some((_, reason)) =
                    self.gather(&role, &mut carry, worker, &mut gathered, free_since)
                else {
                    // Requests outstayed the queue while the batch filled:
                    // their callers are answered before it goes on.
                    *parked = Some(Parked {
                        gathered: std::mem::take(&mut gathered),
                        free_since,
                    });
                    break (0, DispatchReason::Shutdown);
                };
                let rows = self.take_gathered(&mut gathered, worker);
                // Withdrawn to the last one while it filled: gather anew,
                // unless requests that outstayed the queue wait for their answer.
                if rows > 0 || (worker.closed && carry.is_none()) || !worker.outstayed.is_empty() {
                    break (rows, reason);
                }
                free_since = Instant::now();
            };
            drop(parked);
            let more = carry.is_some();
            drop(carry);
            role.release(more);
            gathered_by
        };
        let (rows, cache_keys) = match &self.cache {
            Some(link) => self.answer_from_cache(link, &mut gathered, worker),
            None => (rows, Vec::new()),
        };
        if gathered.is_empty() {
            return None; // `slot` goes back to the ring
        }
        // SAFETY: `take_gathered` won `take()` for every request left in
        // `gathered`, and none is resolved before this batch is returned;
        // `gather` kept the rows within `max_batch_size`, which every slot holds.
        let (collated_rows, collated) = unsafe { slot.collate_all(&gathered) };
        debug_assert_eq!(collated_rows, rows);
        let taken_at = Instant::now();
        let queue_ns: u64 = gathered
            .iter()
            .map(|r| taken_at.saturating_duration_since(r.enqueued_at).as_nanos() as u64)
            .sum();
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.stats
            .requests
            .fetch_add(gathered.len() as u64, Ordering::Relaxed);
        self.stats.queue_ns.fetch_add(queue_ns, Ordering::Relaxed);
        self.stats.dispatch_reasons[reason as usize].fetch_add(1, Ordering::Relaxed);
        if reason != DispatchReason::Shutdown {
            self.last_rows.store(rows, Ordering::Relaxed);
        }
        let oldest_age = taken_at.saturating_duration_since(gathered[0].enqueued_at);
        self.stats
            .release_age_ns
            .fetch_add(oldest_age.as_nanos() as u64, Ordering::Relaxed);
        Some(Batch {
            slot,
            rows,
            routes: Routes::for_batch(&gathered),
            requests: gathered,
            reason,
            taken_at,
            collated,
            cache_keys,
        })
    }

    /// Looks each of `gathered` (taken, not yet collated) up in the cache:
    /// hits leave it for the worker's owner to answer; returns the rows
    /// left and the misses' keys, in order (`None` for an uncached one).
    fn answer_from_cache(
        &self,
        link: &CacheLink,
        gathered: &mut Vec<Arc<Request>>,
        worker: &mut Worker,
    ) -> (usize, Vec<Option<CacheKey>>) {
        let mut keys = Vec::with_capacity(gathered.len());
        let hits_before = worker.cached.len();
        let namespace = link.namespace.load(Ordering::Acquire);
        let mut uncached = 0u64;
        gathered.retain(|r| {
            if r.uncached {
                keys.push(None);
                uncached += 1;
                return true;
            }
            // SAFETY: `take_gathered` won `take()` for every request left in
            // `gathered`, and none is resolved before its batch is returned
            // (or, for a hit, before the worker's owner answers it).
            let key = unsafe { CacheKey::of(namespace, r, &link.rules) };
            match link.cache.get(&key) {
                Some(value) => {
                    worker.cached.push((r.clone(), value));
                    false
                }
                None => {
                    keys.push(Some(key));
                    true
                }
            }
        });
        let hits = (worker.cached.len() - hits_before) as u64;
        self.stats.cache_hits.fetch_add(hits, Ordering::Relaxed);
        let misses = (keys.len() as u64).saturating_sub(uncached);
        self.stats.cache_misses.fetch_add(misses, Ordering::Relaxed);
        (gathered.iter().map(|r| r.rows as usize).sum(), keys)
    }

    /// Fills `gathered` (empty, or a parked batch taken up again) by the
    /// dispatch rule; returns its rows and why it stopped gathering. Empty
    /// only once this worker has seen its close message and no carried
    /// request is left. `None` when requests outstayed the queue meanwhile
    /// (their callers are answered before the batch goes on: `next_batch`
    /// parks it). `free_since`: when the worker that began it was free.
    /// Called by the holder of the gatherer's role.
    ///
    /// Gathered requests stay queued until the batch is released
    /// ([`Batcher::take_gathered`]): a caller may still withdraw one while
    /// the batch fills (its deadline passes, its task is cancelled), and
    /// then it never runs. They count as this batch's rows meanwhile, and
    /// in the queue's length (`queue_depth`), as the requests they are.
    fn gather(
        &self,
        role: &GatherRole<'_>,
        carry: &mut Option<Arc<Request>>,
        worker: &mut Worker,
        gathered: &mut Vec<Arc<Request>>,
        free_since: Instant,
    ) -> Option<(usize, DispatchReason)> {
        let max = self.rule.max_batch_size;
        let mut rows = 0usize;
        let mut budget = Budget::new(self.ring.layouts());
        for r in gathered.iter() {
            // A parked batch, taken up again.
            budget.add(r, self.ring.layouts());
            rows += r.rows as usize;
        }
        if let Some(r) = carry.take() {
            if self.admissible(&r, Instant::now(), worker) {
                self.admit(r, carry, gathered, &mut rows, &mut budget);
            }
        }
        while !worker.closed {
            let now = Instant::now();
            let live =
                |r: &Arc<Request>| r.state() == RequestState::Queued && !self.past_due(r, now);
            if !gathered.iter().all(live) {
                // Withdrawn or expired while the batch filled: they leave it
                // (counted as skipped by `take_one`, which cannot take them).
                gathered.retain(|r| live(r) || self.take_one(r, now, worker));
                rows = 0;
                budget = Budget::new(self.ring.layouts());
                for r in gathered.iter() {
                    budget.add(r, self.ring.layouts());
                    rows += r.rows as usize;
                }
            }
            // Take what is already queued, without blocking.
            while rows < max && carry.is_none() && !worker.closed {
                match self.queue.try_pop() {
                    Popped::Request(r) => {
                        if self.admissible(&r, now, worker) {
                            self.admit(r, carry, gathered, &mut rows, &mut budget);
                        }
                    }
                    Popped::Close => worker.closed = true,
                    Popped::Empty => break,
                }
            }
            if rows >= max {
                return Some((rows, DispatchReason::Full));
            }
            if carry.is_some() {
                return Some((rows, DispatchReason::NextDoesNotFit));
            }
            if worker.closed {
                break;
            }
            let wait_until = if gathered.is_empty() {
                None
            } else {
                let mut window_start = gathered[0].enqueued_at;
                if self.rule.delay_from_free_worker {
                    window_start = window_start.max(free_since);
                }
                let oldest_age = now.saturating_duration_since(window_start);
                let live = gathered
                    .iter()
                    .filter(|r| r.state() == RequestState::Queued);
                let more_waiting = self.queue.len() > live.count();
                let decision = if self.rule.adaptive {
                    let target = self.last_rows.load(Ordering::Relaxed);
                    self.rule
                        .decide_adaptive(rows, oldest_age, more_waiting, target)
                } else {
                    self.rule.decide(rows, oldest_age, more_waiting)
                };
                match decision {
                    Decision::Dispatch(reason) => return Some((rows, reason)),
                    Decision::Wait(limit) => {
                        // A wait too long to represent is a wait without a limit.
                        let until = limit.and_then(|l| now.checked_add(l));
                        // Wake when a gathered request outstays the queue, to answer it.
                        let until = match (until, self.first_queue_deadline(gathered)) {
                            (Some(u), Some(q)) => Some(u.min(q)),
                            (u, q) => u.or(q),
                        };
                        let blocking = gathered
                            .iter()
                            .filter(|r| r.blocking && r.state() == RequestState::Queued)
                            .count();
                        if blocking == 0 {
                            until
                        } else {
                            // The queue counts the gathered ones too, until taken.
                            let live = self.queue.blocking();
                            match self.callers.all_in_now(blocking, live, now) {
                                (true, _) => return Some((rows, DispatchReason::CallersWaiting)),
                                (false, Some(quiet)) => Some(until.map_or(quiet, |u| u.min(quiet))),
                                (false, None) => until,
                            }
                        }
                    }
                }
            };
            if !worker.outstayed.is_empty() {
                // Callers to answer before waiting on: the batch is parked meanwhile.
                return None;
            }
            // Sleep until the decision can change: enough rows, or the deadline.
            // Blocking callers seen lately may be all in with fewer rows than
            // the rule waits for (below `min_batch_size`): the first row wakes
            // the worker then, which decides with them (see `crate::callers`).
            // With a queue timeout, the first request is gathered as it
            // comes, so that its deadline bounds the wait (one still in the
            // queue is checked by no one); the later ones need no wake of
            // their own: one timeout for all, so their deadlines are later
            // than the earliest gathered one's, which `wait_until` keeps.
            let recheck_at = if gathered.is_empty()
                && (self.callers.any_seen() || self.queue_timeout.is_some())
            {
                rows + 1
            } else if self.rule.adaptive {
                let target = self.last_rows.load(Ordering::Relaxed);
                self.rule.recheck_at_adaptive(rows, target)
            } else {
                self.rule.recheck_at(rows)
            };
            role.wait_for_rows(recheck_at - rows, wait_until);
        }
        Some((rows, DispatchReason::Shutdown))
    }

    /// Releases the gathered batch: takes each request still queued and
    /// within its deadline, drops the others (withdrawn while the batch
    /// filled). Returns the rows left.
    fn take_gathered(&self, gathered: &mut Vec<Arc<Request>>, worker: &mut Worker) -> usize {
        let now = Instant::now();
        gathered.retain(|r| self.take_one(r, now, worker));
        gathered.iter().map(|r| r.rows as usize).sum()
    }

    /// Whether `r` may no longer be taken at `now`: past its own deadline,
    /// or waiting longer than the queue timeout.
    fn past_due(&self, r: &Request, now: Instant) -> bool {
        r.is_past_deadline(now) || self.outstayed_queue(r, now)
    }

    /// Whether `r` has waited in the queue longer than the queue timeout at `now`.
    fn outstayed_queue(&self, r: &Request, now: Instant) -> bool {
        self.queue_timeout
            .is_some_and(|t| now.saturating_duration_since(r.enqueued_at) >= t)
    }

    /// The earliest instant at which one of `gathered` outstays the queue.
    fn first_queue_deadline(&self, gathered: &[Arc<Request>]) -> Option<Instant> {
        let timeout = self.queue_timeout?;
        gathered
            .iter()
            .filter_map(|r| r.enqueued_at.checked_add(timeout))
            .min()
    }

    /// Takes `r` for a batch: true when this worker won it; otherwise it is
    /// counted as skipped (expired, or withdrawn by its caller).
    fn take_one(&self, r: &Arc<Request>, now: Instant, worker: &mut Worker) -> bool {
        if self.past_due(r, now) {
            // The caller's own timer reports its deadline; we only never run
            // it. A queue timeout has no timer: the worker's owner answers.
            if r.transition(RequestState::Expired) {
                self.queue.left(r);
                self.stats.skipped_expired.fetch_add(1, Ordering::Relaxed);
                if self.outstayed_queue(r, now) {
                    worker.outstayed.push(r.clone());
                }
            } else {
                self.stats.skipped_withdrawn.fetch_add(1, Ordering::Relaxed);
            }
            return false;
        }
        if !r.take() {
            self.stats.skipped_withdrawn.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.queue.left(r);
        true
    }

    /// Whether `r` may join a batch at `now`: still queued and not past
    /// due. One that may not is dropped here, counted as skipped by
    /// `take_one` (and kept to answer if it outstayed the queue).
    fn admissible(&self, r: &Arc<Request>, now: Instant, worker: &mut Worker) -> bool {
        if r.state() != RequestState::Queued || self.past_due(r, now) {
            self.take_one(r, now, worker); // fails: counts why it is skipped
            return false;
        }
        true
    }

    /// Gathers admissible `r` into the batch if it fits; one that does not
    /// fit becomes the carry, to lead the next batch. It stays queued until
    /// [`Batcher::take_gathered`].
    fn admit(
        &self,
        r: Arc<Request>,
        carry: &mut Option<Arc<Request>>,
        gathered: &mut Vec<Arc<Request>>,
        rows: &mut usize,
        budget: &mut Budget,
    ) {
        if *rows + r.rows as usize > self.rule.max_batch_size
            || !budget.fits(&r, *rows, self.ring.layouts(), self.max_batch_elements)
        {
            // Head of line: it leads the next batch, which it always fits
            // (submit refused any request over a limit on its own).
            *carry = Some(r);
            return;
        }
        budget.add(&r, self.ring.layouts());
        *rows += r.rows as usize;
        gathered.push(r);
    }

    /// The submitter withdraws `request` (`to`: `Cancelled`, `Expired` or `Closed`).
    ///
    /// Returns true when the request will never be read by a worker: this call
    /// withdrew it, or it was already withdrawn. False means a batch has taken
    /// it: its inputs must stay alive until that batch resolves it.
    pub fn withdraw(&self, request: &Request, to: RequestState) -> bool {
        match request.withdraw(to) {
            Withdrawal::Withdrew => {
                self.queue.left(request);
                true
            }
            Withdrawal::AlreadyWithdrawn => true,
            Withdrawal::Taken => false,
        }
    }

    /// Staging slots no batch holds now.
    pub fn free_slots(&self) -> usize {
        self.ring.free_slots()
    }

    /// Refuses new requests; each worker dispatches what it holds, then
    /// stops. Requests submitters hold ([`Unflushed`]) go out first.
    pub fn close(&self) {
        if !self.queue.refuse() {
            return;
        }
        if let Some(link) = &self.cache {
            link.found.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            link.found_ready.notify_all();
        }
        let holders: Vec<Arc<Held>> = {
            let holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
            holders.iter().filter_map(Weak::upgrade).collect()
        };
        for holder in holders {
            holder.flush();
        }
        self.queue.send_closes(self.workers);
    }
}

/// The elements a batch being gathered holds of each variable-length
/// input: `(positions, longest row)` per input (zero for the others), and
/// for inputs padded along several dimensions the longest along each.
struct Budget {
    used: Vec<(usize, usize)>,
    longest: Vec<[usize; crate::MAX_VARIABLE_DIMS]>,
}

impl Budget {
    fn new(layouts: &[Layout]) -> Budget {
        Budget {
            used: vec![(0, 0); layouts.len()],
            longest: vec![[0; crate::MAX_VARIABLE_DIMS]; layouts.len()],
        }
    }

    /// Whether `r` joins a batch of `rows` rows with input `i`, padded
    /// along several dimensions, within `limit` elements counted padded.
    fn padded_fits(
        &self,
        p: &crate::Padded,
        r: &Request,
        i: usize,
        rows: usize,
        limit: usize,
    ) -> bool {
        let mut longest = self.longest[i];
        for (m, &e) in longest.iter_mut().zip(r.inputs()[i].extents()) {
            *m = (*m).max(e);
        }
        p.row_bound(&longest[..p.variable_dims()])
            .and_then(|e| e.checked_mul(rows + r.rows as usize))
            .is_some_and(|e| e <= limit)
    }

    /// Whether `r` joins a batch of `rows` rows within `limit` elements of
    /// every ragged input (a padded one counted padded).
    fn fits(&self, r: &Request, rows: usize, layouts: &[Layout], limit: Option<usize>) -> bool {
        let limit = limit.unwrap_or(usize::MAX);
        let n = r.rows as usize;
        layouts.iter().enumerate().all(|(i, layout)| {
            if let Layout::Padded(p) = layout {
                return self.padded_fits(p, r, i, rows, limit);
            }
            let Some((unit_elements, padded)) = layout.variable() else {
                return true;
            };
            let extent = r.inputs()[i].extent();
            let (positions, longest) = self.used[i];
            let after = if padded {
                (rows + n).checked_mul(longest.max(extent))
            } else {
                n.checked_mul(extent).and_then(|p| p.checked_add(positions))
            };
            after
                .and_then(|p| p.checked_mul(unit_elements))
                .is_some_and(|e| e <= limit)
        })
    }

    fn add(&mut self, r: &Request, layouts: &[Layout]) {
        for (i, layout) in layouts.iter().enumerate() {
            if let Layout::Padded(_) = layout {
                for (m, &e) in self.longest[i].iter_mut().zip(r.inputs()[i].extents()) {
                    *m = (*m).max(e);
                }
            }
            if layout.variable().is_some() {
                let extent = r.inputs()[i].extent();
                let (positions, longest) = &mut self.used[i];
                *positions += r.rows as usize * extent;
                *longest = (*longest).max(extent);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{InputBytes, ResponseCache};
    use std::collections::HashSet;
    use std::sync::Mutex;

    const ROW: usize = 8;

    /// A batcher over heap slots, with the slot memory kept alive by the test.
    struct Fixture {
        batcher: Arc<Batcher>,
        _slots: Vec<Vec<u8>>,
    }

    fn fixture(max: usize, delay: Duration, min: usize, queue: usize, workers: usize) -> Fixture {
        build(max, delay, min, queue, workers, Knobs::default())
    }

    /// A batcher with `priorities` that keeps request parameters.
    fn fixture_with(
        max: usize,
        delay: Duration,
        min: usize,
        queue: usize,
        workers: usize,
        priorities: Priorities,
    ) -> Fixture {
        let knobs = Knobs {
            priorities,
            keep_parameters: true,
            ..Knobs::default()
        };
        build(max, delay, min, queue, workers, knobs)
    }

    /// What a fixture may set besides its sizes.
    struct Knobs {
        priorities: Priorities,
        keep_parameters: bool,
        delay_from_free_worker: bool,
        readiness: Readiness,
        queue_timeout: Option<Duration>,
        cache: Option<(Arc<SharedCache>, u64, KeyRules)>,
    }

    impl Default for Knobs {
        fn default() -> Knobs {
            Knobs {
                priorities: Priorities::NONE,
                keep_parameters: false,
                delay_from_free_worker: false,
                readiness: Readiness::OnPush,
                queue_timeout: None,
                cache: None,
            }
        }
    }

    fn build(
        max: usize,
        delay: Duration,
        min: usize,
        queue: usize,
        workers: usize,
        knobs: Knobs,
    ) -> Fixture {
        let mut store: Vec<Vec<u8>> = (0..workers + 1).map(|_| vec![0u8; max * ROW]).collect();
        let slots = store
            .iter_mut()
            // SAFETY: `store` moves into the fixture, which outlives the batcher's use.
            .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
            .collect();
        let mut rule = DispatchRule::new(max, delay, min, vec![]).unwrap();
        if knobs.delay_from_free_worker {
            rule = rule.delay_from_free_worker();
        }
        let config = BatcherConfig {
            rule,
            row_nbytes: vec![ROW],
            max_queue_size: queue,
            workers,
            readiness: knobs.readiness,
            layouts: Vec::new(),
            max_batch_elements: None,
            bytes_limits: BytesLimits::default(),
            priorities: knobs.priorities,
            default_priority: None,
        };
        Fixture {
            batcher: Arc::new(
                Batcher::new(config, slots)
                    .unwrap()
                    .keeping_parameters(knobs.keep_parameters)
                    .with_queue_timeout(knobs.queue_timeout)
                    .with_response_cache(knobs.cache),
            ),
            _slots: store,
        }
    }

    fn submit(b: &Batcher, bytes: &'static [u8], timeout: Option<Duration>) -> Arc<Request> {
        // SAFETY: static bytes outlive everything.
        let input = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
        b.submit(Sink::EventLoop(0), bytes.len() / ROW, [input], timeout)
            .unwrap()
    }

    /// A request of the blocking caller `caller` (a thread that waits for it).
    fn submit_blocking(b: &Batcher, caller: u64) -> Arc<Request> {
        // SAFETY: static bytes outlive everything.
        let input = unsafe { InputBytes::new(ROW_A.as_ptr(), ROW) };
        let submission = Submission {
            blocking_caller: Some(caller),
            ..Submission::default()
        };
        b.submit_request(Sink::Thread, 1, [input], submission, |_| {})
            .unwrap()
    }

    fn submit_at(b: &Batcher, priority: Option<u32>) -> Result<Arc<Request>, CoreError> {
        // SAFETY: static bytes outlive everything.
        let input = unsafe { InputBytes::new(ROW_A.as_ptr(), ROW) };
        let submission = Submission {
            priority,
            parameters: Some(format!("{{\"p\": {}}}", priority.unwrap_or(0)).into()),
            ..Submission::default()
        };
        b.submit_request(Sink::EventLoop(0), 1, [input], submission, |_| ())
    }

    fn levels(n: u8, max_wait: Option<Duration>) -> Priorities {
        Priorities {
            levels: n,
            max_wait,
        }
    }

    #[test]
    fn a_queue_past_its_bound_is_refused_before_anything_is_allocated() {
        for queue in [0, MAX_QUEUE_SIZE + 1, usize::MAX] {
            let config = BatcherConfig {
                rule: DispatchRule::new(2, Duration::ZERO, 1, vec![]).unwrap(),
                row_nbytes: vec![ROW],
                max_queue_size: queue,
                workers: 1,
                readiness: Readiness::OnPush,
                layouts: Vec::new(),
                max_batch_elements: None,
                bytes_limits: BytesLimits::default(),
                priorities: Priorities::NONE,
                default_priority: None,
            };
            let refused = Batcher::new(config, Vec::new()).err();
            assert!(
                matches!(&refused, Some(CoreError::InvalidConfig(m)) if m.starts_with("max_queue_size must be from 1 to")),
                "{queue}: {refused:?}"
            );
        }
    }

    #[test]
    fn the_most_urgent_level_goes_first_fifo_within_a_level() {
        let f = fixture_with(2, Duration::ZERO, 1, 100, 1, levels(3, None));
        let low = submit_at(&f.batcher, None).unwrap(); // default: least urgent (3)
        let mid = submit_at(&f.batcher, Some(2)).unwrap();
        let high_a = submit_at(&f.batcher, Some(1)).unwrap();
        let high_b = submit_at(&f.batcher, Some(1)).unwrap();
        let mut w = Worker::new();
        let ids = |b: &Batch| b.requests.iter().map(|r| r.id).collect::<Vec<_>>();
        let first = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(ids(&first), vec![high_a.id, high_b.id]);
        assert_eq!(first.requests[0].parameters.as_deref(), Some("{\"p\": 1}"));
        let second = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(ids(&second), vec![mid.id, low.id]);
        assert_eq!(f.batcher.queue_lens(), vec![0, 0, 0]);
    }

    #[test]
    fn parameters_travel_only_to_a_model_that_keeps_them() {
        let keeping = fixture_with(2, Duration::ZERO, 1, 100, 1, Priorities::NONE);
        let kept = submit_at(&keeping.batcher, Some(1)).unwrap();
        assert_eq!(kept.parameters.as_deref(), Some("{\"p\": 1}"));
        let plain = fixture(2, Duration::ZERO, 1, 100, 1); // not keeping
        let dropped = submit_at(&plain.batcher, Some(1)).unwrap();
        assert_eq!(
            dropped.parameters, None,
            "dropped at submit: nothing to carry"
        );
    }

    #[test]
    fn a_passed_over_level_goes_first_once_it_waited_max_wait() {
        let wait = Duration::from_millis(30);
        let f = fixture_with(1, Duration::ZERO, 1, 100, 1, levels(2, Some(wait)));
        let low = submit_at(&f.batcher, Some(2)).unwrap();
        let high = submit_at(&f.batcher, Some(1)).unwrap();
        let mut w = Worker::new();
        let first = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(
            first.requests[0].id, high.id,
            "strict priority before max_wait"
        );
        drop(first);
        let low2 = submit_at(&f.batcher, Some(2)).unwrap();
        let _ = submit_at(&f.batcher, Some(1)).unwrap();
        std::thread::sleep(wait + Duration::from_millis(5));
        let high3 = submit_at(&f.batcher, Some(1)).unwrap();
        let next = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(next.requests[0].id, low.id, "the overdue head goes first");
        drop(next);
        let next = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(next.requests[0].id, low2.id, "still overdue");
        drop(next);
        // Then the urgent lane again, oldest first.
        let next = f.batcher.next_batch(&mut w).unwrap();
        assert_ne!(next.requests[0].id, high3.id);
        drop(next);
        assert_eq!(
            f.batcher.next_batch(&mut w).unwrap().requests[0].id,
            high3.id
        );
    }

    #[test]
    fn a_full_less_urgent_level_never_refuses_a_more_urgent_request() {
        // 4 places: level 2 of 2 admits 2, level 1 all 4.
        let f = fixture_with(4, Duration::ZERO, 1, 4, 1, levels(2, None));
        submit_at(&f.batcher, Some(2)).unwrap();
        submit_at(&f.batcher, Some(2)).unwrap();
        let refused = submit_at(&f.batcher, Some(2)).unwrap_err();
        assert_eq!(refused, CoreError::QueueFull { capacity: 2 });
        submit_at(&f.batcher, Some(1)).unwrap();
        submit_at(&f.batcher, Some(1)).unwrap();
        let refused = submit_at(&f.batcher, Some(1)).unwrap_err();
        assert_eq!(
            refused,
            CoreError::QueueFull { capacity: 4 },
            "the whole queue"
        );
        assert_eq!(f.batcher.queue_lens(), vec![2, 2]);
        let err = submit_at(&f.batcher, Some(3)).unwrap_err();
        assert!(matches!(err, CoreError::InvalidInput(m) if m.contains("between 1")));
        // Priority 0 is the default level, as in Triton.
        assert!(matches!(
            submit_at(&f.batcher, Some(0)).unwrap_err(),
            CoreError::QueueFull { capacity: 2 }
        ));
    }

    #[test]
    fn without_levels_a_priority_is_ignored_and_close_still_drains() {
        let f = fixture_with(8, Duration::ZERO, 1, 100, 1, Priorities::NONE);
        let a = submit_at(&f.batcher, Some(7)).unwrap();
        let f3 = fixture_with(
            8,
            Duration::from_secs(60),
            1,
            100,
            1,
            levels(3, Some(Duration::ZERO)),
        );
        let low = submit_at(&f3.batcher, Some(3)).unwrap();
        let high = submit_at(&f3.batcher, Some(1)).unwrap();
        f3.batcher.close();
        let mut w = Worker::new();
        let batch = f3.batcher.next_batch(&mut w).unwrap();
        let mut ids: Vec<u64> = batch.requests.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![low.id, high.id], "closing dispatches every level");
        drop(batch);
        assert!(f3.batcher.next_batch(&mut w).is_none());
        assert_eq!(
            f.batcher.next_batch(&mut Worker::new()).unwrap().requests[0].id,
            a.id
        );
    }

    static ROW_A: [u8; ROW] = [7; ROW];
    static ROWS_3: [u8; 3 * ROW] = [9; 3 * ROW];

    #[test]
    fn greedy_takes_everything_queued_up_to_max() {
        let f = fixture(4, Duration::ZERO, 1, 100, 1);
        let mut w = Worker::new();
        for _ in 0..6 {
            submit(&f.batcher, &ROW_A, None);
        }
        let b = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(b.rows, 4);
        drop(b);
        let b = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(b.rows, 2);
    }

    #[test]
    fn a_batch_holds_its_slot_until_it_is_dropped_even_on_another_thread() {
        let f = fixture(2, Duration::ZERO, 1, 100, 1); // two slots
        let mut w = Worker::new();
        for _ in 0..5 {
            submit(&f.batcher, &ROW_A, None);
        }
        let first = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(f.batcher.free_slots(), 1);
        let second = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(f.batcher.free_slots(), 0);
        assert_ne!(first.slot.index(), second.slot.index());
        let index = first.slot.index();
        // A third batch waits for a slot until a batch is given back, here by
        // another thread (the CUDA path's complete thread).
        let third = {
            let batcher = f.batcher.clone();
            std::thread::spawn(move || batcher.next_batch(&mut Worker::new()).unwrap())
        };
        std::thread::sleep(Duration::from_millis(if cfg!(miri) { 1 } else { 20 }));
        assert!(!third.is_finished(), "no slot is free");
        std::thread::spawn(move || drop(first)).join().unwrap();
        let third = third.join().unwrap();
        assert_eq!(third.slot.index(), index, "the slot given back");
        assert_eq!(third.rows, 1);
        drop((second, third));
        assert_eq!(f.batcher.free_slots(), 2);
    }

    #[test]
    fn a_request_that_does_not_fit_leads_the_next_batch() {
        let f = fixture(4, Duration::ZERO, 1, 100, 1);
        let mut w = Worker::new();
        let a = submit(&f.batcher, &ROWS_3, None);
        let b = submit(&f.batcher, &ROWS_3, None);
        let first = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(first.routes.groups[0].1[0].id, a.id);
        assert_eq!(first.rows, 3);
        drop(first);
        let second = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(
            second.routes.groups[0].1,
            vec![crate::Route {
                id: b.id,
                start: 0,
                rows: 3
            }]
        );
    }

    #[test]
    fn refuses_bad_requests_before_they_are_queued() {
        let f = fixture(2, Duration::ZERO, 1, 1, 1);
        static SHORT: [u8; 3] = [0; 3];
        let input = unsafe { InputBytes::new(SHORT.as_ptr(), SHORT.len()) };
        let err = f
            .batcher
            .submit(Sink::EventLoop(0), 1, [input], None)
            .unwrap_err();
        assert!(matches!(err, CoreError::InvalidInput(m) if m.contains("expected 8 bytes")));
        static BIG: [u8; 3 * ROW] = [0; 3 * ROW];
        let input = unsafe { InputBytes::new(BIG.as_ptr(), BIG.len()) };
        let err = f
            .batcher
            .submit(Sink::EventLoop(0), 3, [input], None)
            .unwrap_err();
        assert!(err.to_string().contains("exceeds max_batch_size"));
        assert_eq!(f.batcher.queue_len(), 0);
        submit(&f.batcher, &ROW_A, None);
        let input = unsafe { InputBytes::new(ROW_A.as_ptr(), ROW) };
        assert!(matches!(
            f.batcher.submit(Sink::EventLoop(0), 1, [input], None),
            Err(CoreError::QueueFull { capacity: 1 })
        ));
    }

    #[test]
    fn each_batch_records_why_it_was_released() {
        let reasons = |b: &Batcher| -> Vec<u64> {
            let s = b.stats();
            s.dispatch_reasons
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect()
        };
        let mut w = Worker::new();
        // Greedy: whatever is queued; then full; then a request that does not fit.
        let f = fixture(4, Duration::ZERO, 1, 100, 1);
        submit(&f.batcher, &ROW_A, None);
        let b = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(b.reason, DispatchReason::Greedy);
        drop(b);
        for _ in 0..4 {
            submit(&f.batcher, &ROW_A, None);
        }
        assert_eq!(
            f.batcher.next_batch(&mut w).unwrap().reason,
            DispatchReason::Full
        );
        submit(&f.batcher, &ROWS_3, None);
        submit(&f.batcher, &ROWS_3, None);
        let b = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!((b.rows, b.reason), (3, DispatchReason::NextDoesNotFit));
        drop(b);
        assert_eq!(
            f.batcher.next_batch(&mut w).unwrap().reason,
            DispatchReason::Greedy
        );
        let counted = reasons(&f.batcher);
        assert_eq!(counted.iter().sum::<u64>(), 4, "one reason per batch");
        assert_eq!(counted[DispatchReason::NextDoesNotFit as usize], 1);

        // A delay that expires, then shutdown with a batch waiting for its minimum.
        let f = fixture(8, Duration::from_millis(5), 1, 100, 1);
        let mut w = Worker::new();
        submit(&f.batcher, &ROW_A, None);
        assert_eq!(
            f.batcher.next_batch(&mut w).unwrap().reason,
            DispatchReason::DelayExpired
        );
        let f = fixture(8, Duration::ZERO, 4, 100, 1);
        let mut w = Worker::new();
        submit(&f.batcher, &ROW_A, None);
        f.batcher.close();
        assert_eq!(
            f.batcher.next_batch(&mut w).unwrap().reason,
            DispatchReason::Shutdown
        );
        assert!(f.batcher.next_batch(&mut w).is_none());
    }

    #[test]
    fn a_timeout_too_long_for_an_instant_means_no_deadline() {
        let f = fixture(2, Duration::ZERO, 1, 10, 1);
        for timeout in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            let r = submit(&f.batcher, &ROW_A, Some(timeout));
            assert_eq!(r.deadline, None);
        }
        let r = submit(&f.batcher, &ROW_A, Some(Duration::from_secs(3600)));
        assert!(r.deadline.is_some());
    }

    #[test]
    fn a_max_delay_too_long_for_an_instant_waits_without_a_limit() {
        let f = fixture(2, Duration::MAX, 1, 10, 1);
        let batcher = f.batcher.clone();
        submit(&batcher, &ROW_A, None);
        let second = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            submit(&batcher, &ROW_A, None);
        });
        let mut w = Worker::new();
        let b = f.batcher.next_batch(&mut w).unwrap();
        assert_eq!(b.rows, 2, "dispatched when full, not by a deadline");
        second.join().unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn waits_max_delay_for_a_fuller_batch() {
        let f = fixture(8, Duration::from_millis(30), 1, 100, 1);
        let batcher = f.batcher.clone();
        submit(&batcher, &ROW_A, None);
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            submit(&batcher, &ROW_A, None);
        });
        let started = Instant::now();
        let b = f.batcher.next_batch(&mut Worker::new()).unwrap();
        late.join().unwrap();
        assert_eq!(b.rows, 2, "the late request joined the open batch");
        assert!(started.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_cached_request_is_answered_at_submit_or_leaves_its_batch_and_misses_carry_keys() {
        let busy_a_while = || std::thread::sleep(HIT_WAIT_FOR_BUSY + Duration::from_millis(1));
        static ROW_C: [u8; ROW] = [9; ROW];
        let cache: Arc<SharedCache> = Arc::new(ResponseCache::new(1 << 20));
        let namespace = cache.namespace();
        let knobs = Knobs {
            cache: Some((cache.clone(), namespace, KeyRules::default())),
            ..Knobs::default()
        };
        let f = build(8, Duration::ZERO, 1, 100, 1, knobs);
        let mut worker = Worker::new();
        // Nothing kept yet: both run, each with its key.
        let a = submit(&f.batcher, &ROW_A, None);
        let c = submit(&f.batcher, &ROW_C, None);
        let b = f.batcher.next_batch(&mut worker).unwrap();
        assert_eq!(b.rows, 2);
        assert_eq!(b.cache_keys.len(), 2);
        assert!(worker.take_cached().is_empty());
        let value: Arc<CachedValue> = Arc::new("a's result");
        assert!(cache.insert(b.cache_keys[0].unwrap(), value, 10).kept);
        let c_key = b.cache_keys[1].unwrap();
        drop(b);
        // Just released: A's inputs again are looked up as their batch is
        // (a worker is soon free to answer it).
        let early = submit(&f.batcher, &ROW_A, None);
        assert_eq!(early.state(), RequestState::Queued);
        assert!(f.batcher.next_batch(&mut worker).is_none());
        assert_eq!(worker.take_cached()[0].0.id, early.id);
        // Every worker busy a while: found as submitted, never queued; C's run.
        busy_a_while();
        let a2 = submit(&f.batcher, &ROW_A, None);
        assert_eq!(a2.state(), RequestState::Taken, "a hit is taken at submit");
        let c2 = submit(&f.batcher, &ROW_C, None);
        let b = f.batcher.next_batch(&mut worker).unwrap();
        assert_eq!(
            b.requests.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![c2.id]
        );
        assert_eq!((b.rows, b.cache_keys.len()), (1, 1));
        assert!(worker.take_cached().is_empty());
        let found = f.batcher.wait_found().unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0.id, a2.id);
        assert_eq!(found[0].1.downcast_ref::<&str>(), Some(&"a's result"));
        drop(b);
        // C missed at submit, and is kept before it is gathered: found then,
        // no batch, and it waits for the worker's owner.
        let c3 = submit(&f.batcher, &ROW_C, None);
        assert_eq!(c3.state(), RequestState::Queued);
        assert!(cache.insert(c_key, Arc::new("c's result"), 10).kept);
        assert!(f.batcher.next_batch(&mut worker).is_none());
        assert!(!worker.is_closed());
        let cached = worker.take_cached();
        assert_eq!(cached.len(), 1);
        assert_eq!(cached[0].0.id, c3.id);
        assert_eq!(cached[0].0.state(), RequestState::Taken);
        assert!(worker.take_cached().is_empty(), "handed out once");
        let stats = f.batcher.stats();
        assert_eq!(stats.cache_hits.load(Ordering::Relaxed), 3);
        assert_eq!(stats.cache_misses.load(Ordering::Relaxed), 3);
        assert_eq!(stats.requests.load(Ordering::Relaxed), 3, "hits never ran");
        // Another namespace's batcher does not see A's result.
        let other = Knobs {
            cache: Some((cache.clone(), cache.namespace(), KeyRules::default())),
            ..Knobs::default()
        };
        let g = build(8, Duration::ZERO, 1, 100, 1, other);
        submit(&g.batcher, &ROW_A, None);
        assert_eq!(g.batcher.next_batch(&mut Worker::new()).unwrap().rows, 1);
        // Closing: a hit found before is still handed out, then none; a
        // request after it is refused, found or not.
        busy_a_while();
        let a3 = submit(&f.batcher, &ROW_A, None);
        f.batcher.close();
        assert_eq!(f.batcher.wait_found().unwrap()[0].0.id, a3.id);
        assert!(f.batcher.wait_found().is_none());
        // SAFETY: static bytes outlive everything.
        let input = unsafe { InputBytes::new(ROW_A.as_ptr(), ROW) };
        let refused = f.batcher.submit(Sink::Thread, 1, [input], None);
        assert!(matches!(refused, Err(CoreError::Closed)));
        drop((a, c));
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_hit_waits_for_nothing_while_the_workers_are_busy() {
        let cache: Arc<SharedCache> = Arc::new(ResponseCache::new(1 << 20));
        let knobs = Knobs {
            cache: Some((cache.clone(), cache.namespace(), KeyRules::default())),
            ..Knobs::default()
        };
        let f = build(8, Duration::ZERO, 1, 100, 1, knobs);
        let mut worker = Worker::new();
        submit(&f.batcher, &ROW_A, None);
        let b = f.batcher.next_batch(&mut worker).unwrap();
        assert!(
            cache
                .insert(b.cache_keys[0].unwrap(), Arc::new(1u8), 10)
                .kept
        );
        // `b` is still held (its worker busy for a while now); a thread
        // waiting for hits gets the next request for A at once.
        std::thread::sleep(HIT_WAIT_FOR_BUSY + Duration::from_millis(1));
        let batcher = f.batcher.clone();
        let waiter = std::thread::spawn(move || batcher.wait_found().map(|found| found[0].0.id));
        let hit = submit(&f.batcher, &ROW_A, None);
        assert_eq!(waiter.join().unwrap(), Some(hit.id));
        drop(b);
        // Its batch took that long: the next one likely does too, so hits
        // are looked up as they come from its release on.
        static ROW_B: [u8; ROW] = [5; ROW];
        let runs = submit(&f.batcher, &ROW_B, None);
        assert_eq!(runs.state(), RequestState::Queued);
        let b = f.batcher.next_batch(&mut worker).unwrap();
        let at_once = submit(&f.batcher, &ROW_A, None);
        assert_eq!(
            at_once.state(),
            RequestState::Taken,
            "not looked up at submit"
        );
        assert_eq!(f.batcher.wait_found().unwrap()[0].0.id, at_once.id);
        drop(b);
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_batch_goes_once_every_blocking_caller_is_in_it() {
        let f = fixture(8, Duration::from_secs(10), 1, 100, 1);
        submit_blocking(&f.batcher, 1);
        submit_blocking(&f.batcher, 2);
        let mut worker = Worker::new();
        let started = Instant::now();
        let b = f.batcher.next_batch(&mut worker).unwrap();
        assert_eq!((b.rows, b.reason), (2, DispatchReason::CallersWaiting));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "it waited out max_delay"
        );
        drop(b);
        // Caller 2 answered and thinking; caller 1's next request waits for it...
        let batcher = f.batcher.clone();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            submit_blocking(&batcher, 2); // ...and its arrival releases both at once
        });
        submit_blocking(&f.batcher, 1);
        let started = Instant::now();
        let b = f.batcher.next_batch(&mut worker).unwrap();
        late.join().unwrap();
        assert_eq!((b.rows, b.reason), (2, DispatchReason::CallersWaiting));
        assert!(
            started.elapsed() >= Duration::from_millis(20),
            "it left caller 2 behind"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the last arrival did not wake it"
        );
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn the_window_counts_from_a_free_worker_when_asked() {
        // A request older than max_delay when the worker comes for it: by
        // default it goes at once; counted from the free worker, a request
        // arriving 20 ms later joins it.
        for from_free in [false, true] {
            let knobs = Knobs {
                delay_from_free_worker: from_free,
                ..Knobs::default()
            };
            let f = build(8, Duration::from_millis(200), 1, 100, 1, knobs);
            submit(&f.batcher, &ROW_A, None);
            std::thread::sleep(Duration::from_millis(250));
            let batcher = f.batcher.clone();
            let late = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                submit(&batcher, &ROW_A, None);
            });
            let b = f.batcher.next_batch(&mut Worker::new()).unwrap();
            late.join().unwrap();
            let expected = if from_free { 2 } else { 1 };
            assert_eq!(
                (b.rows, b.reason),
                (expected, DispatchReason::DelayExpired),
                "from_free={from_free}"
            );
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_caller_that_does_not_block_keeps_the_window() {
        let f = fixture(8, Duration::from_millis(30), 1, 100, 1);
        submit(&f.batcher, &ROW_A, None); // an event loop's request
        submit_blocking(&f.batcher, 1);
        let b = f.batcher.next_batch(&mut Worker::new()).unwrap();
        assert_eq!((b.rows, b.reason), (2, DispatchReason::DelayExpired));
    }

    /// A batcher whose requests may wait `queue_timeout` to be taken.
    fn fixture_with_queue_timeout(
        max: usize,
        delay: Duration,
        min: usize,
        queue_timeout: Duration,
    ) -> Fixture {
        let knobs = Knobs {
            queue_timeout: Some(queue_timeout),
            ..Knobs::default()
        };
        build(max, delay, min, 100, 1, knobs)
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_request_that_outstays_the_queue_is_handed_back_never_run() {
        let f = fixture_with_queue_timeout(8, Duration::ZERO, 1, Duration::from_millis(20));
        let stale = submit(&f.batcher, &ROW_A, None);
        std::thread::sleep(Duration::from_millis(30));
        let fresh = submit(&f.batcher, &ROW_A, None);
        let mut worker = Worker::new();
        let b = f.batcher.next_batch(&mut worker).unwrap();
        assert_eq!(
            b.requests.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![fresh.id]
        );
        let outstayed = worker.take_outstayed();
        assert_eq!(
            outstayed.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![stale.id]
        );
        assert_eq!(stale.state(), RequestState::Expired);
        assert!(worker.take_outstayed().is_empty(), "handed out once");
        assert_eq!(f.batcher.stats().skipped_expired.load(Ordering::Relaxed), 1);
        assert_eq!(f.batcher.queue_len(), 0);
        // Taken, it runs on: nothing checks the queue timeout after that.
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(fresh.state(), RequestState::Taken);
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_gathered_request_that_outstays_the_queue_is_handed_back_at_once() {
        // The batch waits for 4 rows or 10 s; the lone request's 30 ms of
        // queue time end first, and no other request comes to wake the worker.
        let f =
            fixture_with_queue_timeout(8, Duration::from_secs(10), 4, Duration::from_millis(30));
        let lone = submit(&f.batcher, &ROW_A, None);
        let started = Instant::now();
        let mut worker = Worker::new();
        assert!(
            f.batcher.next_batch(&mut worker).is_none(),
            "no batch, only an answer to give"
        );
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_millis(25), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
        assert_eq!(
            worker
                .take_outstayed()
                .iter()
                .map(|r| r.id)
                .collect::<Vec<_>>(),
            vec![lone.id]
        );
        // The worker gathers on as before.
        let next = submit(&f.batcher, &ROW_A, None);
        f.batcher.close();
        let b = f.batcher.next_batch(&mut worker).unwrap();
        assert_eq!(
            b.requests.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![next.id]
        );
        assert!(worker.take_outstayed().is_empty());
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_request_coming_to_a_waiting_worker_is_gathered_so_its_queue_time_is_watched() {
        // The worker waits for min_batch_size rows before it arrives: without
        // the queue timeout it would only be looked at with 3 more.
        let f =
            fixture_with_queue_timeout(8, Duration::from_secs(10), 4, Duration::from_millis(30));
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = {
            let batcher = f.batcher.clone();
            std::thread::spawn(move || {
                let mut worker = Worker::new();
                let batch = batcher.next_batch(&mut worker);
                tx.send(Instant::now()).unwrap();
                (
                    batch.is_none(),
                    worker
                        .take_outstayed()
                        .iter()
                        .map(|r| r.id)
                        .collect::<Vec<_>>(),
                )
            })
        };
        std::thread::sleep(Duration::from_millis(20)); // the worker waits
        let lone = submit(&f.batcher, &ROW_A, None);
        let submitted = Instant::now();
        let answered = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("never answered");
        assert!(answered.saturating_duration_since(submitted) < Duration::from_secs(1));
        assert_eq!(worker.join().unwrap(), (true, vec![lone.id]));
    }

    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_batch_still_filling_is_parked_while_outstayed_requests_are_answered() {
        // A request every 10 ms, below min_batch_size: the batch keeps
        // filling, with fresh requests in it, while older ones outstay 30 ms.
        let f =
            fixture_with_queue_timeout(8, Duration::from_secs(10), 8, Duration::from_millis(30));
        let first = submit(&f.batcher, &ROW_A, None);
        let trickle = {
            let batcher = f.batcher.clone();
            std::thread::spawn(move || {
                (0..30)
                    .map(|_| {
                        std::thread::sleep(Duration::from_millis(10));
                        submit(&batcher, &ROW_A, None).id
                    })
                    .collect::<Vec<u64>>()
            })
        };
        let started = Instant::now();
        let mut worker = Worker::new();
        let mut seen: Vec<u64> = Vec::new();
        assert!(
            f.batcher.next_batch(&mut worker).is_none(),
            "no batch: callers to answer"
        );
        let answered = started.elapsed();
        let outstayed = worker.take_outstayed();
        assert!(outstayed.iter().any(|r| r.id == first.id));
        assert!(
            answered < Duration::from_millis(200),
            "{answered:?}: not while it filled"
        );
        seen.extend(outstayed.iter().map(|r| r.id));
        let mut submitted = trickle.join().unwrap();
        submitted.push(first.id);
        f.batcher.close();
        // Every request once: in a batch, or handed back to answer.
        loop {
            let batch = f.batcher.next_batch(&mut worker);
            seen.extend(worker.take_outstayed().iter().map(|r| r.id));
            match batch {
                Some(b) => seen.extend(b.requests.iter().map(|r| r.id)),
                None if worker.is_closed() => break,
                None => {}
            }
        }
        seen.sort_unstable();
        submitted.sort_unstable();
        assert_eq!(seen, submitted);
        assert_eq!(f.batcher.queue_len(), 0);
    }

    #[test]
    fn cancelled_and_expired_requests_are_never_taken() {
        let f = fixture(8, Duration::ZERO, 1, 100, 1);
        let cancelled = submit(&f.batcher, &ROW_A, None);
        let expired = submit(&f.batcher, &ROW_A, Some(Duration::ZERO));
        let kept = submit(&f.batcher, &ROW_A, None);
        assert!(f.batcher.withdraw(&cancelled, RequestState::Cancelled));
        assert_eq!(f.batcher.queue_len(), 2);
        let b = f.batcher.next_batch(&mut Worker::new()).unwrap();
        assert_eq!(
            b.routes.groups[0]
                .1
                .iter()
                .map(|r| r.id)
                .collect::<Vec<_>>(),
            vec![kept.id]
        );
        assert_eq!(expired.state(), RequestState::Expired);
        assert_eq!(
            f.batcher.stats().skipped_withdrawn.load(Ordering::Relaxed),
            1
        );
        assert_eq!(f.batcher.stats().skipped_expired.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn close_dispatches_what_was_accepted_then_stops() {
        let f = fixture(8, Duration::from_secs(60), 8, 100, 1);
        submit(&f.batcher, &ROW_A, None);
        f.batcher.close();
        let mut w = Worker::new();
        let b = f
            .batcher
            .next_batch(&mut w)
            .expect("below min_batch_size, still flushed");
        assert_eq!(b.rows, 1);
        drop(b);
        assert!(f.batcher.next_batch(&mut w).is_none());
        assert_eq!(
            f.batcher.free_slots(),
            2,
            "the closing call gave its slot back"
        );
    }

    /// A request gathered into a batch that is still filling stays queued:
    /// withdrawn meanwhile (its deadline, its caller's cancellation) it never
    /// runs, and `queue_len` counts it until the batch goes.
    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_request_withdrawn_while_its_batch_fills_never_runs() {
        let f = fixture(8, Duration::from_millis(300), 1, 100, 1);
        let batcher = &f.batcher;
        let (done, batches) = std::sync::mpsc::channel();
        let worker = {
            let b = batcher.clone();
            std::thread::spawn(move || {
                let batch = b.next_batch(&mut Worker::new()).unwrap();
                let ids: Vec<u64> = batch.requests.iter().map(|r| r.id).collect();
                done.send((ids, batch.rows)).unwrap();
            })
        };
        let expiring = submit(batcher, &ROW_A, Some(Duration::from_millis(40)));
        let cancelled = submit(batcher, &ROW_A, None);
        let kept = submit(batcher, &ROW_A, None);
        std::thread::sleep(Duration::from_millis(20)); // gathered by now
        assert_eq!(batcher.queue_len(), 3, "gathered requests are still queued");
        assert!(batcher.withdraw(&cancelled, RequestState::Cancelled));
        std::thread::sleep(Duration::from_millis(60)); // past the deadline, its caller's timer not run
        let (ids, rows) = batches.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!((ids, rows), (vec![kept.id], 1));
        assert_eq!(expiring.state(), RequestState::Expired);
        let stats = batcher.stats();
        assert_eq!(stats.skipped_expired.load(Ordering::Relaxed), 1);
        assert_eq!(stats.skipped_withdrawn.load(Ordering::Relaxed), 1);
        assert_eq!(batcher.queue_len(), 0);
        worker.join().unwrap();
        batcher.close();
    }

    /// A greedy batcher whose event-loop requests wait for their flush.
    fn greedy(max: usize, min: usize, workers: usize) -> Fixture {
        let knobs = Knobs {
            readiness: Readiness::OnFlush,
            ..Knobs::default()
        };
        build(max, Duration::ZERO, min, 100, workers, knobs)
    }

    fn held_submit(b: &Batcher, holder: &Unflushed) -> Arc<Request> {
        held_submit_by(b, holder, None)
    }

    /// [`held_submit`] by the blocking caller `caller`, if any.
    fn held_submit_by(b: &Batcher, holder: &Unflushed, caller: Option<u64>) -> Arc<Request> {
        // SAFETY: static bytes outlive everything.
        let input = unsafe { InputBytes::new(ROW_A.as_ptr(), ROW) };
        let submission = Submission {
            blocking_caller: caller,
            ..Submission::default()
        };
        b.submit_held(holder, Sink::EventLoop(0), 1, [input], submission, |_| {})
            .unwrap()
    }

    fn next_batch_on_a_thread(
        b: &Arc<Batcher>,
    ) -> std::sync::mpsc::Receiver<(Vec<u64>, DispatchReason)> {
        let (tx, rx) = std::sync::mpsc::channel();
        let b = b.clone();
        std::thread::spawn(move || {
            if let Some(batch) = b.next_batch(&mut Worker::new()) {
                let ids = batch.requests.iter().map(|r| r.id).collect();
                let _ = tx.send((ids, batch.reason));
            }
        });
        rx
    }

    /// A blocking caller's request admitted and not yet sent (held for a
    /// flush here; a push between its admission and its send, when the
    /// worker decides in between) is not in the batch being gathered: the
    /// batch waits for it rather than going without it, which would leave
    /// it to wait out the window alone. Its send nudges the worker.
    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_batch_waits_for_a_blocking_request_admitted_and_not_yet_sent() {
        let knobs = Knobs {
            readiness: Readiness::OnFlush,
            ..Knobs::default()
        };
        // A window (and so a horizon) far longer than the waits below.
        let f = build(8, Duration::from_secs(20), 1, 100, 1, knobs);
        let first = submit_blocking(&f.batcher, 1);
        let second = submit_blocking(&f.batcher, 2);
        let holder = Unflushed::default();
        assert!(holder.open(&f.batcher));
        let third = held_submit_by(&f.batcher, &holder, Some(3));
        let batch = next_batch_on_a_thread(&f.batcher);
        assert!(
            batch.recv_timeout(Duration::from_millis(300)).is_err(),
            "it went without caller 3's request"
        );
        holder.flush();
        let (ids, reason) = batch
            .recv_timeout(Duration::from_secs(5))
            .expect("the send did not wake the worker");
        assert_eq!(
            (ids, reason),
            (
                vec![first.id, second.id, third.id],
                DispatchReason::CallersWaiting
            )
        );
        f.batcher.close();
    }

    /// An event loop's held request is a caller that does not block, as a
    /// pushed one is: a batch with a blocking caller's request waits for
    /// more (`min_batch_size`) instead of going as `CallersWaiting`.
    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_held_request_counts_as_a_caller_that_does_not_block() {
        let f = greedy(8, 4, 1);
        let holder = Unflushed::default();
        assert!(holder.open(&f.batcher));
        let held = held_submit(&f.batcher, &holder);
        holder.flush();
        let blocking = submit_blocking(&f.batcher, 1);
        let batch = next_batch_on_a_thread(&f.batcher);
        assert!(
            batch.recv_timeout(Duration::from_millis(300)).is_err(),
            "an event loop may still add rows: below min_batch_size the batch waits"
        );
        f.batcher.close();
        let (ids, reason) = batch.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(
            (ids, reason),
            (vec![held.id, blocking.id], DispatchReason::Shutdown)
        );
    }

    /// A gathered request past its deadline leaves the batch when the
    /// gatherer next wakes, even before its caller's timer withdraws it: it
    /// does not count toward `min_batch_size`.
    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn an_expired_gathered_request_does_not_count_toward_min_batch_size() {
        let f = fixture(8, Duration::ZERO, 2, 100, 1);
        let batch = next_batch_on_a_thread(&f.batcher);
        let expired = submit(&f.batcher, &ROW_A, Some(Duration::from_millis(30)));
        std::thread::sleep(Duration::from_millis(80)); // gathered, then past its deadline
        let kept = submit(&f.batcher, &ROW_A, None);
        assert!(
            batch.recv_timeout(Duration::from_millis(300)).is_err(),
            "one live row: the batch waits for a second"
        );
        assert_eq!(expired.state(), RequestState::Expired);
        f.batcher.close();
        let (ids, _) = batch.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(ids, vec![kept.id]);
        assert_eq!(f.batcher.stats().skipped_expired.load(Ordering::Relaxed), 1);
    }

    /// A holder registers with a batcher once, however often it switches.
    #[test]
    fn a_holder_switching_batchers_is_registered_once_with_each() {
        let (a, b) = (greedy(8, 1, 1), greedy(8, 1, 1));
        let holder = Unflushed::default();
        for _ in 0..100 {
            for f in [&a, &b] {
                assert!(holder.open(&f.batcher));
                holder.flush();
            }
        }
        for f in [&a, &b] {
            assert_eq!(f.batcher.holders.lock().unwrap().len(), 1);
        }
    }

    /// A request one worker's batch could not take goes to the worker
    /// waiting for the gatherer's role at once, with no push after it to
    /// ring: each worker takes one batch and keeps it.
    #[test]
    #[cfg_attr(miri, ignore = "timed: Miri's clock advances with interpretation")]
    fn a_left_over_request_goes_to_the_waiting_worker_without_another_push() {
        // Both requests become ready at once, at the flush: the first worker
        // takes one and is left with the other.
        let f = greedy(4, 1, 2);
        let batcher = &f.batcher;
        let (done, batches) = std::sync::mpsc::channel();
        let one_batch = |b: Arc<Batcher>, done: std::sync::mpsc::Sender<usize>| {
            std::thread::spawn(move || {
                let batch = b.next_batch(&mut Worker::new()).unwrap();
                done.send(batch.rows).unwrap();
                batch // kept until joined: this worker takes no other
            })
        };
        // The first sleeps for rows holding the role, the second waits for it.
        let first = one_batch(batcher.clone(), done.clone());
        std::thread::sleep(Duration::from_millis(50));
        let second = one_batch(batcher.clone(), done);
        std::thread::sleep(Duration::from_millis(50));
        let holder = Unflushed::default();
        assert!(holder.open(batcher));
        for _ in 0..2 {
            // SAFETY: static bytes outlive everything.
            let input = unsafe { InputBytes::new(ROWS_3.as_ptr(), ROWS_3.len()) };
            let submission = Submission::default();
            batcher
                .submit_held(&holder, Sink::EventLoop(0), 3, [input], submission, |_| {})
                .unwrap();
        }
        holder.flush(); // rings the first; the second request does not fit its batch
        let wait = Duration::from_secs(10);
        assert_eq!(batches.recv_timeout(wait), Ok(3));
        assert_eq!(
            batches.recv_timeout(wait),
            Ok(3),
            "the left-over request waited"
        );
        drop((first.join().unwrap(), second.join().unwrap()));
        batcher.close();
    }

    /// Producers submit and randomly cancel while workers batch: every request
    /// is either taken exactly once or withdrawn, never both, never lost.
    #[test]
    fn stress_every_request_taken_or_withdrawn_exactly_once() {
        const PRODUCERS: usize = 4;
        const PER_PRODUCER: usize = if cfg!(miri) { 50 } else { 20_000 };
        const WORKERS: usize = 3;
        let f = fixture(16, Duration::from_micros(50), 1, 1024, WORKERS);
        let taken: Arc<Mutex<Vec<u64>>> = Arc::default();
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (b, taken) = (f.batcher.clone(), taken.clone());
                std::thread::spawn(move || {
                    let mut w = Worker::new();
                    let mut mine = Vec::new();
                    while let Some(batch) = b.next_batch(&mut w) {
                        for (_, routes) in &batch.routes.groups {
                            mine.extend(routes.iter().map(|r| r.id));
                        }
                        batch.slot.release();
                    }
                    taken.lock().unwrap().extend(mine);
                })
            })
            .collect();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let b = f.batcher.clone();
                std::thread::spawn(move || {
                    let mut submitted = Vec::new();
                    let mut x = p as u64 + 1;
                    for _ in 0..PER_PRODUCER {
                        let input = unsafe { InputBytes::new(ROW_A.as_ptr(), ROW) };
                        loop {
                            match b.submit(Sink::EventLoop(0), 1, [input], None) {
                                Ok(r) => {
                                    submitted.push(r);
                                    break;
                                }
                                Err(CoreError::QueueFull { .. }) => std::thread::yield_now(),
                                Err(e) => panic!("{e}"),
                            }
                        }
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if x % 4 == 0 {
                            let r = &submitted[(x as usize / 4) % submitted.len()];
                            b.withdraw(r, RequestState::Cancelled);
                        }
                    }
                    submitted
                })
            })
            .collect();
        let submitted: Vec<Arc<Request>> = producers
            .into_iter()
            .flat_map(|p| p.join().unwrap())
            .collect();
        f.batcher.close();
        for w in workers {
            w.join().unwrap();
        }
        let taken = taken.lock().unwrap();
        let unique: HashSet<u64> = taken.iter().copied().collect();
        assert_eq!(unique.len(), taken.len(), "a request was taken twice");
        for r in &submitted {
            let in_batch = unique.contains(&r.id);
            match r.state() {
                RequestState::Taken => assert!(in_batch, "request {} taken but lost", r.id),
                RequestState::Cancelled => assert!(!in_batch, "cancelled request {} ran", r.id),
                s => panic!("request {} left in state {s:?}", r.id),
            }
        }
        assert_eq!(submitted.len(), PRODUCERS * PER_PRODUCER);
        let stats = f.batcher.stats();
        assert_eq!(stats.requests.load(Ordering::Relaxed) as usize, taken.len());
        assert_eq!(
            taken.len() + stats.skipped_withdrawn.load(Ordering::Relaxed) as usize,
            submitted.len()
        );
        assert_eq!(
            f.batcher.queue_len(),
            0,
            "every request left the queue exactly once"
        );
    }
}
