//! Effectively-once Kafka consumption: the transactional inbox over a consumer group, on
//! [`rdkafka`].
//!
//! ```no_run
//! use inbox_core::{Consumer, OutgoingMessage, Publish};
//! use inbox_kafka::{KafkaProducer, KafkaSource};
//! use inbox_postgres::PgInbox;
//! # use inbox_core::{Handler, HandlerError, Message, MessageId};
//! # use inbox_postgres::PgTx;
//! # struct Credit;
//! # impl Handler<PgTx> for Credit {
//! #     async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
//! #         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = 1")
//! #             .bind(m.json::<i64>()?)
//! #             .execute(&mut **tx)
//! #             .await?;
//! #         Ok(())
//! #     }
//! # }
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PgInbox::new(sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?);
//! // Producer side (brokers from KAFKA_BROKERS): every record gets an `event_id` header, a
//! // UUIDv7 unless you pass one.
//! let producer = KafkaProducer::builder().connect().await?;
//! let id = producer.send("payments", b"100").await?;
//! producer.send_with_id("payments", &id, b"100").await?; // a retry: same ID, applied once
//! let keyed = OutgoingMessage::generate("100").key("account-1"); // one partition per account
//! producer.send_batch("payments", &[keyed]).await?;
//!
//! // Consumer side: brokers from KAFKA_BROKERS, topic `payments`, group `wallet`.
//! let source = KafkaSource::builder(["payments"], "wallet")
//!     .set_consumer("session.timeout.ms", "10000")
//!     .connect()
//!     .await?;
//! Consumer::new("wallet", source, store, Credit)
//!     .batch_size(100) // up to 100 messages per poll
//!     .parallel_lanes(8) // partitions side by side, each in offset order, one transaction each
//!     .run()
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! (`Credit` is your [`Handler`](inbox_core::Handler), as in the `inbox-postgres` example.)
//!
//! A whole program to copy, with `PgInbox`, a topic of its own and a check of the balance:
//! `examples/examples/kafka.rs` (`cargo run -p inbox-examples --example kafka`).
//!
//! # Ack semantics
//!
//! Kafka acknowledges by committing a position per partition ("everything before offset N is
//! done"). An ack marks its message finished after the database transaction committed; each
//! partition's finished prefix is then committed:
//!
//! - **Explicit, coalesced commits.** The consumer runs with `enable.auto.commit=false`. An
//!   [`Ack::ack_all`](inbox_core::Ack::ack_all) only records its offsets; every
//!   [`KafkaSourceBuilder::commit_interval`] (default 250 ms) a commit task commits the finished
//!   prefix of every partition that moved, in one synchronous request on tokio's blocking pool.
//!   A revoke commits the acked prefix of its partitions at once, and librdkafka completes the
//!   rebalance only after that commit, so the next owner starts behind it; dropping the source
//!   (the end of [`Consumer::run_until`](inbox_core::Consumer::run_until)) revokes everything
//!   the same way before it leaves the group. A failed commit is logged, counted in
//!   [`KafkaSource::offset_commits`] and retried at the next interval: it is not an ack failure.
//!   With `commit_interval(Duration::ZERO)` every ack commits synchronously, so its `Ok` means
//!   the broker has the offset, at one round-trip per batch (per lane with
//!   [`Consumer::parallel_lanes`](inbox_core::Consumer::parallel_lanes)).
//! - **Only the finished prefix.** A commit covers a partition up to its first unfinished
//!   message: an ack of offset 7 while 5 is retried moves nothing; when 5 is acked the commit
//!   jumps to 8. No offset is committed past a message whose transaction has not committed.
//! - **Redelivery and crashes.** A message whose offset was not committed (the process died,
//!   the commit failed, the partition moved) is read again, with everything after it on its
//!   partition, by the partition's next owner, and the inbox skips what was applied. A crash
//!   costs re-reading up to one interval of applied messages (plus a commit in flight); nothing
//!   is lost or applied twice.
//! - **Nack.** Kafka cannot hand out a single record again: a nack seeks the partition back to
//!   the record, so it and every later record of the partition are read again, and nothing past
//!   it is committed meanwhile. A later record is handed out again only if it was handed back
//!   itself: one finished keeps its outcome, one still in the consumer's hands is not handed
//!   out a second time. Kafka does not count deliveries; the adapter counts its own seeks, so
//!   [`Metadata::delivery_count`](inbox_core::Metadata) and
//!   [`Consumer::max_deliveries`](inbox_core::Consumer::max_deliveries) work within a process.
//! - **Delayed redelivery**
//!   ([`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy::redeliver_after)) pauses the
//!   record's partition, seeks back as a nack does, and resumes once the delay has passed: the
//!   partition keeps its order (the records behind it wait, other partitions flow), which retry
//!   topics would not. The record's redelivery count and due time are committed with the
//!   partition's offset, as its metadata ([`redelivery_counts`] says why there), before the
//!   record can be read again, so after a rebalance or a restart the next owner waits out the
//!   rest of the delay and goes on with the schedule: a poison record reaches its dead letter
//!   however often the group rebalances. A commit refused mid-rebalance loses those counts for
//!   the next owner (the consumer that made it keeps them for when the partition comes back);
//!   each such loss, and each delivery cut by a revoke, costs one delivery more than the
//!   schedule says, never the dead letter.
//! - **Rebalances.** A revoke forgets its partitions' in-flight messages: the batch still
//!   commits to the database, but its acks, nacks and redeliveries do nothing to the lost
//!   partitions, and a commit refused with `UNKNOWN_MEMBER_ID`, `REBALANCE_IN_PROGRESS` or
//!   `ILLEGAL_GENERATION` is logged, not reported. The new owner re-reads and the inbox skips. A
//!   member evicted for exceeding `max.poll.interval.ms` (a zombie) may still commit its
//!   transaction: the inbox's unique claim makes its write or the new owner's a no-op.
//! - **IDs and dead letters.** The ID comes from a header (default `event_id`), not from the
//!   offset: a relay that republishes an event gives it a new offset, not a new ID. Other
//!   producers' conventions (CloudEvents, the Debezium outbox router, a JSON field; the
//!   record's position as a weaker last resort) are read with [`KafkaSourceBuilder::id_from`]
//!   (see [`IdFrom`]). A record without an ID, or whose handler failed past the retry limit, is
//!   produced by [`Ack::dead_letter`](inbox_core::Ack::dead_letter) to the dead-letter topic
//!   (default `<topic>.dlq`) with its key, value and headers plus the
//!   [`inbox_core::dead_letter`] headers (`original_position`: `partition 3 offset 17`); the
//!   offset is committed after the delivery report, and a produce that fails seeks back as a
//!   nack does. The first receive checks that every dead-letter topic exists and fails naming a
//!   missing one (or creates it: [`KafkaSourceBuilder::create_dead_letter_topics`]): a record
//!   that cannot be parked would otherwise fail again and again, stalling its partition.
//!
//! # Batches, order and parallelism
//!
//! A receive waits for one message (up to the poll timeout), then takes whatever else the client
//! has already fetched, up to the consumer's batch size. By default the whole batch is one
//! transaction; with [`Consumer::parallel_lanes`](inbox_core::Consumer::parallel_lanes)`(n)` up
//! to `n` partitions (a message's [`lane`](inbox_core::Metadata::lane), `topic[partition]`) are
//! applied side by side, each in transactions of its own, and the consumer receives again while
//! a partition's lane is free. Within a partition messages are applied in offset order, except
//! that a retried message is applied after the rest of its partition's batch. Sources with the
//! same group id (in one process or many) share the partitions as the group assigns them.
//!
//! # Configuration
//!
//! One [`KafkaConnection`] (brokers, librdkafka properties, a token provider) builds the
//! source, the producer, the dead-letter reader and the admin client, so a setting made once
//! reaches them all. The brokers come from [`KafkaConnection::new`] or `KAFKA_BROKERS`; there
//! is no default. Any librdkafka property passes through: [`KafkaConnection::set`] for every
//! client, [`KafkaSourceBuilder::set_consumer`] and [`KafkaProducerBuilder::set`] for one.
//! Crate features: `tls` (on by default: TLS, SCRAM and OAUTHBEARER) and `zstd`
//! (`compression.type=zstd`, and reading batches compressed with it); gzip is always built in.
//! A new group starts at the earliest offset unless told otherwise. Lower `session.timeout.ms`
//! to notice a dead member sooner; keep `max.poll.interval.ms` above the longest batch.
//!
//! # TLS, SASL and tokens
//!
//! ```no_run
//! # use std::time::{Duration, SystemTime};
//! use inbox_kafka::{KafkaConnection, Token, TokenError, TokenProvider};
//!
//! /// Tokens from your cloud's IAM library (AWS MSK IAM, Azure Event Hubs, Confluent Cloud).
//! struct Iam;
//!
//! impl TokenProvider for Iam {
//!     async fn token(&self) -> Result<Token, TokenError> {
//!         Ok(Token {
//!             value: "signed-by-the-iam-library".into(),
//!             principal: "wallet".into(),
//!             expires_at: SystemTime::now() + Duration::from_secs(900),
//!         })
//!     }
//! }
//!
//! # async fn f() -> inbox_kafka::Result<()> {
//! // SCRAM over TLS, from configuration; `Debug` shows `***` for the password.
//! let scram = KafkaConnection::from_env()
//!     .set("security.protocol", "sasl_ssl")
//!     .set("ssl.ca.location", "/etc/kafka/ca.pem")
//!     .set("sasl.mechanism", "SCRAM-SHA-512")
//!     .set("sasl.username", "wallet")
//!     .set("sasl.password", "from-your-secret-store");
//! let source = scram.source(["payments"], "wallet").connect().await?;
//! // OAUTHBEARER with tokens from a provider (sets `sasl.mechanism`), for the source, the
//! // producer and the dead-letter reader alike.
//! let oauth = KafkaConnection::from_env()
//!     .set("security.protocol", "sasl_ssl")
//!     .token_provider(Iam);
//! let source_with_tokens = oauth.source(["payments"], "wallet").connect().await?;
//! let producer = oauth.producer().connect().await?;
//! # let _ = (source, source_with_tokens, producer); Ok(()) }
//! ```
//!
//! librdkafka retries a refused TLS handshake or login forever in the background; the source
//! instead fails its next receive at once with the reason: [`Error::Tls`] (the CA in
//! `ssl.ca.location` did not sign the broker's certificate, or the certificate does not name
//! the host) and [`Error::Authentication`] stop the consumer; [`Error::TokenProvider`] (the
//! provider's own error) is retried. See [`TokenProvider`] for when tokens are asked for.

