//! What every consumer shares, whichever step it runs (the inbox's claim and commit, or an
//! effect's lease and call): its name, retry policy, counters, stage hook and health, and the
//! ways a message is settled: acked, handed back, or dead-lettered.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use tracing::{debug, info, warn, Instrument};

use super::RetryPolicy;
use crate::error::backoff;
use crate::stats::Counter;
use crate::telemetry::{self, dead_letter_span, timed, ConsumerMetrics, SpanNames};
use crate::{
    Ack, Delivery, Error, Failure, HandlerError, Health, MessageId, Recovery, Result, SourceError,
    Stage, StageHook, Stats, StoreError, Transaction,
};

/// The longest wait between tries after a broker or store error.
pub(crate) const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub(crate) struct Common {
    pub(crate) name: String,
    pub(crate) retry: RetryPolicy,
    pub(crate) error_backoff: Duration,
    pub(crate) hook: Option<StageHook>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) health: Health,
    /// The consumer's, the group's and the broker's names in its spans; the group and the
    /// system are the source's, set when the consumer starts.
    pub(crate) names: SpanNames,
    /// Histogram and gauge handles; registered when the consumer starts.
    pub(crate) metrics: ConsumerMetrics,
    /// The store shards in an outage, and how many chunks of each hold on
    /// [`Recovery::Reconnect`] until it is back: the pipeline gives such a shard one lane and
    /// keeps the rest for the others.
    outages: Mutex<BTreeMap<usize, usize>>,
    /// Told when a chunk starts or stops holding in an outage: the pipeline looks again.
    pub(crate) outage_changed: tokio::sync::Notify,
}

impl Common {
    pub(crate) fn new(name: String) -> Self {
        Self {
            names: SpanNames {
                consumer: name.clone(),
                group: None,
                system: "unknown",
            },
            name,
            retry: RetryPolicy::default(),
            error_backoff: Duration::from_millis(500),
            hook: None,
            stats: Arc::new(Stats::default()),
            health: Health::default(),
            metrics: ConsumerMetrics::default(),
            outages: Mutex::default(),
            outage_changed: tokio::sync::Notify::new(),
        }
    }

