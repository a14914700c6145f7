//! Side effects outside the database: a call to a payment API, an email provider, a webhook.
//!
//! [`Consumer`](crate::Consumer) makes a handler effectively-once by committing its writes in the
//! transaction that records the message ID. A call out of the process cannot join that
//! transaction, so [`Consumer::effects`](crate::Consumer::effects) keeps a row per message in two states, processing and
//! done, with a lease:
//!
//! 1. **Lease.** The row is inserted as *processing* with `locked_until` (the lease) and a
//!    fencing token (1, then one more with every new lease on the row), and committed on its own.
//! 2. **Call.** [`EffectHandler::call`] calls the provider with the message's idempotency key
//!    ([`Effect::idempotency_key`], `<consumer>:<message ID>`, the same on every redelivery) and
//!    the token.
//! 3. **Done.** The row is marked done, only if the token is still the current one, in one
//!    transaction with the handler's own database writes ([`EffectHandler::record`]); then the
//!    broker is acked.
//!
//! A redelivered copy finds the row:
//! - *done*: skipped and acked;
//! - *processing, lease live*: someone works on it. The copy is handed back to the broker to
//!   come again once the lease has run out (a nack delayed by the rest of the lease), neither
//!   acked nor counted as an attempt;
//! - *processing, lease over*: its holder died, hung past its lease, or failed without knowing
//!   whether its call landed. A new lease with a higher token is taken, then
//!   [`EffectHandler::landed`] is asked whether the earlier call landed: yes, the row is marked
//!   done without calling again; no, the provider is called again with the same key; unknown,
//!   the handler's [`OnUnknown`] decides.
//!
//! A holder whose lease ran out (a zombie: paused, slow, cut off) cannot mark the row done: the
//! done mark compares its token in the same statement, a newer lease has a higher one, so the
//! zombie's transaction, with its database writes, never commits, and its delivery is handed
//! back instead of acked. A call is given until its lease ends; one still running then is
//! dropped, its outcome unknown. The done mark is bounded by the lease too: a
//! [`record`](EffectHandler::record) still running when the lease ends is dropped, its
//! transaction rolled back, and the message handed back for the next lease to settle.
//!
//! # Each delivery
//!
//! 1. a message without a usable ID is dead-lettered with the reason, then acked;
//! 2. [`LeaseStore::acquire`] takes a lease, committed on its own. Done: skipped and acked.
//!    Another lease live: handed back with a nack delayed by the rest of that lease; neither
//!    acked nor counted as an attempt. When the broker cannot delay (Kafka rewinds at once,
//!    Redis leaves it pending until `claim_idle`) and the copy comes back early, the consumer
//!    waits out the rest of the lease before asking again, so nothing spins;
//! 3. after an unknown outcome ([`Attempt::AfterExpiry`]) the handler's status lookup
//!    ([`EffectHandler::landed`]) and then its [`OnUnknown`] decide between calling again and
//!    marking done without a call;
//! 4. the call runs until the lease ends at most; its outcome decides:
//!    - `Ok`: the done transaction ([`LeaseStore::complete`], then [`EffectHandler::record`],
//!      then commit) and the ack. A done mark refused because a newer lease took over (this
//!      attempt was a zombie) rolls back and hands the delivery back: the newer holder
//!      finishes it, and the copy is later skipped as done. A done transaction that fails is
//!      tried again while the lease lasts; once it has run out (a `record` still running then
//!      is dropped), the lease is released and the message handed back with the retry
//!      backoff, for the next lease to settle;
//!    - a transient error (or a panic, or the lease running out): the lease is released and the
//!      message handed back with the retry backoff, to be leased again; after
//!      [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts) attempts it is
//!      dead-lettered;
//!    - a permanent error: dead-lettered at once.
//!
//! The budget is counted in leases, in the store: every lease is an attempt, whether it ended
//! in an error, a crash or a hang, so a message that kills the process is dead-lettered after
//! `max_attempts` leases too. A copy handed back because of a live lease takes no lease and
//! uses up nothing. The broker's own counters do not see the difference: set a broker-side
//! limit (an SQS `maxReceiveCount`, a quorum queue's delivery limit) well above `max_attempts`,
//! or a message held by a slow call elsewhere is dead-lettered by the broker.
//!
//! A dead letter starts the count again for its replay: a copy carrying
//! [`REPLAYED`](crate::REPLAYED) (every copy [`replay`](crate::replay::replay) publishes) gets a full
//! budget. Any other copy that arrives after the message was dead-lettered (a producer's
//! resend, a copy the broker gave out again behind a rewind) is acked as a duplicate of the
//! dead letter, without a call: were it given a fresh budget too, two copies failing in turn
//! (one handed back, rewinding a Kafka partition past the other's dead letter) would restart
//! each other's count for ever.
//!
//! While the store cannot be reached, the message is held and tried again with a backoff
//! doubling up to 30 s. Everything else (lanes, health, shutdown, the counters) is the one
//! [`Consumer`](crate::Consumer)'s.
//!
//! # Which provider, which choice
//!
//! | the provider has | implement | after an unknown outcome | result |
//! |---|---|---|---|
//! | idempotency keys (Stripe's `Idempotency-Key`) | `on_unknown` → [`OnUnknown::Retry`] | the same key again; the provider answers with the first result | no duplicate and no loss, while the provider keeps the key (Stripe: at least 24 h) |
//! | a status lookup ("did payment X go through?") | [`EffectHandler::landed`] | marked done if it landed, called again if not, asked again later while [`Landed::Pending`] | no duplicate and no loss |
//! | neither | `on_unknown` → [`OnUnknown::Retry`] or [`OnUnknown::Skip`] | called again, or marked done without a call | Retry: a rare duplicate; Skip: a rare loss |
//!
//! With neither keys nor a lookup no clever fix exists; pick whichever costs less. "Unknown" is
//! rare: a crash or a lease running out between sending the call and committing the done mark,
//! or a call that fails without saying whether it applied (a timeout, a cut connection). A call
//! that fails and knows the provider did not apply it (a `429`, a refused connection) returns
//! [`not_applied`] and is retried whatever the choice.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use inbox_core::effect::{not_applied, Effect, EffectHandler, LeaseStore, OnUnknown};
//! use inbox_core::{Consumer, HandlerError, Message, MessageSource};
//!
//! /// Sends each invoice through an email provider that takes idempotency keys.
//! struct SendInvoice;
//!
//! impl<Tx: Send> EffectHandler<Tx> for SendInvoice {
//!     fn on_unknown(&self) -> OnUnknown {
//!         OnUnknown::Retry // the provider deduplicates on the key: a retry cannot send twice
//!     }
//!
//!     async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
//!         // `?` on a timeout or a cut connection: a transient error, outcome unknown.
//!         let status = send_email(effect.idempotency_key(), effect.token(), &message.payload).await?;
//!         match status {
//!             200..=299 => Ok(()),
//!             429 => Err(not_applied("rate limited")), // refused before doing anything
//!             400..=499 => Err(HandlerError::permanent(format!("invoice refused: {status}"))),
//!             _ => Err(HandlerError::transient(format!("provider answered {status}"))),
//!         }
//!     }
//! }
//! # async fn send_email(_key: &str, _token: u64, _body: &[u8]) -> std::io::Result<u16> { Ok(200) }
//!
//! async fn run<S: MessageSource, L: LeaseStore>(source: S, leases: L) -> inbox_core::Result<()> {
//!     // `leases`: `inbox_postgres::PgLeases`, say.
//!     Consumer::effects("invoices", source, leases, SendInvoice)
//!         .lease(Duration::from_secs(30)) // longer than the slowest call
//!         .run() // until Ctrl-C
//!         .await?;
//!     Ok(())
//! }
//! ```
//!
//! # Telemetry
//!
//! The counters and histograms are the consumer's (see [`telemetry`](crate::telemetry)): a
//! lease statement is timed as the claim, a call as the handler, a done transaction as the
//! commit; [`StatsSnapshot`](crate::StatsSnapshot) adds the effect counters `confirmed`,
//! `skipped_unknown`, `busy` and `fenced` (`inbox_effects_<counter>_total`). Each message gets an
//! `inbox.effect` span with the consumer, message ID, broker position, `messaging.system`, the
//! message's `traceparent` (when it has a valid one), the lease's `token` and the `outcome`;
//! inside it, `inbox.effect.call` spans each call and `inbox.effect.landed` each status lookup.

