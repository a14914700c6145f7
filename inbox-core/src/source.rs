//! What a broker adapter implements: receiving deliveries, and settling each one through its
//! handle (ack, nack or dead-letter).

use std::future::Future;
use std::time::Duration;

use crate::{Message, SourceError};

/// One received message and the handle that acknowledges it.
#[derive(Debug)]
pub struct Delivery<A> {
    /// The message.
    pub message: Message,
    /// Acknowledges this delivery, once: acking consumes it.
    pub ack: A,
}

/// Settles one delivery with its broker: ack, nack or dead-letter, each consuming the handle, so
/// a delivery is settled once.
///
/// The consumer calls [`Ack::ack`] (or [`Ack::ack_all`]) only after the database transaction that
/// recorded the message's ID has committed. Each adapter documents what "ack" is on its broker and
/// what happens to a delivery that is never acked (the process died): it must come back, to this
/// consumer or another, so that nothing is lost.
pub trait Ack: Send + Sized + 'static {
    /// The message is done: the broker may forget it.
    fn ack(self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// The message is not done: hand it out again, no sooner than `retry_after` where the
    /// broker can delay (SQS visibility, a delayed requeue); otherwise as soon as it can.
    fn nack(self, retry_after: Duration) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Acknowledges many deliveries, in one broker round-trip where the broker allows
    /// (`DeleteMessageBatch`, one `XACK`, one offset commit, `basic.ack` with `multiple`).
    /// The default acks one by one.
    fn ack_all(acks: Vec<Self>) -> impl Future<Output = Result<(), SourceError>> + Send {
        async move {
            for ack in acks {
                ack.ack().await?;
            }
            Ok(())
        }
    }

    /// Parks `message` (this delivery's) where an operator can see and replay it, then acks the
    /// delivery: for a message that cannot be applied (no ID, unparsable, failed too often).
    ///
    /// The dead letter keeps the payload, key and headers and adds `reason` and where the
    /// message was read, under the names of [`dead_letter`]: [`dead_letter::REASON`],
    /// [`dead_letter::ORIGINAL_SOURCE`] and [`dead_letter::ORIGINAL_POSITION`]. The delivery is
    /// acked only once the dead letter is stored (in one step where the broker allows).
    ///
    /// On an error the delivery stays unacked and comes back (handed back as a nack would, or
    /// as a delivery never acked does), so nothing is lost; the message may then be parked
    /// twice. A source with nowhere to park returns [`Recovery::Fatal`](crate::Recovery::Fatal)
    /// with the setting to fix.
    fn dead_letter(
        self,
        message: &Message,
        reason: &str,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Hands the message back to come again after `delay`, as redelivery number `redelivery`
    /// (from 0) of the consumer's schedule
    /// ([`RetryPolicy::redeliver_after`](crate::RetryPolicy::redeliver_after)), with its ID
    /// unchanged: the copy that comes back reports `redelivery + 1` in
    /// [`Metadata::redeliveries`](crate::Metadata::redeliveries). Each adapter uses its broker's
    /// own means to delay (an SQS visibility timeout, a RabbitMQ delay queue, a pending Redis
    /// entry left unclaimed, a paused Kafka partition, a NATS `-NAK` with a delay) and says in
    /// its docs which.
    ///
    /// On an error the delivery stays unsettled and comes back as a nacked one does, so nothing
    /// is lost (it may come back sooner than `delay`).
    ///
    /// Only called on a source whose [`Capabilities::delayed_redelivery`] is set; the default
    /// refuses.
    fn redeliver(
        self,
        message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        async move {
            let _ = (self, message, delay, redelivery);
            Err(SourceError::new(
                crate::Recovery::Fatal,
                "redeliver",
                "this source cannot delay a redelivery: remove the redelivery schedule \
                 (RetryPolicy::redeliver_after)",
            ))
        }
    }

    /// Whether the broker has already taken this delivery back while the consumer held it (a
    /// Kafka partition revoked since it was received): settling it would do nothing, and the
    /// message comes again (or already came) under a new handle. The consumer drops such a
    /// delivery before its claim instead of applying it. `true` only when the broker is sure
    /// to hand the message out again. Default: `false`, never known.
    fn is_stale(&self) -> bool {
        false
    }
}

/// A broker subscription: a topic, a queue or a stream, as seen by one consumer. What becomes of
/// each delivery (ack, nack, dead letter) goes through its [`Ack`] handle.
pub trait MessageSource: Send {
    /// This broker's acknowledgement handle.
    type Ack: Ack;

    /// Waits for messages, up to the adapter's poll time, and returns at most `max` of them;
    /// an empty batch means none arrived in time.
    ///
    /// The consumer may drop this future at shutdown. An adapter must then lose nothing: a
    /// message it had already taken from the broker comes back as an unacked delivery would.
    fn receive(
        &mut self,
        max: usize,
    ) -> impl Future<Output = Result<Vec<Delivery<Self::Ack>>, SourceError>> + Send;

    /// How long the broker can still hand out a message it once delivered (a topic's
    /// `retention.ms` plus `segment.ms`, a queue's `MessageRetentionPeriod`), where the adapter
    /// can find it out.
    /// The consumer warns at start when the inbox forgets IDs sooner
    /// ([`Consumer::inbox_retention`](crate::Consumer::inbox_retention)). Default: unknown.
    fn redelivery_window(&self) -> Option<Duration> {
        None
    }

    /// The broker, as the OpenTelemetry `messaging.system` attribute names it (`kafka`,
    /// `aws_sqs`, `rabbitmq`, `redis`, `nats`), for the consumer's spans: a new adapter uses the
    /// name the messaging conventions give its broker where they list it. Default: `unknown`.
    fn system(&self) -> &'static str {
        "unknown"
    }

    /// The broker's own name for the consumers that share this source's messages, where it has
    /// one (a Kafka consumer group, a Redis Streams group, a JetStream durable consumer), for
    /// the spans' `messaging.consumer.group.name`. Default: `None`, and the consumer's name stands for it.
    fn consumer_group(&self) -> Option<&str> {
        None
    }

    /// What this source's broker can do. The consumer warns at start when it is asked for
    /// something the source cannot give (a delivery budget without delivery counts), and
    /// spreads the chunks of a source without lanes over its parallel lanes. Default: nothing.
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
    }
}

