//! The producing side: [`RabbitProducer`], publishes confirmed by the broker.

use std::fmt;
use std::future::Future;

use futures_util::future::try_join_all;
use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{OutgoingMessage, Publish, PublishError};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::Mutex;

use crate::short_string::{long_string, short_string};
use crate::{Error, RabbitConnection, Result};

/// AMQP `delivery_mode` 2: the broker writes the message to disk.
const PERSISTENT: u8 = 2;

/// Publishes each of `messages` with `mandatory` set, all of them before the first confirm is
/// awaited, and waits for the broker's confirms: `Ok` means every message is stored in a queue.
pub(crate) async fn publish_confirmed<'a>(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    messages: impl IntoIterator<Item = (&'a [u8], BasicProperties)>,
) -> Result<()> {
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let context = || format!("publishing to `{routing_key}`");
    let exchange_name = short_string("exchange", exchange)?;
    let queue = short_string("routing key", routing_key)?;
    // Each publish's frames are queued on its first poll, in order.
    let confirms = try_join_all(messages.into_iter().map(|(payload, properties)| {
        channel.basic_publish(
            exchange_name.clone(),
            queue.clone(),
            options,
            payload,
            properties,
        )
    }))
    .await
    .map_err(|e| Error::amqp(context(), e))?;
    try_join_all(confirms)
        .await
        .map_err(|e| Error::amqp(context(), e))?
        .into_iter()
        .try_for_each(|confirmation| confirmed(confirmation, exchange, routing_key))
}

/// One connection with a channel in confirm mode, opened at first use and reopened when lost.
/// Concurrent publishers wait here for one connection rather than each opening its own.
pub(crate) struct ConfirmChannel {
    connection: RabbitConnection,
    /// The connection's name.
    name: String,
    /// What the channel is for, in errors: `publishing`, `dead-letter`.
    purpose: &'static str,
    open: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for ConfirmChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConfirmChannel")
            .field("connection", &self.connection)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ConfirmChannel {
    pub(crate) fn new(connection: RabbitConnection, name: String, purpose: &'static str) -> Self {
        Self {
            connection,
            name,
            purpose,
            open: Mutex::new(None),
        }
    }

    /// The open channel, or a channel on a new connection; `true` with a new one.
    pub(crate) async fn channel(&self) -> Result<(Channel, bool)> {
        let mut open = self.open.lock().await;
        if let Some((_, channel)) = open.as_ref() {
            if channel.status().connected() {
                return Ok((channel.clone(), false));
            }
        }
        // Dropping the last handle closes a lost connection in the background.
        *open = None;
        let (connection, channel) = self.connection.open(&self.name, self.purpose).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| Error::amqp("enabling publisher confirms", e))?;
        *open = Some((connection, channel.clone()));
        Ok((channel, true))
    }

    /// [`channel`](Self::channel), connecting within the
    /// [`operation_timeout`](RabbitConnection::operation_timeout) (else
    /// [`Error::ConnectTimeout`]), as the source does. (The dead-letter publisher bounds each
    /// publish, connecting included, with one timeout.)
    async fn bounded_channel(&self) -> Result<Channel> {
        let (channel, _) = self.connection.bounded(self.channel()).await?;
        Ok(channel)
    }

    /// Publishes `messages` to `routing_key` on `exchange` (see [`publish_confirmed`]),
    /// connecting and then publishing each within the operation timeout; a lost connection is
    /// reopened on the next publish.
    pub(crate) async fn publish<'a>(
        &self,
        exchange: &str,
        routing_key: &str,
        messages: impl IntoIterator<Item = (&'a [u8], BasicProperties)>,
    ) -> Result<()> {
        let channel = self.bounded_channel().await?;
        let publishing = publish_confirmed(&channel, exchange, routing_key, messages);
        let result = self.within_timeout(routing_key, publishing).await;
        if result.is_err() && !channel.status().connected() {
            *self.open.lock().await = None;
        }
        result
    }

