//! Test kit: an in-memory broker and store with crash points, for fast, deterministic tests of
//! the algorithm and of handlers (feature `testkit`).
//!
//! - [`MemoryBroker`] delivers at least once: a delivery not acked when its [`MemorySource`] is
//!   dropped (the consumer "died") goes back to the queue, flagged redelivered, like a RabbitMQ
//!   channel closing.
//! - [`MemoryStore`] keeps a state `S` of your choice and the inbox claims; a transaction works
//!   on a copy and publishes it on commit, so a crash before commit leaves nothing behind.
//! - [`crash_at`] builds a [`StageHook`](crate::StageHook) that kills the consumer after claim,
//!   apply, commit or ack.
//! - [`WithoutInbox`] wraps any store and claims nothing: the "commit after the database, no
//!   inbox" anti-pattern, to show what the inbox prevents.
//! - [`FaultProxy`] sits between a client and a real server and refuses, cuts or black-holes its
//!   connections on demand: database and broker outages for fault tests.
//!
//! Never in production: nothing here is durable.
//!
//! ```
//! use inbox_core::testkit::{MemoryBroker, MemoryStore, MemoryTx};
//! use inbox_core::{async_trait, Consumer, Handler, HandlerError, Message, MessageId};
//!
//! /// Adds the amount in each message to a balance.
//! struct Credit;
//!
//! #[async_trait]
//! impl Handler<MemoryTx<i64>> for Credit {
//!     async fn handle(
//!         &self,
//!         tx: &mut MemoryTx<i64>,
//!         _id: &MessageId,
//!         message: &Message,
//!     ) -> Result<(), HandlerError> {
//!         let amount: i64 = message.json()?;
//!         *tx.state_mut() += amount;
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), inbox_core::Error> {
//! let broker = MemoryBroker::new();
//! broker.publish(Some("evt-1"), "100");
//! broker.publish(Some("evt-1"), "100"); // the producer sent it twice
//! let store = MemoryStore::<i64>::new();
//!
//! let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
//!     .run_until_idle()
//!     .await?;
//!
//! assert_eq!(store.state().await, 100); // credited once
//! assert_eq!(stats.skipped_duplicates, 1);
//! # Ok(())
//! # }
//! ```

mod fault_proxy;
mod memory_broker;
mod memory_store;
pub mod provider;
mod without_inbox;

pub use fault_proxy::{FaultProxy, ProxyMode};
pub use memory_broker::{AckMode, MemoryAck, MemoryBroker, MemorySource};
pub use memory_store::{MemoryStore, MemoryTx};
pub use without_inbox::WithoutInbox;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::{HookAction, MessageId, Stage, StageHook};

/// A hook that crashes the consumer the first time any message reaches `stage`, then lets
/// every later call pass (so a restarted consumer with the same hook runs on).
pub fn crash_at(stage: Stage) -> StageHook {
    let fired = Arc::new(Mutex::new(false));
    StageHook::new(move |at, _id| {
        let mut fired = fired.lock().unwrap_or_else(|e| e.into_inner());
        if at == stage && !*fired {
            *fired = true;
            HookAction::Crash
        } else {
            HookAction::Continue
        }
    })
}

/// A hook that crashes the consumer when one of `ids` reaches `stage`, once per ID.
pub fn crash_at_ids(stage: Stage, ids: impl IntoIterator<Item = MessageId>) -> StageHook {
    let armed: Arc<Mutex<HashSet<MessageId>>> = Arc::new(Mutex::new(ids.into_iter().collect()));
    StageHook::new(move |at, id| {
        let mut armed = armed.lock().unwrap_or_else(|e| e.into_inner());
        if at == stage && armed.remove(id) {
            HookAction::Crash
        } else {
            HookAction::Continue
        }
    })
}
