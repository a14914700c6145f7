//! The claim/apply/commit/ack algorithm: owned here, once, for every broker and store.

mod apply;
pub(crate) mod common;
mod lanes;
mod pipeline;
pub(crate) mod stop;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, Stream};
use tracing::{info, warn};

pub use self::apply::Inbox;
use self::common::Common;
use self::stop::Stop;
use crate::effect::{EffectHandler, Effects, LeaseStore};
use crate::telemetry::{self, ConsumerMetrics};
use crate::{
    Ack, BatchHandler, Capabilities, ConsumerBinding, ConsumerState, Delivery, Error, Handler,
    Health, InboxStore, Message, MessageId, MessageSource, PerMessage, Result, Sharded, StageHook,
    Stats, StatsSnapshot,
};

/// How often a failing handler is tried before its message is dead-lettered, and how long to
/// wait between tries.
///
/// A failing message is first tried [`RetryPolicy::max_attempts`] times in the process, a
/// backoff apart. Then, with a redelivery schedule ([`RetryPolicy::redeliver_after`]), it is
/// handed back to the broker to come back after the schedule's next delay, and the in-process
/// attempts start again on that delivery; only once every delay of the schedule was used is it
/// dead-lettered. A ten-minute outage of what the handler calls then costs no dead letters.
///
/// ```
/// use std::time::Duration;
/// # use inbox_core::RetryPolicy;
/// let policy = RetryPolicy::default()
///     .max_attempts(5)
///     .backoff(Duration::from_millis(200), Duration::from_secs(10))
///     .redeliver_after([10, 60, 600].map(Duration::from_secs))
///     .jitter(0.2);
/// assert_eq!(policy.max_attempts, 5);
/// assert_eq!(policy.redeliveries.len(), 3);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Handler attempts per delivery, the first included. At least 1.
    pub max_attempts: u32,
    /// Wait before the second attempt; doubled for each further one.
    pub initial_backoff: Duration,
    /// The longest wait between attempts.
    pub max_backoff: Duration,
    /// The redelivery schedule: after the in-process attempts of its `n`th delivery under the
    /// schedule (counted from 0), a message still failing comes back after `redeliveries[n]`;
    /// past the end it is dead-lettered. Empty by default: dead-lettered after the in-process
    /// attempts.
    pub redeliveries: Vec<Duration>,
    /// How far each redelivery delay may stray, in thousandths of it, either way (so that
    /// messages that failed together do not all come back at once).
    jitter_permille: u16,
}

impl RetryPolicy {
    /// `n` handler attempts per delivery, the first included (default 3).
    #[must_use]
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Waits `initial` before the second attempt (default 100 ms), doubling for each further
    /// one up to `max` (default 5 s); each wait is shortened by up to half, by a draw of the
    /// process's own ([`crate::backoff`]), so that consumers that failed together do not retry
    /// in lockstep.
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max;
        self
    }

    /// After the in-process attempts, hands a message that still fails back to the broker, to
    /// come back after each of `delays` in turn (`[10 s, 1 min, 10 min]`: three redeliveries,
    /// the last ten minutes after the second), then dead-letters it. Each broker delays with
    /// its own means (an SQS visibility timeout, a RabbitMQ delay queue, a pending Redis entry
    /// left unclaimed, a paused Kafka partition; see the adapters' docs); the message keeps its
    /// ID, so the inbox still applies it once. The consumer refuses to start with a schedule on
    /// a source that cannot delay ([`Capabilities::delayed_redelivery`](crate::Capabilities::delayed_redelivery)).
    ///
    /// Where the broker counts deliveries of one message across its redeliveries (Redis
    /// Streams), each redelivery is one more: set [`Consumer::max_deliveries`] above the
    /// schedule's length + 1, or the message is parked before the schedule is used up.
    #[must_use]
    pub fn redeliver_after(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        self.redeliveries = delays.into_iter().collect();
        self
    }

    /// Spreads each redelivery delay by up to `fraction` of it either way (default 0; `0.2`:
    /// a 60 s delay becomes 48 to 72 s). Clamped to 0..=1.
    #[must_use]
    pub fn jitter(mut self, fraction: f64) -> Self {
        // Within 0..=1000 after the clamp, so the cast keeps the value.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let permille = (fraction.clamp(0.0, 1.0) * 1000.0).round() as u16;
        self.jitter_permille = permille;
        self
    }

    /// The jitter fraction ([`RetryPolicy::jitter`]).
    pub fn jitter_fraction(&self) -> f64 {
        f64::from(self.jitter_permille) / 1000.0
    }

    /// The delay before redelivery `n` (counted from 0) with the jitter applied, or `None` when
    /// the schedule is used up and the message is to be dead-lettered.
    pub fn redelivery_delay(&self, n: u32) -> Option<Duration> {
        let base = *self.redeliveries.get(usize::try_from(n).ok()?)?;
        if self.jitter_permille == 0 {
            return Some(base);
        }
        // A uniform draw in [0, 1) from 53 random bits; the core has no RNG dependency of its own.
        #[allow(clippy::cast_precision_loss)]
        let draw = (uuid::Uuid::new_v4().as_u64_pair().0 >> 11) as f64 / (1u64 << 53) as f64;
        let spread = self.jitter_fraction() * (2.0 * draw - 1.0);
        Some(base.mul_f64(1.0 + spread))
    }

    /// The wait before in-process attempt `attempt + 1`.
    pub(crate) fn wait(&self, attempt: u32) -> Duration {
        crate::backoff(self.initial_backoff, self.max_backoff, attempt)
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            redeliveries: Vec::new(),
            jitter_permille: 0,
        }
    }
}

