//! Test support for inbox: never in production, nothing here is durable.
//!
//! An in-memory broker and store with crash points, for fast, deterministic tests of the
//! algorithm and of handlers:
//!
//! - [`MemoryBroker`] delivers at least once: a delivery not acked when its [`MemorySource`] is
//!   dropped (the consumer "died") goes back to the queue, flagged redelivered, like a RabbitMQ
//!   channel closing.
//! - [`MemoryStore`] keeps a state `S` of your choice and the inbox claims; a transaction works
//!   on a copy and publishes it on commit, so a crash before commit leaves nothing behind.
//! - [`Crash`] wraps a consumer's store, handler and source, and stops the consumer dead after
//!   claim, apply, commit or ack, as a crash there would.
//! - Two anti-patterns, to show what the inbox prevents (feature `never-in-production`):
//!   `WithoutInbox` wraps any store and claims nothing ("commit after the database, no
//!   inbox"); `AckOnReceive` wraps any source and acks each delivery as it is received ("ack
//!   first", at-most-once).
//! - [`ScriptedLeases`] answers the effect consumer's lease calls from a script.
//! - [`forward_source!`] and [`forward_ack!`] write the methods a wrapper leaves to the wrapped
//!   source or ack handle.
//!
//! ```
//! use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId};
//!
//! /// Adds the amount in each message to a balance.
//! struct Credit;
//!
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
//!
//! This crate depends on `inbox-core` alone (as `tower-test` on `tower-service`), so the core's
//! tests compile no database or broker client. What needs a real server (a throw-away
//! PostgreSQL schema per test, the wallet domain, the fault proxy, the child-process runner, the
//! local HTTP provider) is in `inbox-conformance`, beside the suite that uses it.
//!
//! What the adapters' tests share besides: [`publish`], one producer sending every way;
//! [`metadata`], a trace parent to send and the checks on what a source reports; [`Sum`], a
//! handler summing numbers in a [`MemoryStore`].

#[cfg(feature = "never-in-production")]
mod ack_on_receive;
mod crash;
mod forward;
#[cfg(feature = "gauges")]
pub mod gauges;
pub mod log;
mod memory_broker;
mod memory_store;
pub mod metadata;
pub mod publish;
mod scripted_leases;
mod sum;
mod wait;
#[cfg(feature = "never-in-production")]
mod without_inbox;

#[cfg(feature = "never-in-production")]
pub use ack_on_receive::{AckOnReceive, AckedOnReceive};
pub use crash::{Crash, Crashed, Crashing, CrashingAck};
pub use memory_broker::{Connection, MemoryAck, MemoryBroker, MemorySource, Redelivery};
pub use memory_store::{MemoryStore, MemoryTx};
pub use scripted_leases::ScriptedLeases;
pub use sum::Sum;
pub use wait::{eventually, receive, watch_errors};
#[cfg(feature = "never-in-production")]
pub use without_inbox::WithoutInbox;

#[doc(hidden)]
pub use inbox_core as __core;

/// `mutex`, locked; a panic while another holder had it leaves the data as it was.
pub fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A retry policy for tests: `max_attempts` tries, 10–50 ms apart.
pub fn fast_retry(max_attempts: u32) -> inbox_core::RetryPolicy {
    inbox_core::RetryPolicy::default()
        .max_attempts(max_attempts)
        .backoff(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_millis(50),
        )
}
