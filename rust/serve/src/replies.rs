//! The native front-end's replies: every request it submitted
//! ([`Sink::Connection`](ferrobatch_core::Sink)) waits in the core's pending
//! table ([`ferrobatch_core::pending`], which owns the exactly-once rules)
//! until its handler is answered through a oneshot sender; this module adds
//! how an answer is encoded from a batch's outputs.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use ferrobatch_core::v2::regions::{self, RegionRange};
use ferrobatch_core::v2::{Codec, Encoded, Output, Shape};
use ferrobatch_core::{Batcher, Outcome, Pending, PerTensor, Request, RequestState, Route, Tally};
use tokio::sync::{mpsc, oneshot};

use crate::grpc::response::{InferResponse, OutputRows};

/// Why a request got no result: its HTTP status and the message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub status: u16,
    pub message: String,
}

impl Failure {
    /// The HTTP status of a request whose caller sees `outcome` (gRPC maps
    /// it on): 400 its own mistake, 503 overload or not running, 504 its
    /// deadline, 500 the model.
    pub fn status_of(outcome: Outcome) -> u16 {
        match outcome {
            Outcome::InvalidInput => 400,
            Outcome::QueueFull | Outcome::ServerClosed => 503,
            Outcome::DeadlineExceeded => 504,
            _ => 500,
        }
    }

    pub fn new(status: u16, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }
}

/// What a waiting handler receives: its response, or why not.
pub type Reply = Result<Answer, Failure>;

/// One request's response, made from its rows of the batch's outputs.
#[derive(Debug)]
pub enum Answer {
    /// An HTTP v2 response body, encoded by the codec.
    Encoded(Encoded),
    /// The rows of each output asked for, as raw little-endian bytes (gRPC's
    /// `raw_output_contents`), in the order asked.
    Raw(Vec<RawOutput>),
    /// A `ModelInfer` call's answer: one gRPC message, prefixed, as sent.
    Message(Bytes),
}

/// One output's rows for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawOutput {
    /// Its index in the codec's outputs.
    pub index: usize,
    /// Its shape: the request's rows first.
    pub shape: Shape,
    pub data: Bytes,
    /// Its top classes (see [`ferrobatch_core::v2::classify`]): BYTES,
    /// whatever the output's datatype.
    pub classified: bool,
}

/// What keeps a request's input bytes alive until it resolves: buffers the
/// inputs are ranges of (an HTTP body, gRPC's raw contents) and the buffers
/// inputs were decoded into (JSON, gRPC's typed contents).
pub struct InputOwners {
    /// One for an HTTP body (inline), one per raw content for gRPC.
    pub shared: smallvec::SmallVec<[Bytes; 1]>,
    pub decoded: Vec<Vec<u8>>,
}

/// Where each output of a plan goes, in the plan's order: a shared-memory
/// range (Triton's system shared-memory extension), written with the
/// output's bytes, which the answer then leaves out; `None`: the answer.
/// Empty (no allocation) when no output is in a region.
pub type OutputRegions = Vec<Option<RegionRange>>;

/// How many classes each output a request asks for is answered with
/// (Triton's classification extension; `None`: its values), aligned with
/// the outputs; empty when none asks for classes (no allocation).
pub type OutputClasses = Vec<Option<u32>>;

/// How to answer one request once its rows are ready.
pub enum ResponsePlan {
    /// An HTTP v2 response: the request's `id`, echoed, and `(output index,
    /// as binary)` per output to send.
    Encoded {
        id: Option<String>,
        outputs: PerTensor<(usize, bool)>,
        regions: OutputRegions,
        classes: OutputClasses,
    },
    /// The raw rows of these outputs (indices), in this order (one in a
    /// region: written there, its rows empty; one with a count in
    /// `classes`: its top classes). `regions` and `classes` are aligned
    /// with `outputs` (or empty) in every plan.
    Raw {
        outputs: PerTensor<usize>,
        regions: OutputRegions,
        classes: OutputClasses,
    },
    /// A `ModelInfer` call: its answer to request `id` of `model_name`, the
    /// rows of these outputs (indices) in this order, written as one gRPC
    /// message ([`InferResponse`]; one in a region: written there, its
    /// `raw_output_contents` entry empty, as Triton answers it).
    Message {
        model_name: Arc<str>,
        id: String,
        outputs: PerTensor<usize>,
        regions: OutputRegions,
        classes: OutputClasses,
    },
    /// A decoupled model's request: each partial answer of its batch (the
    /// raw rows of these outputs, as `Raw`) goes to `partial` as it comes;
    /// the final answer, through the pending table as for any request, is
    /// the end of the stream (`Answer::Raw` with no outputs) or a failure.
    Stream {
        /// Shared: each response reads it under the table's lock (no allocation there).
        outputs: Arc<[usize]>,
        /// As [`OutputRegions`], shared as `outputs` is; `None`: none in a
        /// region (each part overwrites the region: a client reads it
        /// before the next response).
        regions: Option<Arc<[Option<RegionRange>]>>,
        /// As [`OutputClasses`], shared as `outputs` is; `None`: none asks for classes.
        classes: Option<Arc<[Option<u32>]>>,
        partial: mpsc::UnboundedSender<Vec<RawOutput>>,
        /// The unread bytes of the stream it answers on.
        backlog: Arc<Backlog>,
    },
}

