//! What a broker adapter implements: receiving deliveries, acknowledging them, dead-lettering.

use std::time::Duration;

use async_trait::async_trait;

use crate::{Message, SourceError};

/// One received message and the handle that acknowledges it.
#[derive(Debug)]
pub struct Delivery<A> {
    /// The message.
    pub message: Message,
    /// Acknowledges this delivery, once: acking consumes it.
    pub ack: A,
}

/// Acknowledges one delivery to its broker.
///
/// The consumer calls [`Ack::ack`] (or [`Ack::ack_all`]) only after the database transaction that
/// recorded the message's ID has committed. Each adapter documents what "ack" is on its broker and
/// what happens to a delivery that is never acked (the process died): it must come back, to this
/// consumer or another, so that nothing is lost.
#[async_trait]
pub trait Ack: Send + Sized + 'static {
    /// The message is done: the broker may forget it.
    async fn ack(self) -> Result<(), SourceError>;

    /// The message is not done: hand it out again, no sooner than `retry_after` where the
    /// broker can delay (SQS visibility, a delayed requeue); otherwise as soon as it can.
    async fn nack(self, retry_after: Duration) -> Result<(), SourceError>;

    /// Acknowledges many deliveries, in one broker round-trip where the broker allows
    /// (`DeleteMessageBatch`, one `XACK`, one offset commit, `basic.ack` with `multiple`).
    /// The default acks one by one.
    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        for ack in acks {
            ack.ack().await?;
        }
        Ok(())
    }
}

/// A broker subscription: a topic, a queue or a stream, as seen by one consumer.
#[async_trait]
pub trait MessageSource: Send {
    /// This broker's acknowledgement handle.
    type Ack: Ack;

    /// Waits for messages, up to the adapter's poll time, and returns at most `max` of them;
    /// an empty batch means none arrived in time.
    ///
    /// The consumer may drop this future at shutdown. An adapter must then lose nothing: a
    /// message it had already taken from the broker comes back as an unacked delivery would.
    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<Self::Ack>>, SourceError>;

    /// Parks a message that cannot be applied (no ID, unparsable, failed too often) where an
    /// operator can see and replay it, with `reason`. The consumer acks the delivery only after
    /// this returned `Ok`, so a failed dead-letter loses nothing.
    async fn dead_letter(&mut self, message: &Message, reason: &str) -> Result<(), SourceError>;

    /// How long the broker can still hand out a message it once delivered (a topic's
    /// `retention.ms`, a queue's `MessageRetentionPeriod`), where the adapter can find it out.
    /// The consumer warns at start when the inbox forgets IDs sooner
    /// ([`Consumer::inbox_retention`](crate::Consumer::inbox_retention)). Default: unknown.
    fn redelivery_window(&self) -> Option<Duration> {
        None
    }

    /// The broker, as the OpenTelemetry `messaging.system` attribute names it (`kafka`,
    /// `aws_sqs`, `rabbitmq`, `redis`), for the consumer's spans. Default: `unknown`.
    fn system(&self) -> &'static str {
        "unknown"
    }
}
