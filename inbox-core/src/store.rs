//! What an inbox store implements: a transaction in which message IDs are claimed, and the
//! transaction itself, which ends itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::{InvalidId, MessageId, Recovery, StoreError};

/// An open store transaction, consumed by its end: [`commit`](Transaction::commit) or
/// [`rollback`](Transaction::rollback), as `sqlx::Transaction` is. One type for the inbox's
/// claims ([`InboxStore::Tx`]) and an effect's done mark
/// ([`LeaseStore::Tx`](crate::effect::LeaseStore::Tx)). Dropped without either (a crash, a
/// cancelled future), it must leave nothing behind.
pub trait Transaction: Send + 'static {
    /// Commits. A transaction the database has already aborted (a handler caught an SQL error
    /// and returned `Ok`) must fail here with [`Recovery::Retry`](crate::Recovery::Retry), never
    /// report success: the consumer then isolates the message and retries or dead-letters it,
    /// instead of acking a message whose effects were rolled back. PostgreSQL answers `COMMIT`
    /// of an aborted transaction with `ROLLBACK` and no error; `inbox_postgres::PgTx` checks for
    /// it, and a PostgreSQL store of your own can return that type.
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

/// What a consumer tells its store once, before its first transaction: see
/// [`InboxStore::bind`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerBinding {
    /// The consumer's name: the scope of its IDs (two consumers with different names each apply
    /// every message once).
    pub consumer: String,
    /// The consumer's [`handler_timeout`](crate::Consumer::handler_timeout), when set.
    pub handler_timeout: Option<Duration>,
}

impl ConsumerBinding {
    /// A binding for the consumer `consumer`, with no handler timeout.
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            handler_timeout: None,
        }
    }

    /// With the consumer's handler timeout.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }
}