/// What a failing message does to the order of its lane: see [`Consumer::order`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Order {
    /// A message that fails is retried after the rest of its chunk, which is committed without
    /// it: later messages of its lane overtake it. A poison message costs its lane nothing
    /// but its own retries. The default.
    #[default]
    FailuresLast,
    /// A message that fails blocks its lane (a Kafka partition, an SQS FIFO message group)
    /// until it is applied or dead-lettered: no later message of the lane is applied before it.
    /// A poison message stalls its lane for its whole retry schedule.
    Strict,
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
///    transaction, up to [`RetryPolicy::max_attempts`], then handed back to the broker for the
///    next delay of the redelivery schedule ([`RetryPolicy::redeliver_after`]) or, once that is
///    used up (or empty), dead-lettered with the error; a permanent failure is dead-lettered at
///    once; a panic counts as a transient failure. With [`Order::Strict`] only the messages
///    before it are committed first, and the rest of its chunk waits until it is applied,
///    handed back or dead-lettered.
///
/// While the store cannot be reached ([`Recovery::Reconnect`](crate::Recovery::Reconnect)) the
/// batch is held and tried again with a backoff doubling up to 30 s, not handed back: an outage
/// does not use up the broker's delivery budget (`max_deliveries`, a quorum queue's delivery
/// limit, an SQS redrive policy), so healthy messages are not dead-lettered because the database
/// was down. Shutdown during an outage hands the held messages back. A broker error that is not
/// [`Recovery::Fatal`](crate::Recovery::Fatal) is
/// logged and the receive is tried again after a backoff.
///
/// Shutdown ([`Consumer::run`] on SIGINT or SIGTERM, or [`Consumer::run_until`]): no new batch
/// is received, the batches in flight are applied, committed and acked for up to
/// [`Consumer::shutdown_timeout`]; what has not finished by then (a second signal cuts the wait
/// short) is rolled back and handed back to the broker, and `run` returns. Nothing is acked that
/// was not committed, so a consumer that is cut short or killed later loses nothing.
///
/// Order: within one batch, messages are applied in the order received; a message that fails and
/// is retried is applied after the rest of its batch, unless [`Order::Strict`] holds the rest
/// behind it (see [`Consumer::order`]). With [`Consumer::parallel_lanes`], a batch
/// is split by [`Metadata::lane`](crate::Metadata::lane) (a Kafka partition, say): each lane
/// keeps that order and runs in a transaction of its own, several lanes at a time; a source
/// without lanes has its chunks applied side by side in no order.
///
/// The same pipeline runs calls out of the process, with a lease per message instead of the
/// inbox's claim: see [`Consumer::effects`]. `W` is the step each chunk goes through:
/// [`Inbox`] for [`Consumer::new`] and [`Consumer::batched`], [`Effects`] for
/// [`Consumer::effects`].
#[derive(Debug)]
#[must_use = "a consumer does nothing until it is run"]
pub struct Consumer<S, W> {
    source: S,
    step: W,
    batch_size: usize,
    lanes: usize,
    inbox_retention: Option<Duration>,
    shutdown_timeout: Duration,
}

