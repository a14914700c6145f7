//! Applying one chunk of one lane: dead letters, the claim, the handler and the commit, the
//! split of a failed transaction, and retries.

use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use tokio::time::Instant;

use tracing::{debug, info, info_span, warn, Instrument};

use super::common::{failure_reason, guarded, Common, TxFailure};
use super::stop::Stop;
use super::{Order, Processed};
use crate::stats::Counter;
use crate::telemetry::{self, process_span, timed};
use crate::{
    Ack, BatchHandler, BatchItem, Delivery, Error, Failure, HandlerError, InboxStore, MessageId,
    Recovery, RefusedId, Result, Sharded, Stage, Transaction,
};

/// The inbox step: each chunk claimed, applied and committed in one store transaction, then
/// acked. Made by [`Consumer::new`](crate::Consumer::new) and
/// [`Consumer::batched`](crate::Consumer::batched).
#[derive(Debug)]
pub struct Inbox<St, H> {
    pub(super) common: Common,
    /// One store, or several with the shard of each message.
    pub(super) store: Sharded<St>,
    pub(super) handler: H,
    pub(super) max_deliveries: Option<u32>,
    pub(super) handler_timeout: Option<Duration>,
    pub(super) order: Order,
}

enum Outcome {
    Skipped,
    Applied,
    Failed(HandlerError),
    /// Not applied: handed back to the broker (shutdown during a store outage).
    HandedBack,
    /// Not tried: a message before it failed, and [`Order::Strict`] holds the rest of the
    /// chunk until that one is applied or dead-lettered.
    Held,
}

/// A message whose ID the store's claim refused ([`RefusedId`]): dead-lettered with this
/// reason, as no handler's doing.
#[derive(Debug, thiserror::Error)]
#[error("message ID {0:?} refused by the inbox store: {1}")]
struct RefusedByStore(MessageId, String);

/// How far [`Inbox::apply_part`] got.
enum Part<A> {
    /// Everything is settled or handed back, but for these acks, to send.
    Done(Vec<(MessageId, A)>),
    /// Strict order: a failed message was applied or dead-lettered; these came after it, and
    /// are still to apply.
    Then(Vec<Delivery<A>>),
    /// Strict order: a failed message went back to the broker, and what came after it too.
    Blocked,
}

/// A message to apply: its ID and what the handler decoded from it.
struct Work<A, I> {
    /// Its place in the chunk.
    at: usize,
    id: MessageId,
    delivery: Delivery<A>,
    item: I,
}