/// A transactional store that remembers which message IDs each consumer has applied.
///
/// Everything happens inside one store transaction: the consumer claims the IDs, the
/// [`Handler`](crate::Handler) writes its side effect through the same transaction, and both
/// commit or roll back together. A claim that finds an ID already recorded (committed by an
/// earlier delivery, or by a racing consumer that commits first) answers `false` for it, and
/// the consumer skips that message. The store's uniqueness constraint is what serialises racing
/// consumers: no lock outside the database is needed.
///
/// A store is written in three methods: [`bind`](InboxStore::bind) (a copy of the store for one
/// consumer), [`begin`](InboxStore::begin) and [`claim`](InboxStore::claim), which refuses an ID
/// the store cannot keep with [`RefusedId`]. `inbox-conformance`'s store
/// suite checks one against the contract. The repository's `docs/writing-a-store.md` writes one
/// over an application's own PostgreSQL table, on `inbox_postgres::PgTx`, whose commit already
/// refuses a transaction the server aborted.
///
/// A store of claims in memory, whose transactions run one at a time (a database runs them side
/// by side, and its unique key makes a racing claim of one ID wait for the first to end):
///
/// ```
/// use std::collections::HashSet;
/// use std::sync::Arc;
///
/// use inbox_core::{
///     handler_fn, Consumer, ConsumerBinding, HandlerError, InboxStore, Message, MessageId,
///     StoreError, Transaction,
/// };
/// use inbox_testkit::MemoryBroker;
/// use tokio::sync::{Mutex, OwnedMutexGuard};
///
/// type Claims = HashSet<(String, MessageId)>;
///
/// #[derive(Clone, Default)]
/// struct SetStore {
///     claims: Arc<Mutex<Claims>>,
///     consumer: String,
/// }
///
/// /// Holds the claims until it ends: a second transaction waits for it.
/// struct SetTx {
///     claims: OwnedMutexGuard<Claims>,
///     new: Vec<(String, MessageId)>,
/// }
///
/// impl Transaction for SetTx {
///     async fn commit(mut self) -> Result<(), StoreError> {
///         self.claims.extend(self.new);
///         Ok(())
///     }
///     async fn rollback(self) -> Result<(), StoreError> {
///         Ok(())
///     }
/// }
///
/// impl InboxStore for SetStore {
///     type Tx = SetTx;
///
///     fn bind(&self, binding: &ConsumerBinding) -> Self {
///         let consumer = binding.consumer.clone();
///         Self { consumer, ..self.clone() }
///     }
///
///     async fn begin(&self) -> Result<SetTx, StoreError> {
///         let claims = Arc::clone(&self.claims).lock_owned().await;
///         Ok(SetTx { claims, new: Vec::new() })
///     }
///
///     async fn claim(&self, tx: &mut SetTx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
///         let mut answers = Vec::with_capacity(ids.len());
///         for id in ids {
///             let key = (self.consumer.clone(), id.clone());
///             let new = !tx.claims.contains(&key) && !tx.new.contains(&key);
///             if new {
///                 tx.new.push(key);
///             }
///             answers.push(new);
///         }
///         Ok(answers)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), inbox_core::Error> {
/// let broker = MemoryBroker::new();
/// for id in ["evt-1", "evt-2", "evt-1"] {
///     broker.publish(Some(id), "100");
/// }
/// let handler = handler_fn(async |_: &mut SetTx, _: &MessageId, _: &Message| {
///     Ok::<_, HandlerError>(())
/// });
/// let stats = Consumer::new("wallet", broker.source(), SetStore::default(), handler)
///     .run_until_idle()
///     .await?;
/// assert_eq!((stats.applied, stats.skipped_duplicates), (2, 1));
/// # Ok(()) }
/// ```
///
/// Errors carry a [`Recovery`](crate::Recovery): `Reconnect` when the store cannot be reached
/// (the consumer holds the messages and tries again, using up no delivery budget), `Retry` when
/// this transaction failed (the consumer splits the batch to find the message that fails and
/// retries it alone), `Fatal` when nothing will work until someone fixes it.
pub trait InboxStore: Send + Sync + 'static {
    /// An open transaction, handed to the handler; it commits or rolls back itself.
    type Tx: Transaction;

    /// This store for one consumer: its claims are scoped to `binding.consumer`. The consumer
    /// calls it once, when it starts, before any transaction; no I/O happens here, so a store
    /// that keeps names in a registry resolves the name at its first
    /// [`begin`](InboxStore::begin), before the transaction opens, and never inside one.
    ///
    /// `binding.handler_timeout` is the consumer's bound on a handler call. A handler cut off
    /// by it is dropped, but a statement it sent may keep running in the store, and the
    /// rollback that follows waits for it with the transaction's locks held. A store that can
    /// end its statements bounds those after the claim by it (the shorter of it and its own
    /// statement timeout); the claim itself, which may wait on a peer's uncommitted claim of
    /// the same ID, keeps the store's own timeouts (cut off by the handler's bound, that wait
    /// would count as the message's failure while the peer goes on).
    fn bind(&self, binding: &ConsumerBinding) -> Self
    where
        Self: Sized;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Records `ids` (distinct) for the bound consumer inside `tx`, in one round-trip where the
    /// store allows; the answer has one flag per ID, in order. `true`: the ID is new and its
    /// message must be applied in this transaction; `false`: it was applied before, skip it.
    /// Where two IDs make one key in the store (a UUID spelt in capitals and in lower case, for a
    /// UUID key), only the first of them is `true`, as claims one by one would answer.
    ///
    /// An ID the store cannot keep (a non-UUID for a uuid key column, say) fails the claim with
    /// [`RefusedId`] (`Err(RefusedId { index, reason }.into())`), before anything is written:
    /// the consumer then dead-letters that message and applies the others without it.
    fn claim(
        &self,
        tx: &mut Self::Tx,
        ids: &[MessageId],
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;
}

/// A claim refused the ID at `index` of its batch: the store cannot keep it. Returned from
/// [`InboxStore::claim`] as a [`StoreError`] (`RefusedId { .. }.into()`), it makes the consumer
/// dead-letter that message, saying why, and apply the rest of the batch without it.
#[derive(Debug, thiserror::Error)]
#[error("message ID {index} of the claim refused by the inbox store: {reason}")]
pub struct RefusedId {
    /// The refused ID's place in the claimed batch.
    pub index: usize,
    /// Why the store cannot keep it.
    pub reason: InvalidId,
}

impl RefusedId {
    /// The refusal inside `e`, if `e` is one.
    pub fn of(e: &StoreError) -> Option<&Self> {
        std::error::Error::source(e).and_then(|source| source.downcast_ref())
    }
}

impl From<RefusedId> for StoreError {
    fn from(refused: RefusedId) -> Self {
        StoreError::new(Recovery::Retry, "claiming message IDs", refused)
    }
}

impl<S: InboxStore> InboxStore for Arc<S> {
    type Tx = S::Tx;

    fn bind(&self, binding: &ConsumerBinding) -> Self {
        Arc::new((**self).bind(binding))
    }
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        (**self).begin().await
    }
    async fn claim(&self, tx: &mut Self::Tx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        (**self).claim(tx, ids).await
    }
}