impl ResponsePlan {
    /// The outputs it answers with, as bits of their indices (a model that
    /// asks for its requests is told); 0 (not said) if one is past bit 63.
    pub fn requested_outputs(&self) -> u64 {
        let indices: Box<dyn Iterator<Item = usize> + '_> = match self {
            ResponsePlan::Encoded { outputs, .. } => Box::new(outputs.iter().map(|&(i, _)| i)),
            ResponsePlan::Raw { outputs, .. } | ResponsePlan::Message { outputs, .. } => {
                Box::new(outputs.iter().copied())
            }
            ResponsePlan::Stream { outputs, .. } => Box::new(outputs.iter().copied()),
        };
        ferrobatch_core::v2::output_bits(indices)
    }
}

/// The bytes of a stream's responses made but not yet taken by its client
/// (the gRPC stream's writer), bounded: a response past the bound fails its
/// request (`QueueFull`, 429) instead of being held, so a client that stops
/// reading costs at most `limit` bytes, whatever the model makes.
///
/// A response of a model of one response per request is made before its
/// size is known: it is counted whatever its size ([`Backlog::add`]), and
/// the stream reads no more requests while the unread bytes are over the
/// limit ([`Backlog::under_limit`]), so it holds at most the limit plus the
/// responses of the requests already read.
#[derive(Debug)]
pub struct Backlog {
    unread: AtomicUsize,
    limit: usize,
    /// Woken when the unread bytes fall to the limit or below.
    drained: tokio::sync::Notify,
}

impl Backlog {
    pub fn new(limit: usize) -> Arc<Backlog> {
        Arc::new(Backlog {
            unread: AtomicUsize::new(0),
            limit,
            drained: tokio::sync::Notify::new(),
        })
    }

    /// Counts `bytes` more unread; false, counting nothing, past the limit.
    pub fn take(&self, bytes: usize) -> bool {
        self.unread
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |unread| {
                unread.checked_add(bytes).filter(|&n| n <= self.limit)
            })
            .is_ok()
    }

    /// Counts `bytes` more unread, past the limit too: a response already
    /// made, which has nowhere else to go.
    pub fn add(&self, bytes: usize) {
        let _ = self
            .unread
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |unread| {
                Some(unread.saturating_add(bytes))
            });
    }

    /// `bytes` counted by [`Backlog::take`] or [`Backlog::add`] were read.
    pub fn release(&self, bytes: usize) {
        let before = self
            .unread
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |unread| {
                Some(unread.saturating_sub(bytes))
            })
            .unwrap_or(0);
        if before > self.limit && before.saturating_sub(bytes) <= self.limit {
            self.drained.notify_waiters();
        }
    }

    /// Returns once the unread bytes are at the limit or below.
    pub async fn under_limit(&self) {
        // The common case first: no waiter registered (Notify takes a lock).
        while self.unread() > self.limit {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable(); // before the check: a release between them wakes it
            if self.unread() <= self.limit {
                return;
            }
            drained.await;
        }
    }

    pub fn unread(&self) -> usize {
        self.unread.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// The bytes a partial answer counts against its stream's [`Backlog`].
pub fn part_bytes(part: &[RawOutput]) -> usize {
    part.iter()
        .fold(0usize, |n, o| n.saturating_add(o.data.len()))
}

/// The count of classes output `i` of a request is answered with, if any.
fn class_of(classes: &[Option<u32>], i: usize) -> Option<u32> {
    classes.get(i).copied().flatten()
}

/// The outcome a request is counted as when answering it failed: the
/// client's own mistake (400: an output too large for its region, or to
/// rank as classes) or the model's.
pub(crate) fn failed_outcome(failure: &Failure) -> Outcome {
    match failure.status {
        400 => Outcome::InvalidInput,
        _ => Outcome::ModelError,
    }
}

/// Writes each output's bytes into its shared-memory range (`(output name,
/// bytes, range)`; see [`regions::write_all`]): one that does not fit fails
/// the request (400: the client's range), its regions untouched.
pub fn write_regions(writes: &[(&str, &[u8], &RegionRange)]) -> Result<(), Failure> {
    regions::write_all(writes).map_err(|e| Failure::new(400, e.to_string()))
}

/// What a native request holds until its batch is done.
struct Held {
    plan: ResponsePlan,
    _inputs: InputOwners,
}

/// One finished batch output, whole: its shape (rows first) and bytes, in
/// the codec's output order; `rows` says where each row is when rows differ
/// in size (BYTES, variable length), `None` when every row is
/// `data.len() / rows` bytes of `shape[1..]`.
pub struct Column<'a> {
    pub shape: &'a [u64],
    pub data: &'a [u8],
    pub rows: Option<&'a VaryingRows>,
}