    /// `publishing` to `routing_key` within the
    /// [`operation_timeout`](RabbitConnection::operation_timeout), else
    /// [`Error::ConfirmTimeout`]: a broker that cannot store the message (an alarm) or no longer
    /// answers must not hold the caller. The connection stays: a late confirm is dropped, and
    /// the next publish waits anew (a connection that is gone is found by its heartbeat).
    pub(crate) async fn within_timeout(
        &self,
        routing_key: &str,
        publishing: impl Future<Output = Result<()>>,
    ) -> Result<()> {
        let waited = self.connection.operation_timeout;
        tokio::time::timeout(waited, publishing)
            .await
            .map_err(|_elapsed| Error::ConfirmTimeout {
                routing_key: routing_key.to_owned(),
                waited,
            })?
    }

    /// Closes the connection, if open, waiting for the broker's answer up to the operation
    /// timeout; a later publish opens a new one.
    pub(crate) async fn close(&self, reason: &str) {
        let open = self.open.lock().await.take();
        if let Some((connection, _)) = open {
            let closing = connection.close(200, reason.into());
            let waited = self.connection.operation_timeout;
            if tokio::time::timeout(waited, closing).await.is_err() {
                tracing::warn!(
                    connection = self.name,
                    ?waited,
                    "RabbitMQ did not answer the close; the connection is dropped"
                );
            }
        }
    }
}

/// What a publisher confirm says: `Ok` only for a message stored in a queue.
fn confirmed(confirmation: Confirmation, exchange: &str, routing_key: &str) -> Result<()> {
    match confirmation {
        // A mandatory message that found no queue is returned, then confirmed.
        Confirmation::Ack(Some(_returned)) => Err(Error::Unroutable {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        }),
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Nack(_) => Err(Error::Nacked {
            routing_key: routing_key.to_owned(),
        }),
        // The channel is in confirm mode; a missing confirm means it is not what we opened.
        Confirmation::NotRequested => Err(Error::Config(
            "publisher confirms are off on this channel".into(),
        )),
    }
}

/// `properties` with a `traceparent` header from the current span's trace context (feature
/// `opentelemetry` of inbox-core), unless they carry one.
fn with_traceparent(properties: BasicProperties) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    match inbox_core::TraceParent::current() {
        Some(parent) if !headers.contains_key(TRACEPARENT_HEADER) => {
            headers.insert(TRACEPARENT_HEADER.into(), long_string(&parent.to_string()));
            properties.with_headers(headers)
        }
        _ => properties,
    }
}

/// The persistent properties of `message`: its ID as `message_id`, its
/// [`traced_headers`](OutgoingMessage::traced_headers) as AMQP headers (long strings).
fn properties(message: &OutgoingMessage) -> Result<BasicProperties> {
    let id = short_string("message ID", message.id.as_str())?;
    let properties = BasicProperties::default()
        .with_message_id(id)
        .with_delivery_mode(PERSISTENT);
    let mut headers = FieldTable::default();
    for (name, value) in message.traced_headers() {
        let value = AMQPValue::LongString(value.into_owned().into());
        headers.insert(short_string("header name", name)?, value);
    }
    Ok(if headers.inner().is_empty() {
        properties
    } else {
        properties.with_headers(headers)
    })
}

/// Configures a [`RabbitProducer`]; made by [`RabbitProducer::builder`], finished by
/// [`connect`](Self::connect).
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct RabbitProducerBuilder {
    connection: RabbitConnection,
    connection_name: String,
    exchange: String,
}

impl RabbitProducerBuilder {
    /// A producer on the broker `connection` reaches.
    pub(crate) fn new(connection: RabbitConnection) -> Self {
        Self {
            connection,
            exchange: String::new(),
            connection_name: "inbox-rabbitmq producer".to_owned(),
        }
    }

    /// Publishes to `exchange` instead of straight to queues (the default exchange, `""`): a
    /// destination given to [`Publish`] is then the routing key (for a fanout exchange any key,
    /// `""` say; for a topic exchange `orders.created`). Publishes are mandatory: one that no
    /// bound queue takes fails with [`Error::Unroutable`](crate::Error::Unroutable) rather than
    /// vanishing. Route destinations to producers of different exchanges with
    /// [`inbox_core::Destinations`].
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }

    /// The client-provided connection name the management UI shows (default
    /// `inbox-rabbitmq producer`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// Connects and opens a channel in confirm mode. Fails with [`Error::Config`] on a
    /// connection setting the source refuses too (a heartbeat or operation timeout of 0), when
    /// the broker cannot be reached or refuses the login, and with [`Error::ConnectTimeout`]
    /// when it does not answer within
    /// [`operation_timeout`](RabbitConnection::operation_timeout).
    pub async fn connect(self) -> Result<RabbitProducer> {
        self.connection.check()?;
        let producer = RabbitProducer {
            exchange: self.exchange,
            publisher: ConfirmChannel::new(self.connection, self.connection_name, "publishing"),
        };
        producer.publisher.bounded_channel().await?;
        Ok(producer)
    }
}