impl<St, H> Inbox<St, H>
where
    St: InboxStore,
    H: BatchHandler<St::Tx>,
{
    /// Applies one chunk of one lane. Returns the acks of the messages settled by the commit,
    /// for the caller to send behind the next chunk's transaction; dead letters, hand-backs and
    /// a chunk with failures (acked before its failed messages are retried) are settled here.
    ///
    /// With [`Order::Strict`] a failed message holds the rest of its chunk: what came before it
    /// is committed and acked, it is retried alone until applied or dead-lettered, and only then
    /// is the rest applied; if it goes back to the broker instead, the rest follows it, in order.
    pub(super) async fn apply_chunk<A: Ack>(
        &self,
        deliveries: Vec<Delivery<A>>,
        stop: &Stop,
    ) -> Result<Processed<A>> {
        self.common.count(Counter::Received, deliveries.len());
        let mut acks = Vec::new();
        let mut next = deliveries;
        let blocked = loop {
            match self.apply_part(next, stop).await? {
                Part::Done(done) => {
                    acks.extend(done);
                    break false;
                }
                Part::Then(held) => next = held,
                Part::Blocked => break true,
            }
        };
        Ok(Processed { acks, blocked })
    }

    /// Applies `deliveries`, as far as [`Order`] allows.
    async fn apply_part<A: Ack>(
        &self,
        deliveries: Vec<Delivery<A>>,
        stop: &Stop,
    ) -> Result<Part<A>> {
        let strict = self.order == Order::Strict;
        // Strict order: the deliveries after a failed one, in order, with their places.
        let mut held: Vec<(usize, Delivery<A>)> = Vec::new();
        let mut work: Vec<Work<A, H::Item>> = Vec::with_capacity(deliveries.len());
        let mut failed = Vec::new();
        // Later copies of an ID already in this chunk: one broker entry handed out twice (a
        // partition revoked and assigned back, a seek, a visibility timeout or an `XAUTOCLAIM`
        // while the first copy waited in its lane) or a producer's duplicate. Each follows the
        // first copy's outcome: acked once that one is applied, skipped or dead-lettered, handed
        // back with it otherwise. Acked on its own, a copy could settle the entry (or move a
        // Kafka offset) past a first copy that then fails and is handed back: lost.
        let mut copies: Vec<(usize, MessageId, Delivery<A>)> = Vec::new();
        let mut seen = HashSet::new();
        let mut stale = 0;
        // Strict order: a message went back to the broker unapplied (parked before its claim
        // but its dead letter failed, taken back by the broker, or failed and handed back):
        // what follows it goes back after it, as behind a failure.
        let mut blocked = false;
        let mut deliveries = deliveries.into_iter().enumerate();
        while let Some((at, delivery)) = deliveries.next() {
            let to_claim = if delivery.ack.is_stale() {
                // Taken back while it waited in its lane: its new copy is the one to apply.
                stale += 1;
                Err(false)
            } else {
                self.park_before_claim(delivery).await?
            };
            let (id, delivery) = match to_claim {
                Ok(to_claim) => to_claim,
                // Strict order: what follows it in its lane waits for the copy that comes back,
                // as behind a failure: a broker that takes back one delivery (an SQS
                // visibility timeout) hands out the rest of its lane again after it.
                Err(false) if strict => {
                    blocked = true;
                    held.extend(deliveries.by_ref());
                    break;
                }
                Err(_) => continue,
            };
            if !seen.insert(id.clone()) {
                copies.push((at, id, delivery));
                continue;
            }
            // Decoded before any database work: a message that does not decode never enters a
            // transaction, and is retried or dead-lettered on its own.
            match self.handler.decode(&id, &delivery.message) {
                Ok(item) => work.push(Work {
                    at,
                    id,
                    delivery,
                    item,
                }),
                Err(e) => {
                    failed.push((at, id, delivery, e));
                    if strict {
                        held.extend(deliveries.by_ref());
                        break;
                    }
                }
            }
        }

        if stale > 0 {
            info!(consumer = %self.common.name, messages = stale, "dropped deliveries the broker took back while they waited; their new copies are applied instead");
        }
        let outcomes = if work.is_empty() {
            Vec::new()
        } else {
            self.apply_or_abort(&work, stop).await?
        };
        let mut done: Vec<(MessageId, A)> = Vec::new();
        let mut handed_back = Vec::new();
        let mut waits = HashSet::new();
        // Strict order stops at the first message that does not decode: at most one.
        let decode_failed = if strict { failed.pop() } else { None };
        for (
            Work {
                at, id, delivery, ..
            },
            outcome,
        ) in work.into_iter().zip(outcomes)
        {
            match outcome {
                Outcome::Skipped | Outcome::Applied => done.push((id, delivery.ack)),
                Outcome::Failed(e) => failed.push((at, id, delivery, e)),
                Outcome::HandedBack => handed_back.push(delivery.ack),
                Outcome::Held => {
                    waits.insert(id);
                    held.push((at, delivery));
                }
            }
        }
        match decode_failed {
            // Strict order: a message before the one that did not decode failed in the
            // transaction; the undecoded one waits behind it with the rest.
            Some((at, id, delivery, _)) if !failed.is_empty() => {
                waits.insert(id);
                held.push((at, delivery));
            }
            Some(f) => failed.push(f),
            None => {}
        }
        // Sets of IDs only when the chunk holds copies: the common chunk has none.
        let (settled, retrying): (HashSet<MessageId>, HashSet<MessageId>) = if copies.is_empty() {
            Default::default()
        } else {
            (
                done.iter().map(|(id, _)| id.clone()).collect(),
                failed.iter().map(|(_, id, _, _)| id.clone()).collect(),
            )
        };
        let mut waiting = Vec::new();
        for (at, id, copy) in copies {
            if settled.contains(&id) {
                self.common.skipped(&id);
                self.common.metrics.lag(std::iter::once(&copy.message));
                done.push((id, copy.ack));
            } else if retrying.contains(&id) {
                waiting.push((id, copy));
            } else if waits.contains(&id) {
                held.push((at, copy));
            } else {
                handed_back.push(copy.ack);
            }
        }
        self.common.hand_back(handed_back).await;
        if failed.is_empty() && !blocked {
            return Ok(Part::Done(done));
        }
        held.sort_by_key(|(at, _)| *at);
        let held: Vec<Delivery<A>> = held.into_iter().map(|(_, d)| d).collect();
        self.common.ack_all(done).await;
        failed.sort_by_key(|(at, ..)| *at);
        for (_, id, delivery, e) in failed {
            let settled = if stop.stopping() {
                self.common.hand_back(vec![delivery.ack]).await;
                false
            } else {
                self.retry_alone(id.clone(), delivery, e, stop).await?
            };
            let (same, rest): (Vec<_>, Vec<_>) = waiting.into_iter().partition(|(c, _)| *c == id);
            waiting = rest;
            if settled {
                for _ in &same {
                    self.common.skipped(&id);
                }
                self.common
                    .ack_all(same.into_iter().map(|(id, copy)| (id, copy.ack)).collect())
                    .await;
            } else {
                self.common
                    .hand_back(same.into_iter().map(|(_, copy)| copy.ack).collect())
                    .await;
                // Strict order: what waited behind it goes back after it, in order.
                if strict {
                    blocked = true;
                    break;
                }
            }
        }
        if blocked {
            self.common
                .hand_back(held.into_iter().map(|d| d.ack).collect())
                .await;
            return Ok(Part::Blocked);
        }
        Ok(if held.is_empty() {
            Part::Done(Vec::new())
        } else {
            Part::Then(held)
        })
    }

    /// Dead-letters a message that cannot be claimed: it has no ID, or it was delivered more
    /// often than [`Consumer::max_deliveries`](crate::Consumer::max_deliveries) allows. `Ok(Ok(..))`: its ID and the delivery, to claim; `Ok(Err(parked))`: dead-lettered
    /// (`true`), or its dead letter failed and it comes back from the broker (`false`).
    async fn park_before_claim<A: Ack>(
        &self,
        delivery: Delivery<A>,
    ) -> Result<Result<(MessageId, Delivery<A>), bool>> {
        let id = match &delivery.message.id {
            Ok(id) => id.clone(),
            Err(e) => {
                let reason = e.to_string();
                return Ok(Err(self.common.dead_letter(None, delivery, reason).await?));
            }
        };
        if let (Some(limit), Some(count)) =
            (self.max_deliveries, delivery.message.meta.delivery_count)
        {
            if count > limit {
                let reason = format!("delivered {count} times, more than the limit of {limit}");
                return Ok(Err(self
                    .common
                    .dead_letter(Some(&id), delivery, reason)
                    .await?));
            }
        }
        Ok(Ok((id, delivery)))
    }

    /// [`Inbox::apply_all`], unless shutdown cuts the work in flight short first: then the
    /// transaction in progress is dropped (it rolls back) and every message is handed back.
    async fn apply_or_abort<A>(
        &self,
        work: &[Work<A, H::Item>],
        stop: &Stop,
    ) -> Result<Vec<Outcome>> {
        tokio::select! {
            biased;
            outcomes = self.apply_all(work, stop) => outcomes,
            () = stop.aborted() => Ok(work.iter().map(|_| Outcome::HandedBack).collect()),
        }
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
    ///
    /// Pieces are applied in order, lower half first. With [`Order::Strict`] the first message
    /// whose failure stands ends the work: what comes after it is [`Outcome::Held`].
    async fn apply_all<A>(&self, work: &[Work<A, H::Item>], stop: &Stop) -> Result<Vec<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> = work.iter().map(|_| None).collect();
        // Pieces still to apply, the next one last.
        let mut pieces: Vec<Range<usize>> = Vec::with_capacity(4);
        pieces.push(0..work.len());
        let mut outages = 0;
        // Set while this chunk holds in its shard's outage.
        let mut holding = None;
        while let Some(piece) = pieces.pop() {
            let (lo, hi) = (piece.start, piece.end);
            match self.apply_in_tx(&work[piece.clone()]).await {
                Ok(done) => {
                    if outages > 0 {
                        self.common.health.recovered();
                        holding = None;
                    }
                    outages = 0;
                    for (slot, outcome) in outcomes[piece].iter_mut().zip(done) {
                        *slot = Some(outcome);
                    }
                }
                Err(TxFailure::Handler(_, e)) if hi - lo == 1 => {
                    outcomes[lo] = Some(Outcome::Failed(e));
                    if self.order == Order::Strict {
                        break;
                    }
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
                        self.common.count(Counter::Error, 1);
                        return Err(Error::Store(e));
                    }
                    Recovery::Reconnect => {
                        let wait = self.common.outage(&mut outages);
                        holding.get_or_insert_with(|| {
                            self.common.holding(self.shard_of_work(&work[lo]))
                        });
                        warn!(consumer = %self.common.name, error = %e, messages = hi - lo, ?wait, "inbox store unreachable; holding the messages until it is back");
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
                        outcomes[lo] = Some(Outcome::Failed(HandlerError::transient(e)));
                        if self.order == Order::Strict {
                            break;
                        }
                    }
                },
            }
        }
        // Pieces are applied in order, so what is left after a failure in strict order comes
        // after it, and is held. Stopped during an outage: what was not applied goes back to
        // the broker.
        let held = self.order == Order::Strict
            && outcomes
                .iter()
                .any(|o| matches!(o, Some(Outcome::Failed(_))));
        Ok(outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or(if held {
                    Outcome::Held
                } else {
                    Outcome::HandedBack
                })
            })
            .collect())
    }

    /// The store shard of `w`'s message: a chunk's messages share one.
    fn shard_of_work<A>(&self, w: &Work<A, H::Item>) -> usize {
        self.store.shard_of(&w.id, &w.delivery.message)
    }

    /// Claims, applies and commits `work` in one transaction, without savepoints: a handler
    /// failure rolls everything back. Nothing is acked here.
    async fn apply_in_tx<A>(&self, work: &[Work<A, H::Item>]) -> Result<Vec<Outcome>, TxFailure> {
        let span = process_span(
            &self.common.names,
            work.iter().map(|w| (&w.id, &w.delivery.message)),
        );
        let result = self.claim_apply_commit(work).instrument(span.clone()).await;
        if let Err(failure) = &result {
            telemetry::record_error(&span, failure.error_type());
        }
        result
    }

    /// [`Inbox::apply_in_tx`], inside its span.
    async fn claim_apply_commit<A>(
        &self,
        work: &[Work<A, H::Item>],
    ) -> Result<Vec<Outcome>, TxFailure> {
        let ids: Vec<MessageId> = work.iter().map(|w| w.id.clone()).collect();
        // The lanes give a chunk one shard's messages: its first message names the shard.
        let store = match work.first() {
            Some(w) => self.store.shard(self.shard_of_work(w)),
            None => self.store.shard(0),
        };
        let mut tx = store.begin().await.map_err(TxFailure::Store)?;
        let claimed = timed(&self.common.metrics.claim, store.claim(&mut tx, &ids)).await;
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(e) => {
                let failure = match RefusedId::of(&e) {
                    // The message fails alone, for good: it is dead-lettered, the rest applied.
                    Some(refused) if refused.index < work.len() => {
                        let id = work[refused.index].id.clone();
                        let error = RefusedByStore(id, refused.reason.to_string());
                        TxFailure::Handler(Some(refused.index), HandlerError::permanent(error))
                    }
                    _ => TxFailure::Store(e),
                };
                return Err(self.common.abandon(tx, failure).await);
            }
        };
        let fresh: Vec<&Work<A, H::Item>> = work
            .iter()
            .zip(&claimed)
            .filter(|(_, new)| **new)
            .map(|(w, _)| w)
            .collect();
        for w in &fresh {
            self.common.stage(Stage::Claimed, &w.id);
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
                return Err(self
                    .common
                    .abandon(tx, TxFailure::Handler(at, failure))
                    .await);
            }
            for w in &fresh {
                self.common.stage(Stage::Applied, &w.id);
            }
        }
        if fresh.is_empty() {
            // Nothing to keep: every message was a duplicate.
            self.common.rollback(tx).await;
        } else {
            timed(&self.common.metrics.commit, tx.commit())
                .await
                .map_err(TxFailure::Store)?;
            self.common.count(Counter::Commit, 1);
            self.common.count(Counter::Applied, fresh.len());
        }
        self.common.metrics.batch_size.record(work.len() as f64);
        self.common
            .metrics
            .lag(work.iter().map(|w| &w.delivery.message));
        self.common.health.batch_done();
        let skipped = work.len() - fresh.len();
        info!(consumer = %self.common.name, applied = fresh.len(), skipped, "committed a batch");
        let mut outcomes = Vec::with_capacity(work.len());
        for (w, new) in work.iter().zip(claimed) {
            if new {
                debug!(consumer = %self.common.name, message_id = %w.id.escaped(), position = %w.delivery.message.meta.position.escape_debug(), outcome = "applied", "applied");
                self.common.stage(Stage::Committed, &w.id);
                outcomes.push(Outcome::Applied);
            } else {
                self.common.skipped(&w.id);
                outcomes.push(Outcome::Skipped);
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
        let span = info_span!("inbox.batch", consumer = %self.common.name, messages = batch.len());
        let call = self.handler.handle_batch(tx, batch).instrument(span);
        let limit = self.handler_timeout.unwrap_or_default();
        let deadline = self.handler_timeout.map(|l| Instant::now() + l);
        let called = guarded("handler", deadline, call, || {
            HandlerError::transient(format!(
                "the handler did not return within the handler timeout of {limit:?}"
            ))
        });
        timed(&self.common.metrics.handler, called).await
    }

    /// A message whose handler (or decoding) failed inside a batch or alone: retried on its own.
    /// `true` when it is settled for good (applied, skipped or dead-lettered), `false` when it
    /// goes back to the broker (handed back, or its dead letter failed).
    async fn retry_alone<A: Ack>(
        &self,
        mut id: MessageId,
        mut delivery: Delivery<A>,
        first: HandlerError,
        stop: &Stop,
    ) -> Result<bool> {
        let mut error = first;
        let mut attempt = 1;
        loop {
            if error.failure() == Failure::Permanent || attempt >= self.common.retry.max_attempts {
                let reason = if error.source().is::<RefusedByStore>() {
                    error.to_string()
                } else {
                    failure_reason(&error, attempt)
                };
                return if error.failure() == Failure::Permanent {
                    self.common.dead_letter(Some(&id), delivery, reason).await
                } else {
                    self.common
                        .redeliver_or_dead_letter(&id, delivery, reason)
                        .await
                };
            }
            warn!(consumer = %self.common.name, message_id = %id.escaped(), attempt, error = %error, "handler failed; retrying");
            self.common.count(Counter::Retried, 1);
            if stop.pause(self.common.retry.wait(attempt)).await {
                self.common.hand_back(vec![delivery.ack]).await;
                return Ok(false);
            }
            attempt += 1;
            let item = match self.handler.decode(&id, &delivery.message) {
                Ok(item) => item,
                Err(e) => {
                    error = e;
                    continue;
                }
            };
            let work = [Work {
                at: 0,
                id,
                delivery,
                item,
            }];
            let outcome = self.apply_or_abort(&work, stop).await?.pop();
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
                    self.common.ack_all(vec![(same, back.ack)]).await;
                    return Ok(true);
                }
                Some(Outcome::HandedBack | Outcome::Held) | None => {
                    self.common.hand_back(vec![back.ack]).await;
                    return Ok(false);
                }
            }
        }
    }
}
