//! Dead letters and delayed copies published on a connection of their own, each publish
//! bounded by a timeout; and a dead-letter queue read back for [`inbox_core::replay`]:
//! `basic.get` without auto-ack, a `basic.ack` once replayed, the rest returned to the queue
//! when the reading ends.

use std::time::Duration;

use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::replay::{self, DeadLetter};
use inbox_core::{Message, OperationError, REDELIVERY_COUNT};
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::producer::{publish_confirmed, ConfirmChannel};
use crate::redelivery::{DelayQueues, DelayedCopy};
use crate::short_string::{long_string, short_string};
use crate::source::{sent_at, value_bytes, Amqp};
use crate::topology::{dead_lettering_to, declare_queue};
use crate::{Error, IdFrom, RabbitConnection, RabbitSourceBuilder, Result};

/// The dead-letter publisher of one [`RabbitSource`](crate::RabbitSource), shared by all its
/// acks.
///
/// Its own connection, because RabbitMQ blocks a whole connection once it publishes during a
/// memory or disk alarm: on the consuming connection the acks would stop too. Opened at the
/// first dead letter and reopened when lost.
#[derive(Debug)]
pub(crate) struct DeadLetters {
    publisher: ConfirmChannel,
    /// The queue consumed, and its dead-letter queue.
    queue: String,
    dead_letter_queue: String,
    /// Delay queues declared on the open connection.
    delay_queues: Mutex<DelayQueues>,
}

impl DeadLetters {
    pub(crate) fn new(config: &RabbitSourceBuilder) -> Self {
        let name = format!("{} dead letters", config.effective_connection_name());
        Self {
            publisher: ConfirmChannel::new(config.connection.clone(), name, "dead-letter"),
            queue: config.queue.clone(),
            dead_letter_queue: config.dead_letter_queue(),
            delay_queues: Mutex::new(DelayQueues::new()),
        }
    }

    /// Publishes `message` to the dead-letter queue, persistent, with its original body,
    /// properties and headers plus the [`inbox_core::dead_letter`] headers.
    pub(crate) async fn park(
        &self,
        message: &Message,
        original: &BasicProperties,
        reason: &str,
    ) -> Result<()> {
        let mut headers = original.headers().clone().unwrap_or_default();
        headers.insert(REASON.into(), long_string(reason));
        headers.insert(ORIGINAL_SOURCE.into(), long_string(&self.queue));
        headers.insert(
            ORIGINAL_POSITION.into(),
            long_string(&message.meta.position),
        );
        let props = original.clone().with_headers(headers).with_delivery_mode(2);
        let queue = &self.dead_letter_queue;
        let payload = message.payload.as_slice();
        self.publisher
            .within_timeout(queue, async {
                publish_confirmed(&self.channel().await?, "", queue, [(payload, props)]).await
            })
            .await
    }

    /// Publishes the [`DelayedCopy`] of `message` for redelivery `redelivery`, expiring after
    /// `delay`. A copy returned unroutable found its delay queue deleted: the queue is declared
    /// again and the copy published once more.
    pub(crate) async fn delay(
        &self,
        message: &Message,
        original: &BasicProperties,
        delay: Duration,
        redelivery: u32,
    ) -> Result<()> {
        let copy = DelayedCopy::new(&self.queue, delay, redelivery);
        let mut headers = FieldTable::default();
        for (name, value) in original.headers().clone().unwrap_or_default().inner() {
            if DelayedCopy::keeps_header(name.as_str()) {
                headers.insert(name.clone(), value.clone());
            }
        }
        headers.insert(
            REDELIVERY_COUNT.into(),
            AMQPValue::LongLongInt(i64::from(copy.redeliveries)),
        );
        let props = original
            .clone()
            .with_headers(headers)
            .with_delivery_mode(2)
            .with_expiration(copy.expiration_ms.to_string().into());
        let queue = copy.queue.as_str();
        let payload = message.payload.as_slice();
        self.publisher
            .within_timeout(queue, async {
                let channel = self.channel().await?;
                self.declare_delay_queue(&channel, queue).await?;
                let sent = publish_confirmed(&channel, "", queue, [(payload, props.clone())]).await;
                if !matches!(sent, Err(Error::Unroutable { .. })) {
                    return sent;
                }
                tracing::warn!(queue, "delay queue is gone; declaring it again");
                self.delay_queues.lock().await.gone(queue);
                self.declare_delay_queue(&channel, queue).await?;
                publish_confirmed(&channel, "", queue, [(payload, props)]).await
            })
            .await
    }