mod apply;
mod lease;
mod settle;

pub use apply::Effects;
pub use lease::{Acquired, Lease, LeaseStore, Release};

/// The lease [`Consumer::effects`](crate::Consumer::effects) starts with.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

use std::time::Duration;

use std::future::Future;

use tokio::time::Instant;

use crate::{BoxError, HandlerError, Message, MessageId};

/// Which lease on its message an attempt holds, and what the attempts before it left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Attempt {
    /// The first lease: nothing was called before.
    First,
    /// The attempt before failed and knew the provider had not applied its call
    /// ([`not_applied`]): calling again cannot apply twice.
    AfterNotApplied,
    /// A lease before this one ended without a known outcome: its holder crashed, hung past the
    /// lease, or its call failed without saying whether it applied. That call may have landed.
    AfterExpiry,
}

/// The answer of a status lookup ([`EffectHandler::landed`]): did an earlier call for this
/// message land at the provider?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landed {
    /// It landed: the row is marked done without calling again.
    Yes,
    /// It did not, and no earlier call can land any more: the provider is called again.
    No,
    /// The provider still works on an earlier call (a payment "processing"): the message is
    /// handed back and asked about again after the retry backoff; each look counts as an
    /// attempt. Answer `No` only when no call in flight can still land, or a late one lands
    /// beside the new call.
    Pending,
    /// The lookup cannot tell, or the provider has none (the default): the handler's
    /// [`OnUnknown`] decides.
    Unknown,
}