/// What a [`MessageSource`] can do, as it reports it ([`MessageSource::capabilities`]).
///
/// | | delivery count | delayed nack | delayed redelivery | lanes |
/// |---|---|---|---|---|
/// | Kafka | no | no | yes (paused partition) | yes (partitions) |
/// | SQS | yes | yes (visibility) | yes (visibility) | yes (FIFO message groups) |
/// | RabbitMQ | yes (quorum queues) | no | yes (delay queues) | no |
/// | Redis Streams | yes | no | yes (pending, unclaimed until due) | no |
/// | NATS JetStream | yes (`num_delivered`) | yes (`-NAK` with a delay) | yes (`-NAK` with a delay) | opt-in (by subject) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    delivery_count: bool,
    delayed_nack: bool,
    delayed_redelivery: bool,
    lanes: bool,
}

impl Capabilities {
    /// None of them.
    pub const NONE: Self = Self {
        delivery_count: false,
        delayed_nack: false,
        delayed_redelivery: false,
        lanes: false,
    };

    /// [`Ack::redeliver`] brings the message back after the delay asked, and deliveries
    /// report [`Metadata::redeliveries`](crate::Metadata::redeliveries), so the consumer can
    /// follow a redelivery schedule
    /// ([`RetryPolicy::redeliver_after`](crate::RetryPolicy::redeliver_after)).
    #[must_use]
    pub const fn with_delayed_redelivery(mut self) -> Self {
        self.delayed_redelivery = true;
        self
    }

    /// See [`Capabilities::with_delayed_redelivery`].
    pub const fn delayed_redelivery(&self) -> bool {
        self.delayed_redelivery
    }

    /// Every delivery carries [`Metadata::delivery_count`](crate::Metadata::delivery_count),
    /// so [`Consumer::max_deliveries`](crate::Consumer::max_deliveries) can park a message that
    /// kills its consumer before any retry is counted.
    #[must_use]
    pub const fn with_delivery_count(mut self) -> Self {
        self.delivery_count = true;
        self
    }

    /// [`Ack::nack`] keeps the message away for `retry_after` (otherwise it comes back as soon
    /// as the broker can, and the consumer's backoff is the only delay).
    #[must_use]
    pub const fn with_delayed_nack(mut self) -> Self {
        self.delayed_nack = true;
        self
    }

    /// Deliveries carry an ordering lane ([`Metadata::lane`](crate::Metadata::lane)) that
    /// [`Consumer::parallel_lanes`](crate::Consumer::parallel_lanes) applies side by side, each
    /// in order. Without it, the source keeps no order the consumer could keep, and parallel
    /// lanes apply its chunks side by side in no order.
    #[must_use]
    pub const fn with_lanes(mut self) -> Self {
        self.lanes = true;
        self
    }

    /// See [`Capabilities::with_delivery_count`].
    pub const fn delivery_count(&self) -> bool {
        self.delivery_count
    }

    /// See [`Capabilities::with_delayed_nack`].
    pub const fn delayed_nack(&self) -> bool {
        self.delayed_nack
    }

    /// See [`Capabilities::with_lanes`].
    pub const fn lanes(&self) -> bool {
        self.lanes
    }
}

/// The names every adapter gives the metadata of a dead-lettered message (a Kafka or RabbitMQ
/// header, an SQS message attribute, a Redis stream field), beside the original payload, key
/// and ID; and how soon a message whose dead letter failed comes back.
pub mod dead_letter {
    use std::time::Duration;

    /// Why the message was parked, as the consumer wrote it.
    pub const REASON: &str = "reason";
    /// The topic, queue or stream the message was read from.
    pub const ORIGINAL_SOURCE: &str = "original_source";
    /// Where it was in that source: `partition 3 offset 17`, a stream entry ID, an SQS message
    /// ID ([`Metadata::position`](crate::Metadata::position)).
    pub const ORIGINAL_POSITION: &str = "original_position";

    /// How long a message whose dead letter failed ([`Ack::dead_letter`](crate::Ack::dead_letter)
    /// returned an error) stays away, where the adapter can delay its return (an SQS visibility
    /// change, a RabbitMQ delayed requeue): a dead-letter destination that refuses everything
    /// is then not asked again in a tight loop.
    pub const RETRY_AFTER: Duration = Duration::from_secs(1);
}

/// The name under which an adapter that re-publishes a message for a delayed redelivery (a
/// RabbitMQ delay queue, a Redis stream entry added again) carries its redelivery count on the
/// copy ([`Metadata::redeliveries`](crate::Metadata::redeliveries)): a header or field, decimal
/// text or an integer.
pub const REDELIVERY_COUNT: &str = "x-inbox-redelivery";

/// The header every copy a dead-letter [`replay`](crate::replay::replay) publishes carries. The effect
/// consumer ([`Consumer::effects`](crate::Consumer::effects)) gives a replayed message a fresh
/// budget of attempts; any other copy that arrives after its message was dead-lettered (a
/// producer's resend, a broker's redelivery) is acked as a duplicate of the dead letter.
pub const REPLAYED: &str = "x-inbox-replayed";
