//! The claim/apply/commit/ack algorithm: owned here, once, for every broker and store.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::sync::{watch, Mutex};
use tracing::{info, info_span, warn, Instrument};

use crate::error::backoff;
use crate::stats::Counter;
use crate::{
    Ack, BatchHandler, BatchItem, Delivery, Error, Failure, Handler, HandlerError, HookAction,
    InboxStore, MessageId, MessageSource, PerMessage, Recovery, Result, SourceError, Stage,
    StageHook, Stats, StatsSnapshot, StoreError,
};

/// How often a failing handler is tried before its message is dead-lettered, and how long to
/// wait between tries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Handler attempts per delivery, the first included. At least 1.
    pub max_attempts: u32,
    /// Wait before the second attempt; doubled for each further one.
    pub initial_backoff: Duration,
    /// The longest wait between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// Runs a [`Handler`] over a [`MessageSource`] so that each message ID is applied once,
/// through an [`InboxStore`].
///
/// For each batch the source returns:
/// 1. a message without a usable ID, or delivered more often than
///    [`Consumer::max_deliveries`], is dead-lettered with the reason, then acked;
/// 2. the IDs are claimed in one store transaction; an ID already claimed is a duplicate, skipped;
/// 3. each new message's handler runs in that transaction, with no savepoints;
/// 4. the transaction commits once, and only then is the batch acked; an ack that fails now is
///    logged and counted, not fatal: the redelivered copy will find its ID and be skipped;
/// 5. when a handler fails or the commit is refused (a constraint checked at commit, a handler
///    that swallowed an SQL error), the transaction rolls back and the batch is applied again in
///    smaller transactions until the failure is pinned on one message: the result equals
///    applying the messages one by one;
/// 6. a message whose handler failed is retried on its own with backoff, each attempt in a fresh
///    transaction, up to [`RetryPolicy::max_attempts`], then dead-lettered with the error; a
///    permanent failure is dead-lettered at once; a panic counts as a transient failure.
///
/// While the store cannot be reached ([`Recovery::Reconnect`]) the batch is held and tried again
/// with a backoff doubling up to 30 s, not handed back: an outage does not use up the broker's
/// delivery budget (`max_deliveries`, a quorum queue's delivery limit, an SQS redrive policy), so
/// healthy messages are not dead-lettered because the database was down. Shutdown during an
/// outage hands the held messages back. A broker error that is not [`Recovery::Fatal`] is
/// logged and the receive is tried again after a backoff.
///
/// Order: within one batch, messages are applied in the order received; a message that fails and
/// is retried is applied after the rest of its batch. With [`Consumer::parallel_lanes`], a batch
/// is split by [`Metadata::lane`](crate::Metadata::lane) (a Kafka partition, say): each lane
/// keeps that order and runs in a transaction of its own, several lanes at a time.
#[derive(Debug)]
pub struct Consumer<S, St, H> {
    source: S,
    core: Core<St, H>,
    batch_size: usize,
    lanes: usize,
    inbox_retention: Option<Duration>,
}

/// Received messages waiting to be applied, by lane, each lane in received order; a lane with
/// a chunk being applied is busy and gives out nothing until that chunk is done.
struct Lanes<A> {
    lanes: Vec<(Option<String>, VecDeque<Delivery<A>>, bool)>,
    held: usize,
}

impl<A> Default for Lanes<A> {
    fn default() -> Self {
        Self {
            lanes: Vec::new(),
            held: 0,
        }
    }
}

impl<A> Lanes<A> {
    fn add(&mut self, batch: Vec<Delivery<A>>) {
        self.held += batch.len();
        for delivery in batch {
            let lane = &delivery.message.meta.lane;
            match self.lanes.iter_mut().find(|(l, _, _)| l == lane) {
                Some((_, queue, _)) => queue.push_back(delivery),
                None => self
                    .lanes
                    .push((lane.clone(), VecDeque::from([delivery]), false)),
            }
        }
    }