/// What to do with a message whose earlier call may or may not have landed, when no status
/// lookup can tell. A required choice: nothing can make it safe without help from the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUnknown {
    /// Call again. Safe with a provider that deduplicates on the idempotency key; without one,
    /// the rare unknown outcome becomes a duplicate (a second email, a second charge).
    Retry,
    /// Mark the row done without calling. The rare unknown outcome becomes a loss when the
    /// earlier call did not land after all. [`Settled::Skipped`] tells
    /// [`EffectHandler::record`], so the case can be flagged for a person.
    Skip,
}

/// How a message reached its done mark, as [`EffectHandler::record`] is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// This attempt called the provider and the call returned `Ok`.
    Called,
    /// The status lookup said an earlier call landed; not called again.
    Landed,
    /// An earlier call's outcome was unknown and [`OnUnknown::Skip`] said not to call again:
    /// the effect may be missing.
    Skipped,
}

impl Settled {
    /// `called`, `landed` or `skipped`: for logs and columns.
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Called => "called",
            Settled::Landed => "landed",
            Settled::Skipped => "skipped",
        }
    }
}

/// One attempt at a message's side effect: what a handler passes to the provider.
#[derive(Debug, Clone)]
pub struct Effect {
    id: MessageId,
    key: String,
    lease: Lease,
    ends: Instant,
}

impl Effect {
    pub(crate) fn new(consumer: &str, id: MessageId, lease: Lease, ends: Instant) -> Self {
        Self {
            key: id.idempotency_key(consumer),
            id,
            lease,
            ends,
        }
    }

    /// The message ID.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// The key to send as the provider's idempotency key: `<consumer>:<message ID>`
    /// ([`MessageId::idempotency_key`]), the same for every attempt at this message.
    pub fn idempotency_key(&self) -> &str {
        &self.key
    }

    /// This attempt's fencing token: higher than every earlier lease's on the message. A
    /// provider that stores it can refuse a call carrying a lower one (a zombie's).
    pub fn token(&self) -> u64 {
        self.lease.token
    }

    /// What the attempts before this one left behind.
    pub fn attempt(&self) -> Attempt {
        self.lease.attempt
    }

    /// Leases taken on this message so far, this one included (reset when it is
    /// dead-lettered, so a replay gets a full budget).
    pub fn attempts(&self) -> u32 {
        self.lease.attempts
    }

    /// Whether the lease before this one ended in a dead letter: the count started again
    /// ([`Release::dead_lettered`]) on a row that had leases before.
    pub(crate) fn after_dead_letter(&self) -> bool {
        self.lease.attempts == 1 && self.lease.token > 1
    }

    /// How long ago the first lease on this message was taken. Once this is longer than the
    /// provider keeps idempotency keys (Stripe: 24 h), a retry on the key alone may apply twice.
    pub fn since_first(&self) -> Duration {
        self.lease.since_first
    }

    /// The time left on this attempt's lease: the call is dropped when it runs out, so a client
    /// timeout shorter than this gets an answer instead of a cut.
    pub fn remaining(&self) -> Duration {
        self.ends.saturating_duration_since(Instant::now())
    }

    pub(crate) fn ends(&self) -> Instant {
        self.ends
    }
}