    /// A chunk of store shard `shard` holds in an outage until the guard is dropped (the
    /// shard is back, or the chunk was handed back or cut short).
    pub(crate) fn holding(&self, shard: usize) -> Holding<'_> {
        *self.outages().entry(shard).or_default() += 1;
        self.outage_changed.notify_one();
        Holding {
            common: self,
            shard,
        }
    }

    /// The store shards in an outage now, and how many chunks of each hold.
    pub(crate) fn outages(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        self.outages.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn count(&self, counter: Counter, n: usize) {
        self.stats.add(&self.name, counter, n as u64);
    }

    pub(crate) fn stage(&self, stage: Stage, id: &MessageId) {
        if let Some(hook) = &self.hook {
            hook.call(stage, id);
        }
    }

    pub(crate) fn skipped(&self, id: &MessageId) {
        self.count(Counter::SkippedDuplicate, 1);
        debug!(consumer = %self.name, message_id = %id.escaped(), outcome = "skipped_duplicate", "skipped a duplicate");
    }

    /// Acks settled messages, in one call where the broker allows. An ack that fails is logged
    /// and counted, not fatal: the redelivered copy finds its ID and is skipped.
    pub(crate) async fn ack_all<A: Ack>(&self, acks: Vec<(MessageId, A)>) {
        if acks.is_empty() {
            return;
        }
        let n = acks.len();
        let (ids, acks): (Vec<_>, Vec<_>) = acks.into_iter().unzip();
        let span = telemetry::settle_span(&self.names, "ack", n);
        let acked = timed(&self.metrics.ack, A::ack_all(acks).instrument(span.clone())).await;
        match acked {
            Ok(()) => {
                for id in &ids {
                    self.stage(Stage::Acked, id);
                }
            }
            Err(e) => {
                telemetry::record_error(&span, recovery_type(e.recovery()));
                self.count(Counter::AckFailure, n);
                warn!(consumer = %self.name, messages = n, error = %e, "ack failed after commit; redelivered copies will be skipped as duplicates");
            }
        }
    }

    /// Gives messages back to the broker unapplied, for redelivery after the error backoff.
    pub(crate) async fn hand_back<A: Ack>(&self, acks: Vec<A>) {
        if acks.is_empty() {
            return;
        }
        info!(consumer = %self.name, messages = acks.len(), "handing messages back to the broker");
        let span = telemetry::settle_span(&self.names, "nack", acks.len());
        async {
            for ack in acks {
                self.nack(ack, self.error_backoff).await;
            }
        }
        .instrument(span)
        .await;
    }

    /// Gives one message back for redelivery after `wait`.
    pub(crate) async fn nack<A: Ack>(&self, ack: A, wait: Duration) {
        if let Err(e) = ack.nack(wait).await {
            warn!(consumer = %self.name, error = %e, "nack failed; the broker will redeliver on its own");
        }
    }

    /// A message whose in-process attempts are used up on a transient failure: handed back to
    /// the broker for the next delay of the redelivery schedule, or dead-lettered once the
    /// schedule is used up (or empty). `true` when it is parked for good, `false` when it comes
    /// back from the broker. The one place this decision is made, for every source.
    pub(crate) async fn redeliver_or_dead_letter<A: Ack>(
        &self,
        id: &MessageId,
        delivery: Delivery<A>,
        reason: String,
    ) -> Result<bool> {
        let n = delivery.message.meta.redeliveries;
        let Some(delay) = self.retry.redelivery_delay(n) else {
            let reason = if n > 0 {
                format!("{reason} (after {n} delayed redeliveries)")
            } else {
                reason
            };
            return self.dead_letter(Some(id), delivery, reason).await;
        };
        let span = telemetry::settle_span(&self.names, "redeliver", 1);
        let Delivery { message, ack } = delivery;
        match ack
            .redeliver(&message, delay, n)
            .instrument(span.clone())
            .await
        {
            Ok(()) => {
                self.count(Counter::Redelivered, 1);
                warn!(consumer = %self.name, message_id = %id.escaped(), redelivery = n + 1, of = self.retry.redeliveries.len(), ?delay, %reason, "handed back to the broker to come back after a delay");
                Ok(false)
            }
            Err(e) => {
                telemetry::record_error(&span, recovery_type(e.recovery()));
                self.count(Counter::Error, 1);
                warn!(consumer = %self.name, message_id = %id.escaped(), error = %e, "delayed redelivery failed; the message comes back from the broker");
                if e.recovery() == Recovery::Fatal {
                    return Err(Error::Source(e));
                }
                Ok(false)
            }
        }
    }

    /// Rolls `tx` back; a rollback that fails is logged, as the store discards the
    /// transaction anyway.
    pub(crate) async fn rollback<T: Transaction>(&self, tx: T) {
        if let Err(e) = tx.rollback().await {
            warn!(consumer = %self.name, error = %e, "rollback failed; the store discards the transaction");
        }
    }

    /// One more failed try while the store is unreachable ([`Recovery::Reconnect`]): counted,
    /// health set failing, and the wait before the next try, doubling with `outages`.
    pub(crate) fn outage(&self, outages: &mut u32) -> Duration {
        self.count(Counter::Error, 1);
        self.health.failing();
        *outages += 1;
        backoff(self.error_backoff, MAX_ERROR_BACKOFF, *outages)
    }

    /// Rolls back a transaction that cannot commit and passes `failure` on.
    pub(crate) async fn abandon<T: Transaction>(&self, tx: T, failure: TxFailure) -> TxFailure {
        self.rollback(tx).await;
        failure
    }

    /// How long to wait before receiving again after `e`, or the error that stops the consumer.
    pub(crate) fn source_failed(&self, e: SourceError, failures: u32) -> Result<Duration> {
        self.count(Counter::Error, 1);
        if e.recovery() == Recovery::Fatal {
            return Err(Error::Source(e));
        }
        let wait = backoff(self.error_backoff, MAX_ERROR_BACKOFF, failures);
        warn!(consumer = %self.name, error = %e, ?wait, "receive failed; retrying");
        Ok(wait)
    }

    /// Parks the message on the source's dead-letter destination and acks it; `true` when it
    /// was parked, `false` when the dead letter failed and the message comes back from the
    /// broker.
    pub(crate) async fn dead_letter<A: Ack>(
        &self,
        id: Option<&MessageId>,
        delivery: Delivery<A>,
        reason: String,
    ) -> Result<bool> {
        let span = dead_letter_span(&self.names, id, &delivery.message);
        let parked = self
            .park(id, delivery, reason)
            .instrument(span.clone())
            .await;
        if !matches!(parked, Ok(true)) {
            telemetry::record_error(&span, "dead_letter_failed");
        }
        parked
    }

    /// [`Common::dead_letter`], inside its span.
    async fn park<A: Ack>(
        &self,
        id: Option<&MessageId>,
        delivery: Delivery<A>,
        reason: String,
    ) -> Result<bool> {
        let shown = id.map_or_else(|| "(no ID)".to_owned(), |id| id.escaped().to_string());
        let Delivery { message, ack } = delivery;
        match ack.dead_letter(&message, &reason).await {
            Ok(()) => {
                self.count(Counter::DeadLettered, 1);
                warn!(consumer = %self.name, message_id = %shown, position = %message.meta.position.escape_debug(), outcome = "dead_lettered", %reason, "dead-lettered {shown}");
                Ok(true)
            }
            Err(e) => {
                self.count(Counter::Error, 1);
                // The handle left the delivery unacked: it comes back and is tried again.
                tracing::error!(consumer = %self.name, message_id = %shown, error = %e, %reason, "dead-letter failed; the message is not acked and comes back from the broker");
                if e.recovery() == Recovery::Fatal {
                    return Err(Error::Source(e));
                }
                Ok(false)
            }
        }
    }
}

