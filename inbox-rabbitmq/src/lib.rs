//! The transactional inbox over RabbitMQ, on [`lapin`] and tokio.
//!
//! [`RabbitSource`] consumes a quorum queue with manual acks and hands each delivery to
//! [`inbox_core::Consumer`], which claims the message ID, runs your handler and commits in one
//! database transaction, and only then acks. [`RabbitProducer`] publishes persistent,
//! broker-confirmed messages that carry a `message_id`, to any queue, through
//! [`inbox_core::Publish`].
//!
//! The source reads the ID from the AMQP `message_id` property unless
//! [`RabbitSourceBuilder::id_from`] names another convention (see [`IdFrom`]): a header, a
//! CloudEvent's `cloudEvents_id` or `cloudEvents:id` header (binary mode) or `id` (a
//! structured-mode JSON body), its `source` and `id` together, the Debezium outbox router's
//! `id` header, or a JSON field of the body. Never the delivery tag.
//!
//! ```no_run
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Publish};
//! use inbox_postgres::{PgInbox, PgTx};
//! use inbox_rabbitmq::{RabbitProducer, RabbitSource};
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
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The broker AMQP_URL names (unset, connect fails); `RabbitConnection::new(url)` names one.
//! let source = RabbitSource::builder("wallet-credits")
//!     .prefetch(50)
//!     .connect() // declares the queues
//!     .await?;
//!
//! let producer = RabbitProducer::builder().connect().await?;
//! let id = producer.send("wallet-credits", b"100").await?; // a UUIDv7 message_id, confirmed
//! producer.send_with_id("wallet-credits", &id, b"100").await?; // sent twice: applied once
//!
//! let pool = sqlx::PgPool::connect("postgres://postgres:postgres@127.0.0.1:5432/inbox").await?;
//! let inbox = PgInbox::new(pool);
//! inbox.migrate().await?;
//! Consumer::new("wallet", source, inbox, Credit)
//!     .batch_size(20)
//!     .max_deliveries(10) // below the queue's x-delivery-limit (20)
//!     .run()
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! A whole program to copy, with a queue of its own and a check of the balance:
//! `examples/examples/rabbitmq.rs` (`cargo run -p inbox-examples --example rabbitmq`).
//!
//! # Topology
//!
//! With [`Topology::Declare`] (the default) the source declares these queues at connect, and
//! with [`Topology::Expect`] it only checks that they exist (a passive declare on a throwaway
//! channel each), failing the connect with [`Error::MissingQueue`], which names the queue, when
//! one is missing:
//!
//! - `<queue>`: durable, `x-queue-type = quorum`, `x-dead-letter-exchange = ""` (the default
//!   exchange), `x-dead-letter-routing-key = <queue>.dlq`, `x-dead-letter-strategy =
//!   at-least-once` (with `x-overflow = reject-publish`, which that strategy requires), and
//!   `x-delivery-limit` ([`RabbitSourceBuilder::delivery_limit`], default 20).
//! - `<queue>.dlq`: durable, quorum.
//!
//! So with [`Topology::Declare`] the queue is a quorum queue and
//! [`MessageSource::capabilities`](inbox_core::MessageSource::capabilities) reports a delivery
//! count; with [`Topology::Expect`] the queue may be a classic one, whose redeliveries carry no
//! count, and it reports none.
//!
//! Two paths lead to the dead-letter queue, both without loss:
//! - the adapter's: a message with no usable ID, a permanent handler error, or a handler that
//!   failed [`RetryPolicy::max_attempts`](inbox_core::RetryPolicy) times in a row is published
//!   to `<queue>.dlq` with its body, properties and headers plus the headers named in
//!   [`inbox_core::dead_letter`]: `reason` (why), `original_source` (the queue) and
//!   `original_position` (connection, channel and delivery tag), confirmed by the broker, and
//!   only then acked, all by the delivery's handle ([`RabbitAck`]'s
//!   [`Ack::dead_letter`](inbox_core::Ack::dead_letter)). It publishes on a second connection
//!   (`<connection name> dead letters`, shared by the source's acks): during a memory or disk
//!   alarm RabbitMQ blocks every connection that publishes, and the consuming one must keep
//!   acking. A publish not confirmed within [`RabbitConnection::operation_timeout`] (default
//!   10 s) fails with [`Error::ConfirmTimeout`], a [`Recovery::Retry`](inbox_core::Recovery): the
//!   message is requeued after [`RETRY_AFTER`](inbox_core::dead_letter::RETRY_AFTER) and
//!   dead-lettered on a later delivery (the late copy may land too, so the dead-letter queue
//!   can hold it twice);
//! - the broker's: a message handed out more than `x-delivery-limit` times (requeued by nacks,
//!   or in flight each time a consumer process died) is moved there by the quorum queue itself,
//!   with RabbitMQ's `x-death` header. This stops a message that crashes the process from
//!   looping forever; the retries of ordinary handler failures happen in process, in the core.
//!
//! # Ack semantics
//!
//! - **Ack** is `basic.ack` on the channel the delivery came on, sent after the transaction that
//!   recorded the message ID committed. A batch is acked with one `basic.ack` and `multiple = true`
//!   when its tags are the oldest unsettled ones of the channel (the usual case), else one by one.
//!   A delivery counts as settled only once its ack or nack frame is queued, and lapin sends a
//!   channel's frames in order, so a `multiple` ack never covers a delivery whose delayed nack
//!   is still to be sent, nor one whose own ack or nack failed. After the channel closed an ack
//!   fails with [`Recovery::Reconnect`](inbox_core::Recovery), the core logs it, the next
//!   receive reconnects (the core backs off between failed attempts), and the redelivered copy
//!   is skipped.
//! - **Redelivery**: RabbitMQ requeues every unacked delivery when its channel or connection
//!   closes (process killed, network lost, `rabbitmqctl close_connection`, heartbeat missed) and
//!   hands it out again, to this consumer or another, with `redelivered` set and, on a quorum
//!   queue, `x-delivery-count` raised ([`Metadata::delivery_count`](inbox_core::Metadata) is
//!   that count + 1). If the handler had committed, the inbox finds the ID and skips the copy.
//! - **A connection that goes silent** (a partition, a black-holing firewall, a frozen broker)
//!   is noticed by the AMQP heartbeat after about two intervals
//!   ([`RabbitConnection::heartbeat`]). Until then acks are written into the dead socket and report success, though the broker never
//!   sees them: those messages are redelivered once the broker drops the connection, and the
//!   inbox skips them. A reconnect that reaches a broker that never answers gives up after
//!   [`RabbitConnection::operation_timeout`] ([`Error::ConnectTimeout`]) and is tried again.
//!   The conformance suite's network-fault scenarios and `tests/it/broker_restart.rs` black-hole,
//!   cut, refuse and restart the broker mid-stream and check that every event is applied once.
//! - **Nack** (the core hands a message back after a store error) is a delayed requeue: a
//!   spawned task waits `retry_after`, then sends `basic.nack` with `requeue = true`. The waiting
//!   message holds one prefetch slot; the others keep flowing, so it cannot starve the queue.
//! - **Delayed redelivery** (a redelivery schedule,
//!   [`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy::redeliver_after)): a copy is
//!   published, confirmed, to the delay queue `<queue>.delay.<n>` (a quorum queue, declared at
//!   first use and again if deleted, that dead-letters expired messages back to `<queue>` at
//!   least once) with the delay as its `expiration` and the count in the header
//!   `x-inbox-redelivery`; then the delivery is acked. The copy is a new message to the queue:
//!   no `x-delivery-count`, nothing counted against `x-delivery-limit`. See [`RabbitAck`] and
//!   [`redelivery`].
//! - **What counts against `x-delivery-limit`**: the quorum queue's delivery count, which the
//!   broker compares with the limit, goes up by one each time a delivery returns to the queue
//!   before RabbitMQ 4.3: a `basic.nack` or `basic.reject` with `requeue`, and equally a channel
//!   or connection that closed with the delivery unacked (a crash, a lost network, the broker's
//!   `consumer_timeout`, 30 minutes by default, on a delivery held that long). The local test
//!   broker (3.10.8) does exactly this: see `tests/it/delivery_count.rs`. RabbitMQ 4.3 counts only
//!   failed deliveries: `basic.reject` with `requeue` still counts, `basic.nack` with `requeue`
//!   no longer does (rabbitmq-server #15387; not checked here, the local broker being older).
//!   So this adapter hands back with `basic.nack`, once per hand-back, never `basic.reject`, and
//!   a delayed nack whose channel closed while it waited is dropped, not sent on a new channel:
//!   a hand-back costs at most one count, and a nack none from 4.3 on. Before 4.3 a store
//!   outage during which the consumer hands the same messages back again and again spends their
//!   limit, and past it the broker dead-letters messages that never failed. The cure is in the
//!   consumer: hold the batch while the store is down instead of handing it back, or choose a
//!   `delivery_limit` and a `Consumer::error_backoff` that outlast the outages you expect.
//!
//! # TLS
//!
//! Plain `amqp://` needs no TLS library. `amqps://` takes this crate's `tls` feature, on by
//! default as on every crate of this workspace (rustls on ring, trusting the system's root
//! certificates: lapin's `rustls-native-certs`), or its `native-tls` feature (lapin's
//! feature of that name). A broker whose certificate comes from a CA of its own (a private one,
//! a managed broker's) is trusted with [`RabbitConnection::ca_certificates`], which reaches the
//! source, the producer and the dead-letter reader built from that connection. A certificate
//! from another CA or for another host name is refused at connect with an error that says so (`invalid peer certificate: UnknownIssuer`, `certificate not valid for
//! name …`); `tests/it/tls.rs` shows each on a TLS-only node of its own.

mod ack;
mod config;
mod connection;
mod dead_letter;
mod error;
mod producer;
pub mod redelivery;
mod short_string;
mod source;
mod topology;
pub mod unsettled;

pub use ack::RabbitAck;
pub use config::{RabbitSourceBuilder, Topology};
pub use connection::RabbitConnection;
pub use dead_letter::{RabbitDeadLetters, RabbitDeadLettersBuilder};
pub use error::{Error, Result};
pub use inbox_core::{CloudEventsIdentity, IdFrom};
pub use lapin;
pub use producer::{RabbitProducer, RabbitProducerBuilder};
pub use source::RabbitSource;

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}

    #[test]
    fn public_types_cross_threads() {
        send::<RabbitSource>();
        send_sync::<RabbitAck>();
        send_sync::<RabbitProducer>();
        send_sync::<RabbitSourceBuilder>();
        send_sync::<RabbitProducerBuilder>();
        send_sync::<Error>();
    }
}
