//! The transactional inbox store on MySQL and MariaDB (InnoDB), for [`inbox_core`].
//!
//! ```no_run
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, MessageSource};
//! use inbox_mysql::{MySqlInbox, MySqlTx};
//!
//! struct Credit;
//!
//! impl Handler<MySqlTx> for Credit {
//!     async fn handle(&self, tx: &mut MySqlTx, id: &MessageId, message: &Message) -> Result<(), HandlerError> {
//!         let amount: i64 = message.json()?;
//!         sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = 1")
//!             .bind(amount)
//!             .execute(&mut **tx) // the inbox transaction: commits with the claim, or not at all
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! /// `source`: a Kafka, SQS, RabbitMQ or Redis Streams adapter's source.
//! async fn run(source: impl MessageSource) -> Result<(), Box<dyn std::error::Error>> {
//!     // mysql://user:password@host:3306/database
//!     let pool = sqlx::MySqlPool::connect(&std::env::var("INBOX_MYSQL_URL")?).await?;
//!     let inbox = MySqlInbox::new(pool);
//!     inbox.migrate().await?;
//!     Consumer::new("wallet", source, inbox, Credit).run().await?;
//!     Ok(())
//! }
//! ```
//!
//! ## What differs from the PostgreSQL store
//! The guarantee is the same: the claim and the handler's writes commit together or not at
//! all, and a redelivered message finds its claim. How it is kept differs where the databases
//! do:
//!
//! - **Isolation.** The inbox transaction runs under `READ COMMITTED`, not InnoDB's default
//!   `REPEATABLE READ`, to keep gap locks out of claims, purges and handlers' writes; see
//!   [`MySqlInbox`].
//! - **Errors inside a transaction.** A failed statement in MySQL undoes that statement only,
//!   and the transaction goes on: a handler that ignores such an error commits what else it
//!   did, as it would in any MySQL program. A deadlock (1213) is different: InnoDB rolls the
//!   whole transaction back, the claim with it. [`MySqlTx`] keeps what a handler runs after
//!   that from committing, and its commit fails so the message is retried.
//! - **Deadlocks and lock waits** (errors 1213 and 1205) are transient: the consumer retries the
//!   message ([`inbox_core::Recovery::Retry`]). A lost connection makes the consumer reconnect
//!   and try again; a commit cut off that way has an unknown outcome, which the redelivery
//!   settles (its claim is there, or it is applied now).
//! - **DDL** (`CREATE`, `ALTER`, `TRUNCATE`…) commits the open transaction implicitly in MySQL:
//!   a handler must not run it, or the claim commits before the handler is done.
//! - **Retention** is [`MySqlInbox::purge`], a batched `DELETE`; there is no partitioned layout.
//! - **No outbox or leases yet**: the outbox relay and the effect leases are PostgreSQL's.
//!
//! ## Bad IDs
//! The core refuses, and dead-letters, IDs that are empty, longer than 1024 bytes or not
//! UTF-8. Every other ID is stored verbatim in [`KeyMode::Text`], in a `varbinary(1024)`
//! column, and compared byte for byte: whitespace and case matter. The store refuses a text key
//! longer than its column on its own too (never cut short, which on a server outside strict mode
//! would make two IDs sharing the first 1,024 bytes one). [`KeyMode::Uuid`] also refuses IDs
//! that are not UUIDs; [`KeyMode::Hashed`] takes any ID and keeps 16 bytes of it.
//!
//! ## Servers
//! Tested on MariaDB 10.11 (`cargo xtask services` starts Debian's). The SQL is MySQL 8's as
//! well (no `RETURNING`, no MariaDB-only syntax), but no MySQL server runs in this workspace's
//! tests. MySQL 8's default authentication (`caching_sha2_password`) needs TLS (the feature
//! `tls`, on by default) or sqlx's feature `mysql-rsa`.
//!
//! ## Why there is no SQLite store
//! The inbox's guarantee across processes rests on a racing claim that waits for the first
//! claimant's transaction on that one row and then sees its outcome. SQLite has one writer per
//! database file: a second consumer's write transaction waits for the whole database (or fails
//! with `SQLITE_BUSY` once its busy timeout passes), so competing consumers, the usual way to
//! scale a queue's consumers, would run one transaction at a time, and a long handler would
//! stall every other consumer. A single consumer process with its effects in the same SQLite
//! file (a local tool, an edge device) would be correct, and the claim would be the same
//! `INSERT` as here; it is left out until there is such a user, rather than shipped as a store
//! whose limits contradict the rest of the project's (several processes, one table).

mod error;
mod migration;
mod retention;
mod store;
mod table;
mod tx;

pub use error::{Error, Result, DEADLOCK, LOCK_WAIT_TIMEOUT};
pub use inbox_core::sql::KeyMode;
pub use retention::{PurgeReport, DEFAULT_PURGE_BATCH};
pub use store::MySqlInbox;
pub use table::TableName;
pub use tx::MySqlTx;

/// The sqlx this crate is built on: its pool, connection (behind [`MySqlTx`]) and error types
/// are the ones in this crate's API. Name sqlx through this re-export (`use inbox_mysql::sqlx;`)
/// so your queries use the same sqlx version as the store.
pub use sqlx;
