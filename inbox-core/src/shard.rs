//! The stores a consumer spreads messages over, by a key the user chooses: one database, or
//! several.

use std::fmt;
use std::sync::Arc;

use crate::{ConsumerBinding, InboxStore, Message, MessageId};

type Route = dyn Fn(&MessageId, &Message) -> usize + Send + Sync;

/// Several inbox stores of one kind (one per database), and a routing function that picks the
/// shard of each message: a tenant or account from a header or the payload, or the Kafka
/// partition ([`Metadata::lane`](crate::Metadata::lane)). Give it to
/// [`Consumer::new`](crate::Consumer::new) in place of one store (one store is a `Sharded` of
/// one, by `From`); a store itself knows nothing of shards.
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
#[derive(Clone)]
pub struct Sharded<S> {
    stores: Vec<S>,
    /// `None`: one store.
    route: Option<Arc<Route>>,
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
            route: Some(Arc::new(route)),
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

/// One store: every message in it.
impl<S: InboxStore> From<S> for Sharded<S> {
    fn from(store: S) -> Self {
        Self {
            stores: vec![store],
            route: None,
        }
    }
}

impl<S: InboxStore> Sharded<S> {
    /// Each shard's store bound to the consumer ([`InboxStore::bind`]).
    pub(crate) fn bind(&self, binding: &ConsumerBinding) -> Self {
        Self {
            stores: self.stores.iter().map(|s| s.bind(binding)).collect(),
            route: self.route.clone(),
        }
    }

    /// The shard of `message`: the routing function's answer modulo the number of shards.
    pub(crate) fn shard_of(&self, id: &MessageId, message: &Message) -> usize {
        self.route
            .as_ref()
            .map_or(0, |route| route(id, message) % self.stores.len())
    }

    /// How many shards there are.
    pub(crate) fn count(&self) -> usize {
        self.stores.len()
    }

    /// The store of shard `index`.
    pub(crate) fn shard(&self, index: usize) -> &S {
        &self.stores[index % self.stores.len()]
    }
}
