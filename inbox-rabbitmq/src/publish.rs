//! The producing side: [`RabbitPublisher`], publishes confirmed by the broker.

use std::fmt;

use futures_util::future::try_join_all;
use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{async_trait, MessageId, OutgoingMessage, Publish, PublishError};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::Mutex;

use crate::short_string::short_string;
use crate::{connect, Error, Result};

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
    match confirm {
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

/// Publishes messages that an inbox consumer can deduplicate: each carries a `message_id`
/// (a UUIDv7 unless you pass one), is persistent (`delivery_mode = 2`), is `mandatory`, and is
/// confirmed by the broker before the call returns.
///
/// It publishes through the default exchange straight to one queue. A lost connection is
/// reopened on the next publish; a publish that failed may or may not have reached the queue,
/// so publish it again **with the same ID** and the inbox drops the extra copy.
pub struct RabbitPublisher {
    url: String,
    name: String,
    routing_key: String,
    state: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("url", &connect::redact(&self.url))
            .field("routing_key", &self.routing_key)
            .finish_non_exhaustive()
    }
}

impl RabbitPublisher {
    /// Connects to `url` and publishes to `queue` (which must exist: see
    /// [`RabbitConfig::declare_topology`](crate::RabbitConfig::declare_topology)).
    pub async fn connect(url: &str, queue: &str) -> Result<Self> {
        short_string("queue name", queue)?;
        let publisher = Self {
            url: url.to_owned(),
            name: format!("inbox-rabbitmq publisher {queue}"),
            routing_key: queue.to_owned(),
            state: Mutex::new(None),
        };
        publisher.channel().await?;
        Ok(publisher)
    }

    /// Publishes `payload` with a fresh UUIDv7 [`MessageId`] and returns the ID.
    pub async fn publish(&self, payload: &[u8]) -> Result<MessageId> {
        let id = MessageId::generate();
        self.publish_with_id(&id, payload).await?;
        Ok(id)
    }

    /// Publishes `payload` with message ID `id`: use the same ID when you publish again after an
    /// error, so the consumer applies it once.
    pub async fn publish_with_id(&self, id: &MessageId, payload: &[u8]) -> Result<()> {
        let properties =
            BasicProperties::default().with_message_id(short_string("message ID", id.as_str())?);
        self.publish_with_properties(payload, properties).await
    }

    /// Publishes `payload` with your `properties` (headers, content type, or no `message_id` at
    /// all), made persistent.
    pub async fn publish_with_properties(
        &self,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<()> {
        let channel = self.channel().await?;
        let properties = with_traceparent(properties).with_delivery_mode(PERSISTENT);
        let result = publish_confirmed(&channel, "", &self.routing_key, payload, properties).await;
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
        let connection = connect::open(&self.url, &self.name, None).await?;
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
            let _ = connection.close(200, "publisher closed".into()).await;
        }
    }
}

/// `destination` must be the queue this publisher was built for: a publisher refuses any other
/// with a [`Recovery::Fatal`](inbox_core::Recovery::Fatal) error ([`Error::Config`]); make one
/// per queue and route them with [`Destinations`](inbox_core::Destinations). Keys are ignored: a
/// queue has one order for all its messages.
///
/// Each message is published as by [`RabbitPublisher::publish_with_id`] (persistent,
/// `mandatory`, `message_id` set), all of them before the first confirm is awaited; `Ok` once the
/// broker confirmed every one.
#[async_trait]
impl Publish for RabbitPublisher {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let failed = |e: Error| {
            PublishError::new(
                e.recovery(),
                format!("publishing to RabbitMQ queue `{destination}`"),
                e,
            )
        };
        if destination != self.routing_key {
            return Err(failed(Error::Config(format!(
                "this RabbitPublisher publishes to queue `{}`, not `{destination}`; make one \
                 publisher per queue and route them with inbox_core::Destinations",
                self.routing_key
            ))));
        }
        // Checked before anything is sent, so a batch goes out whole or not at all.
        let ids = messages
            .iter()
            .map(|message| short_string("message ID", message.id.as_str()))
            .collect::<Result<Vec<_>>>()
            .map_err(failed)?;
        let channel = self.channel().await.map_err(failed)?;
        let routing_key = self.routing_key.as_str();
        let queue = short_string("queue name", routing_key).map_err(failed)?;
        let context = || format!("publishing to `{routing_key}`");
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let result = async {
            // Each publish's frames are queued on its first poll, in slice order.
            let confirms = try_join_all(messages.iter().zip(ids).map(|(message, id)| {
                let properties = BasicProperties::default()
                    .with_message_id(id)
                    .with_delivery_mode(PERSISTENT);
                channel.basic_publish(
                    "".into(),
                    queue.clone(),
                    options,
                    &message.payload,
                    properties,
                )
            }))
            .await
            .map_err(|e| Error::amqp(context(), e))?;
            let confirmations = try_join_all(confirms)
                .await
                .map_err(|e| Error::amqp(context(), e))?;
            for confirmation in confirmations {
                match confirmation {
                    Confirmation::Ack(None) => {}
                    // A mandatory message that found no queue is returned, then confirmed.
                    Confirmation::Ack(Some(_returned)) => {
                        return Err(Error::Unroutable {
                            exchange: String::new(),
                            routing_key: routing_key.to_owned(),
                        })
                    }
                    Confirmation::Nack(_) => {
                        return Err(Error::Nacked {
                            routing_key: routing_key.to_owned(),
                        })
                    }
                    Confirmation::NotRequested => {
                        return Err(Error::Config(
                            "publisher confirms are off on this channel".into(),
                        ))
                    }
                }
            }
            Ok(())
        }
        .await;
        if result.is_err() && !channel.status().connected() {
            // Reconnect on the next publish.
            *self.state.lock().await = None;
        }
        result.map_err(failed)
    }
}