    /// The publishing channel, on a connection opened at first use and reopened when lost.
    async fn channel(&self) -> Result<Channel> {
        let (channel, fresh) = self.publisher.channel().await?;
        if fresh {
            // What the old connection declared is declared again, so a delay queue deleted
            // meanwhile exists before a copy goes to it.
            self.delay_queues.lock().await.reconnected();
        }
        Ok(channel)
    }

    /// Declares delay queue `name` once per connection: a durable quorum queue whose expired
    /// messages the broker dead-letters, at least once, to the consumed queue through the
    /// default exchange. Each message carries its own expiration, so the queue takes any
    /// schedule; a message expires only at the head of the queue, so one step's copies come
    /// back in order, none sooner than its own delay.
    async fn declare_delay_queue(&self, channel: &Channel, name: &str) -> Result<()> {
        if !self.delay_queues.lock().await.needs_declaring(name) {
            return Ok(());
        }
        let args = dead_lettering_to(&self.queue);
        declare_queue(channel, "delay queue", name, args, "").await?;
        self.delay_queues.lock().await.declared(name);
        Ok(())
    }

    /// Closes the connection, if open; a later dead letter opens a new one.
    pub(crate) async fn close(&self) {
        self.publisher.close("consumer closed").await;
    }
}

/// The messages of a RabbitMQ dead-letter queue (`<queue>.dlq`), as [`inbox_core::replay`]
/// reads them: each keeps its body, properties and headers and carries the
/// [`inbox_core::dead_letter`] headers. Its ID is the `message_id` property (or the header
/// [`id_header`](RabbitDeadLettersBuilder::id_header) names), its position its place in the
/// queue when read (`1` the oldest; it changes as messages leave), its time the message's own
/// `timestamp_in_ms` header or `timestamp` property, when the publisher set one: RabbitMQ keeps
/// no time of its own.
///
/// Reading takes every message with `basic.get` and holds it unacknowledged on one channel; a
/// replayed one is acked (removed), and closing the channel returns the others to the queue,
/// in their order.
///
/// Before RabbitMQ 4.3 a quorum queue counts each return as a delivery (`x-delivery-count`
/// rises by one per reading). The dead-letter queue the source declares has no
/// `x-delivery-limit`, but RabbitMQ 4.0 gives every quorum queue a default limit of 20, and a
/// message over it is dropped (a dead-letter queue has no dead-letter exchange of its own): on
/// RabbitMQ 4.0 to 4.2, set a policy with `delivery-limit: -1` on the dead-letter queues before
/// reading them often.
pub struct RabbitDeadLetters {
    queue: String,
    id_from: IdFrom,
    connection: Connection,
    channel: Channel,
    read: u64,
    drained: bool,
}

