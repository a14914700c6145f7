//! Effectively-once Amazon SQS consumers: an [`inbox_core`] [`MessageSource`](inbox_core::MessageSource) on `aws-sdk-sqs`.
//!
//! SQS delivers at least once, standard and FIFO queues alike: a message whose visibility
//! timeout runs out while its handler still works is handed to another consumer, a crash
//! between the database commit and the delete brings the message back, and FIFO
//! deduplication only covers sends within 5 minutes. With [`inbox_core::Consumer`] and an
//! inbox store, every such second copy finds its ID already claimed and is skipped.
//!
//! ```no_run
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Publish};
//! use inbox_postgres::{PgInbox, PgTx};
//! use inbox_sqs::SqsConnection;
//!
//! struct Credit;
//!
//! impl Handler<PgTx> for Credit {
//!     async fn handle(&self, tx: &mut PgTx, id: &MessageId, message: &Message)
//!         -> Result<(), HandlerError> {
//!         let amount: i64 = message.json()?;
//!         sqlx::query("UPDATE wallet SET balance = balance + $1")
//!             .bind(amount)
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn run(inbox: PgInbox) -> Result<(), Box<dyn std::error::Error>> {
//! // Credentials, region and endpoint (AWS_ENDPOINT_URL_SQS) from the environment;
//! // `SqsConnection::new(client)` for a client of your own. Both halves reach SQS through it.
//! let sqs = SqsConnection::from_env();
//! let queue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/payments";
//!
//! // Producers put a stable ID in the `event_id` attribute; a resend keeps it.
//! let producer = sqs.producer().connect().await?;
//! let id = producer.send(queue_url, b"100").await?;
//! producer.send_with_id(queue_url, &id, b"100").await?; // sent twice: applied once
//!
//! let source = sqs.source(queue_url)
//!     .dead_letter_queue("https://sqs.eu-west-1.amazonaws.com/123456789012/payments-dlq")
//!     .connect()
//!     .await?;
//! Consumer::new("wallet", source, inbox, Credit)
//!     .batch_size(10)
//!     .run()
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! A whole program to copy, with a queue of its own and a check of the balance:
//! `examples/examples/sqs.rs` (`cargo run -p inbox-examples --example sqs`).
//!
//! # The message ID
//! It comes from a message attribute, `event_id` unless [`SqsSourceBuilder::id_attribute`] says
//! otherwise, set by the producer ([`SqsProducer`] does it, with a UUIDv7 from
//! [`Publish::send`](inbox_core::Publish::send)). Never the SQS `MessageId`: SQS assigns a new
//! one to every send, so a producer's retry would look new. On FIFO queues,
//! [`SqsSourceBuilder::dedup_id_fallback`] opts in to the `MessageDeduplicationId` for messages
//! without the attribute; SQS deduplicates on it for 5 minutes only, the inbox for as long as it
//! keeps IDs. A message with neither is dead-lettered with the reason.
//!
//! Messages of other producers are read where their convention puts the ID, with
//! [`SqsSourceBuilder::id_from`] (see [`IdFrom`]): another attribute, the FIFO deduplication ID
//! alone, a structured-mode CloudEvent in the body (`id`, or `source` and `id`; CloudEvents
//! defines no SQS binding for attributes), the Debezium outbox router's `id` as an attribute, or
//! a JSON field of the body.
//!
//! # Ack semantics
//! - **Ack** is `DeleteMessage` with the receipt handle of the receive that returned this
//!   copy; a batch is deleted with `DeleteMessageBatch`, 10 per call. The consumer acks only
//!   after the inbox transaction committed. A delete that fails then (network, or a stale
//!   receipt handle because the visibility ran out) is logged and counted, not fatal: the
//!   message comes back after its visibility timeout and is skipped as a duplicate.
//! - **Redelivery**: a message not deleted is visible again when its visibility timeout runs
//!   out, to this consumer or another, with `ApproximateReceiveCount`
//!   ([`Metadata::delivery_count`](inbox_core::Metadata::delivery_count)) one higher. That
//!   covers crashes, kills and dropped receives: nothing is lost.
//! - **Visibility heartbeat** (on by default, [`SqsSourceBuilder::heartbeat`]): from receive
//!   until ack or nack, a background task extends each message's visibility
//!   (`ChangeMessageVisibility`) every third of the timeout, so a slow handler keeps its
//!   message. It stops at once when the ack is used or dropped: an extension in flight is
//!   cancelled, not waited for (one already on the wire may still land after a nack, which then
//!   comes back after one visibility timeout instead of its delay).
//! - **Staleness**: when an extension finds the receipt handle refused (the message was handed
//!   out again under a new handle, or deleted by its other copy), the heartbeat logs and stops,
//!   and the delivery reports [`Ack::is_stale`](inbox_core::Ack::is_stale): the consumer drops it
//!   before its claim if it has not started on it; otherwise the other copy finds the ID claimed
//!   (waiting for this transaction if it is still open) and is skipped, as it is without the
//!   heartbeat, where staleness is not known.
//! - **Nack** (a store error, a failed dead letter) is `ChangeMessageVisibility` to the delay,
//!   at least [`SqsSourceBuilder::retry_backoff`], rounded up to whole seconds (300 ms is 1 s).
//!   A failed dead letter is nacked with [`RETRY_AFTER`](inbox_core::dead_letter::RETRY_AFTER)
//!   (1 s). Handler failures are retried by the consumer in-process first
//!   ([`RetryPolicy`](inbox_core::RetryPolicy)), under the heartbeat.
//! - **Delayed redelivery** ([`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy::redeliver_after))
//!   sends a copy of the message to its own queue, then deletes the message: same body, same
//!   attributes (the ID attribute always kept), plus
//!   [`REDELIVERY_COUNT`](inbox_core::REDELIVERY_COUNT) (`x-inbox-redelivery`), the
//!   redelivery's number from 1, which the copy reports as
//!   [`Metadata::redeliveries`](inbox_core::Metadata::redeliveries). SQS cannot change a message
//!   in place, so the count rides on the copy: only a redelivery the consumer asked for moves a
//!   message along its schedule. A hand-back (a nack behind a blocked strict-order message, a
//!   failed dead letter, a shutdown) or a receive after a crash or a visibility timeout leaves
//!   the message and its count as they were; `ApproximateReceiveCount`
//!   ([`Metadata::delivery_count`](inbox_core::Metadata::delivery_count)) still counts those,
//!   per copy. On a standard queue SQS delays the copy itself (`DelaySeconds`, up to 15
//!   minutes, whole seconds rounded up); a longer delay, and any delay on a FIFO queue (which
//!   takes no per-message delay), is carried in the attribute
//!   [`REDELIVER_AT`](delivery::REDELIVER_AT), and a receive before that time hides the copy
//!   again until then (`ChangeMessageVisibility`, 12 hours at most at a time) without handing
//!   it out. Each such receive counts in `ApproximateReceiveCount`; the due time is the sending
//!   consumer's clock, so consumers' clocks apart shift it by as much. On a FIFO queue the copy
//!   keeps the message group and has a deduplication ID of its own (from the receipt handle);
//!   it joins the back of its group, so the messages of the group sent before the copy are
//!   applied before it (a hidden copy then holds its group back until it is due). The copy is
//!   sent first and the message deleted only then: a failure in between leaves both, under one
//!   ID, and the inbox applies one. A copy that cannot be sent leaves the message in place,
//!   visible again after the delay with its count unchanged; without permission to send to the
//!   queue (`sqs:SendMessage`) the consumer stops with an error saying so. A dead letter leaves
//!   the count off, so a replay starts a new schedule.
//!
//! The bookkeeping behind these rules (the redelivery count and due time of a received copy,
//! how a copy is sent, the staleness flag, the FIFO deduplication ID of each kind of send) is
//! plain state in [`delivery`], which the source and its acks drive.
//!
//! # Dead letters
//! A message without a usable ID, with a permanent handler error, or failing `max_attempts`
//! times, is dead-lettered, then deleted, by its handle ([`SqsAck`]'s
//! [`Ack::dead_letter`](inbox_core::Ack::dead_letter), which keeps the attributes the message
//! was received with):
//! - with [`SqsSourceBuilder::dead_letter_queue`], it is sent there (`SendMessage`: same body,
//!   same attributes, plus [`REASON`](inbox_core::dead_letter::REASON),
//!   [`ORIGINAL_SOURCE`](inbox_core::dead_letter::ORIGINAL_SOURCE) (the queue URL) and
//!   [`ORIGINAL_POSITION`](inbox_core::dead_letter::ORIGINAL_POSITION) (`message <SQS message
//!   ID>`), less a redelivered copy's count, and the ID in the source's ID attribute (written
//!   from the ID when it was the `MessageDeduplicationId`, which a send cannot copy), so a
//!   replay into the source keeps it; SQS allows 10 attributes, so the last other original ones
//!   by name give way to these), and only then deleted from the source queue: a failure in
//!   between leaves a copy in both, never in neither. The queue must exist:
//!   [`SqsSourceBuilder::connect`] checks (`GetQueueUrl`) and fails naming it. On a FIFO
//!   dead-letter queue the `MessageGroupId` is the original's (hashed into SQS's alphabet where
//!   needed) and the `MessageDeduplicationId` is new per delivery (from its receipt handle),
//!   never the event ID: a message dead-lettered again within SQS's 5-minute window arrives
//!   again instead of being dropped as a duplicate;
//! - without one, if the queue has a `RedrivePolicy`, its dead-letter queue is resolved when
//!   the source connects, and used the same way. Where it cannot be resolved (no `GetQueueUrl`
//!   permission), the message is handed back (nacked) and SQS's redrive moves it after
//!   `maxReceiveCount` receives, without a reason attribute. A redrive dead-letter queue that
//!   does not exist fails the connect. Set the consumer's
//!   [`max_deliveries`](inbox_core::Consumer::max_deliveries) below `maxReceiveCount` so a
//!   message that crashes the process every time is dead-lettered by the consumer first;
//! - with neither, dead-lettering fails with a [`Recovery::Fatal`](inbox_core::Recovery)
//!   error naming both settings, and the consumer stops rather than loop.
//!
//! # Timeouts
//! The clients from [`connect`], [`connect_to`] and [`config_loader`] have [`default_timeouts`]
//! (30 s per attempt, longer than the 20 s long poll; 90 s per call), so a stalled connection
//! fails and is retried instead of hanging the consumer. [`SqsSourceBuilder::connect`] refuses a
//! client whose timeout per attempt is not longer than the
//! [poll timeout](SqsSourceBuilder::poll_timeout), and warns about one with no timeout at all.
//!
//! # Capabilities
//! [`MessageSource::capabilities`](inbox_core::MessageSource::capabilities) reports a delivery
//! count (`ApproximateReceiveCount`) and a delayed nack (the visibility timeout) on every queue,
//! and lanes (the message group) on a FIFO queue, whose URL ends in `.fifo`.
//!
//! # Batches and order
//! A receive returns up to 10 messages; the consumer claims and commits them in one
//! transaction and deletes them in one `DeleteMessageBatch`. Standard queues have no order; on
//! FIFO queues, messages of one group arrive in order and are applied in that order within a
//! batch, and a failing message is retried after the rest of its batch.

mod ack;
mod config;
mod connection;
mod copy;
mod dead_letter;
pub mod delivery;
mod error;
mod fifo;
mod heartbeat;
mod producer;
mod source;

pub use ack::SqsAck;
/// Re-exported so callers adjust the loader from [`config_loader`] with the same version.
pub use aws_config;
pub use config::{SqsSourceBuilder, DEFAULT_ID_ATTRIBUTE};
pub use connection::{config_loader, connect, connect_to, default_timeouts, SqsConnection};
pub use dead_letter::{SqsDeadLetters, SqsDeadLettersBuilder};
pub use delivery::DEDUPLICATION_ID_HEADER;
pub use error::{Error, Result};
pub use inbox_core::{CloudEventsIdentity, IdFrom};
pub use producer::{SqsProducer, SqsProducerBuilder};
pub use source::SqsSource;

/// Re-exported so callers build clients and queues with the same SDK version.
pub use aws_sdk_sqs;

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn public_types_are_thread_safe() {
        assert_send_sync::<SqsAck>();
        assert_send_sync::<SqsSource>();
        assert_send_sync::<SqsProducer>();
        assert_send_sync::<Error>();
        assert_send::<SqsSourceBuilder>();
        assert_send::<SqsProducerBuilder>();
        assert_send_sync::<SqsConnection>();
    }
}
