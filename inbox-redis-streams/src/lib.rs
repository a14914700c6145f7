//! Effectively-once consumption of a Redis stream: a consumer group read by an
//! [`inbox_core::Consumer`], recovering dead consumers' entries with `XAUTOCLAIM`.
//!
//! ```no_run
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Publish};
//! use inbox_postgres::{PgInbox, PgTx};
//! use inbox_redis_streams::RedisConnection;
//!
//! /// Adds the amount in each message to account 1.
//! struct Credit;
//!
//! impl Handler<PgTx> for Credit {
//!     async fn handle(&self, tx: &mut PgTx, _id: &MessageId, message: &Message) -> Result<(), HandlerError> {
//!         let amount: i64 = message.json()?;
//!         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = 1")
//!             .bind(amount)
//!             .execute(&mut **tx) // the inbox transaction: commits with the claim, or not at all
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Redis at REDIS_URL (unset: connect fails); `RedisConnection::new(url)` names one. The
//! // source, the producer and the dead-letter reader all reach Redis through it.
//! let redis = RedisConnection::from_env();
//! let producer = redis.producer().connect().await?;
//! let id = producer.send("payments", b"100").await?;
//! producer.send_with_id("payments", &id, b"100").await?; // a retried publish: same ID, new entry
//!
//! let source = redis.source("payments", "wallet")
//!     .consumer_name("wallet-0") // one per process, stable across restarts: see `consumer_name`
//!     .connect()
//!     .await?;
//! let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?; // PostgreSQL at DATABASE_URL
//! let inbox = PgInbox::new(pool);
//! inbox.migrate().await?;
//! Consumer::new("wallet", source, inbox, Credit) // credits 100 once
//!     .batch_size(50)
//!     .max_deliveries(5)
//!     .run()
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! A whole program to copy, with a stream of its own and a check of the balance:
//! `examples/examples/redis_streams.rs` (`cargo run -p inbox-examples --example redis_streams`).
//!
//! # Entry layout
//!
//! An entry holds the producer-set message ID in the ID field (default `event_id`, see
//! [`RedisStreamSourceBuilder::id_field`]), the body in the field `payload`, and any other fields,
//! which the consumer sees as [`Message::headers`](inbox_core::Message::headers) in entry order.
//! The stream entry ID (`1718000000000-0`) is only the [position](inbox_core::Metadata::position):
//! a republished event gets a new one, so it cannot deduplicate. An entry without an ID field
//! is dead-lettered. [`RedisStreamProducer`] writes this layout.
//!
//! Entries of other producers are read where their convention puts the ID, with
//! [`RedisStreamSourceBuilder::id_from`] (see [`IdFrom`]): another field, a structured-mode
//! CloudEvent in `payload` (`id`, or `source` and `id`), the Debezium outbox router's `id` as a
//! field, or a JSON field of the payload. Those fields then stay among the headers.
//!
//! # Ack semantics
//!
//! - **Ack** is `XACK <stream> <group> <entry ID…>`, sent only after the database transaction
//!   that recorded the message ID committed, one `XACK` for a whole batch. It removes the
//!   entries from the group's pending entries list (PEL). A failed ack after the commit is
//!   logged, not fatal: the entry stays pending, comes back, and is skipped as a duplicate.
//! - **Never acked** (the process died, or its ack failed): the entry stays in the dead
//!   consumer's PEL. A process restarted under the same consumer name rereads it first thing
//!   (`XREADGROUP … 0`); otherwise any consumer takes it over with `XAUTOCLAIM` once it has been
//!   idle for [`claim_idle`](RedisStreamSourceBuilder::claim_idle). Both raise its delivery count,
//!   which [`Metadata::delivery_count`](inbox_core::Metadata::delivery_count) reports, so
//!   [`Consumer::max_deliveries`](inbox_core::Consumer::max_deliveries) dead-letters an entry
//!   that keeps killing its consumer.
//! - **Slow, not dead**: an entry whose handler runs longer than `claim_idle` is claimed by
//!   another consumer while the first still works on it (a zombie). Both then try to apply it;
//!   the inbox's unique claim lets exactly one commit win and the other skip. Keep `claim_idle`
//!   above the slowest handler to avoid the wasted work.
//! - **Lost connection**: a command that fails, or gets no reply within
//!   [`operation_timeout`](RedisConnection::operation_timeout), drops its connection and
//!   the next one connects anew. The source then rereads its own pending entries first, so
//!   entries whose read reply or `XACK` was lost come back at once (and are skipped as
//!   duplicates if already applied), not after `claim_idle`.
//! - **Nack** leaves the entry pending: Redis cannot delay a redelivery, so it comes back after
//!   `claim_idle`, through `XAUTOCLAIM`.
//! - **Delayed redelivery** (a redelivery schedule,
//!   [`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy::redeliver_after)) leaves the
//!   entry pending too, marked with its count and delay in the hash
//!   `<stream>:<group>:redeliveries`, its idle time restarted; the claim sweep takes a marked
//!   entry once it has been idle for its delay. That copy then belongs to its consumer like any
//!   other: taken over only after `claim_idle`, however long its handler runs past the delay.
//!   See [`RedisStreamAck`] and [`sweep`].
//! - **Dead letter** ([`RedisStreamAck`]'s [`Ack::dead_letter`](inbox_core::Ack::dead_letter)):
//!   `XADD <stream>:dlq * <original fields…> reason <text> original_source <stream>
//!   original_position <entry ID>` (the names of [`inbox_core::dead_letter`]; the dead-letter
//!   stream's name on a cluster: see [Redis Cluster](#redis-cluster)) and `XACK`, in
//!   one script: the `XACK` runs only if the `XADD` did (inside `MULTI` it would run even when
//!   the `XADD` failed, and the entry would be lost). If the script fails, or its reply is lost,
//!   the entry stays pending and is dead-lettered again later: the dead-letter stream may hold
//!   a copy twice, never zero times.
//! - **Trimmed or deleted while pending** (`XTRIM`, `XADD … MAXLEN`, `XDEL`): nothing is left
//!   to apply, so the entry is removed from the PEL with `XACK` and logged (a warning with its
//!   ID), whether the reread finds it (`[id, nil]`) or `XAUTOCLAIM` does. Redis 7 drops such
//!   entries from the PEL during `XAUTOCLAIM` and lists their IDs; Redis 6.2 claims them and
//!   answers a bare nil without the ID, so the source looks them up in its own PEL over the
//!   range the claim covered and acks those no longer in the stream. The live entries of the
//!   same reply are delivered either way.
//! - **Batches**: entries of one batch are applied in stream order in one transaction; a
//!   reclaimed entry is applied when it is reclaimed, after newer entries, so a stream consumed
//!   by several consumers (or with recoveries) is not applied in strict stream order.
//!
//! # A deleted consumer group
//!
//! The source creates its group at start if it is missing (`XGROUP CREATE <stream> <group> 0
//! MKSTREAM`, so entries added before the first start are read). If the group, or the whole
//! stream key, is deleted while the source runs, it does **not** create it again: a group made
//! at `0` would silently reread the whole stream, one made at `$` would silently skip what was
//! added meanwhile. [`receive`](inbox_core::MessageSource::receive) logs an error naming the
//! stream and group and fails with [`Error::GroupMissing`], which is fatal: the consumer stops.
//! Re-create the group at the entry to resume from and restart the consumer (a restart without
//! that creates the group at `0`, as on a first start: the whole stream is read again, and the
//! inbox skips the IDs it still holds).
//!
//! # Redis Cluster
//!
//! With the feature `cluster`, `RedisConnection::cluster` takes the URLs of some of a cluster's
//! nodes instead of one server's; the source, the producer and the dead-letter reader built from
//! it have the same options as on one server. Each command goes to the
//! master of the stream's hash slot; the client follows `MOVED` and `ASK` through slot
//! migrations and finds the new master after a failover.
//!
//! ```no_run
//! # #[cfg(feature = "cluster")]
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use inbox_redis_streams::RedisConnection;
//!
//! let cluster = RedisConnection::cluster(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]);
//! let producer = cluster
//!     .producer()
//!     .wait_for_replicas(1, Duration::from_secs(1)) // survive the master's death
//!     .connect()
//!     .await?;
//! let source = cluster
//!     .source("{payments}", "wallet")
//!     .consumer_name("wallet-0")
//!     .connect() // dead letters to `{payments}:dlq`, in the same slot
//!     .await?;
//! # let _ = (producer, source); Ok(()) }
//! ```
//!
//! - **Keys**: the stream, its group and its dead-letter stream must share a hash slot (the
//!   dead-letter script touches both streams). The default dead-letter stream is `<stream>:dlq`
//!   when the stream has a hash tag (`{payments}` → `{payments}:dlq`) and `{<stream>}:dlq` when
//!   it has none (`payments` → `{payments}:dlq`, whose tag hashes to the slot of `payments`).
//!   A dead-letter stream in another slot fails `connect`.
//! - **Lost writes**: Redis replicates asynchronously, so an `XADD` the master answered can die
//!   with it, before any replica had it: the send returned `Ok` and the entry never reaches a
//!   consumer. [`RedisStreamProducerBuilder::wait_for_replicas`] makes a send return `Ok` only
//!   once replicas have it (`WAIT`); without it, a failover loses the last writes the old
//!   master had not streamed to its replica.
//! - **Lost acks and reads**: an `XACK`, or the record of a delivery, that the old master had
//!   not replicated is gone after a failover too: the entry is pending again (or undelivered)
//!   and comes back, and the inbox skips it. A dead letter's copy and ack replicate together.
//! - **During the failover** (`cluster-node-timeout` plus the election) the stream's slot has no
//!   master: commands fail, the consumer backs off and retries. A command that lost its
//!   connection or timed out makes the source connect anew and reread its own pending entries,
//!   as on one server; an entry whose ack was lost without that comes back through `XAUTOCLAIM`
//!   after `claim_idle`.
//!
//! # Consumer names when scaled
//!
//! Every process needs its own consumer name in the group; see
//! [`RedisStreamSourceBuilder::consumer_name`]. The inbox consumer name given to
//! [`Consumer::new`](inbox_core::Consumer::new) is a different thing: all instances of one
//! logical consumer share it (it scopes the applied IDs), while each has its own Redis consumer
//! name.