mod ack;
mod admin;
mod commit;
mod config;
mod connection;
mod context;
mod dead_letter;
mod dead_letters;
mod error;
mod failure;
mod producer;
mod redelivery;
pub mod redelivery_counts;
mod shared_consumer;
mod source;
mod token;
pub mod tracker;

pub use ack::KafkaAck;
pub use admin::{KafkaAdmin, Retention};
pub use commit::OffsetCommits;
pub use config::KafkaSourceBuilder;
pub use connection::{brokers_from_env, KafkaConnection};
pub use dead_letters::{KafkaDeadLetters, KafkaDeadLettersBuilder, DEFAULT_REPLAY_GROUP};
pub use error::{Error, Result};
pub use inbox_core::{CloudEventsIdentity, IdFrom};
pub use producer::{KafkaProducer, KafkaProducerBuilder};
pub use rdkafka;
pub use source::KafkaSource;
pub use token::{Token, TokenError, TokenProvider};

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        assert_send::<KafkaSource>();
        assert_send_sync::<KafkaAck>();
        assert_send_sync::<KafkaProducer>();
        assert_send_sync::<KafkaSourceBuilder>();
        assert_send_sync::<KafkaProducerBuilder>();
        assert_send_sync::<OffsetCommits>();
        assert_send_sync::<Token>();
        assert_send_sync::<Error>();
    }
}
