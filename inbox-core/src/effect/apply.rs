//! The step of [`Consumer::effects`](crate::Consumer::effects), per message: lease, decide,
//! call, mark done, ack, or hand back or dead-letter.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tracing::field::{display, Empty};
use tracing::{debug, info, info_span, warn, Instrument, Span};

use super::{
    is_not_applied, Acquired, Attempt, Effect, EffectHandler, Landed, LeaseStore, OnUnknown,
    Release, Settled, DEFAULT_LEASE,
};
use crate::consumer::common::{failure_reason, guarded, Common, TxFailure};
use crate::consumer::stop::Stop;
use crate::consumer::{Processed, Step};
use crate::stats::Counter;
use crate::telemetry::timed;
use crate::{
    Ack, Capabilities, Delivery, Error, Failure, HandlerError, Message, MessageId, Recent,
    Recovery, Result, Stage, TraceParent, Transaction, REPLAYED,
};

/// Added to the rest of a live lease before a busy copy comes back, so it does not come back
/// a moment too early and find the lease still live.
const BUSY_MARGIN: Duration = Duration::from_millis(50);

/// The effect step: each message leased, called and marked done, then acked. Made by
/// [`Consumer::effects`](crate::Consumer::effects).
#[derive(Debug)]
pub struct Effects<L, H> {
    pub(super) common: Common,
    pub(super) leases: L,
    handler: H,
    pub(crate) lease: Duration,
    /// When each recently handed-back message may be tried again.
    pub(super) not_before: Mutex<Recent<Instant>>,
}