/// How long the batches in flight may take to finish after shutdown is asked for, by default:
/// within the 30 s Kubernetes and ECS give a container between SIGTERM and SIGKILL.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// Refuses a consumer name no store can keep, before anything is received: an empty one, or
/// one with a control character (PostgreSQL text refuses NUL: every claim would fail and every
/// message be dead-lettered).
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::Config("the consumer name is empty".into()));
    }
    if name.contains(char::is_control) {
        return Err(Error::Config(format!(
            "the consumer name {name:?} contains a control character; use letters, digits, \
             `-`, `_` or `.`"
        )));
    }
    Ok(())
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

/// What one chunk came to, for the pipeline.
pub(crate) struct Processed<A> {
    /// The acks to send once the chunk is done.
    pub(crate) acks: Vec<(MessageId, A)>,
    /// Strict order: a failed message went back to the broker unapplied, and the messages of
    /// its lane received after it must follow it there, not be applied before it comes again.
    pub(crate) blocked: bool,
}

/// The work a [`Consumer`] does with each chunk between its receive and its ack: [`Inbox`]
/// (from [`Consumer::new`] and [`Consumer::batched`]) or [`Effects`] (from
/// [`Consumer::effects`]). Sealed: this crate implements it, and users name it to write
/// functions over any consumer.
///
/// ```
/// use std::time::Duration;
///
/// use inbox_core::{Consumer, InboxStore, Inbox, MessageSource, BatchHandler, Work};
///
/// /// Settings every consumer of a service shares, whatever it does with its messages.
/// fn tune<S: MessageSource, W: Work>(consumer: Consumer<S, W>) -> Consumer<S, W> {
///     let lanes = std::env::var("LANES").ok().and_then(|n| n.parse().ok()).unwrap_or(4);
///     consumer
///         .batch_size(100)
///         .parallel_lanes(lanes)
///         .shutdown_timeout(Duration::from_secs(20))
/// }
///
/// /// And what only an inbox consumer has.
/// fn tune_inbox<S, St, H>(consumer: Consumer<S, Inbox<St, H>>) -> Consumer<S, Inbox<St, H>>
/// where
///     S: MessageSource,
///     St: InboxStore,
///     H: BatchHandler<St::Tx>,
/// {
///     tune(consumer).handler_timeout(Duration::from_secs(5))
/// }
/// ```
#[allow(private_bounds)] // sealed: `Step` is the crate's own
pub trait Work: Step {}

impl<W: Step> Work for W {}

/// One step of the consumer pipeline: what happens to each chunk of one lane between its
/// receive and its ack. [`Inbox`] and [`Effects`] are the two.
pub(crate) trait Step: Send + Sync {
    fn common(&self) -> &Common;

    fn common_mut(&mut self) -> &mut Common;

    /// Refuses settings this step cannot run with, and warns about ones the source cannot
    /// honour.
    fn check(&self, capabilities: Capabilities) -> Result<()>;

    /// Binds the step's store to the consumer, once, as the consumer starts.
    fn bind(&mut self) {}

    /// Whether a failed message blocks its lane ([`Order::Strict`]).
    fn strict(&self) -> bool {
        false
    }

    /// The store shard `message` goes to ([`Sharded`]); a chunk holds one shard's messages. The
    /// default, one store, is shard 0.
    fn shard_of(&self, message: &Message) -> usize {
        let _ = message;
        0
    }

    /// How many store shards [`Step::shard_of`] answers over.
    fn shard_count(&self) -> usize {
        1
    }

    /// Applies one chunk of one lane. Returns the acks to send once the chunk is done (the
    /// pipeline sends them behind the next chunk's work); everything else it settles itself.
    fn process<A: Ack>(
        &self,
        chunk: Vec<Delivery<A>>,
        stop: &Stop,
    ) -> impl Future<Output = Result<Processed<A>>>;
}

impl<St, H> Step for Inbox<St, H>
where
    St: InboxStore,
    H: BatchHandler<St::Tx>,
{
    fn common(&self) -> &Common {
        &self.common
    }

    fn common_mut(&mut self) -> &mut Common {
        &mut self.common
    }

    fn check(&self, capabilities: Capabilities) -> Result<()> {
        if self.max_deliveries.is_some() && !capabilities.delivery_count() {
            warn!(
                consumer = %self.common.name,
                system = self.common.names.system,
                "max_deliveries is set, but this source counts no deliveries: a message that \
                 kills its consumer comes back until the retry budget or handler_timeout stops it"
            );
        }
        Ok(())
    }

    fn bind(&mut self) {
        let binding = ConsumerBinding {
            consumer: self.common.name.clone(),
            handler_timeout: self.handler_timeout,
        };
        self.store = self.store.bind(&binding);
    }

    fn strict(&self) -> bool {
        self.order == Order::Strict
    }

    /// A message without a usable ID goes to shard 0: it is dead-lettered before any
    /// transaction.
    fn shard_of(&self, message: &Message) -> usize {
        match &message.id {
            Ok(id) => self.store.shard_of(id, message),
            Err(_) => 0,
        }
    }

    fn shard_count(&self) -> usize {
        self.store.count()
    }

    fn process<A: Ack>(
        &self,
        chunk: Vec<Delivery<A>>,
        stop: &Stop,
    ) -> impl Future<Output = Result<Processed<A>>> {
        self.apply_chunk(chunk, stop)
    }
}