    /// Up to `max` messages of the first lane that has some and is not busy; that lane is busy
    /// until [`Lanes::done`].
    fn take(&mut self, max: usize) -> Option<(Option<String>, Vec<Delivery<A>>)> {
        let (lane, queue, busy) = self
            .lanes
            .iter_mut()
            .find(|(_, queue, busy)| !*busy && !queue.is_empty())?;
        *busy = true;
        let n = queue.len().min(max);
        self.held -= n;
        let chunk: Vec<Delivery<A>> = queue.drain(..n).collect();
        let lane = lane.clone();
        // Round robin: the lane goes to the back, so the others get their turn first.
        if let Some(i) = self.lanes.iter().position(|(l, _, _)| *l == lane) {
            let entry = self.lanes.remove(i);
            self.lanes.push(entry);
        }
        Some((lane, chunk))
    }

    fn done(&mut self, lane: &Option<String>) {
        if let Some(i) = self.lanes.iter().position(|(l, _, _)| l == lane) {
            if self.lanes[i].1.is_empty() {
                self.lanes.remove(i);
            } else {
                self.lanes[i].2 = false;
            }
        }
    }

    fn len(&self) -> usize {
        self.held
    }

    /// Everything not yet given out, lanes left as they are.
    fn drain(&mut self) -> Vec<A> {
        self.held = 0;
        self.lanes
            .iter_mut()
            .flat_map(|(_, queue, _)| queue.drain(..))
            .map(|d| d.ack)
            .collect()
    }
}

/// How much longer the broker can redeliver than the inbox remembers, if at all.
///
/// A redelivery older than the inbox's retention finds no row and is applied again, so the
/// retention must cover the broker's window (plus a margin for replays and redrives).
pub fn retention_shortfall(
    inbox_retention: Duration,
    broker_window: Option<Duration>,
) -> Option<Duration> {
    broker_window
        .filter(|window| *window > inbox_retention)
        .map(|window| window - inbox_retention)
}

#[derive(Debug)]
struct Core<St, H> {
    name: String,
    store: St,
    handler: H,
    retry: RetryPolicy,
    max_deliveries: Option<u32>,
    error_backoff: Duration,
    hook: Option<StageHook>,
    stats: Arc<Stats>,
}

/// The longest wait between tries after a broker or store error.
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(30);

enum Outcome {
    Skipped,
    Applied,
    Failed(HandlerError),
    /// Not applied: handed back to the broker (shutdown during a store outage).
    HandedBack,
}

/// Why a transaction did not commit.
enum TxFailure {
    /// The handler failed, for the message at this index when known; the transaction was
    /// rolled back.
    Handler(Option<usize>, HandlerError),
    /// The store failed (at begin, claim or commit).
    Store(StoreError),
    /// A stage hook stopped the consumer dead.
    Crash(Error),
}

impl From<Error> for TxFailure {
    fn from(e: Error) -> Self {
        TxFailure::Crash(e)
    }
}

/// A message to apply: its ID and what the handler decoded from it.
struct Work<A, I> {
    id: MessageId,
    delivery: Delivery<A>,
    item: I,
}

/// Tells the work in flight that shutdown was asked for.
#[derive(Debug, Clone)]
struct Stop(watch::Receiver<bool>);

impl Stop {
    fn stopping(&self) -> bool {
        *self.0.borrow()
    }

    /// Sleeps `wait`, or less when shutdown is asked for; `true` when it was.
    async fn pause(&self, wait: Duration) -> bool {
        if self.stopping() {
            return true;
        }
        let mut stop = self.0.clone();
        tokio::select! {
            () = tokio::time::sleep(wait) => false,
            Ok(_) = stop.wait_for(|stopping| *stopping) => true,
        }
    }
}

impl<S, St, H> Consumer<S, St, PerMessage<H>>
where
    S: MessageSource,
    St: InboxStore,
    H: Handler<St::Tx>,
{
    /// A consumer named `name` running `handler` once per new message: the inbox scopes IDs per
    /// name, so two consumers with different names each apply every message once, and instances
    /// of one scaled consumer share a name.
    pub fn new(name: impl Into<String>, source: S, store: St, handler: H) -> Self {
        Consumer::batched(name, source, store, PerMessage(handler))
    }
}

