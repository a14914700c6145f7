//! Publishing dead letters: on a connection of their own, each publish bounded by a timeout.

use std::fmt;
use std::time::Duration;

use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Message, REDELIVERY_COUNT};
use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::producer::publish_confirmed;
use crate::redelivery::{DelayQueues, DelayedCopy};
use crate::short_string::short_string;
use crate::{Error, RabbitConnection, RabbitSourceBuilder, Result};

/// The dead-letter publisher of one [`RabbitSource`](crate::RabbitSource), shared by all its
/// acks.
///
/// Its own connection, because RabbitMQ blocks a whole connection once it publishes during a
/// memory or disk alarm: on the consuming connection the acks would stop too. Opened at the
/// first dead letter and reopened when lost.
pub(crate) struct DeadLetters {
    connection: RabbitConnection,
    name: String,
    timeout: Duration,
    /// The queue consumed, and its dead-letter queue.
    queue: String,
    dead_letter_queue: String,
    open: Mutex<Option<(Connection, Channel)>>,
    /// Delay queues declared on the open connection.
    delay_queues: Mutex<DelayQueues>,
}

impl fmt::Debug for DeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetters")
            .field("name", &self.name)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl DeadLetters {
    pub(crate) fn new(config: &RabbitSourceBuilder) -> Self {
        Self {
            connection: config.connection.clone(),
            name: format!("{} dead letters", config.effective_connection_name()),
            timeout: config.connection.operation_timeout,
            queue: config.queue.clone(),
            dead_letter_queue: config.dead_letter_queue(),
            open: Mutex::new(None),
            delay_queues: Mutex::new(DelayQueues::new()),
        }
    }

    /// Publishes `message` to the dead-letter queue through the default exchange, with its
    /// original body, properties and headers plus the [`inbox_core::dead_letter`] headers
    /// (`reason`, `original_source`: the queue, `original_position`: connection, channel and
    /// tag), persistent.
    pub(crate) async fn park(
        &self,
        message: &Message,
        original: &BasicProperties,
        reason: &str,
    ) -> Result<()> {
        let mut headers = original.headers().clone().unwrap_or_default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.to_owned()));
        headers.insert(REASON.into(), text(reason));
        headers.insert(ORIGINAL_SOURCE.into(), text(&self.queue));
        headers.insert(ORIGINAL_POSITION.into(), text(&message.meta.position));
        let props = original.clone().with_headers(headers).with_delivery_mode(2);
        self.publish(&self.dead_letter_queue, &message.payload, props)
            .await
    }

    /// Publishes a copy of `message` to the delay queue of redelivery `redelivery`
    /// (`<queue>.delay.<redelivery>`, declared at its first use), expiring after `delay`, with
    /// [`REDELIVERY_COUNT`] set to `redelivery + 1`; the delay queue dead-letters it back to
    /// the queue once it expires. The copy keeps the body, properties and headers, less the
    /// quorum queue's `x-delivery-count`: the copy is a new message to the queue (see
    /// [`DelayedCopy`]). A copy returned unroutable found its delay queue deleted: the queue is
    /// declared again and the copy published once more.
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
        let timeout = self.timeout;
        let queue = copy.queue.as_str();
        let published = async {
            let channel = self.channel().await?;
            self.declare_delay_queue(&channel, queue).await?;
            let sent =
                publish_confirmed(&channel, "", queue, &message.payload, props.clone()).await;
            if !matches!(sent, Err(Error::Unroutable { .. })) {
                return sent;
            }
            tracing::warn!(queue, "delay queue is gone; declaring it again");
            self.delay_queues.lock().await.gone(queue);
            self.declare_delay_queue(&channel, queue).await?;
            publish_confirmed(&channel, "", queue, &message.payload, props).await
        };
        match tokio::time::timeout(timeout, published).await {
            Ok(result) => result,
            Err(_elapsed) => Err(Error::ConfirmTimeout {
                routing_key: copy.queue,
                waited: timeout,
            }),
        }
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
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.to_owned()));
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert("x-dead-letter-exchange".into(), text(""));
        args.insert("x-dead-letter-routing-key".into(), text(&self.queue));
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(short_string("delay queue name", name)?, options, args)
            .await
            .map_err(|e| Error::amqp(format!("declaring delay queue `{name}`"), e))?;
        self.delay_queues.lock().await.declared(name);
        Ok(())
    }

    /// Publishes to `queue` through the default exchange and waits for the confirm, for at most
    /// the timeout: a broker that cannot store it (an alarm) must not stall the consumer.
    async fn publish(
        &self,
        queue: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<()> {
        let timeout = self.timeout;
        let published = async {
            let channel = self.channel().await?;
            publish_confirmed(&channel, "", queue, payload, properties).await
        };
        match tokio::time::timeout(timeout, published).await {
            Ok(result) => result,
            // The connection stays: a late confirm is dropped, and the next publish waits anew.
            Err(_elapsed) => Err(Error::ConfirmTimeout {
                routing_key: queue.to_owned(),
                waited: timeout,
            }),
        }
    }

    /// The open channel, or a new connection and channel. Concurrent dead letters (of parallel
    /// lanes) wait here for one connection rather than each opening its own.
    async fn channel(&self) -> Result<Channel> {
        let mut open = self.open.lock().await;
        if let Some((_, channel)) = open.as_ref() {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        // Dropping the last handle closes a lost connection in the background.
        *open = None;
        let connection = self.connection.open(&self.name).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| Error::amqp("opening the dead-letter channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| Error::amqp("enabling publisher confirms", e))?;
        *open = Some((connection, channel.clone()));
        // Channel numbers start again on a new connection: what the old one declared is
        // declared again, so a delay queue deleted meanwhile exists before a copy goes to it.
        self.delay_queues.lock().await.reconnected();
        Ok(channel)
    }

    /// Closes the connection, if open; a later dead letter opens a new one.
    pub(crate) async fn close(&self) {
        let open = self.open.lock().await.take();
        if let Some((connection, _)) = open {
            let _ = connection.close(200, "consumer closed".into()).await;
        }
    }
}