impl<S, St, H> Consumer<S, Inbox<St, PerMessage<H>>>
where
    S: MessageSource,
    St: InboxStore,
    H: Handler<St::Tx>,
{
    /// A consumer named `name` running `handler` once per new message: the inbox scopes IDs per
    /// name, so two consumers with different names each apply every message once, and instances
    /// of one scaled consumer share a name.
    ///
    /// `store` is one [`InboxStore`], or several in a [`Sharded`], each message in the shard its
    /// routing function picks.
    pub fn new(
        name: impl Into<String>,
        source: S,
        store: impl Into<Sharded<St>>,
        handler: H,
    ) -> Self {
        Consumer::batched(name, source, store, PerMessage(handler))
    }
}

impl<S, St, H> Consumer<S, Inbox<St, H>>
where
    S: MessageSource,
    St: InboxStore,
    H: BatchHandler<St::Tx>,
{
    /// A consumer named `name` handing all new messages of each transaction to `handler` at
    /// once (see [`BatchHandler`]), for set-based writes. Otherwise as [`Consumer::new`].
    pub fn batched(
        name: impl Into<String>,
        source: S,
        store: impl Into<Sharded<St>>,
        handler: H,
    ) -> Self {
        Consumer::with_step(
            source,
            Inbox {
                common: Common::new(name.into()),
                store: store.into(),
                handler,
                max_deliveries: None,
                handler_timeout: None,
                order: Order::default(),
            },
        )
    }

    /// Dead-letter a message the broker reports having delivered more than `n` times, before
    /// running its handler: it stops a message that kills the process (and so is never acked or
    /// dead-lettered by the retry path) from looping forever. Only brokers that count
    /// deliveries report one.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.step.max_deliveries = Some(n);
        self
    }

    /// Fails a handler call (per message, or per batch for a [`BatchHandler`]) that has not
    /// returned after `timeout`, as a transient failure: its transaction rolls back, releasing
    /// its row locks, and the message is retried and dead-lettered like any failure. Without it
    /// (the default) a handler stuck on a call that never returns holds its transaction, its
    /// locks and the broker's ownership of its messages for ever. Set it above the slowest
    /// legitimate batch. The store is told it ([`InboxStore::bind`]), so a statement the
    /// handler left running (waiting on a lock) ends too and the rollback does not wait for it.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.step.handler_timeout = Some(timeout);
        self
    }

    /// What a failing message does to the messages after it in its lane
    /// ([`Metadata::lane`](crate::Metadata::lane): a Kafka partition, an SQS FIFO message group;
    /// a source without lanes is one lane). By default ([`Order::FailuresLast`]) they overtake
    /// it and the lane keeps moving.
    ///
    /// [`Order::Strict`]: each lane is applied exactly in the order received. When a message
    /// fails, the messages before it in its chunk are committed and acked, it is retried alone
    /// with the [`RetryPolicy`] backoff until it is applied or dead-lettered (a dead letter
    /// unblocks the lane, the message is left out at its place), and only then are the messages
    /// after it applied. For a [`BatchHandler`] that does not say which message failed, the
    /// failing batch is bisected, lower half first, to the first failing message. The cost:
    /// while a message fails, its lane applies nothing — a poison message stalls its key for
    /// its whole retry schedule (`max_attempts` tries and their backoff) — and the lane's later
    /// messages stay received and unacked meanwhile (other lanes go on). Shutdown while a lane
    /// is blocked hands the failed message back and everything after it, in order (Kafka: a
    /// seek back to the failed offset). On a source without lanes strict order needs one
    /// chunk at a time: `parallel_lanes` above 1 is refused at start. One exception: with a
    /// redelivery schedule on an SQS FIFO queue, the delayed copy joins the back of its message
    /// group, so the messages after it overtake it (see `inbox-sqs`, "Ack semantics").
    pub fn order(mut self, order: Order) -> Self {
        self.step.order = order;
        self
    }
}