impl<S, St, H> Consumer<S, St, H>
where
    S: MessageSource,
    St: InboxStore,
    H: BatchHandler<St::Tx>,
{
    /// A consumer named `name` handing all new messages of each transaction to `handler` at
    /// once (see [`BatchHandler`]), for set-based writes. Otherwise as [`Consumer::new`].
    pub fn batched(name: impl Into<String>, source: S, store: St, handler: H) -> Self {
        Self {
            source,
            batch_size: 1,
            lanes: 1,
            inbox_retention: None,
            core: Core {
                name: name.into(),
                store,
                handler,
                retry: RetryPolicy::default(),
                max_deliveries: None,
                error_backoff: Duration::from_millis(500),
                hook: None,
                stats: Arc::new(Stats::default()),
            },
        }
    }

    /// Up to `n` messages per receive, claimed and committed in one transaction and acked
    /// together (default 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Applies up to `n` lanes of a batch at the same time (default 1: the whole batch in one
    /// transaction). A batch is split by [`Metadata::lane`](crate::Metadata::lane); messages of
    /// one lane are applied in the order received, in one transaction and one ack per lane, and
    /// the next batch is received once every lane is done. Sources that set no lane (one queue,
    /// one order) form a single lane, so this changes nothing for them. Each running lane holds
    /// one store transaction (one pooled connection). Lanes whose handlers write the same rows
    /// wait on each other's locks like any concurrent transactions, and a deadlock fails a
    /// handler, which is then retried after the rest of its lane: key messages so that what
    /// shares rows shares a lane (Kafka: one account, one partition).
    pub fn parallel_lanes(mut self, n: usize) -> Self {
        self.lanes = n;
        self
    }

    /// How failing handlers are retried.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.core.retry = policy;
        self
    }

    /// Dead-letter a message the broker reports having delivered more than `n` times, before
    /// running its handler: it stops a message that kills the process (and so is never acked or
    /// dead-lettered by the retry path) from looping forever. Only brokers that count
    /// deliveries report one.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.core.max_deliveries = Some(n);
        self
    }

    /// The first wait after a broker or store error (doubling up to 30 s while errors repeat).
    pub fn error_backoff(mut self, wait: Duration) -> Self {
        self.core.error_backoff = wait;
        self
    }

    /// Calls `hook` at each [`Stage`] of each message.
    pub fn on_stage(mut self, hook: StageHook) -> Self {
        self.core.hook = Some(hook);
        self
    }

    /// How long the inbox store remembers IDs (its purge window). At start the consumer warns
    /// when the source can redeliver for longer
    /// ([`MessageSource::redelivery_window`]): such a late copy would be applied again.
    pub fn inbox_retention(mut self, window: Duration) -> Self {
        self.inbox_retention = Some(window);
        self
    }

    /// Live counters, readable while the consumer runs.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.core.stats)
    }

    /// Runs until Ctrl-C (SIGINT), then finishes the batch in flight and returns.
    pub async fn run(self) -> Result<StatsSnapshot> {
        self.run_until(async {
            // If no signal handler can be installed, run until the process ends.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
        .await
    }

    /// Runs until `shutdown` completes. Shutdown is graceful: no new batch is received, the batch
    /// in flight is applied, committed and acked, then this returns the counters.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<StatsSnapshot> {
        self.run_loop(shutdown, false).await
    }

    /// Runs until a receive comes back empty, then returns: for draining a queue in tools and
    /// tests.
    pub async fn run_until_idle(self) -> Result<StatsSnapshot> {
        self.run_loop(std::future::pending(), true).await
    }

    /// The pipeline: up to `lanes` chunks of `batch_size` (one per lane, so each lane keeps its
    /// order) are applied side by side, receiving goes on while a lane is free, and a chunk's acks
    /// go out while the next chunks are applied. At most `batch_size × lanes` messages are held
    /// unapplied, so a consumer that dies takes no more deliveries down with it (or onto a
    /// broker's delivery count) than that. Nothing is acked before the commit of its claim.
    async fn run_loop(
        mut self,
        shutdown: impl Future<Output = ()> + Send,
        until_idle: bool,
    ) -> Result<StatsSnapshot> {
        self.check()?;
        tokio::pin!(shutdown);
        let (stop_tx, stop_rx) = watch::channel(false);
        let stop = Stop(stop_rx);
        let (batch_size, lanes) = (self.batch_size, self.lanes);
        let core = &self.core;
        let source = Mutex::new(&mut self.source);
        let source = &source;
        let stop = &stop;
        let capacity = batch_size.saturating_mul(lanes);
        let mut queued = Lanes::default();
        let mut working = FuturesUnordered::new();
        let mut acking = FuturesUnordered::new();
        let mut receiving = None;
        let mut receive_after: Option<Instant> = None;
        let mut failures = 0;
        let mut failed: Option<Error> = None;
        let mut idle = false;
        loop {
            let stopping = stop.stopping();
            while working.len() < lanes && !stopping {
                let Some((lane, chunk)) = queued.take(batch_size) else {
                    break;
                };
                working.push(async move { (lane, core.process(source, chunk, stop).await) });
            }
            let held = queued.len() + working.len() * batch_size;
            if receiving.is_none()
                && receive_after.is_none()
                && !stopping
                && !idle
                && held < capacity
                && acking.len() <= lanes
            {
                let n = batch_size
                    .max(capacity - held)
                    .min(batch_size.saturating_mul(lanes));
                receiving = Some(Box::pin(
                    async move { source.lock().await.receive(n).await },
                ));
            }
            if stopping || idle {
                // A receive still waiting (a long poll) is dropped: receives are cancel-safe,
                // and what a cancelled one took comes back from the broker.
                receiving = None;
                core.hand_back(queued.drain()).await;
                if working.is_empty() && acking.is_empty() && receiving.is_none() {
                    break;
                }
            }
            tokio::select! {
                biased;
                () = &mut shutdown, if !stopping => {
                    stop_tx.send_replace(true);
                }
                Some((lane, result)) = working.next() => {
                    queued.done(&lane);
                    match result {
                        Ok(acks) => acking.push(core.ack_all(acks)),
                        Err(e @ Error::Crashed { .. }) => return Err(e),
                        Err(e) => {
                            failed.get_or_insert(e);
                            stop_tx.send_replace(true);
                        }
                    }
                }
                Some(result) = acking.next() => {
                    match result {
                        Ok(()) => {}
                        Err(e @ Error::Crashed { .. }) => return Err(e),
                        Err(e) => {
                            failed.get_or_insert(e);
                            stop_tx.send_replace(true);
                        }
                    }
                }
                received = async { receiving.as_mut().expect("guarded by is_some").await }, if receiving.is_some() => {
                    receiving = None;
                    match received {
                        Ok(batch) if batch.is_empty() => {
                            failures = 0;
                            if until_idle && working.is_empty() && acking.is_empty() && queued.len() == 0 {
                                idle = true;
                            }
                        }
                        Ok(batch) => {
                            failures = 0;
                            queued.add(batch);
                        }
                        Err(e) => {
                            failures += 1;
                            match core.source_failed(e, failures) {
                                Ok(wait) => receive_after = Some(Instant::now() + wait),
                                Err(e) => {
                                    failed.get_or_insert(e);
                                    stop_tx.send_replace(true);
                                }
                            }
                        }
                    }
                }
                () = sleep_until(receive_after.unwrap_or_else(Instant::now)), if receive_after.is_some() => {
                    receive_after = None;
                }
                else => break,
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(core.stats.snapshot()),
        }
    }

    fn check(&self) -> Result<()> {
        if self.core.name.is_empty() {
            return Err(Error::Config("the consumer name is empty".into()));
        }
        if self.batch_size == 0 {
            return Err(Error::Config("the batch size is 0; use at least 1".into()));
        }
        if self.lanes == 0 {
            return Err(Error::Config("parallel_lanes is 0; use at least 1".into()));
        }
        if self.core.retry.max_attempts == 0 {
            return Err(Error::Config("max_attempts is 0; use at least 1".into()));
        }
        if let Some(retention) = self.inbox_retention {
            let window = self.source.redelivery_window();
            if let Some(gap) = retention_shortfall(retention, window) {
                warn!(
                    consumer = %self.core.name,
                    inbox_retention = ?retention,
                    broker_window = ?window,
                    "the inbox forgets IDs {gap:?} before the broker stops redelivering; \
                     a copy redelivered in that gap would be applied again: raise the inbox retention"
                );
            }
        }
        Ok(())
    }
}

impl<St, H> Core<St, H>
where
    St: InboxStore,
    H: BatchHandler<St::Tx>,
{
    /// Applies one chunk of one lane. Returns the acks of the messages settled by the commit,
    /// for the caller to send behind the next chunk's transaction; dead letters, hand-backs and
    /// a chunk with failures (acked before its failed messages are retried) are settled here.
    async fn process<S: MessageSource>(
        &self,
        source: &Mutex<&mut S>,
        deliveries: Vec<Delivery<S::Ack>>,
        stop: &Stop,
    ) -> Result<Vec<(MessageId, S::Ack)>> {
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        self.count(Counter::Received, deliveries.len());
        let mut done: Vec<(MessageId, S::Ack)> = Vec::new();
        let mut work: Vec<Work<S::Ack, H::Item>> = Vec::with_capacity(deliveries.len());
        let mut failed = Vec::new();
        let mut seen = HashSet::new();
        for delivery in deliveries {
            let id = match &delivery.message.id {
                Ok(id) => id.clone(),
                Err(e) => {
                    let reason = e.to_string();
                    self.dead_letter(source, None, delivery, reason).await?;
                    continue;
                }
            };
            if let Err(e) = self.store.check_id(&id) {
                let reason = format!("message ID {id:?} refused by the inbox store: {e}");
                self.dead_letter(source, Some(&id), delivery, reason)
                    .await?;
                continue;
            }
            if let (Some(limit), Some(count)) =
                (self.max_deliveries, delivery.message.meta.delivery_count)
            {
                if count > limit {
                    let reason = format!("delivered {count} times, more than the limit of {limit}");
                    self.dead_letter(source, Some(&id), delivery, reason)
                        .await?;
                    continue;
                }
            }
            if !seen.insert(id.clone()) {
                // The same ID twice in one batch: the first copy decides, this one is a duplicate.
                self.skipped(&id);
                done.push((id, delivery.ack));
                continue;
            }
            // Decoded before any database work: a message that does not decode never enters a
            // transaction, and is retried or dead-lettered on its own.
            match self.handler.decode(&id, &delivery.message) {
                Ok(item) => work.push(Work { id, delivery, item }),
                Err(e) => failed.push((id, delivery, e)),
            }
        }

        let outcomes = if work.is_empty() {
            Vec::new()
        } else {
            self.apply_all(&work, stop).await?
        };
        let mut handed_back = Vec::new();
        for (Work { id, delivery, .. }, outcome) in work.into_iter().zip(outcomes) {
            match outcome {
                Outcome::Skipped | Outcome::Applied => done.push((id, delivery.ack)),
                Outcome::Failed(e) => failed.push((id, delivery, e)),
                Outcome::HandedBack => handed_back.push(delivery.ack),
            }
        }
        self.hand_back(handed_back).await;
        if failed.is_empty() {
            return Ok(done);
        }
        self.ack_all(done).await?;
        for (id, delivery, e) in failed {
            if stop.stopping() {
                self.hand_back(vec![delivery.ack]).await;
                continue;
            }
            self.retry_alone(source, id, delivery, e, stop).await?;
        }
        Ok(Vec::new())
    }

    /// Applies `work` in as few transactions as possible: all of it in one, and when that fails,
    /// in smaller pieces, until each failure is pinned on one message. The outcome is the same as
    /// applying the messages one by one, in order, with the failed ones left out:
    /// - a handler failure rolls back its transaction; when the handler says which message
    ///   failed, the messages before it are applied again together, the failing one alone (its
    ///   failure then stands), the rest after it; otherwise the piece is halved;
    /// - a store error that says [`Recovery::Retry`] (a constraint failing at commit, a handler
    ///   that swallowed an SQL error and left the transaction aborted, a deadlock) halves the
    ///   piece, and on a single message counts as that message's failure, so it is retried and
    ///   dead-lettered after [`RetryPolicy::max_attempts`] instead of looping with its neighbours;
    /// - [`Recovery::Reconnect`] (the store is unreachable) says nothing about the messages:
    ///   the piece is held and tried again after a backoff until the store is back, so an outage
    ///   uses up no delivery budget; on shutdown what is held is handed back;
    /// - [`Recovery::Fatal`] stops the consumer.
    async fn apply_all<A>(&self, work: &[Work<A, H::Item>], stop: &Stop) -> Result<Vec<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> = work.iter().map(|_| None).collect();
        // Pieces still to apply, the next one last.
        let mut pieces: Vec<Range<usize>> = Vec::with_capacity(4);
        pieces.push(0..work.len());
        let mut outages = 0;
        while let Some(piece) = pieces.pop() {
            let (lo, hi) = (piece.start, piece.end);
            match self.apply_in_tx(&work[piece.clone()]).await {
                Ok(done) => {
                    outages = 0;
                    for (slot, outcome) in outcomes[piece].iter_mut().zip(done) {
                        *slot = Some(outcome);
                    }
                }
                Err(TxFailure::Crash(e)) => return Err(e),
                Err(TxFailure::Handler(_, e)) if hi - lo == 1 => {
                    outcomes[lo] = Some(Outcome::Failed(e))
                }
                Err(TxFailure::Handler(None, _)) => {
                    let mid = lo + (hi - lo) / 2;
                    pieces.extend([mid..hi, lo..mid]);
                }
                Err(TxFailure::Handler(Some(i), _)) => {
                    let at = lo + i;
                    pieces.extend(
                        [at + 1..hi, at..at + 1, lo..at]
                            .into_iter()
                            .filter(|p| !p.is_empty()),
                    );
                }
                Err(TxFailure::Store(e)) => match e.recovery() {
                    Recovery::Fatal => {
                        self.count(Counter::Error, 1);
                        return Err(Error::Store(e));
                    }
                    Recovery::Reconnect => {
                        self.count(Counter::Error, 1);
                        outages += 1;
                        let wait = backoff(self.error_backoff, MAX_ERROR_BACKOFF, outages);
                        warn!(consumer = %self.name, error = %e, messages = hi - lo, ?wait, "inbox store unreachable; holding the messages until it is back");
                        pieces.push(piece);
                        if stop.pause(wait).await {
                            break;
                        }
                    }
                    Recovery::Retry if hi - lo > 1 => {
                        let mid = lo + (hi - lo) / 2;
                        pieces.extend([mid..hi, lo..mid]);
                    }
                    Recovery::Retry => {
                        outcomes[lo] = Some(Outcome::Failed(HandlerError::transient(e)))
                    }
                },
            }
        }
        // Stopped during an outage: what was not applied goes back to the broker.
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::HandedBack))
            .collect())
    }

    /// Claims, applies and commits `work` in one transaction, without savepoints: a handler
    /// failure rolls everything back. Nothing is acked here.
    async fn apply_in_tx<A>(&self, work: &[Work<A, H::Item>]) -> Result<Vec<Outcome>, TxFailure> {
        let ids: Vec<MessageId> = work.iter().map(|w| w.id.clone()).collect();
        let mut tx = self.store.begin().await.map_err(TxFailure::Store)?;
        let claimed = match self.store.claim_many(&mut tx, &self.name, &ids).await {
            Ok(claimed) => claimed,
            Err(e) => return Err(self.abandon(tx, TxFailure::Store(e)).await),
        };
        let fresh: Vec<&Work<A, H::Item>> = work
            .iter()
            .zip(&claimed)
            .filter(|(_, new)| **new)
            .map(|(w, _)| w)
            .collect();
        for w in &fresh {
            self.stage(Stage::Claimed, &w.id)?;
        }
        if !fresh.is_empty() {
            let batch: Vec<BatchItem<'_, H::Item>> = fresh
                .iter()
                .map(|w| BatchItem {
                    id: &w.id,
                    message: &w.delivery.message,
                    item: &w.item,
                })
                .collect();
            if let Err(failure) = self.call_handler(&mut tx, &batch).await {
                // The index is within `fresh`; the caller splits `work`.
                let at = failure.index().and_then(|i| {
                    let id = &fresh.get(i)?.id;
                    work.iter().position(|w| &w.id == id)
                });
                return Err(self.abandon(tx, TxFailure::Handler(at, failure)).await);
            }
            for w in &fresh {
                self.stage(Stage::Applied, &w.id)?;
            }
        }
        let outcomes: Vec<Outcome> = claimed
            .iter()
            .map(|new| {
                if *new {
                    Outcome::Applied
                } else {
                    Outcome::Skipped
                }
            })
            .collect();
        if fresh.is_empty() {
            // Nothing to keep: every message was a duplicate.
            if let Err(e) = self.store.rollback(tx).await {
                warn!(consumer = %self.name, error = %e, "rollback failed; the store discards the transaction");
            }
        } else {
            self.store.commit(tx).await.map_err(TxFailure::Store)?;
            self.count(Counter::Commit, 1);
            self.count(Counter::Applied, fresh.len());
        }
        for (w, outcome) in work.iter().zip(&outcomes) {
            match outcome {
                Outcome::Applied => {
                    info!(consumer = %self.name, message_id = %w.id, position = %w.delivery.message.meta.position, outcome = "applied", "applied {}", w.id);
                    self.stage(Stage::Committed, &w.id)?;
                }
                Outcome::Skipped => self.skipped(&w.id),
                Outcome::Failed(_) | Outcome::HandedBack => {}
            }
        }
        Ok(outcomes)
    }

    /// Runs the handler over `batch`, turning a panic into a transient failure.
    async fn call_handler(
        &self,
        tx: &mut St::Tx,
        batch: &[BatchItem<'_, H::Item>],
    ) -> Result<(), HandlerError> {
        let span = info_span!("inbox.batch", consumer = %self.name, messages = batch.len());
        let call = self.handler.handle_batch(tx, batch);
        match AssertUnwindSafe(call).catch_unwind().instrument(span).await {
            Ok(result) => result,
            Err(panic) => {
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-text panic payload".to_owned());
                Err(HandlerError::transient(format!("handler panicked: {text}")))
            }
        }
    }

    /// A message whose handler (or decoding) failed inside a batch or alone: retried on its own.
    async fn retry_alone<S: MessageSource>(
        &self,
        source: &Mutex<&mut S>,
        mut id: MessageId,
        mut delivery: Delivery<S::Ack>,
        first: HandlerError,
        stop: &Stop,
    ) -> Result<()> {
        let mut error = first;
        let mut attempt = 1;
        loop {
            if error.failure() == Failure::Permanent || attempt >= self.retry.max_attempts {
                let reason = match error.failure() {
                    Failure::Permanent => format!("handler refused the message: {error}"),
                    _ => format!("handler failed {attempt} time(s), last error: {error}"),
                };
                return self.dead_letter(source, Some(&id), delivery, reason).await;
            }
            warn!(consumer = %self.name, message_id = %id, attempt, error = %error, "handler failed; retrying");
            self.count(Counter::Retried, 1);
            let r = &self.retry;
            if stop
                .pause(backoff(r.initial_backoff, r.max_backoff, attempt))
                .await
            {
                self.hand_back(vec![delivery.ack]).await;
                return Ok(());
            }
            attempt += 1;
            let item = match self.handler.decode(&id, &delivery.message) {
                Ok(item) => item,
                Err(e) => {
                    error = e;
                    continue;
                }
            };
            let work = [Work { id, delivery, item }];
            let outcome = self.apply_all(&work, stop).await?.pop();
            let [Work {
                id: same,
                delivery: back,
                ..
            }] = work;
            match outcome {
                Some(Outcome::Failed(e)) => {
                    error = e;
                    (id, delivery) = (same, back);
                }
                Some(Outcome::Applied | Outcome::Skipped) => {
                    return self.ack_all(vec![(same, back.ack)]).await;
                }
                Some(Outcome::HandedBack) | None => {
                    self.hand_back(vec![back.ack]).await;
                    return Ok(());
                }
            }
        }
    }

    async fn dead_letter<S: MessageSource>(
        &self,
        source: &Mutex<&mut S>,
        id: Option<&MessageId>,
        delivery: Delivery<S::Ack>,
        reason: String,
    ) -> Result<()> {
        let shown = id.map_or_else(|| "(no ID)".to_owned(), MessageId::to_string);
        let position = &delivery.message.meta.position;
        // Lanes running side by side take turns at the source.
        let parked = source
            .lock()
            .await
            .dead_letter(&delivery.message, &reason)
            .await;
        match parked {
            Ok(()) => {
                self.count(Counter::DeadLettered, 1);
                warn!(consumer = %self.name, message_id = %shown, position = %position, outcome = "dead_lettered", %reason, "dead-lettered {shown}");
                if let Err(e) = delivery.ack.ack().await {
                    self.count(Counter::AckFailure, 1);
                    warn!(consumer = %self.name, message_id = %shown, error = %e, "ack after dead-letter failed; the copy will be dead-lettered again");
                }
                Ok(())
            }
            Err(e) => {
                self.count(Counter::Error, 1);
                tracing::error!(consumer = %self.name, message_id = %shown, error = %e, %reason, "dead-letter failed; the message is handed back to the broker");
                if e.recovery() == Recovery::Fatal {
                    return Err(Error::Source(e));
                }
                if let Err(e) = delivery.ack.nack(self.error_backoff).await {
                    warn!(consumer = %self.name, error = %e, "nack failed; the broker will redeliver on its own");
                }
                Ok(())
            }
        }
    }

    async fn ack_all<A: Ack>(&self, acks: Vec<(MessageId, A)>) -> Result<()> {
        if acks.is_empty() {
            return Ok(());
        }
        let n = acks.len();
        let (ids, acks): (Vec<_>, Vec<_>) = acks.into_iter().unzip();
        match A::ack_all(acks).await {
            Ok(()) => {
                for id in &ids {
                    self.stage(Stage::Acked, id)?;
                }
            }
            Err(e) => {
                self.count(Counter::AckFailure, n);
                warn!(consumer = %self.name, messages = n, error = %e, "ack failed after commit; redelivered copies will be skipped as duplicates");
            }
        }
        Ok(())
    }

    /// Rolls back a transaction that cannot commit and passes `failure` on.
    async fn abandon(&self, tx: St::Tx, failure: TxFailure) -> TxFailure {
        if let Err(rollback) = self.store.rollback(tx).await {
            warn!(consumer = %self.name, error = %rollback, "rollback failed too; the store discards the transaction");
        }
        failure
    }

    /// Gives messages back to the broker unapplied, for redelivery after the error backoff.
    async fn hand_back<A: Ack>(&self, acks: Vec<A>) {
        if acks.is_empty() {
            return;
        }
        info!(consumer = %self.name, messages = acks.len(), "handing messages back to the broker");
        for ack in acks {
            if let Err(e) = ack.nack(self.error_backoff).await {
                warn!(consumer = %self.name, error = %e, "nack failed; the broker will redeliver on its own");
            }
        }
    }

    /// How long to wait before receiving again after `e`, or the error that stops the consumer.
    fn source_failed(&self, e: SourceError, failures: u32) -> Result<Duration> {
        self.count(Counter::Error, 1);
        if e.recovery() == Recovery::Fatal {
            return Err(Error::Source(e));
        }
        let wait = backoff(self.error_backoff, MAX_ERROR_BACKOFF, failures);
        warn!(consumer = %self.name, error = %e, ?wait, "receive failed; retrying");
        Ok(wait)
    }

    fn skipped(&self, id: &MessageId) {
        self.count(Counter::SkippedDuplicate, 1);
        info!(consumer = %self.name, message_id = %id, outcome = "skipped_duplicate", "skipped duplicate {id}");
    }

    fn stage(&self, stage: Stage, id: &MessageId) -> Result<()> {
        match &self.hook {
            Some(hook) if hook.call(stage, id) == HookAction::Crash => Err(Error::Crashed {
                stage,
                id: id.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn count(&self, counter: Counter, n: usize) {
        self.stats.add(&self.name, counter, n as u64);
    }
}