mod ack;
#[cfg(feature = "cluster")]
mod cluster;
mod config;
mod connection;
mod dead_letters;
mod error;
mod producer;
mod reply;
mod source;
pub mod sweep;

pub use ack::RedisStreamAck;
pub use config::RedisStreamSourceBuilder;
pub use connection::RedisConnection;
pub use dead_letters::{RedisDeadLetters, RedisDeadLettersBuilder};
pub use error::{Error, Result};
pub use inbox_core::{CloudEventsIdentity, IdFrom};
pub use producer::{RedisStreamProducer, RedisStreamProducerBuilder};
pub use source::RedisStreamSource;

/// The Redis client this crate uses, for [`RedisConnection::from_client`] and
/// [`RedisStreamProducerBuilder::connection_manager`].
pub use redis;

/// The Redis URL from the `REDIS_URL` environment variable; unset or empty is an error that
/// says so. There is no default: a missing setting must not reach a Redis on localhost.
pub fn url_from_env() -> Result<String> {
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => Ok(url),
        _ => Err(Error::Config(
            "no Redis server: set REDIS_URL or name one with `RedisConnection::new(url)`".into(),
        )),
    }
}

/// The entry field that holds the message ID unless configured otherwise.
pub const DEFAULT_ID_FIELD: &str = "event_id";

/// The entry field that holds the payload.
pub const PAYLOAD_FIELD: &str = "payload";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_types_cross_threads() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<RedisStreamSource>();
        send_sync::<RedisStreamAck>();
        send_sync::<RedisStreamProducer>();
        send_sync::<RedisStreamSourceBuilder>();
        send_sync::<RedisStreamProducerBuilder>();
        send_sync::<RedisConnection>();
        send_sync::<Error>();
    }
}