/// Calls a provider once per message, through [`Consumer::effects`](crate::Consumer::effects).
///
/// The handler gets nothing that could ack the message: the consumer acks only after the done
/// mark committed.
pub trait EffectHandler<Tx: Send>: Send + Sync {
    /// What to do when an earlier call's outcome is unknown and [`landed`](Self::landed) cannot
    /// tell: [`OnUnknown::Retry`] (a rare duplicate unless the provider takes idempotency
    /// keys) or [`OnUnknown::Skip`] (a rare loss).
    fn on_unknown(&self) -> OnUnknown;

    /// Makes the call. Pass [`Effect::idempotency_key`] (and [`Effect::token`], where the
    /// provider can use it).
    ///
    /// - `Ok(())`: the provider applied it, now or on an earlier call with the same key.
    /// - a transient error: whether it applied is unknown (a timeout, a cut connection, a
    ///   `5xx`); the message is handed back and retried with backoff, and the next attempt
    ///   asks [`landed`](Self::landed) first. Use [`not_applied`] when the provider surely did
    ///   not apply it. After [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts)
    ///   attempts the message is dead-lettered.
    /// - a permanent error: the provider refused it and no retry can help; dead-lettered now.
    /// - a panic counts as a transient error.
    fn call(
        &self,
        effect: &Effect,
        message: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Asks the provider whether an earlier call for this message landed; called before a
    /// retry whose earlier outcome is unknown ([`Attempt::AfterExpiry`]). Look the call up by
    /// its idempotency key or whatever reference the call carried. An error counts as an
    /// attempt that failed with an unknown outcome. The default: [`Landed::Unknown`].
    fn landed(
        &self,
        effect: &Effect,
        message: &Message,
    ) -> impl Future<Output = Result<Landed, HandlerError>> + Send {
        let _ = (effect, message);
        async { Ok(Landed::Unknown) }
    }

    /// Writes to the database what goes with the effect (the order is paid, the email was
    /// sent), in the transaction that marks the message done: both commit or neither. Runs
    /// once the done mark is taken, so a zombie's writes never happen. An error rolls both
    /// back; the done transaction is tried again up to
    /// [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts) times without calling
    /// the provider again. It runs until the lease ends at most (the store may bound its
    /// statements by the lease as well): after that, its transaction is rolled back and the
    /// message handed back, and the next lease asks [`landed`](Self::landed). The default
    /// writes nothing.
    fn record(
        &self,
        tx: &mut Tx,
        effect: &Effect,
        settled: Settled,
        message: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        let _ = (tx, effect, settled, message);
        async { Ok(()) }
    }
}

impl<Tx: Send, H: EffectHandler<Tx> + ?Sized> EffectHandler<Tx> for std::sync::Arc<H> {
    fn on_unknown(&self) -> OnUnknown {
        (**self).on_unknown()
    }
    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        (**self).call(effect, message).await
    }
    async fn landed(&self, effect: &Effect, message: &Message) -> Result<Landed, HandlerError> {
        (**self).landed(effect, message).await
    }
    async fn record(
        &self,
        tx: &mut Tx,
        effect: &Effect,
        settled: Settled,
        message: &Message,
    ) -> Result<(), HandlerError> {
        (**self).record(tx, effect, settled, message).await
    }
}

/// A transient failure of a call that the provider surely did not apply: it refused the call
/// before doing anything (a `429`, a `503` from a gateway in front of it), or the call never
/// left (a refused connection). The next attempt calls again without asking
/// [`EffectHandler::landed`] and without consulting [`OnUnknown`].
///
/// Claim it only when it is certain: a timeout or a connection cut after sending is unknown.
pub fn not_applied(source: impl Into<BoxError>) -> HandlerError {
    HandlerError::transient(NotApplied(source.into()))
}

/// Whether `e` came from [`not_applied`].
pub(crate) fn is_not_applied(e: &HandlerError) -> bool {
    e.source().downcast_ref::<NotApplied>().is_some()
}

/// The marker [`not_applied`] wraps its error in.
#[derive(Debug, thiserror::Error)]
#[error("{0} (not applied)")]
struct NotApplied(#[source] BoxError);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Failure;

    #[test]
    fn not_applied_is_a_transient_error_the_consumer_can_recognise() {
        let e = not_applied("rate limited");
        assert_eq!(e.failure(), Failure::Transient);
        assert!(is_not_applied(&e));
        assert_eq!(e.to_string(), "rate limited (not applied)");
        let cause = std::error::Error::source(e.source()).map(ToString::to_string);
        assert_eq!(cause.as_deref(), Some("rate limited"));
        assert!(!is_not_applied(&HandlerError::transient("timed out")));
    }
}
