//! The producing side: [`RabbitProducer`], publishes confirmed by the broker.

use std::fmt;

use futures_util::future::try_join_all;
use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{OutgoingMessage, Publish, PublishError};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::Mutex;

use crate::short_string::short_string;
use crate::{Error, RabbitConnection, Result};

/// AMQP `delivery_mode` 2: the broker writes the message to disk.
const PERSISTENT: u8 = 2;

/// Publishes with `mandatory` set and waits for the broker's confirm: `Ok` means the message is
/// stored in a queue.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    properties: BasicProperties,
) -> Result<()> {
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let context = || format!("publishing to `{routing_key}`");
    let confirm = channel
        .basic_publish(
            short_string("exchange", exchange)?,
            short_string("routing key", routing_key)?,
            options,
            payload,
            properties,
        )
        .await
        .map_err(|e| Error::amqp(context(), e))?
        .await
        .map_err(|e| Error::amqp(context(), e))?;
    confirmed(confirm, exchange, routing_key)
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
    let Some(parent) = inbox_core::TraceParent::current() else {
        return properties;
    };
    let mut headers = properties.headers().clone().unwrap_or_default();
    if headers
        .inner()
        .keys()
        .any(|k| k.as_str() == TRACEPARENT_HEADER)
    {
        return properties;
    }
    headers.insert(
        TRACEPARENT_HEADER.into(),
        AMQPValue::LongString(parent.to_string().into()),
    );
    properties.with_headers(headers)
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
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct RabbitProducerBuilder {
    connection: RabbitConnection,
    connection_name: String,
    exchange: String,
}

impl fmt::Debug for RabbitProducerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitProducerBuilder")
            .field("connection", &self.connection)
            .field("connection_name", &self.connection_name)
            .field("exchange", &self.exchange)
            .finish()
    }
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

    /// Connects and opens a channel in confirm mode. Fails when the broker cannot be reached
    /// or refuses the login.
    pub async fn connect(self) -> Result<RabbitProducer> {
        let producer = RabbitProducer {
            connection: self.connection,
            name: self.connection_name,
            exchange: self.exchange,
            state: Mutex::new(None),
        };
        producer.channel().await?;
        Ok(producer)
    }
}

/// Publishes messages that an inbox consumer can deduplicate, to any queue: each carries a
/// `message_id` (a UUIDv7 unless you pass one), is persistent (`delivery_mode = 2`), is
/// `mandatory`, and is confirmed by the broker before the call returns.
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
pub struct RabbitProducer {
    connection: RabbitConnection,
    name: String,
    /// `""`: the default exchange, a destination is a queue.
    exchange: String,
    state: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for RabbitProducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitProducer")
            .field("connection", &self.connection)
            .field("connection_name", &self.name)
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
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
        let channel = self.channel().await?;
        let properties = with_traceparent(properties).with_delivery_mode(PERSISTENT);
        let result = publish_confirmed(&channel, &self.exchange, queue, payload, properties).await;
        if result.is_err() && !channel.status().connected() {
            // Reconnect on the next publish.
            *self.state.lock().await = None;
        }
        result
    }

    /// The open confirm-mode channel, reconnecting if it is gone.
    async fn channel(&self) -> Result<Channel> {
        let mut state = self.state.lock().await;
        if let Some((_, channel)) = state.as_ref() {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        let connection = self.connection.open(&self.name).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| Error::amqp("opening the publishing channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| Error::amqp("enabling publisher confirms", e))?;
        *state = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// Closes the connection.
    pub async fn close(self) {
        if let Some((connection, _)) = self.state.into_inner() {
            let _ = connection.close(200, "producer closed".into()).await;
        }
    }
}

/// `destination` is a queue name, the routing key on the default exchange. Keys are ignored: a
/// queue has one order for all its messages.
///
/// Each message is published persistent, `mandatory`, with its ID as `message_id` and its
/// headers (and the current trace as `traceparent`) as AMQP headers, all of them before the first
/// confirm is awaited; `Ok` once the broker confirmed every one.
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
                let channel = self.channel().await.map_err(failed)?;
                let routing_key = destination;
                let exchange = short_string("exchange", &self.exchange).map_err(failed)?;
                let queue = short_string("routing key", routing_key).map_err(failed)?;
                let context = || format!("publishing to `{routing_key}`");
                let options = BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                };
                let result = async {
                    // Each publish's frames are queued on its first poll, in slice order.
                    let confirms = try_join_all(messages.iter().zip(properties).map(
                        |(message, properties)| {
                            channel.basic_publish(
                                exchange.clone(),
                                queue.clone(),
                                options,
                                &message.payload,
                                properties,
                            )
                        },
                    ))
                    .await
                    .map_err(|e| Error::amqp(context(), e))?;
                    let confirmations = try_join_all(confirms)
                        .await
                        .map_err(|e| Error::amqp(context(), e))?;
                    confirmations.into_iter().try_for_each(|confirmation| {
                        confirmed(confirmation, &self.exchange, routing_key)
                    })
                }
                .await;
                if result.is_err() && !channel.status().connected() {
                    // Reconnect on the next publish.
                    *self.state.lock().await = None;
                }
                result.map_err(failed)
            });
        traced.await
    }
}