impl std::fmt::Debug for RabbitDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitDeadLetters")
            .field("queue", &self.queue)
            .field("id_from", &self.id_from)
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RabbitDeadLetters`]; start with [`RabbitDeadLetters::builder`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct RabbitDeadLettersBuilder {
    queue: String,
    connection: RabbitConnection,
    id_from: IdFrom,
}

impl RabbitDeadLetters {
    /// Reads the dead-letter queue `queue` (like `payments.dlq`), on the broker `AMQP_URL`
    /// names (another broker: [`RabbitConnection::dead_letters`]).
    pub fn builder(queue: impl Into<String>) -> RabbitDeadLettersBuilder {
        RabbitConnection::from_env().dead_letters(queue)
    }
}

impl RabbitDeadLettersBuilder {
    /// Reads `queue` on the broker `connection` reaches.
    pub(crate) fn new(connection: RabbitConnection, queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            connection,
            id_from: IdFrom::MessageIdProperty,
        }
    }

    /// Reads the ID from this header instead of the `message_id` property, as the source does
    /// with [`RabbitSourceBuilder::id_header`](crate::RabbitSourceBuilder::id_header).
    pub fn id_header(self, name: impl Into<String>) -> Self {
        self.id_from(IdFrom::Header(name.into()))
    }

    /// Reads the ID where `from` says, as the source does with
    /// [`RabbitSourceBuilder::id_from`](crate::RabbitSourceBuilder::id_from) (default: the
    /// `message_id` property).
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.id_from = from;
        self
    }

    /// Connects and opens the reading channel.
    pub async fn connect(self) -> Result<RabbitDeadLetters> {
        let name = format!("inbox dead letters of {}", self.queue);
        self.connection.check()?;
        let opening = self.connection.open(&name, "dead-letter reading");
        let (connection, channel) = self.connection.bounded(opening).await?;
        Ok(RabbitDeadLetters {
            queue: self.queue,
            id_from: self.id_from,
            connection,
            channel,
            read: 0,
            drained: false,
        })
    }
}

impl replay::DeadLetters for RabbitDeadLetters {
    fn name(&self) -> &str {
        &self.queue
    }

    async fn next(&mut self, max: usize) -> std::result::Result<Vec<DeadLetter>, OperationError> {
        let mut letters = Vec::new();
        while !self.drained && letters.len() < max {
            let queue = short_string("queue name", &self.queue)?;
            let got = self
                .channel
                .basic_get(queue, BasicGetOptions { no_ack: false })
                .await
                .map_err(|e| Error::amqp(format!("basic.get from `{}`", self.queue), e))?;
            let Some(got) = got else {
                self.drained = true;
                break;
            };
            self.read += 1;
            let delivery = got.delivery;
            let props = &delivery.properties;
            let headers = props.headers().clone().unwrap_or_default();
            let mut letter = DeadLetter::new(self.read.to_string(), delivery.data.clone());
            letter.handle = delivery.delivery_tag.to_string();
            letter.id = self
                .id_from
                .read(&Amqp {
                    headers: &headers,
                    message_id: props.message_id().as_ref().map(|s| s.as_str()),
                    body: &delivery.data,
                })
                .ok();
            letter.timestamp = sent_at(&headers, *props.timestamp());
            // `x-` headers are the broker's (`x-delivery-count`, `x-death`), not the message's.
            // An ID header stays: the producer sends the ID as `message_id` only.
            letter.take_metadata(
                headers
                    .inner()
                    .iter()
                    .filter(|(name, _)| !name.as_str().starts_with("x-"))
                    .map(|(name, value)| (name.to_string(), value_bytes(value)))
                    .collect(),
            );
            // One the broker parked by itself (`x-delivery-limit`, a TTL) has no reason of the
            // consumer's: the broker's own (`delivery_limit`, `expired`) stands for it.
            if letter.reason.is_none() {
                letter.reason = headers
                    .inner()
                    .get("x-first-death-reason")
                    .map(|reason| String::from_utf8_lossy(&value_bytes(reason)).into_owned());
            }
            letters.push(letter);
        }
        Ok(letters)
    }

    async fn remove(&mut self, letters: &[DeadLetter]) -> std::result::Result<(), OperationError> {
        for letter in letters {
            let tag: u64 = letter
                .handle
                .parse()
                .map_err(|_| Error::Config(format!("`{}` is not a delivery tag", letter.handle)))?;
            self.channel
                .basic_ack(tag, BasicAckOptions { multiple: false })
                .await
                .map_err(|e| Error::amqp(format!("acking dead letter {}", letter.position), e))?;
        }
        Ok(())
    }

    async fn close(&mut self) -> std::result::Result<(), OperationError> {
        // Closing the channel returns every unacked message to the queue.
        self.channel
            .close(200, "dead letters read".into())
            .await
            .map_err(|e| Error::amqp("closing the dead-letter reading channel", e))?;
        let _ = self.connection.close(200, "dead letters read".into()).await;
        Ok(())
    }
}