impl<L, H> Step for Effects<L, H>
where
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    fn common(&self) -> &Common {
        &self.common
    }

    fn common_mut(&mut self) -> &mut Common {
        &mut self.common
    }

    fn check(&self, _: Capabilities) -> Result<()> {
        if self.lease.is_zero() {
            return Err(Error::Config(
                "the lease is 0; use longer than the slowest call".into(),
            ));
        }
        if !self.common.retry.redeliveries.is_empty() {
            // Effects count their attempts in leases, in the store; a schedule of delayed
            // redeliveries is not wired into that count.
            return Err(Error::Config(
                "Consumer::effects does not follow a redelivery schedule \
                 (RetryPolicy::redeliver_after); remove it and raise max_attempts instead"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Leases, calls and settles the messages of a chunk one after the other (each is a call
    /// out, and its lease is its own). On shutdown the rest of the chunk is handed back; when
    /// the work in flight is cut short, the call is dropped as a crash would drop it.
    async fn process<A: Ack>(&self, chunk: Vec<Delivery<A>>, stop: &Stop) -> Result<Processed<A>> {
        for delivery in chunk {
            if stop.stopping() {
                self.common.hand_back(vec![delivery.ack]).await;
                continue;
            }
            tokio::select! {
                biased;
                done = self.process_one(delivery, stop) => done?,
                () = stop.aborted() => {
                    warn!(consumer = %self.common.name, "shutdown cut a call short: its lease runs out, and the next attempt asks whether it landed");
                }
            }
        }
        Ok(Processed {
            acks: Vec::new(),
            blocked: false,
        })
    }
}

impl<L, H> Effects<L, H>
where
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    pub(crate) fn new(common: Common, leases: L, handler: H) -> Self {
        Self {
            common,
            leases,
            handler,
            lease: DEFAULT_LEASE,
            not_before: Mutex::new(Recent::new(1024)),
        }
    }

    async fn process_one<A: Ack>(&self, delivery: Delivery<A>, stop: &Stop) -> Result<()> {
        self.common.count(Counter::Received, 1);
        let id = match &delivery.message.id {
            Ok(id) => id.clone(),
            Err(e) => {
                let reason = e.to_string();
                return self.park(None, delivery, reason).await.map(drop);
            }
        };
        if let Err(e) = self.leases.check_id(&id) {
            let reason = format!("message ID {id:?} refused by the lease store: {e}");
            return self.park(Some(&id), delivery, reason).await.map(drop);
        }
        let message = &delivery.message;
        let span = info_span!(
            "inbox.effect",
            consumer = %self.common.name,
            message_id = %id.escaped(),
            position = %message.meta.position.escape_debug(),
            "messaging.system" = self.common.names.system,
            traceparent = Empty,
            token = Empty,
            outcome = Empty,
        );
        // Joins the logs to the producer's trace.
        if let Some(parent) = TraceParent::from_message(message) {
            span.record("traceparent", display(parent));
        }
        self.lease_and_apply(id, delivery, stop)
            .instrument(span)
            .await
    }

    async fn lease_and_apply<A: Ack>(
        &self,
        id: MessageId,
        delivery: Delivery<A>,
        stop: &Stop,
    ) -> Result<()> {
        // Before each try: the rest of a hand-back delay, or the backoff of a store outage.
        let mut wait = self.too_early(&id);
        if let Some(wait) = wait {
            debug!(?wait, "came back before its hand-back delay (the broker does not delay a nack); waiting here");
        }
        let mut outages = 0;
        let (acquired, started) = loop {
            if let Some(wait) = wait {
                if stop.pause(wait).await {
                    outcome("handed_back");
                    self.hand_back(delivery.ack).await;
                    return Ok(());
                }
            }
            let started = Instant::now();
            let acquire = self.leases.acquire(&self.common.name, &id, self.lease);
            let acquired = timed(&self.common.metrics.claim, acquire).await;
            match acquired {
                Ok(acquired) => {
                    if outages > 0 {
                        self.common.health.recovered();
                    }
                    break (acquired, started);
                }
                Err(e) if e.recovery() == Recovery::Fatal => {
                    self.common.count(Counter::Error, 1);
                    return Err(Error::Store(e));
                }
                Err(e) => {
                    let backoff = self.common.outage(&mut outages);
                    warn!(error = %e, wait = ?backoff, "lease store failed; holding the message and trying again");
                    wait = Some(backoff);
                }
            }
        };
        match acquired {
            Acquired::Done => {
                self.common.count(Counter::SkippedDuplicate, 1);
                outcome("skipped_duplicate");
                info!(
                    outcome = "skipped_duplicate",
                    "skipped duplicate {}: already done",
                    id.escaped()
                );
                self.ack(&id, delivery.ack).await;
                Ok(())
            }
            Acquired::Busy { retry_after } => {
                self.common.count(Counter::Busy, 1);
                outcome("busy");
                let wait = retry_after + BUSY_MARGIN;
                info!(
                    outcome = "busy",
                    ?wait,
                    "{} is leased by another attempt; handed back until its lease ends",
                    id.escaped()
                );
                self.hand_back_for(&id, delivery.ack, wait).await;
                Ok(())
            }
            Acquired::Leased(lease) => {
                Span::current().record("token", lease.token);
                let effect = Effect::new(&self.common.name, id, lease, started + self.lease);
                if effect.after_dead_letter() && delivery.message.header(REPLAYED).is_none() {
                    return self.skip_dead_lettered(effect, delivery.ack).await;
                }
                self.common.stage(Stage::Claimed, effect.id());
                self.apply(effect, delivery, stop).await
            }
        }
    }

    /// A copy of a dead-lettered message that is not its replay: acked as a duplicate of the
    /// dead letter, and the lease given back as dead-lettered, so the replay still finds a full
    /// budget (and the attempt before it, as the dead-lettered lease left it).
    async fn skip_dead_lettered<A: Ack>(&self, effect: Effect, ack: A) -> Result<()> {
        let release = Release {
            not_applied: effect.attempt() == Attempt::AfterNotApplied,
            dead_lettered: true,
        };
        self.release(&effect, release).await;
        self.common.count(Counter::SkippedDuplicate, 1);
        outcome("skipped_duplicate");
        info!(
            outcome = "skipped_duplicate",
            "skipped a copy of {}: dead-lettered before, and this copy is not its replay",
            effect.id().escaped()
        );
        self.ack(effect.id(), ack).await;
        Ok(())
    }

    /// Decides between calling, confirming and skipping; calls; then marks done.
    async fn apply<A: Ack>(
        &self,
        effect: Effect,
        delivery: Delivery<A>,
        stop: &Stop,
    ) -> Result<()> {
        let message = &delivery.message;
        let decided = match effect.attempt() {
            Attempt::First | Attempt::AfterNotApplied => None,
            Attempt::AfterExpiry => {
                let span = info_span!("inbox.effect.landed", token = effect.token());
                let lookup = self.handler.landed(&effect, message).instrument(span);
                let landed = self.bounded(&effect, lookup).await;
                match landed {
                    Ok(Landed::Yes) => Some(Settled::Landed),
                    Ok(Landed::No) => None,
                    Ok(Landed::Unknown) => match self.handler.on_unknown() {
                        OnUnknown::Retry => None,
                        OnUnknown::Skip => Some(Settled::Skipped),
                    },
                    Ok(Landed::Pending) => {
                        let e =
                            HandlerError::transient("the provider still works on an earlier call");
                        return self.failed(effect, delivery, e, false).await;
                    }
                    Err(e) => return self.failed(effect, delivery, e, false).await,
                }
            }
        };
        let settled = match decided {
            Some(settled) => settled,
            None if effect.attempts() > self.common.retry.max_attempts => {
                // Earlier leases ended without an error the consumer saw: crashes or hangs.
                let reason = format!(
                    "leased {} times, more than the {} attempts allowed (earlier attempts crashed or hung; \
                     one of their calls may have landed under key {})",
                    effect.attempts(),
                    self.common.retry.max_attempts,
                    effect.idempotency_key().escape_debug()
                );
                let not_applied = effect.attempt() == Attempt::AfterNotApplied;
                return self
                    .dead_letter_leased(&effect, delivery, reason, not_applied)
                    .await;
            }
            None => {
                let span = info_span!(
                    "inbox.effect.call",
                    token = effect.token(),
                    attempt = effect.attempts(),
                );
                let call = self.handler.call(&effect, message).instrument(span);
                let called = self.bounded(&effect, call);
                match timed(&self.common.metrics.handler, called).await {
                    Ok(()) => {
                        self.common.stage(Stage::Applied, effect.id());
                        Settled::Called
                    }
                    Err(e) => return self.failed(effect, delivery, e, true).await,
                }
            }
        };
        self.finish(effect, settled, delivery, stop).await
    }

    /// Runs a handler future until the lease ends, a panic counting as a transient failure.
    async fn bounded<T>(
        &self,
        effect: &Effect,
        work: impl Future<Output = Result<T, HandlerError>>,
    ) -> Result<T, HandlerError> {
        guarded("handler", Some(effect.ends()), work, || {
            HandlerError::transient(format!(
                "still running when its lease of {:?} ran out; dropped, outcome unknown",
                self.lease
            ))
        })
        .await
    }

    /// A call (`called`) or a status lookup that failed: retried through the broker, or
    /// dead-lettered.
    async fn failed<A: Ack>(
        &self,
        effect: Effect,
        delivery: Delivery<A>,
        error: HandlerError,
        called: bool,
    ) -> Result<()> {
        let permanent = error.failure() == Failure::Permanent;
        // A call failing for good is the provider refusing it, so it did not apply. A lookup
        // that fails says nothing about the earlier call.
        let not_applied = called && (permanent || is_not_applied(&error));
        if permanent || effect.attempts() >= self.common.retry.max_attempts {
            let reason = failure_reason(&error, effect.attempts());
            return self
                .dead_letter_leased(&effect, delivery, reason, not_applied)
                .await;
        }
        self.common.count(Counter::Retried, 1);
        outcome("retried");
        let wait = self.common.retry.wait(effect.attempts());
        warn!(attempt = effect.attempts(), error = %error, not_applied, ?wait, "call failed; handed back for a retry");
        self.release(
            &effect,
            Release {
                not_applied,
                dead_lettered: false,
            },
        )
        .await;
        self.hand_back_for(effect.id(), delivery.ack, wait).await;
        Ok(())
    }

    /// The done transaction, tried again while it fails, then the ack.
    async fn finish<A: Ack>(
        &self,
        effect: Effect,
        settled: Settled,
        delivery: Delivery<A>,
        stop: &Stop,
    ) -> Result<()> {
        let (mut tries, mut outages) = (0, 0);
        loop {
            let marked = self.mark_done(&effect, settled, &delivery.message);
            let wait = match timed(&self.common.metrics.commit, marked).await {
                Ok(true) => {
                    if outages > 0 {
                        self.common.health.recovered();
                    }
                    self.common.count(Counter::Commit, 1);
                    self.common.health.batch_done();
                    break;
                }
                Ok(false) => {
                    self.common.count(Counter::Fenced, 1);
                    outcome("fenced");
                    warn!(token = effect.token(), outcome = "fenced", "not marked done: a newer lease took over {} while this attempt ran; handed back for its holder to finish", effect.id().escaped());
                    self.hand_back(delivery.ack).await;
                    return Ok(());
                }
                Err(TxFailure::Store(e)) if e.recovery() == Recovery::Fatal => {
                    self.common.count(Counter::Error, 1);
                    return Err(Error::Store(e));
                }
                Err(TxFailure::Store(e)) if e.recovery() == Recovery::Reconnect => {
                    let wait = self.common.outage(&mut outages);
                    warn!(error = %e, ?wait, "lease store unreachable; holding the message until it is back");
                    wait
                }
                Err(failure) => {
                    let error = match failure {
                        TxFailure::Handler(_, e) => e,
                        TxFailure::Store(e) => HandlerError::transient(e),
                    };
                    tries += 1;
                    if error.failure() == Failure::Permanent
                        || tries >= self.common.retry.max_attempts
                    {
                        let reason = format!(
                            "the done mark failed {tries} time(s) after the effect was {}: {error}",
                            settled.as_str()
                        );
                        return self
                            .dead_letter_leased(&effect, delivery, reason, false)
                            .await;
                    }
                    if effect.remaining().is_zero() {
                        // No time is left to mark done under this lease: the next lease settles
                        // the message, asking first whether this attempt's call landed.
                        self.common.count(Counter::Retried, 1);
                        outcome("retried");
                        let wait = self.common.retry.wait(effect.attempts());
                        warn!(error = %error, ?wait, "the done mark did not commit within the lease; handed back for the next lease to settle");
                        self.release(&effect, Release::unknown()).await;
                        self.hand_back_for(effect.id(), delivery.ack, wait).await;
                        return Ok(());
                    }
                    self.common.count(Counter::Retried, 1);
                    warn!(error = %error, tries, "done transaction failed; trying it again");
                    self.common.retry.wait(tries)
                }
            };
            if stop.pause(wait).await {
                outcome("handed_back");
                self.release(&effect, Release::unknown()).await;
                self.hand_back(delivery.ack).await;
                return Ok(());
            }
        }
        self.common.stage(Stage::Committed, effect.id());
        let (counter, outcome) = match settled {
            Settled::Called => (Counter::Applied, "applied"),
            Settled::Landed => (Counter::Confirmed, "confirmed"),
            Settled::Skipped => (Counter::SkippedUnknown, "skipped_unknown"),
        };
        self.common.count(counter, 1);
        self::outcome(outcome);
        if settled == Settled::Skipped {
            warn!(outcome, "{} marked done without a call after an unknown outcome, as OnUnknown::Skip says: its effect may be missing", effect.id().escaped());
        } else {
            info!(
                outcome,
                token = effect.token(),
                "{outcome} {}",
                effect.id().escaped()
            );
        }
        self.ack(effect.id(), delivery.ack).await;
        Ok(())
    }

    /// Marks done and runs the handler's writes in one transaction. `false`: fenced out.
    async fn mark_done(
        &self,
        effect: &Effect,
        settled: Settled,
        message: &Message,
    ) -> Result<bool, TxFailure> {
        let mut tx = self.leases.begin().await.map_err(TxFailure::Store)?;
        let marked = self
            .leases
            .complete(&mut tx, &self.common.name, effect.id(), effect.token())
            .await;
        match marked {
            Ok(true) => {}
            Ok(false) => {
                self.common.rollback(tx).await;
                return Ok(false);
            }
            Err(e) => return Err(self.common.abandon(tx, TxFailure::Store(e)).await),
        }
        // Bounded by the lease: past it, the open transaction would keep the row from the
        // next lease, and the consumer from its next message.
        let record = self.handler.record(&mut tx, effect, settled, message);
        let recorded = guarded("record", Some(effect.ends()), record, || {
            HandlerError::transient(format!(
                "record was still running when the lease of {:?} ran out; dropped",
                self.lease
            ))
        })
        .await;
        if let Err(e) = recorded {
            return Err(self.common.abandon(tx, TxFailure::Handler(None, e)).await);
        }
        tx.commit().await.map_err(TxFailure::Store)?;
        Ok(true)
    }
}

/// Records how the current message's `inbox.effect` span ended.
pub(super) fn outcome(outcome: &'static str) {
    Span::current().record("outcome", outcome);
}