/// Publishes messages that an inbox consumer can deduplicate, to any queue: each carries a
/// `message_id` (a UUIDv7 unless you pass one), is persistent (`delivery_mode = 2`), is
/// `mandatory`, and is confirmed by the broker before the call returns. A confirm that does not
/// come within [`operation_timeout`](RabbitConnection::operation_timeout) (an alarm, a broker
/// that stopped answering) fails the send with [`Error::ConfirmTimeout`]; so do a connect, with
/// [`Error::ConnectTimeout`], and `close` stops waiting for the broker's answer.
///
/// Send through [`Publish`]: `send(queue, payload)`, `send_with_id(queue, &id, payload)`,
/// `send_batch(queue, &messages)`. The destination is a queue name: the message goes through the
/// default exchange with the queue name as routing key, so the queue must exist (see
/// [`RabbitSourceBuilder::declare_topology`](crate::RabbitSourceBuilder::declare_topology)); one
/// that does not fails with [`Error::Unroutable`]. A lost connection is reopened on the next
/// publish; a publish that failed may or may not have reached the queue, so publish it again
/// **with the same ID** and the inbox drops the extra copy.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_core::Publish;
/// use inbox_rabbitmq::RabbitProducer;
///
/// let producer = RabbitProducer::builder().connect().await?; // the broker AMQP_URL names
/// let id = producer.send("payments", b"100").await?; // a UUIDv7 message_id, confirmed
/// producer.send_with_id("payments", &id, b"100").await?; // sent twice: applied once
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct RabbitProducer {
    /// `""`: the default exchange, a destination is a queue.
    exchange: String,
    publisher: ConfirmChannel,
}

impl RabbitProducer {
    /// Starts configuring a producer on the broker `AMQP_URL` names (another broker:
    /// [`RabbitConnection::producer`]); finish with [`connect`](RabbitProducerBuilder::connect).
    pub fn builder() -> RabbitProducerBuilder {
        RabbitConnection::from_env().producer()
    }

    /// Publishes `payload` to `queue` (with [`exchange`](RabbitProducerBuilder::exchange): under
    /// that routing key) with your `properties` (headers, content type, a timestamp, or no
    /// `message_id` at all), made persistent, and waits for the confirm.
    pub async fn publish_with_properties(
        &self,
        queue: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<()> {
        let properties = with_traceparent(properties).with_delivery_mode(PERSISTENT);
        self.publisher
            .publish(&self.exchange, queue, [(payload, properties)])
            .await
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.publisher.close("producer closed").await;
    }
}

/// `destination` is a queue name, or the routing key on the producer's exchange. Keys are
/// ignored: a queue has one order for all its messages. Each message's headers (and the current
/// trace as `traceparent`) go as AMQP headers; all are published before the first confirm is
/// awaited, and `Ok` means the broker confirmed every one.
impl Publish for RabbitProducer {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let traced =
            inbox_core::telemetry::traced_send("rabbitmq", destination, messages.len(), async {
                let target = if self.exchange.is_empty() {
                    format!("RabbitMQ queue `{destination}`")
                } else {
                    format!(
                        "RabbitMQ exchange `{}` with routing key `{destination}`",
                        self.exchange
                    )
                };
                let failed = |e: Error| {
                    PublishError::new(e.recovery(), format!("publishing to {target}"), e)
                };
                // Checked before anything is sent, so a batch goes out whole or not at all.
                let properties = messages
                    .iter()
                    .map(properties)
                    .collect::<Result<Vec<_>>>()
                    .map_err(failed)?;
                let payloads = messages.iter().map(|message| message.payload.as_slice());
                self.publisher
                    .publish(&self.exchange, destination, payloads.zip(properties))
                    .await
                    .map_err(failed)
            });
        traced.await
    }
}
