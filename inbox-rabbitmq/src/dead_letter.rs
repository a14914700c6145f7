//! Publishing dead letters and delayed copies: on a connection of their own, each publish
//! bounded by a timeout.

use std::time::Duration;

use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Message, REDELIVERY_COUNT};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use tokio::sync::Mutex;

use crate::producer::{publish_confirmed, ConfirmChannel};
use crate::redelivery::{DelayQueues, DelayedCopy};
use crate::short_string::long_string;
use crate::topology::{dead_lettering_to, declare_queue};
use crate::{Error, RabbitSourceBuilder, Result};

/// The dead-letter publisher of one [`RabbitSource`](crate::RabbitSource), shared by all its
/// acks.
///
/// Its own connection, because RabbitMQ blocks a whole connection once it publishes during a
/// memory or disk alarm: on the consuming connection the acks would stop too. Opened at the
/// first dead letter and reopened when lost.
#[derive(Debug)]
pub(crate) struct DeadLetters {
    publisher: ConfirmChannel,
    timeout: Duration,
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
            timeout: config.connection.operation_timeout,
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
        self.bounded(queue, async {
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
        self.bounded(queue, async {
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

    /// `publishing` to `queue` within the timeout: a broker that cannot store it (an alarm) must
    /// not stall the consumer.
    async fn bounded(
        &self,
        queue: &str,
        publishing: impl std::future::Future<Output = Result<()>>,
    ) -> Result<()> {
        match tokio::time::timeout(self.timeout, publishing).await {
            Ok(result) => result,
            // The connection stays: a late confirm is dropped, and the next publish waits anew.
            Err(_elapsed) => Err(Error::ConfirmTimeout {
                routing_key: queue.to_owned(),
                waited: self.timeout,
            }),
        }
    }

    /// Closes the connection, if open; a later dead letter opens a new one.
    pub(crate) async fn close(&self) {
        self.publisher.close("consumer closed").await;
    }
}