/// Where each row of an output whose rows differ in size is: its bytes and
/// its own shape. A request of one row is answered with that row as it is;
/// a request of several, with its rows padded to their longest, as in
/// process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VaryingRows {
    /// Per row: its bytes in the column's data.
    pub ranges: Vec<Range<usize>>,
    /// Per row: its shape (without the batch dimension), every row of the
    /// same rank.
    pub shapes: Vec<Vec<u64>>,
    /// Bytes of one element; `None` for BYTES (each element serialized, see
    /// [`ferrobatch_core::bytes`]).
    pub itemsize: Option<usize>,
    /// The element written where a row is shorter than the request's
    /// longest: `itemsize` bytes, or a BYTES element's own bytes.
    pub pad: Vec<u8>,
}

/// Most bytes a multi-row request's padded output may take: a model whose
/// rows' lengths make the padded box explode is answered with an error.
const MAX_PADDED_BYTES: usize = 1 << 30;

/// Why a streamed request failed: its client left `backlog.limit()` bytes
/// of responses unread.
fn backlog_full(backlog: &Backlog, bytes: usize) -> Failure {
    Failure::new(
        429,
        format!(
            "the client reads this stream's responses too slowly: {} bytes are unread \
             and the next response ({bytes} bytes) would pass the stream's bound of {} \
             (max_stream_backlog); the request is cancelled",
            backlog.unread(),
            backlog.limit()
        ),
    )
}

/// The pending requests of one served model.
pub struct Replies {
    codec: Codec,
    batcher: Arc<Batcher>,
    pending: Pending<oneshot::Sender<Reply>, Held>,
}

impl Replies {
    pub fn new(codec: Codec, batcher: Arc<Batcher>) -> Replies {
        Replies {
            codec,
            batcher,
            pending: Pending::new(),
        }
    }

    pub fn batcher(&self) -> &Arc<Batcher> {
        &self.batcher
    }

    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    /// What this model's native callers saw.
    /// Whether a request of `routes` is in this table (a front-end's own).
    pub fn holds_any(&self, routes: &[Route]) -> bool {
        !self.pending.peek(routes, |_, _| Some(())).is_empty()
    }

    /// Whether no request is in this table.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }

    pub fn tally(&self) -> &Tally {
        self.pending.tally()
    }

    /// Registers `request` (not queued yet); its result goes to `tx`.
    pub fn register(
        &self,
        request: &Arc<Request>,
        plan: ResponsePlan,
        inputs: InputOwners,
        tx: oneshot::Sender<Reply>,
    ) {
        let held = Held {
            plan,
            _inputs: inputs,
        };
        self.pending.register(request, tx, held);
    }

    /// Drops the entry of a request the queue refused (it was never queued).
    pub fn unregister(&self, id: u64) {
        self.pending.unregister(id);
    }

    /// The handler of request `id` gives up on it (`to`: `Expired` when its
    /// deadline passed, `Cancelled` when its client went away): withdraws it
    /// if no batch took it, and counts `outcome` unless a result beat it.
    /// Returns true when this call answered it (the caller replies
    /// `outcome`'s error), false when a result was sent first.
    pub fn abandon(&self, id: u64, to: RequestState, outcome: Outcome) -> bool {
        self.pending
            .abandon(&*self.batcher, id, to, outcome)
            .is_some()
    }

