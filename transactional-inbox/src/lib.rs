//! Effectively-once message handlers on any broker: the transactional inbox.
//!
//! One dependency and a feature per broker and store:
//!
//! ```sh
//! cargo add transactional-inbox -F kafka,postgres
//! ```
//!
//! | feature | module | crate |
//! |---|---|---|
//! | (always) | the crate root: [`Consumer`], [`Handler`] ([`handler_fn`]), [`BatchHandler`], [`MessageId`], … | `inbox-core` |
//! | `postgres` | `transactional_inbox::postgres` (`PgInbox`, `Outbox`, `PgLeases`) | `inbox-postgres` |
//! | `mysql` | `transactional_inbox::mysql` (`MySqlInbox`) | `inbox-mysql` |
//! | `kafka` | `transactional_inbox::kafka` | `inbox-kafka` (rdkafka, librdkafka built from source) |
//! | `kafka-zstd` | `kafka`, with zstd compression | `inbox-kafka`'s feature `zstd` |
//! | `sqs` | `transactional_inbox::sqs` | `inbox-sqs` (aws-sdk-sqs) |
//! | `rabbitmq` | `transactional_inbox::rabbitmq` | `inbox-rabbitmq` (lapin) |
//! | `redis-streams` | `transactional_inbox::redis_streams` | `inbox-redis-streams` (redis) |
//! | `redis-cluster` | `redis-streams`, with Redis Cluster | `inbox-redis-streams`'s feature `cluster` |
//! | `nats` | `transactional_inbox::nats` | `inbox-nats` (async-nats, JetStream) |
//! | `opentelemetry` | trace propagation | `inbox-core`'s feature |
//! | `tls` (default) | TLS on every connection: rustls on ring where the client allows (PostgreSQL: `sslmode=verify-full&sslrootcert=…` in the URL; MySQL: `ssl-mode=verify_identity&ssl-ca=…`; `rediss://`; `amqps://`), Kafka through the system's OpenSSL | each crate's feature `tls` |
//!
//! Every item of `inbox-core` is at the crate root, so a handler reads the same with either
//! dependency:
//!
//! ```
//! use transactional_inbox::{Handler, HandlerError, Message, MessageId};
//!
//! struct Audit;
//!
//! impl<Tx: Send + 'static> Handler<Tx> for Audit {
//!     async fn handle(&self, _tx: &mut Tx, id: &MessageId, message: &Message) -> Result<(), HandlerError> {
//!         println!("{id}: {} bytes", message.payload.len());
//!         Ok(())
//!     }
//! }
//! ```
//!
//! The runnable programs per broker are in the repository's `examples/examples/` directory.

pub use inbox_core::*;

/// The transactional inbox store on PostgreSQL: [`inbox_postgres`].
#[cfg(feature = "postgres")]
pub use inbox_postgres as postgres;

/// The transactional inbox store on MySQL and MariaDB: [`inbox_mysql`].
#[cfg(feature = "mysql")]
pub use inbox_mysql as mysql;

/// The Kafka adapter: [`inbox_kafka`].
#[cfg(feature = "kafka")]
pub use inbox_kafka as kafka;

/// The Amazon SQS adapter: [`inbox_sqs`].
#[cfg(feature = "sqs")]
pub use inbox_sqs as sqs;

/// The RabbitMQ adapter: [`inbox_rabbitmq`].
#[cfg(feature = "rabbitmq")]
pub use inbox_rabbitmq as rabbitmq;

/// The Redis Streams adapter: [`inbox_redis_streams`].
#[cfg(feature = "redis-streams")]
pub use inbox_redis_streams as redis_streams;

/// The NATS JetStream adapter: [`inbox_nats`].
#[cfg(feature = "nats")]
pub use inbox_nats as nats;

/// The README's quick start, compiled as a doctest (`no_run`: it needs the services), so the
/// first program a user copies stays true. Its fragments are `ignore`.
#[cfg(all(doctest, feature = "postgres", feature = "redis-streams"))]
#[doc = include_str!("../../README.md")]
pub struct ReadmeQuickStart;