impl<S, L, H> Consumer<S, Effects<L, H>>
where
    S: MessageSource,
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    /// A consumer named `name` running an [`EffectHandler`] (a call out of the process: a
    /// payment API, an email provider) so that each message's call is made once, as far as the
    /// provider allows, with its state in a [`LeaseStore`]: see the
    /// [`effect`](crate::effect) module for the algorithm. The name is part of every
    /// idempotency key, so instances of one scaled consumer share it and different consumers
    /// do not.
    ///
    /// The messages of a chunk are called one after the other, each under its own lease; with
    /// [`Consumer::parallel_lanes`] the lanes call side by side. Shutdown lets the calls in
    /// flight finish for up to [`Consumer::shutdown_timeout`]; a call still running then is
    /// dropped as a crash would drop it, its lease left to run out, and the next attempt asks
    /// the handler whether it landed.
    pub fn effects(name: impl Into<String>, source: S, leases: L, handler: H) -> Self {
        Consumer::with_step(
            source,
            Effects::new(Common::new(name.into()), leases, handler),
        )
    }

    /// How long an attempt owns its message (default [`DEFAULT_LEASE`](crate::effect::DEFAULT_LEASE)):
    /// longer than the slowest call you expect, since a call is dropped when its lease ends,
    /// and short enough that a crashed attempt's message is taken over soon.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.step.lease = lease;
        self
    }
}

