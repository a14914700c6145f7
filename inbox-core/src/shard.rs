//! A store that spreads messages over several databases by a key the user chooses.

use std::fmt;
use std::sync::Arc;

use crate::{
    ConsumerBinding, DynInboxStore, InboxStore, InvalidId, Message, MessageId, OperationError,
    Recovery, StoreError,
};

type Route = dyn Fn(&MessageId, &Message) -> usize + Send + Sync;

/// Several inbox stores of one kind (one per database), and a routing function that picks the
/// shard of each message: a tenant or account from a header or the payload, or the Kafka
/// partition ([`Metadata::lane`](crate::Metadata::lane)).
///
/// A message's claim and its effect commit in its shard's transaction, so the handler gets that
/// shard's transaction type (a `PgTx` for PostgreSQL shards) and writes the effect there. The
/// consumer never mixes shards in one transaction: a batch that spans shards is split into
/// chunks per shard, each committed on its own and acked only after its own commit. A shard
/// that fails leaves the others running: its messages are retried, held through an outage or
/// handed back to the broker, while the other shards' messages are acked as they commit. A
/// shard in an outage has one chunk out at a time (the one that finds out when it is back), so
/// the other lanes stay free for the healthy shards; its other messages wait in the consumer,
/// outside the window (`batch_size` × `parallel_lanes`), up to the read-ahead bound of
/// [`Consumer::parallel_lanes`](crate::Consumer::parallel_lanes) (8,192 messages per lane,
/// 65,536 in all), and are not handed back, so an outage uses up none of their delivery budget.
/// With `parallel_lanes(1)` that one chunk is the consumer's only one: give a sharded consumer
/// at least one lane more than it has shards in an outage at once.
///
/// ```
/// use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Sharded};
/// use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};
///
/// struct Credit;
///
/// impl Handler<MemoryTx<i64>> for Credit {
///     // The handler is the one an unsharded store takes: it gets its shard's transaction.
///     async fn handle(&self, tx: &mut MemoryTx<i64>, _: &MessageId, m: &Message)
///         -> Result<(), HandlerError> {
///         *tx.state_mut() += m.json::<i64>()?;
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), inbox_core::Error> {
/// let broker = MemoryBroker::new();
/// for (id, tenant) in [("evt-1", "acme"), ("evt-2", "globex"), ("evt-1", "acme")] {
///     let mut m = Message::new(Ok(MessageId::new(id).expect("a valid ID")), b"100".to_vec());
///     m.headers.push(("tenant".into(), tenant.into()));
///     broker.publish_message(m);
/// }
/// // One store per database (`PgInbox`s on two pools, say); the tenant header picks it.
/// let (acme, others) = (MemoryStore::<i64>::new(), MemoryStore::<i64>::new());
/// let store = Sharded::new(vec![acme.clone(), others.clone()], |_: &MessageId, m: &Message| {
///     usize::from(m.header("tenant") != Some(&b"acme"[..]))
/// });
/// Consumer::new("wallet", broker.source(), store, Credit).run_until_idle().await?;
/// assert_eq!(acme.state().await, 100); // once, though delivered twice
/// assert_eq!(others.state().await, 100);
/// # Ok(()) }
/// ```
///
/// # Routing
///
/// The function must give a message the same shard every time it is delivered: the inbox
/// catches a redelivery only in the shard that holds its claim. Its answer is taken modulo the
/// number of shards, so a hash can be returned as is. Adding a shard moves keys; there is no
/// resharding here: drain the consumer first, or route so existing keys keep their shard.
///
/// # Ordering
///
/// A lane's messages keep their order within each shard. When a lane spans shards (a Kafka
/// partition holding several tenants), its shards' chunks are applied side by side, and two
/// messages of the lane in different shards may commit in either order; route by the lane
/// itself (the partition) when the whole lane's order matters.
///
/// # Outside the consumer
///
/// [`InboxStore::begin`] and [`InboxStore::claim`] have no shard to go to and fail with
/// [`Recovery::Fatal`]; open a shard's transaction with [`Sharded::stores`] or
/// [`InboxStore::shard`]. For the same reason a store wrapper (a test's crash layer, say) goes
/// around each shard's store, not around the `Sharded` one.
pub struct Sharded<S> {
    stores: Vec<S>,
    route: Arc<Route>,
}

impl<S: InboxStore> Sharded<S> {
    /// One shard per store, in order: shard `i` is `stores[i]`.
    ///
    /// # Panics
    ///
    /// If `stores` is empty.
    pub fn new(
        stores: Vec<S>,
        route: impl Fn(&MessageId, &Message) -> usize + Send + Sync + 'static,
    ) -> Self {
        assert!(
            !stores.is_empty(),
            "a sharded inbox store needs at least one store"
        );
        Self {
            stores,
            route: Arc::new(route),
        }
    }

    /// The shards' stores, in shard order.
    pub fn stores(&self) -> &[S] {
        &self.stores
    }
}

impl<S: fmt::Debug> fmt::Debug for Sharded<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sharded")
            .field("stores", &self.stores)
            .finish_non_exhaustive()
    }
}

fn no_shard(what: &str) -> StoreError {
    OperationError::new(
        Recovery::Fatal,
        what.to_owned(),
        "a sharded inbox store has no single database: open a transaction in one shard's store \
         (Sharded::stores or InboxStore::shard)",
    )
}

impl<S: InboxStore> InboxStore for Sharded<S> {
    type Tx = S::Tx;

    /// Each shard's store bound the same way.
    fn bind(&self, binding: &ConsumerBinding) -> Self {
        Self {
            stores: self.stores.iter().map(|s| s.bind(binding)).collect(),
            route: Arc::clone(&self.route),
        }
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        Err(no_shard("beginning a transaction"))
    }

    async fn claim(&self, _tx: &mut Self::Tx, _ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        Err(no_shard("claiming message IDs"))
    }

    /// Refused if any shard would refuse it: the check comes before routing.
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        self.stores.iter().try_for_each(|s| s.check_id(id))
    }

    fn shard_of(&self, id: &MessageId, message: &Message) -> usize {
        (self.route)(id, message) % self.stores.len()
    }

    fn shard_count(&self) -> usize {
        self.stores.len()
    }

    fn shard(&self, index: usize) -> &(dyn DynInboxStore<Tx = Self::Tx> + 'static) {
        &self.stores[index % self.stores.len()]
    }
}
