//! Effectively-once message handling on at-least-once brokers: the transactional inbox.
//!
//! Every broker redelivers: after a crash between the database commit and the ack, after a
//! rebalance, when a producer resends, when a visibility timeout runs out mid-handler. This crate
//! makes the second copy harmless. Each message carries a producer-set ID; in one store
//! transaction the [`Consumer`] claims that ID for its consumer name and runs your [`Handler`],
//! which writes its side effect through the same transaction; the broker ack comes after the
//! commit. A redelivered copy finds its ID claimed, is skipped, and is acked.
//!
//! A [`BatchHandler`] (with [`Consumer::batched`]) gets all new messages of a transaction at
//! once, decoded beforehand, for set-based writes.
//!
//! A side effect outside the database (an HTTP call, an email) cannot join that transaction;
//! [`Consumer::effects`] keeps processing and done states with a lease and a
//! fencing token for it, and passes the provider an idempotency key per message.
//!
//! A message for another broker can join it: the handler writes it into an outbox table
//! through the same transaction (`inbox_postgres::Outbox`), and a relay publishes it under a
//! stable ID through [`Publish`], the producing side every adapter's producer implements.
//!
//! This crate has no broker or database dependency. Pick a [`MessageSource`] adapter
//! (`inbox-kafka`, `inbox-sqs`, `inbox-rabbitmq`, `inbox-redis-streams`) and an [`InboxStore`]
//! (`inbox-postgres`), or implement the traits for your own.
//!
//! ```
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId};
//! use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};
//!
//! /// Adds the amount in each message to a balance.
//! struct Credit;
//!
//! impl Handler<MemoryTx<i64>> for Credit {
//!     async fn handle(&self, tx: &mut MemoryTx<i64>, _id: &MessageId, message: &Message) -> Result<(), HandlerError> {
//!         let amount: i64 = message.json()?; // unparsable: dead-lettered, never retried
//!         *tx.state_mut() += amount; // the inbox transaction: commits with the claim, or not at all
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), inbox_core::Error> {
//! // Any adapter's source and any store; here the in-memory ones of `inbox-testkit`.
//! let broker = MemoryBroker::new();
//! broker.publish(Some("evt-1"), "100");
//! broker.publish(Some("evt-1"), "100"); // the same message again: a producer's resend
//! let store = MemoryStore::<i64>::new();
//! let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
//!     .batch_size(100) // one transaction and one ack round trip per 100 messages
//!     .run_until_idle() // in production `run()`: until SIGINT or SIGTERM
//!     .await?;
//! assert_eq!(store.state().await, 100); // credited once
//! assert_eq!(stats.skipped_duplicates, 1);
//! # Ok(()) }
//! ```
//!
//! On PostgreSQL the handler is a `Handler<inbox_postgres::PgTx>` that writes through
//! `&mut **tx` with sqlx, and the store is `inbox_postgres::PgInbox`: see that crate.
//!
//! Several databases behind one consumer: [`Sharded`] routes each message to one of them by a
//! key of your choice, and commits its claim and effect there.
//!
//! Testing a handler needs no broker or database: the crate `inbox-testkit` has an in-memory
//! broker and store, with crash points.
//!
//! Logging goes through `tracing`: one line per batch at `info`, per-message lines at `debug`
//! with escaped IDs, and spans after the OpenTelemetry messaging conventions (`inbox.process`
//! per transaction, `inbox.settle` per ack, nack or dead letter). Metrics go through the
//! `metrics` facade, labelled by consumer: counters (`inbox_messages_applied_total`,
//! `inbox_duplicates_skipped_total`, `inbox_retries_total`, `inbox_dead_lettered_total`,
//! `inbox_ack_failures_total`, ...), histograms (`inbox_handler_duration_seconds`,
//! `inbox_end_to_end_lag_seconds`, ...) and gauges (`inbox_in_flight_messages`,
//! `inbox_consumer_ready`); [`telemetry`] lists them all and propagates W3C `traceparent`
//! headers. [`Probes`] says what `/healthz` and `/readyz` answer, for the HTTP server the
//! application already runs; with the feature `opentelemetry`, a message's `traceparent` becomes
//! the parent of its processing span.

mod consumer;
pub mod effect;
mod error;
mod handler;
mod health;
mod hooks;
mod id_from;
mod message;
mod probes;
mod publish;
mod recent;
mod redact;
pub mod replay;
mod shard;
mod source;
pub mod sql;
mod stats;
mod store;
pub mod telemetry;

pub use consumer::{
    retention_shortfall, Consumer, Inbox, Order, RetryPolicy, Work, DEFAULT_SHUTDOWN_TIMEOUT,
};
pub use error::{
    backoff, BoxError, Error, Failure, HandlerError, OperationError, Recovery, Result, SourceError,
    StoreError,
};
pub use handler::{
    handler_fn, BatchHandler, BatchItem, Handler, HandlerCall, HandlerFn, PerMessage,
};
pub use health::{ConsumerState, Health};
pub use hooks::{Stage, StageHook};
pub use id_from::{Binding, CloudEventsIdentity, IdCarrier, IdFrom};
pub use message::{IdError, InvalidId, Message, MessageId, Metadata};
pub use probes::{Answer, Probes};
pub use publish::{Destinations, DynPublish, OutgoingMessage, Publish, PublishError};
use recent::Recent;
pub use redact::{is_secret_setting, redact_url, REDACTED};
pub use shard::Sharded;
pub use source::{
    dead_letter, Ack, Capabilities, Delivery, MessageSource, REDELIVERY_COUNT, REPLAYED,
};
pub use stats::{Stats, StatsSnapshot};
pub use store::{ConsumerBinding, InboxStore, RefusedId, Transaction};
pub use telemetry::{describe_metrics, TraceParent};