impl<S, W> Consumer<S, W>
where
    S: MessageSource,
    W: Work,
{
    fn with_step(source: S, step: W) -> Self {
        Self {
            source,
            step,
            batch_size: 1,
            lanes: 1,
            inbox_retention: None,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }

    /// Up to `n` messages per receive, claimed and committed in one transaction and acked
    /// together (default 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Applies up to `n` chunks side by side, each in a transaction of its own (default 1: one
    /// chunk at a time).
    ///
    /// On a source with lanes ([`Capabilities::lanes`](crate::Capabilities::lanes): Kafka
    /// partitions, SQS FIFO message groups) a chunk holds messages of one lane
    /// ([`Metadata::lane`](crate::Metadata::lane)), applied in the order received, and a lane has
    /// one chunk out at a time, so each lane keeps its order. When everything received belongs
    /// to busy lanes (librdkafka hands out one partition's records in runs), a free lane reads
    /// ahead, holding up to 8,192 messages per lane (65,536 in all), until a message it can
    /// take arrives.
    ///
    /// On a source without lanes (a RabbitMQ queue, a Redis stream, an SQS standard queue) every
    /// free slot takes the next chunk: `n` is how many transactions run at once, and messages
    /// are applied in no order across them.
    ///
    /// Each running chunk holds one store transaction (one pooled connection: give the pool at
    /// least `n`). Chunks whose handlers write the same rows wait on each other's locks like any
    /// concurrent transactions, and a deadlock fails a handler, which is then retried after the
    /// rest of its chunk: key messages so that what shares rows shares a lane (Kafka: one
    /// account, one partition).
    pub fn parallel_lanes(mut self, n: usize) -> Self {
        self.lanes = n;
        self
    }

    /// How failing handlers are retried. For [`Consumer::effects`] the attempts are counted
    /// in leases, in the store, so a message that kills the process is dead-lettered after
    /// `max_attempts` leases too.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.step.common_mut().retry = policy;
        self
    }

    /// The first wait after a broker or store error (doubling up to 30 s while errors repeat).
    pub fn error_backoff(mut self, wait: Duration) -> Self {
        self.step.common_mut().error_backoff = wait;
        self
    }

    /// How long the batches in flight may take to finish once shutdown is asked for (default
    /// [`DEFAULT_SHUTDOWN_TIMEOUT`]). When it runs out, their transactions are rolled back and
    /// their messages handed back to the broker (a nack; where the broker has none, the
    /// redelivery that follows an unacked message), and `run` returns. Keep it below your
    /// orchestrator's grace period (Kubernetes: `terminationGracePeriodSeconds`, 30 s by
    /// default), so the process exits before it is SIGKILLed.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Calls `hook` at each [`Stage`](crate::Stage) of each message. For
    /// [`Consumer::effects`]: `Claimed` once the lease is committed, `Applied` once the call
    /// returned `Ok`, `Committed` once the done mark is, `Acked` after the ack.
    pub fn on_stage(mut self, hook: StageHook) -> Self {
        self.step.common_mut().hook = Some(hook);
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
        Arc::clone(&self.step.common().stats)
    }

    /// Whether the consumer is live and ready, readable while it runs: for liveness and
    /// readiness probes.
    pub fn health(&self) -> Health {
        self.step.common().health.clone()
    }

    /// Runs until SIGINT (Ctrl-C) or SIGTERM (what Kubernetes, ECS and systemd send to stop a
    /// process), then shuts down gracefully (see [`Consumer::shutdown_timeout`]); a second
    /// signal cuts the wait for the batches in flight short. Returns the counters.
    pub async fn run(self) -> Result<StatsSnapshot> {
        self.run_loop(stop::signals(), false).await
    }

    /// Runs until `shutdown` completes, then shuts down as [`Consumer::run`] does: for
    /// applications that own their signal handling, or stop consumers on their own terms (pass
    /// a `CancellationToken::cancelled()`, a `oneshot` receiver, `ctrl_c()`...).
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<StatsSnapshot> {
        self.run_loop(stream::once(shutdown), false).await
    }

    /// Runs until a receive comes back empty, then returns: for draining a queue in tools and
    /// tests.
    pub async fn run_until_idle(self) -> Result<StatsSnapshot> {
        self.run_loop(stream::pending(), true).await
    }

    /// The pipeline: up to `lanes` chunks of `batch_size` (one per lane, so each lane keeps its
    /// order; any chunks of a source without lanes) are applied side by side, receiving goes on
    /// while a lane is free, and a chunk's acks go out while the next chunks are applied. At
    /// most `batch_size × lanes` messages are held unapplied (plus the read-ahead of a free
    /// lane, see [`Consumer::parallel_lanes`]), so a consumer that dies takes few deliveries down
    /// with it (or onto a broker's delivery count). Nothing is acked before the commit of its
    /// claim.
    async fn run_loop(
        mut self,
        shutdown: impl Stream<Item = ()> + Send,
        until_idle: bool,
    ) -> Result<StatsSnapshot> {
        // Registered now, with the recorder the application installed before starting.
        let names = &mut self.step.common_mut().names;
        names.system = self.source.system();
        names.group = self.source.consumer_group().map(str::to_owned);
        self.check()?;
        self.step.bind();
        let common = self.step.common_mut();
        common.metrics = ConsumerMetrics::register(&common.name);
        common.health.attach(&common.name);
        telemetry::windows(
            &common.name,
            self.inbox_retention,
            self.source.redelivery_window(),
        );
        let health = common.health.clone();
        health.set(ConsumerState::Running);
        let result = self.pipeline(shutdown, until_idle).await;
        health.set(ConsumerState::Stopped);
        result
    }

    fn check(&self) -> Result<()> {
        let common = self.step.common();
        check_name(&common.name)?;
        for (setting, value) in [
            ("the batch size", self.batch_size),
            ("parallel_lanes", self.lanes),
            ("max_attempts", common.retry.max_attempts as usize),
        ] {
            if value == 0 {
                return Err(Error::Config(format!("{setting} is 0; use at least 1")));
            }
        }
        let capabilities = self.source.capabilities();
        if !common.retry.redeliveries.is_empty() && !capabilities.delayed_redelivery() {
            return Err(Error::Config(format!(
                "a redelivery schedule is set (RetryPolicy::redeliver_after), but the {} source \
                 cannot delay a redelivery: remove the schedule, or use an adapter that can \
                 (see Capabilities::delayed_redelivery)",
                self.source.system()
            )));
        }
        self.step.check(capabilities)?;
        if self.step.strict() && self.lanes > 1 && !capabilities.lanes() {
            return Err(Error::Config(format!(
                "strict order on a source without lanes allows one chunk at a time, but \
                 parallel_lanes is {}: use parallel_lanes(1), or Order::FailuresLast",
                self.lanes
            )));
        }
        if self.lanes > 1 && !capabilities.lanes() {
            info!(
                consumer = %common.name,
                system = self.source.system(),
                lanes = self.lanes,
                "this source has no ordering lanes: up to {} chunks are applied side by side, \
                 in no order across them",
                self.lanes
            );
        }
        if let Some(retention) = self.inbox_retention {
            let window = self.source.redelivery_window();
            if let Some(gap) = retention_shortfall(retention, window) {
                warn!(
                    consumer = %common.name,
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