/// Why a transaction (the inbox's claim and handler, an effect's done mark) did not commit.
pub(crate) enum TxFailure {
    /// The handler failed, for the message at this index when known; the transaction was
    /// rolled back.
    Handler(Option<usize>, HandlerError),
    /// The store failed (at begin, claim, done mark or commit).
    Store(StoreError),
}

impl TxFailure {
    /// `error.type` of the transaction's span.
    pub(crate) fn error_type(&self) -> &'static str {
        match self {
            Self::Handler(_, e) if e.failure() == Failure::Permanent => "handler_permanent",
            Self::Handler(..) => "handler",
            Self::Store(e) => recovery_type(e.recovery()),
        }
    }
}

/// One chunk holding in its shard's outage ([`Common::holding`]).
pub(crate) struct Holding<'a> {
    common: &'a Common,
    shard: usize,
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let mut outages = self.common.outages();
        if let Some(n) = outages.get_mut(&self.shard) {
            *n -= 1;
            if *n == 0 {
                outages.remove(&self.shard);
            }
        }
        drop(outages);
        self.common.outage_changed.notify_one();
    }
}

/// Runs handler code (`what` in the error), a panic counting as a transient failure, and past
/// `deadline` dropped with the error `overrun` makes.
pub(crate) async fn guarded<T>(
    what: &str,
    deadline: Option<tokio::time::Instant>,
    work: impl Future<Output = Result<T, HandlerError>>,
    overrun: impl FnOnce() -> HandlerError,
) -> Result<T, HandlerError> {
    let work = AssertUnwindSafe(work).catch_unwind();
    let caught = match deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline, work).await {
            Ok(caught) => caught,
            Err(_) => return Err(overrun()),
        },
        None => work.await,
    };
    caught.unwrap_or_else(|panic| {
        let text = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-text panic payload".to_owned());
        Err(HandlerError::transient(format!("{what} panicked: {text}")))
    })
}

/// The dead-letter reason of a message whose handler refused it for good, or failed `attempts`
/// times.
pub(crate) fn failure_reason(error: &HandlerError, attempts: u32) -> String {
    if error.failure() == Failure::Permanent {
        format!("handler refused the message: {error}")
    } else {
        format!("handler failed {attempts} time(s), last error: {error}")
    }
}

/// `error.type` of a broker or store failure: what the consumer does next.
pub(crate) fn recovery_type(recovery: Recovery) -> &'static str {
    match recovery {
        Recovery::Retry => "retry",
        Recovery::Reconnect => "reconnect",
        Recovery::Fatal => "fatal",
    }
}
