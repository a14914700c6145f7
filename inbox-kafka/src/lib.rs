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
//! Kafka acknowledges by committing a position per partition: "everything before offset N is
//! done". Here an ack marks the message finished after the database transaction committed, and
//! the partition's finished prefix is committed from there:
//!
//! - **Explicit commits, never auto-commit, coalesced.** The consumer runs with
//!   `enable.auto.commit=false`. An [`Ack::ack_all`](inbox_core::Ack::ack_all) only records its
//!   offsets, with no broker call; a commit task commits the finished prefix of every partition
//!   that moved, in one synchronous request (on tokio's blocking pool), every
//!   [`KafkaSourceBuilder::commit_interval`] (default 250 ms). When partitions are revoked, the
//!   acked prefix of each is committed right away, and librdkafka completes the rebalance only
//!   after that commit, so the partition's next owner starts behind it. Dropping the source (the
//!   end of [`Consumer::run_until`](inbox_core::Consumer::run_until)) revokes everything the
//!   same way before it leaves the group. A failed commit is logged, counted in
//!   [`KafkaSource::offset_commits`], and retried at the next interval; it is not an ack failure.
//! - **What a crash costs.** A process that dies between its database commits and the next
//!   offset commit leaves up to one interval of applied messages uncommitted (plus a commit in
//!   flight): the partitions' next owner reads them again and the inbox skips each, as it skips
//!   any redelivery. Nothing is lost and nothing is applied twice; what it costs is re-reading
//!   those messages. No offset is ever committed past a message whose transaction has not
//!   committed, because only acked messages move the prefix.
//! - **Synchronous per ack.** With `commit_interval(Duration::ZERO)` every ack commits its
//!   partitions' new prefixes itself, synchronously, so its `Ok` means the broker has the offset
//!   and a commit failure is an ack failure. It costs one commit round-trip per batch (per lane
//!   with [`Consumer::parallel_lanes`](inbox_core::Consumer::parallel_lanes)).
//! - **Only the finished prefix.** Offsets in flight are tracked per partition; a commit covers
//!   the partition up to its first unfinished message. An ack of offset 7 while 5 is still being
//!   retried moves nothing; when 5 is acked the next commit jumps to 8.
//! - **Redelivery.** A message whose offset was not committed (the process died, the commit
//!   failed, the partition moved) is read again by whoever owns the partition next, from the last
//!   committed offset; the inbox finds its ID and skips it. Everything after it on the partition
//!   is re-read too and skipped the same way.
//! - **Nack.** Kafka cannot hand out a single record again. A nack seeks the partition back to the
//!   nacked offset, so it and every later record of that partition are read again; nothing past
//!   it is committed meanwhile. A later record is handed out again only if it was handed back
//!   itself: one finished keeps its outcome, and one still in the consumer's hands is not handed
//!   out a second time beside it. The adapter counts its
//!   own seeks, so [`Metadata::delivery_count`](inbox_core::Metadata) is set on such re-reads
//!   (and [`Consumer::max_deliveries`](inbox_core::Consumer::max_deliveries) works within one
//!   process); Kafka itself does not count deliveries.
//! - **Delayed redelivery** (a redelivery schedule,
//!   [`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy::redeliver_after)) pauses the
//!   record's partition, seeks it back to the record as a nack does, and resumes it once the
//!   delay has passed: blocking, so the partition keeps its order (the records behind it wait;
//!   other partitions flow), rather than retry topics, which would apply a later record of the
//!   same key first. The record's redelivery count and the time it is due are committed with
//!   the partition's offset, as the commit's metadata, before the record can be read again
//!   (see [`redelivery_counts`] for why there): after a rebalance or a restart the partition's
//!   next owner reads them with the committed offset before it hands out a record of the
//!   partition, waits out what is left of the delay, and goes on with the schedule, so a poison
//!   record reaches its dead letter however often the group rebalances. A commit refused
//!   mid-rebalance (Kafka refuses them while the group waits for its members to sync) loses the
//!   counts it carried for the partition's next owner; the consumer that made it keeps them and
//!   merges them in when the partition comes back to it. Each such loss, and each delivery cut
//!   by a revoke, costs the record one more delivery than its schedule says, never its dead
//!   letter. A redelivery (or a nack) of a delivery received before its partition was revoked
//!   does nothing to the partition: its owner reads the record again from the last commit.
//! - **Rebalances.** When partitions are revoked, their in-flight messages are forgotten: the
//!   batch in flight still finishes and commits to the database, but its acks commit nothing for
//!   the lost partitions, and a commit refused with `UNKNOWN_MEMBER_ID`, `REBALANCE_IN_PROGRESS`
//!   or `ILLEGAL_GENERATION` is logged, not reported. The new owner re-reads and the inbox skips.
//!   A member evicted for exceeding `max.poll.interval.ms` (a zombie) may still commit its
//!   database transaction: the inbox's unique claim makes either its write or the new owner's a
//!   no-op.
//! - **No ID.** The ID comes from a header (default `event_id`), not from the offset: a relay
//!   that republishes an event gives it a new offset, not a new ID. Records of other producers
//!   are read where their convention puts it, with [`KafkaSourceBuilder::id_from`]: a
//!   CloudEvent's `ce_id` header (binary mode) or `id` (a structured-mode JSON value), its
//!   `ce_source` and `ce_id` together, the Debezium outbox router's `id` header, a JSON field of
//!   the value (see [`IdFrom`]); for topics whose producers set none, the record's position
//!   ([`IdFrom::Position`], a weaker promise: a resend is applied again). A record without one,
//!   and a
//!   record whose handler failed past the retry limit, is produced to the dead-letter topic
//!   (default `<topic>.dlq`) with its key, value and headers plus the headers `reason`,
//!   `original_source` (the topic) and `original_position` (`partition 3 offset 17`), named by
//!   [`inbox_core::dead_letter`], through the delivery's handle ([`KafkaAck`]'s
//!   [`Ack::dead_letter`](inbox_core::Ack::dead_letter)); it waits for the delivery report, then
//!   the offset is committed. A produce that fails seeks the partition back to the record, as a
//!   nack does, so it comes again. The first receive checks that every dead-letter topic exists
//!   and fails, naming the topic, if one does not (or creates it, with
//!   [`KafkaSourceBuilder::create_dead_letter_topics`]): a record that cannot be parked would
//!   otherwise be handed back and fail again, stalling its partition.
//!
//! # Batches, order and parallelism
//!
//! A receive waits for one message (up to the poll timeout), then takes whatever else the client
//! has already fetched, up to the consumer's batch size. Each message carries its partition as
//! its lane ([`Metadata::lane`](inbox_core::Metadata::lane), `topic[partition]`):
//!
//! - by default the whole batch is one transaction;
//! - with [`Consumer::parallel_lanes`](inbox_core::Consumer::parallel_lanes)`(n)` up to `n`
//!   partitions are applied side by side, each in transactions of its own,
//!   while one partition's messages stay in offset order; the consumer receives again while a
//!   partition's lane is free.
//!
//! Within a partition messages are applied in offset order, except that a failing message that
//! is retried is applied after the rest of its partition's batch. Several sources with the same
//! group id (in one process or many) share the partitions as the group assigns them.
//!
//! # Configuration
//!
//! One [`KafkaConnection`] (the brokers, librdkafka properties, a token provider) builds the
//! source, the producer, the dead-letter reader and the admin client, so TLS, SASL or a token
//! provider set once reaches them all. The brokers come from `KAFKA_BROKERS` unless
//! [`KafkaConnection::new`] names them; with neither, connecting fails with an error that says
//! so (there is no default). Any librdkafka property passes through: [`KafkaConnection::set`]
//! for every client (TLS and SASL: the crate feature `tls`, on by default, gives TLS, SCRAM
//! and OAUTHBEARER), [`KafkaSourceBuilder::set_consumer`] and [`KafkaProducerBuilder::set`] for one
//! client (timeouts, assignment strategy, batching). zstd
//! compression (`compression.type=zstd` on a producer, and reading batches another producer
//! compressed with zstd) needs the crate feature `zstd`; gzip (`libz`) is always built in. A
//! new group starts at the earliest offset (`auto.offset.reset=earliest`) unless told otherwise.
//! Lower `session.timeout.ms` to notice a dead member sooner; keep `max.poll.interval.ms` above
//! the longest batch.
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
