//! The transactional inbox store on PostgreSQL, for [`inbox_core`].
//!
//! ```no_run
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, MessageSource};
//! use inbox_postgres::{PgInbox, PgTx};
//!
//! struct Credit;
//!
//! impl Handler<PgTx> for Credit {
//!     async fn handle(&self, tx: &mut PgTx, id: &MessageId, message: &Message) -> Result<(), HandlerError> {
//!         let amount: i64 = message.json()?;
//!         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = 1")
//!             .bind(amount)
//!             .execute(&mut **tx) // the inbox transaction: commits with the claim, or not at all
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! /// `source`: a Kafka, SQS, RabbitMQ or Redis Streams adapter's source.
//! async fn run(source: impl MessageSource) -> Result<(), Box<dyn std::error::Error>> {
//!     let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//!     let inbox = PgInbox::new(pool);
//!     inbox.migrate().await?;
//!     Consumer::new("wallet", source, inbox, Credit).run().await?;
//!     Ok(())
//! }
//! ```
//!
//! ## Bad IDs
//! The core refuses, and dead-letters, IDs that are empty, longer than 1024 bytes, not UTF-8 or
//! holding a NUL byte (`text` cannot store NUL). Every other ID is stored verbatim in
//! [`KeyMode::Text`] and compared byte for byte: whitespace and case matter. [`KeyMode::Uuid`]
//! additionally refuses IDs that are not UUIDs; [`KeyMode::Hashed`] takes any ID and keeps 16
//! bytes of it.
//!
//! ## Retention at ingest speed: partitions
//! [`PgInbox::purge`] deletes expired rows in batches, which at tens of thousands of messages a
//! second costs about what the claims cost. [`PgInbox::partitioned`] lays the table out in
//! partitions by UUIDv7 key range (a day each by default), and the purge then drops a day whole;
//! see [`Partitions`].
//!
//! ## Side effects on a broker: the outbox
//! A handler that must publish writes the message into an [`Outbox`] table through the same
//! transaction; an [`OutboxRelay`] publishes the committed rows through any adapter's producer
//! ([`inbox_core::Publish`]) under a stable message ID and marks them sent once the broker
//! confirmed. See [`Outbox`].
//!
//! ## Side effects outside the database: leases
//! A call to a provider (a payment API, an email service) cannot join the inbox transaction:
//! [`PgLeases`] keeps the lease and fencing token [`inbox_core::Consumer::effects`] needs.
//!
//! ## A store of your own on the same database
//! An application that already records processed messages in a table of its own can keep it:
//! its [`InboxStore`](inbox_core::InboxStore) opens a [`PgTx`] ([`PgTx::begin`], or `From` a
//! `sqlx::Transaction`), and handlers written for [`PgInbox`] run on it unchanged; see the
//! repository's `docs/writing-a-store.md`.

mod error;
mod lease;
mod migration;
mod outbox;
mod partition;
mod pooling;
mod relay;
mod retention;
mod store;
mod table;
mod tx;

pub use error::{Error, Result};
pub use inbox_core::sql::KeyMode;
pub use lease::{PgLeases, DEFAULT_LEASE_LOCK_TIMEOUT};
pub use outbox::{
    spawn_outbox_purger, Outbox, OUTBOX_ERRORS_COUNTER, OUTBOX_OLDEST_UNSENT_GAUGE,
    OUTBOX_PUBLISHED_COUNTER,
};
pub use partition::{Conversion, DroppedPartition, PartitionInfo, PartitionRange, Partitions};
pub use relay::{OutboxRelay, RelayError, RelayStats};
pub use retention::{
    spawn_purger, ConsumerWindow, PurgeReport, Storage, DEFAULT_PURGE_BATCH, OLDEST_AGE_GAUGE,
    PURGE_LAST_SUCCESS_GAUGE,
};
pub use store::PgInbox;
pub use table::TableName;
pub use tx::PgTx;

/// The sqlx this crate is built on: its pool, connection (behind [`PgTx`]) and error types are the
/// ones in this crate's API. Name sqlx through this re-export (`use inbox_postgres::sqlx;`) so
/// your queries use the same sqlx version as the store.
pub use sqlx;
