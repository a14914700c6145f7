//! What a lease store implements: processing and done rows with a lease and a fencing token.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::Attempt;
use crate::{InvalidId, MessageId, StoreError, Transaction};

/// A lease taken on a message's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The fencing token: 1 for the first lease, one more for every lease after it.
    pub token: u64,
    /// What the leases before this one left behind.
    pub attempt: Attempt,
    /// Leases taken since the row was made or last dead-lettered, this one included. The
    /// consumer reads 1 with a `token` above 1 as the first lease after a dead letter, which
    /// only a replay of the message may use.
    pub attempts: u32,
    /// How long ago the first lease on the row was taken.
    pub since_first: Duration,
}

/// What [`LeaseStore::acquire`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// The row was new (inserted as processing) or its lease had run out (leased again with a
    /// higher token); the lease is committed.
    Leased(Lease),
    /// Another lease is live, or another transaction holds the row longer than the store waits
    /// for it (a done mark not yet committed): the caller hands the message back for
    /// `retry_after`, the time left on that lease (or the store's wait). Nothing was changed.
    Busy {
        /// The time left on the live lease.
        retry_after: Duration,
    },
    /// The message is done: skip it.
    Done,
}

/// How a lease is given up without a done mark, so the next copy need not wait for it to run
/// out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// The call surely did not apply: the next lease is [`Attempt::AfterNotApplied`], not
    /// [`Attempt::AfterExpiry`].
    pub not_applied: bool,
    /// The message was dead-lettered: the attempt count starts again, so a replay of the dead
    /// letter gets a full budget.
    pub dead_lettered: bool,
}

/// Rows of processing and done messages, one per consumer and message ID, with a lease and a
/// fencing token: what [`Consumer::effects`](crate::Consumer::effects) keeps its state in.
///
/// The fencing token is what keeps a zombie out: every new lease on a row gets a higher token,
/// and [`complete`](Self::complete) marks the row done only if the caller's token is still the
/// row's, compared in the same statement that writes the mark. Time (the lease) decides only
/// when a new lease may be taken, never whether a done mark counts.
///
/// Errors carry a [`Recovery`](crate::Recovery) as in [`InboxStore`](crate::InboxStore):
/// `Reconnect` holds the message and tries again without using up attempts, `Retry` on the done
/// transaction retries it, `Fatal` stops the consumer.
pub trait LeaseStore: Send + Sync + 'static {
    /// An open transaction, in which the done mark and the handler's writes commit together;
    /// it commits or rolls back itself.
    type Tx: Transaction;

    /// In one atomic step, committed on its own: inserts the row as processing with a lease of
    /// `lease` and token 1; or, if the row is processing and its lease has run out, takes a new
    /// lease with the token raised by one; or reports a live lease ([`Acquired::Busy`]) or a
    /// done row ([`Acquired::Done`]) and changes nothing. It must not wait for the row without
    /// limit: a row another transaction keeps locked is [`Acquired::Busy`] after a bounded
    /// wait, or the sequential effect consumer waits as long.
    fn acquire(
        &self,
        consumer: &str,
        id: &MessageId,
        lease: Duration,
    ) -> impl Future<Output = Result<Acquired, StoreError>> + Send;

    /// Ends the lease `token` now, without a done mark, as `release` says. `false`: a newer
    /// lease exists (or the row is done), nothing changed.
    fn release(
        &self,
        consumer: &str,
        id: &MessageId,
        token: u64,
        release: Release,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Marks the row done inside `tx` if `token` is still the row's token and the row is not
    /// done yet, in one statement. `false`: fenced out (a newer lease exists, or the row is
    /// already done); the store must then leave `tx` unable to commit anything, so nothing a
    /// zombie wrote in it can land.
    fn complete(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: &MessageId,
        token: u64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Refuses an ID this store cannot keep, before any lease; the consumer dead-letters such a
    /// message. The default accepts every ID.
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        let _ = id;
        Ok(())
    }
}

impl<L: LeaseStore> LeaseStore for Arc<L> {
    type Tx = L::Tx;

    async fn acquire(
        &self,
        consumer: &str,
        id: &MessageId,
        lease: Duration,
    ) -> Result<Acquired, StoreError> {
        (**self).acquire(consumer, id, lease).await
    }
    async fn release(
        &self,
        consumer: &str,
        id: &MessageId,
        token: u64,
        release: Release,
    ) -> Result<bool, StoreError> {
        (**self).release(consumer, id, token, release).await
    }
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        (**self).begin().await
    }
    async fn complete(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: &MessageId,
        token: u64,
    ) -> Result<bool, StoreError> {
        (**self).complete(tx, consumer, id, token).await
    }
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        (**self).check_id(id)
    }
}
