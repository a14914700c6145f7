//! What an inbox store implements: a transaction in which message IDs are claimed, and the
//! transaction itself, which ends itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::{InvalidId, Message, MessageId, StoreError};

/// An open store transaction, consumed by its end: [`commit`](Transaction::commit) or
/// [`rollback`](Transaction::rollback), as `sqlx::Transaction` is. One type for the inbox's
/// claims ([`InboxStore::Tx`]) and an effect's done mark
/// ([`LeaseStore::Tx`](crate::effect::LeaseStore::Tx)). Dropped without either (a crash, a
/// cancelled future), it must leave nothing behind.
pub trait Transaction: Send + 'static {
    /// Commits. A transaction the database has already aborted (a handler caught an SQL error
    /// and returned `Ok`) must fail here with [`Recovery::Retry`](crate::Recovery::Retry), never
    /// report success: the consumer then isolates the message and retries or dead-letters it,
    /// instead of acking a message whose effects were rolled back.
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls back.
    fn rollback(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// No transaction: for a lease store with nothing to write beside its done mark, and for
/// tests.
impl Transaction for () {
    async fn commit(self) -> Result<(), StoreError> {
        Ok(())
    }
    async fn rollback(self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A transactional store that remembers which message IDs each consumer has applied.
///
/// Everything happens inside one store transaction: the consumer claims the ID, the
/// [`Handler`](crate::Handler) writes its side effect through the same transaction, and both
/// commit or roll back together. A claim that finds the ID already recorded (committed by an
/// earlier delivery, or by a racing consumer that commits first) returns `false`, and the consumer
/// skips the message. The store's uniqueness constraint is what serialises racing consumers: no
/// lock outside the database is needed.
///
/// Errors carry a [`Recovery`](crate::Recovery): `Reconnect` when the store cannot be reached
/// (the consumer holds the messages and tries again, using up no delivery budget), `Retry` when
/// this transaction failed (the consumer splits the batch to find the message that fails and
/// retries it alone), `Fatal` when nothing will work until someone fixes it.
pub trait InboxStore: Send + Sync + 'static {
    /// An open transaction, handed to the handler; it commits or rolls back itself.
    type Tx: Transaction;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Records `id` for `consumer` inside `tx`. `true`: the ID is new and the message must be
    /// applied in this transaction; `false`: it was applied before, skip it.
    fn claim(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: &MessageId,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Claims many distinct IDs at once (one round-trip where the store allows); the answer has
    /// one flag per ID, in order. The default claims one by one.
    fn claim_many(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        ids: &[MessageId],
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send {
        async move {
            let mut claimed = Vec::with_capacity(ids.len());
            for id in ids {
                claimed.push(self.claim(tx, consumer, id).await?);
            }
            Ok(claimed)
        }
    }

    /// Refuses an ID this store cannot keep (a non-UUID for a uuid key column, say), before any
    /// transaction; the consumer dead-letters such a message. The default accepts every ID.
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        let _ = id;
        Ok(())
    }

    /// Told the consumer's [`handler_timeout`](crate::Consumer::handler_timeout) when it is
    /// set. A handler cut off by it is dropped, but a statement it sent may keep running in the
    /// store, and the rollback that follows waits for it, with the transaction's locks held: a
    /// statement waiting on a lock would keep the consumer waiting as long. A store that can
    /// end its statements after `timeout` does so from now on, for the statements after the
    /// claim: the claim itself, which may wait on a peer's uncommitted claim of the same ID,
    /// keeps the store's own timeouts (cut off by the handler's bound, that wait would count as
    /// the message's failure while the peer goes on). The default does nothing.
    fn set_handler_timeout(&mut self, timeout: Duration) {
        let _ = timeout;
    }

    /// Which shard holds `message`'s claim and effect, for a store that spreads messages over
    /// several databases ([`Sharded`](crate::Sharded)). The consumer never puts messages of
    /// two shards in one transaction: it applies each shard's messages in chunks of their own,
    /// opened through [`InboxStore::shard`]. The default, one database, is shard 0.
    fn shard_of(&self, id: &MessageId, message: &Message) -> usize {
        let _ = (id, message);
        0
    }

    /// How many shards [`InboxStore::shard_of`] spreads messages over: while one is in an
    /// outage, the consumer gives it one chunk at a time and keeps the rest of its window for
    /// the others. The default, one database, is 1.
    fn shard_count(&self) -> usize {
        1
    }

    /// The store of shard `index` (as [`InboxStore::shard_of`] answered), in which the
    /// consumer begins, claims and commits that shard's chunks. The default is the store itself.
    fn shard(&self, index: usize) -> &(dyn DynInboxStore<Tx = Self::Tx> + 'static)
    where
        Self: Sized,
    {
        let _ = index;
        self
    }
}

impl<S: InboxStore> InboxStore for Arc<S> {
    type Tx = S::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        (**self).begin().await
    }
    async fn claim(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: &MessageId,
    ) -> Result<bool, StoreError> {
        (**self).claim(tx, consumer, id).await
    }
    async fn claim_many(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        ids: &[MessageId],
    ) -> Result<Vec<bool>, StoreError> {
        (**self).claim_many(tx, consumer, ids).await
    }
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        (**self).check_id(id)
    }
    fn shard_of(&self, id: &MessageId, message: &Message) -> usize {
        (**self).shard_of(id, message)
    }
    fn shard_count(&self) -> usize {
        (**self).shard_count()
    }
    fn shard(&self, index: usize) -> &(dyn DynInboxStore<Tx = Self::Tx> + 'static) {
        (**self).shard(index)
    }
    /// Passed on only while this is the one `Arc` of the store; otherwise a warning says so.
    fn set_handler_timeout(&mut self, timeout: Duration) {
        match Arc::get_mut(self) {
            Some(store) => store.set_handler_timeout(timeout),
            None => tracing::warn!(
                ?timeout,
                "the inbox store is shared through an Arc: the handler timeout cannot reach its \
                 statements, so a handler cut off while a statement waits on a lock keeps its \
                 lane waiting; give the consumer its own store (clone it), or bound the store's \
                 statements yourself"
            ),
        }
    }
}

/// [`InboxStore`] as a trait object: what [`InboxStore::shard`] returns.
///
/// `InboxStore`'s async methods return `impl Future`, which keeps it from being made into a
/// `dyn` object; this trait has those a shard's transactions go through, returning boxed
/// futures, under names of their own (`dyn_` and the `InboxStore` method's), so that they are
/// never ambiguous beside `InboxStore`'s. Every `InboxStore` implements it, and
/// `dyn DynInboxStore` implements `InboxStore` (one database: shard 0 of 1).
pub trait DynInboxStore: Send + Sync {
    /// [`InboxStore::Tx`].
    type Tx: Transaction;

    /// [`InboxStore::begin`].
    fn dyn_begin(&self) -> BoxFuture<'_, Result<Self::Tx, StoreError>>;

    /// [`InboxStore::claim`].
    fn dyn_claim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        id: &'a MessageId,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// [`InboxStore::claim_many`].
    fn dyn_claim_many<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        ids: &'a [MessageId],
    ) -> BoxFuture<'a, Result<Vec<bool>, StoreError>>;

    /// [`InboxStore::check_id`].
    fn dyn_check_id(&self, id: &MessageId) -> Result<(), InvalidId>;
}

impl<S: InboxStore> DynInboxStore for S {
    type Tx = S::Tx;

    fn dyn_begin(&self) -> BoxFuture<'_, Result<Self::Tx, StoreError>> {
        Box::pin(InboxStore::begin(self))
    }
    fn dyn_claim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        id: &'a MessageId,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(InboxStore::claim(self, tx, consumer, id))
    }
    fn dyn_claim_many<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        ids: &'a [MessageId],
    ) -> BoxFuture<'a, Result<Vec<bool>, StoreError>> {
        Box::pin(InboxStore::claim_many(self, tx, consumer, ids))
    }
    fn dyn_check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        InboxStore::check_id(self, id)
    }
}

impl<Tx: Transaction> InboxStore for dyn DynInboxStore<Tx = Tx> {
    type Tx = Tx;

    async fn begin(&self) -> Result<Tx, StoreError> {
        self.dyn_begin().await
    }
    async fn claim(&self, tx: &mut Tx, consumer: &str, id: &MessageId) -> Result<bool, StoreError> {
        self.dyn_claim(tx, consumer, id).await
    }
    async fn claim_many(
        &self,
        tx: &mut Tx,
        consumer: &str,
        ids: &[MessageId],
    ) -> Result<Vec<bool>, StoreError> {
        self.dyn_claim_many(tx, consumer, ids).await
    }
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        self.dyn_check_id(id)
    }
}