    /// Answers every request still pending with `failure` (the server stops).
    pub fn fail_all(&self, failure: &Failure, outcome: Outcome) {
        self.fail_all_before(failure, outcome, u64::MAX);
    }

    /// [`Replies::fail_all`] for the requests numbered below `before` (those
    /// of a run that stopped; a server started again numbers on).
    pub fn fail_all_before(&self, failure: &Failure, outcome: Outcome, before: u64) {
        for tx in self
            .pending
            .fail_all_before(Some(&*self.batcher), outcome, before)
        {
            let _ = tx.send(Err(failure.clone()));
        }
    }

    /// Answers the requests of one batch whose model call failed, counted
    /// as their callers see it (`Outcome::ModelError`, or the error a
    /// forwarding model passed on).
    pub fn fail_batch(&self, routes: &[Route], failure: &Failure, outcome: Outcome) {
        let now = Instant::now();
        for taken in self.pending.take(routes) {
            self.pending.count(outcome, taken.enqueued_at, now);
            let _ = taken.answer.send(Err(failure.clone()));
        }
    }

    /// Hands one partial answer of a decoupled model's batch (`columns`, as
    /// for [`Replies::deliver`]) to each of its streaming requests whose
    /// caller still listens; their entries stay. Returns how many listen
    /// (0: the model may stop producing). Encoding runs on the calling
    /// thread (a worker, without the GIL).
    pub fn stream(&self, routes: &[Route], columns: &[Column<'_>]) -> usize {
        let listening = self.pending.peek(routes, |_, held| match &held.plan {
            ResponsePlan::Stream {
                outputs,
                regions,
                classes,
                partial,
                backlog,
            } => Some((
                outputs.clone(),
                (regions.clone(), classes.clone()),
                partial.clone(),
                backlog.clone(),
            )),
            _ => None,
        });
        let mut sent = 0;
        for (route, (outputs, (regions, classes), partial, backlog)) in listening {
            let regions = regions.as_deref().unwrap_or_default();
            let classes = classes.as_deref().unwrap_or_default();
            match self.raw_rows(&route, &outputs, regions, classes, columns) {
                Ok(part) => {
                    let bytes = part_bytes(&part);
                    if !backlog.take(bytes) {
                        self.fail_one(route.id, Outcome::QueueFull, backlog_full(&backlog, bytes));
                        continue;
                    }
                    match partial.send(part) {
                        Ok(()) => sent += 1,
                        // The caller went away (its handler abandons it).
                        Err(_) => backlog.release(bytes),
                    }
                }
                // Rows the model did not give (or an output too large for its
                // region): the request fails now, counted once; its batch
                // goes on for the others.
                Err(failure) => self.fail_one(route.id, failed_outcome(&failure), failure),
            }
        }
        sent
    }

    /// Fails one streaming request of a batch still running, counted once
    /// as `outcome`; its batch goes on for the others.
    fn fail_one(&self, id: u64, outcome: Outcome, failure: Failure) {
        let to = RequestState::Cancelled; // moot: a batch holds it
        if let Some(answer) = self.pending.abandon(&*self.batcher, id, to, outcome) {
            let _ = answer.send(Err(failure));
        }
    }

    /// Ends the streams of a decoupled model's finished batch: each caller
    /// still waiting gets the end of its stream, counted a success.
    pub fn end_streams(&self, routes: &[Route]) {
        let now = Instant::now();
        for taken in self.pending.take(routes) {
            self.pending
                .count(Outcome::Succeeded, taken.enqueued_at, now);
            let _ = taken.answer.send(Ok(Answer::Raw(Vec::new())));
        }
    }

    /// Answers the requests of one finished batch from its `columns` (every
    /// output, whole, in the codec's order). A request whose first row is in
    /// `failed` gets that failure instead (it failed alone). Encoding runs
    /// here, on the calling thread (a worker, without the GIL).
    pub fn deliver(
        &self,
        routes: &[Route],
        columns: &[Column<'_>],
        failed: &[(u32, Failure, Outcome)],
    ) {
        let now = Instant::now();
        for taken in self.pending.take(routes) {
            let route = taken.route;
            let (reply, outcome) = match failed.binary_search_by_key(&route.start, |f| f.0) {
                Ok(i) => (Err(failed[i].1.clone()), failed[i].2),
                Err(_) => match self.encode(&route, &taken.held.plan, columns) {
                    Ok(answer) => (Ok(answer), Outcome::Succeeded),
                    Err(failure) => {
                        let outcome = failed_outcome(&failure);
                        (Err(failure), outcome)
                    }
                },
            };
            // Counted before the caller can see it: stats() never lags a reply.
            self.pending.count(outcome, taken.enqueued_at, now);
            let _ = taken.answer.send(reply);
        }
    }

    /// The response to one request: its rows of each output it asked for.
    fn encode(&self, route: &Route, plan: &ResponsePlan, columns: &[Column<'_>]) -> Reply {
        match plan {
            ResponsePlan::Encoded {
                id,
                outputs,
                regions,
                classes,
            } => {
                let mut shapes: PerTensor<Shape> = PerTensor::with_capacity(outputs.len());
                let mut slices: PerTensor<Cow<'_, [u8]>> = PerTensor::with_capacity(outputs.len());
                for (i, &(index, _)) in outputs.iter().enumerate() {
                    let (shape, data) =
                        self.answered_rows(route, index, class_of(classes, i), columns)?;
                    shapes.push(shape);
                    slices.push(data);
                }
                let outputs: PerTensor<Output<'_>> = outputs
                    .iter()
                    .zip(shapes.iter().zip(&slices))
                    .enumerate()
                    .map(|(i, (&(index, binary), (shape, data)))| Output {
                        index,
                        shape,
                        data: data.as_ref(),
                        binary,
                        classified: class_of(classes, i).is_some(),
                    })
                    .collect();
                self.codec
                    .encode_with_regions(id.as_deref(), &outputs, regions)
                    .map(Answer::Encoded)
                    .map_err(|e| Failure::new(e.status(), e.to_string()))
            }
            ResponsePlan::Stream { .. } => Ok(Answer::Raw(Vec::new())),
            ResponsePlan::Raw {
                outputs,
                regions,
                classes,
            } => self
                .raw_rows(route, outputs, regions, classes, columns)
                .map(Answer::Raw),
            ResponsePlan::Message {
                model_name,
                id,
                outputs,
                regions,
                classes,
            } => {
                let mut rows: PerTensor<(usize, Shape, Cow<'_, [u8]>)> =
                    PerTensor::with_capacity(outputs.len());
                for (i, &index) in outputs.iter().enumerate() {
                    let (shape, data) =
                        self.answered_rows(route, index, class_of(classes, i), columns)?;
                    rows.push((index, shape, data));
                }
                if !regions.is_empty() {
                    let writes: Vec<(&str, &[u8], &RegionRange)> = rows
                        .iter()
                        .zip(regions)
                        .filter_map(|((index, _, data), r)| {
                            Some((self.output_name(*index), data.as_ref(), r.as_ref()?))
                        })
                        .collect();
                    write_regions(&writes)?;
                }
                let outputs: PerTensor<OutputRows<'_>> = rows
                    .iter()
                    .enumerate()
                    .map(|(i, (index, shape, data))| OutputRows {
                        index: *index,
                        shape,
                        classified: class_of(classes, i).is_some(),
                        // In its region: an empty entry, as Triton answers it.
                        data: match regions.get(i) {
                            Some(Some(_)) => &[],
                            _ => data,
                        },
                    })
                    .collect();
                let framed = InferResponse::new(&self.codec, model_name, id, &outputs).framed()?;
                // Exactly its capacity: the `Bytes` takes the buffer as it is.
                Ok(Answer::Message(Bytes::from(framed)))
            }
        }
    }

    /// The name of the codec's output `index` ("" if none: a caller's bug).
    fn output_name(&self, index: usize) -> &str {
        self.codec
            .outputs()
            .get(index)
            .map_or("", |o| o.name.as_str())
    }

    /// The rows of `route` in each of `outputs` (indices), as raw bytes;
    /// those with a range in `regions` (aligned, or empty) written there,
    /// their bytes empty; those with a count in `classes` (aligned, or
    /// empty) as their top classes.
    fn raw_rows(
        &self,
        route: &Route,
        outputs: &[usize],
        regions: &[Option<RegionRange>],
        classes: &[Option<u32>],
        columns: &[Column<'_>],
    ) -> Result<Vec<RawOutput>, Failure> {
        let mut rows = Vec::with_capacity(outputs.len());
        for (i, &index) in outputs.iter().enumerate() {
            let class_count = class_of(classes, i);
            let (shape, data) = self.answered_rows(route, index, class_count, columns)?;
            rows.push((index, shape, data, class_count.is_some()));
        }
        // An output is never both classified and in a region (the request
        // is refused); others of the same request may be either.
        if !regions.is_empty() {
            let writes: Vec<(&str, &[u8], &RegionRange)> = rows
                .iter()
                .zip(regions)
                .filter_map(|((index, _, data, _), r)| {
                    Some((self.output_name(*index), data.as_ref(), r.as_ref()?))
                })
                .collect();
            write_regions(&writes)?;
        }
        Ok(rows
            .into_iter()
            .enumerate()
            .map(|(i, (index, shape, data, classified))| RawOutput {
                index,
                shape,
                data: match (matches!(regions.get(i), Some(Some(_))), data) {
                    (true, _) => Bytes::new(),
                    (false, Cow::Borrowed(data)) => Bytes::copy_from_slice(data),
                    (false, Cow::Owned(data)) => Bytes::from(data),
                },
                classified,
            })
            .collect())
    }

    /// [`Replies::rows`], as the request asks for them: with a count,
    /// its top classes (BYTES, see [`ferrobatch_core::v2::Codec::classify`]).
    fn answered_rows<'a>(
        &self,
        route: &Route,
        index: usize,
        class_count: Option<u32>,
        columns: &[Column<'a>],
    ) -> Result<(Shape, Cow<'a, [u8]>), Failure> {
        let (shape, data) = self.rows(route, index, columns)?;
        let Some(count) = class_count else {
            return Ok((shape, data));
        };
        let (shape, classes) = self
            .codec
            .classify(index, count, &shape, &data)
            .map_err(|e| Failure::new(e.status(), e.to_string()))?;
        Ok((shape, Cow::Owned(classes)))
    }

    /// The rows of `route` in output `index`: their shape and bytes, or the
    /// failure saying the model's output has no such rows.
    fn rows<'a>(
        &self,
        route: &Route,
        index: usize,
        columns: &[Column<'a>],
    ) -> Result<(Shape, Cow<'a, [u8]>), Failure> {
        let column = columns.get(index).ok_or_else(|| {
            Failure::new(
                500,
                format!("model '{}' returned too few outputs", self.codec.model()),
            )
        })?;
        let (mut shape, data) = rows_of(column, route).ok_or_else(|| {
            let name = self
                .codec
                .outputs()
                .get(index)
                .map_or("?", |o| o.name.as_str());
            Failure::new(
                500,
                format!(
                    "model '{}' returned output '{name}' of shape {:?}, which has no rows {}..{}",
                    self.codec.model(),
                    column.shape,
                    route.start,
                    u64::from(route.start) + u64::from(route.rows)
                ),
            )
        })?;
        if !self.codec.batching() && !shape.is_empty() {
            shape.remove(0); // one sample, shaped as declared: no batch dimension
        }
        Ok((shape, data))
    }
}

/// Rows `route.start..+route.rows` of `column`: their shape and bytes, or
/// None when the column has no such rows (or its bytes do not match its shape).
fn rows_of<'a>(column: &Column<'a>, route: &Route) -> Option<(Shape, Cow<'a, [u8]>)> {
    if let Some(varying) = column.rows {
        return varying_rows_of(column.data, varying, route);
    }
    let (&batch_rows, rest) = column.shape.split_first()?;
    let batch_rows = usize::try_from(batch_rows).ok()?;
    let row_bytes = column.data.len().checked_div(batch_rows).unwrap_or(0);
    if row_bytes.checked_mul(batch_rows)? != column.data.len() {
        return None;
    }
    let start = usize::try_from(route.start).ok()?;
    let rows = usize::try_from(route.rows).ok()?;
    if start.checked_add(rows)? > batch_rows {
        return None;
    }
    let from = start.checked_mul(row_bytes)?;
    let to = from.checked_add(rows.checked_mul(row_bytes)?)?;
    let mut shape = Shape::with_capacity(column.shape.len());
    shape.push(route.rows as u64);
    shape.extend_from_slice(rest);
    Some((shape, Cow::Borrowed(column.data.get(from..to)?)))
}

/// [`rows_of`] for rows that differ in size: one row as it is; several
/// back to back when they are of one shape and adjacent, else padded to
/// their longest along each dimension.
fn varying_rows_of<'a>(
    data: &'a [u8],
    varying: &VaryingRows,
    route: &Route,
) -> Option<(Shape, Cow<'a, [u8]>)> {
    let start = usize::try_from(route.start).ok()?;
    let end = start.checked_add(usize::try_from(route.rows).ok()?)?;
    let ranges = varying.ranges.get(start..end)?;
    let shapes = varying.shapes.get(start..end)?;
    let (first, first_shape) = (ranges.first()?, shapes.first()?);
    let last = ranges.last()?;
    let same_shape = shapes.iter().all(|s| s == first_shape);
    let adjacent = ranges.windows(2).all(|w| w[0].end == w[1].start);
    let mut shape = Shape::with_capacity(first_shape.len() + 1);
    shape.push(route.rows as u64);
    if same_shape && adjacent {
        shape.extend_from_slice(first_shape);
        return Some((shape, Cow::Borrowed(data.get(first.start..last.end)?)));
    }
    let rank = first_shape.len();
    if shapes.iter().any(|s| s.len() != rank) {
        return None;
    }
    let longest: Vec<u64> = (0..rank)
        .map(|d| shapes.iter().map(|s| s[d]).max().unwrap_or(0))
        .collect();
    let rows: Vec<(&[u8], &[u64])> = ranges
        .iter()
        .zip(shapes)
        .map(|(r, s)| Some((data.get(r.clone())?, s.as_slice())))
        .collect::<Option<_>>()?;
    let padded = pad_rows(&rows, &longest, varying.itemsize, &varying.pad)?;
    shape.extend_from_slice(&longest);
    Some((shape, Cow::Owned(padded)))
}

/// `rows` (each its bytes and shape) in a box of shape `[rows, *longest]`,
/// row-major, `pad` wherever a row is shorter; `None` when a row's bytes do
/// not match its shape or the box is too large.
fn pad_rows(
    rows: &[(&[u8], &[u64])],
    longest: &[u64],
    itemsize: Option<usize>,
    pad: &[u8],
) -> Option<Vec<u8>> {
    let dims: Vec<usize> = longest
        .iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<_>>()?;
    let box_elements = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    let element_bytes = itemsize.unwrap_or(4 + pad.len());
    let total = box_elements
        .checked_mul(rows.len())?
        .checked_mul(element_bytes.max(1))?;
    if total > MAX_PADDED_BYTES {
        return None;
    }
    let mut out = Vec::with_capacity(total);
    for &(data, shape) in rows {
        let shape: Vec<usize> = shape
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .collect::<Option<_>>()?;
        let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
        let elements: Vec<&[u8]> = match itemsize {
            Some(n) if n > 0 && data.len() == count.checked_mul(n)? => {
                data.chunks_exact(n).collect()
            }
            Some(_) => return None,
            None => ferrobatch_core::bytes::elements(data).collect(),
        };
        if elements.len() != count {
            return None;
        }
        let mut index = vec![0usize; dims.len()];
        for _ in 0..box_elements {
            // Row-major position `index` of the box: the row's own element
            // when it lies within the row's shape, else the pad.
            let own = index.iter().zip(&shape).all(|(&i, &n)| i < n);
            let element = if own {
                let at = index
                    .iter()
                    .zip(&shape)
                    .fold(0usize, |at, (&i, &n)| at * n + i);
                elements[at]
            } else {
                pad
            };
            match itemsize {
                Some(_) => out.extend_from_slice(element),
                None => ferrobatch_core::bytes::push(&mut out, element).ok()?,
            }
            for d in (0..dims.len()).rev() {
                index[d] += 1;
                if index[d] < dims[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::Backlog;

    #[test]
    fn a_backlog_refuses_what_would_pass_its_limit_and_counts_nothing_then() {
        let backlog = Backlog::new(100);
        assert!(backlog.take(60));
        assert!(!backlog.take(41), "60 + 41 > 100");
        assert_eq!(backlog.unread(), 60, "a refused take counts nothing");
        assert!(backlog.take(40));
        backlog.release(70);
        assert_eq!(backlog.unread(), 30);
        assert!(!backlog.take(usize::MAX), "no overflow");
        backlog.release(usize::MAX);
        assert_eq!(backlog.unread(), 0, "never below zero");
    }
}
