//! The consuming side: [`RabbitSource`].

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use futures_util::{FutureExt, StreamExt};
use inbox_core::{Binding, Capabilities, Delivery, IdCarrier, Message, MessageSource, SourceError};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::ack::{Link, RabbitAck};
use crate::dead_letter::DeadLetters;
use crate::redelivery::{Counts, DELIVERY_COUNT_HEADER};
use crate::short_string::short_string;
use crate::{topology, Error, RabbitConnection, RabbitSourceBuilder, Result, Topology};

/// A RabbitMQ queue as an inbox [`MessageSource`]. See the crate docs for the topology and the
/// ack semantics.
pub struct RabbitSource {
    config: RabbitSourceBuilder,
    generation: u64,
    live: Option<Live>,
    /// The dead-letter publisher, shared by every ack.
    dead_letters: Arc<DeadLetters>,
}

struct Live {
    link: Arc<Link>,
    /// Started by the first receive, whose batch size sets the prefetch window.
    consumer: Option<lapin::Consumer>,
}

impl fmt::Debug for RabbitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitSource")
            .field("queue", &self.config.queue)
            .field("generation", &self.generation)
            .field("connected", &self.live.is_some())
            .finish_non_exhaustive()
    }
}

impl RabbitSourceBuilder {
    /// Connects, declares (or checks) the topology and starts consuming. An error here is a
    /// configuration, permission or reachability problem; later connection losses are retried
    /// by [`MessageSource::receive`].
    pub async fn connect(self) -> Result<RabbitSource> {
        self.check()?;
        let dead_letters = Arc::new(DeadLetters::new(&self));
        let mut source = RabbitSource {
            config: self,
            generation: 0,
            live: None,
            dead_letters,
        };
        source.open().await?;
        Ok(source)
    }
}

impl RabbitSource {
    /// Starts configuring a source that consumes `queue`, on the broker `AMQP_URL` names
    /// (another broker, or a CA of its own: [`RabbitConnection::source`]); finish with
    /// [`connect`](RabbitSourceBuilder::connect).
    pub fn builder(queue: impl Into<String>) -> RabbitSourceBuilder {
        RabbitConnection::from_env().source(queue)
    }

    /// The settings it was built with (the broker, the queue, the connection name, ...).
    pub fn settings(&self) -> &RabbitSourceBuilder {
        &self.config
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.config.queue
    }

    /// Closes the connection now (the broker requeues unacked deliveries). Dropping the source
    /// does the same in the background.
    pub async fn close(mut self) {
        // Bounded: `connection.close` waits for the broker's `close-ok`, which a dead connection
        // never sends.
        let waited = self.config.connection.operation_timeout;
        if let Some(live) = self.live.take() {
            let closing = live.link.connection.close(200, "consumer closed".into());
            let _ = tokio::time::timeout(waited, closing).await;
        }
        let _ = tokio::time::timeout(waited, self.dead_letters.close()).await;
    }

    /// Connects and prepares the topology, within [`RabbitConnection::operation_timeout`].
    async fn open(&mut self) -> Result<()> {
        self.live = None;
        self.generation += 1;
        let config = &self.config;
        let link = config
            .connection
            .bounded(async {
                let name = config.effective_connection_name();
                let (connection, channel) = config.connection.open(&name, "consuming").await?;
                topology::prepare(&connection, &channel, config).await?;
                Ok(Link::new(self.generation, connection, channel))
            })
            .await?;
        self.live = Some(Live {
            link: Arc::new(link),
            consumer: None,
        });
        Ok(())
    }

    /// Starts consuming with a prefetch window for batches of `batch`. RabbitMQ fixes a
    /// consumer's window when it starts (a later per-consumer `basic.qos` applies only to
    /// consumers started after it), so this waits for the first receive to know the batch size.
    async fn consume(
        config: &RabbitSourceBuilder,
        link: &Link,
        batch: usize,
    ) -> Result<lapin::Consumer> {
        link.channel
            .basic_qos(
                config.prefetch_for(batch),
                BasicQosOptions { global: false },
            )
            .await
            .map_err(|e| Error::amqp("setting prefetch (basic.qos)", e))?;
        link.channel
            .basic_consume(
                short_string("queue name", &config.queue)?,
                short_string("consumer tag", &config.consumer_tag)?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| Error::amqp(format!("consuming queue `{}`", config.queue), e))
    }

    /// Reconnects when the connection or channel is gone. The caller (the core loop) backs off
    /// between failed attempts.
    async fn ensure_open(&mut self) -> Result<(), SourceError> {
        let open = self.live.as_ref().is_some_and(|live| live.link.is_open());
        if !open {
            tracing::warn!(queue = %self.config.queue, generation = self.generation + 1, "RabbitMQ connection or channel lost; reconnecting");
            self.open().await?;
            tracing::info!(queue = %self.config.queue, generation = self.generation, "reconnected to RabbitMQ; consuming again");
        }
        Ok(())
    }

    fn lost(&mut self, why: String) -> SourceError {
        self.live = None;
        SourceError::new(
            inbox_core::Recovery::Reconnect,
            format!("consuming queue `{}`", self.config.queue),
            why,
        )
    }

    fn convert(
        &mut self,
        link: &Arc<Link>,
        delivery: lapin::message::Delivery,
    ) -> Delivery<RabbitAck> {
        let tag = delivery.delivery_tag;
        let props = delivery.properties;
        let headers = props.headers().clone().unwrap_or_default();
        let id = self.config.id_from.read(&Amqp {
            headers: &headers,
            message_id: props.message_id().as_ref().map(|s| s.as_str()),
            body: &delivery.data,
        });
        // Quorum queues count earlier deliveries in `x-delivery-count`; absent on a first delivery.
        let header = |name: &str| headers.inner().get(name).and_then(as_u64);
        let counts = Counts::read(
            header(DELIVERY_COUNT_HEADER),
            delivery.redelivered,
            header(inbox_core::REDELIVERY_COUNT),
        );
        let mut message = Message::new(id, delivery.data);
        message.key = Some(delivery.routing_key.as_str().as_bytes().to_vec());
        message.headers = headers
            .inner()
            .iter()
            .map(|(k, v)| (k.to_string(), value_bytes(v)))
            .collect();
        let meta = &mut message.meta;
        meta.source = self.config.queue.clone();
        meta.position = link.position(tag);
        meta.delivery_count = counts.delivery_count;
        meta.redelivered = counts.redelivered;
        meta.redeliveries = counts.redeliveries;
        // One queue, one order: no lane.
        meta.timestamp = sent_at(&headers, *props.timestamp());
        link.track(tag);
        Delivery {
            message,
            ack: RabbitAck {
                link: Arc::clone(link),
                tag,
                dead_letters: Arc::clone(&self.dead_letters),
                properties: props,
            },
        }
    }
}

impl MessageSource for RabbitSource {
    type Ack = RabbitAck;

    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    /// A delivery count with [`Topology::Declare`], which makes the queue a quorum queue (its
    /// `x-delivery-count`); nothing with [`Topology::Expect`], whose queue may be a classic one,
    /// where a redelivery carries no count. A nack requeues at once, after the wait in process,
    /// so the broker holds nothing back: no delayed nack. One queue is one order: no lanes, so
    /// parallel lanes apply its chunks side by side in no order. A delayed redelivery goes
    /// through a delay queue (see [`RabbitAck`]), declared at its first use with either
    /// topology.
    fn capabilities(&self) -> Capabilities {
        match self.config.topology {
            Topology::Declare => Capabilities::NONE
                .with_delivery_count()
                .with_delayed_redelivery(),
            Topology::Expect => Capabilities::NONE.with_delayed_redelivery(),
        }
    }

    /// Waits up to the poll timeout for a first delivery, then takes whatever else is already
    /// buffered, up to `max`. The first receive starts the consumer, with a prefetch window for
    /// batches of `max` unless one was set. Cancel-safe: the only wait happens before any
    /// delivery is taken from the channel.
    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<RabbitAck>>, SourceError> {
        self.ensure_open().await?;
        let poll = self.config.poll_timeout;
        let Some(live) = self.live.as_mut() else {
            return Err(self.lost("not connected".into()));
        };
        if live.consumer.is_none() {
            match Self::consume(&self.config, &live.link, max).await {
                Ok(consumer) => live.consumer = Some(consumer),
                Err(e) => return Err(self.lost(e.to_string())),
            }
        }
        let Some(consumer) = live.consumer.as_mut() else {
            return Err(self.lost("not consuming".into()));
        };
        let link = Arc::clone(&live.link);
        let first = match tokio::time::timeout(poll, consumer.next()).await {
            Err(_elapsed) => return Ok(Vec::new()),
            Ok(next) => match delivered(next) {
                Ok(delivery) => delivery,
                Err(why) => return Err(self.lost(why)),
            },
        };
        let mut raw = vec![first];
        let mut broken = None;
        while raw.len() < max {
            let Some(next) = consumer.next().now_or_never() else {
                break;
            };
            match delivered(next) {
                Ok(delivery) => raw.push(delivery),
                Err(why) => {
                    broken = Some(why);
                    break;
                }
            }
        }
        if let Some(why) = broken {
            // Hand out what arrived; their acks fail and the broker redelivers them.
            tracing::warn!(queue = %self.config.queue, %why, "RabbitMQ channel lost; reconnecting on the next receive");
            self.live = None;
        }
        Ok(raw.into_iter().map(|d| self.convert(&link, d)).collect())
    }
}

/// What a consumer stream yielded: a delivery, or why the channel is lost.
fn delivered(
    next: Option<lapin::Result<lapin::message::Delivery>>,
) -> std::result::Result<lapin::message::Delivery, String> {
    match next {
        Some(Ok(delivery)) => Ok(delivery),
        Some(Err(e)) => Err(format!("the channel failed: {e}")),
        None => Err("the broker cancelled the consumer (queue deleted?)".into()),
    }
}

/// Where AMQP keeps what [`IdFrom`](inbox_core::IdFrom) reads: the header table, the
/// `message_id` property, and CloudEvents' binary mode as `cloudEvents_` headers (the prefix the
/// CloudEvents AMQP binding prefers) or `cloudEvents:` ones (the older prefix).
pub(crate) const ID_BINDING: Binding = Binding {
    broker: "RabbitMQ",
    header: "header",
    property: Some("property message_id"),
    position: None,
    cloud_events_prefixes: &["cloudEvents_", "cloudEvents:"],
};

/// A delivery as [`IdFrom::read`](inbox_core::IdFrom::read) sees it.
pub(crate) struct Amqp<'a> {
    pub(crate) headers: &'a FieldTable,
    pub(crate) message_id: Option<&'a str>,
    pub(crate) body: &'a [u8],
}

impl IdCarrier for Amqp<'_> {
    fn binding(&self) -> &Binding {
        &ID_BINDING
    }

    fn header(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, String>> {
        let value = self.headers.inner().get(name)?;
        if matches!(value, AMQPValue::Void) {
            return None;
        }
        Some(
            text_bytes(value)
                .map(Cow::Owned)
                .ok_or_else(|| value.get_type().to_string()),
        )
    }

    fn property(&self) -> Option<Cow<'_, [u8]>> {
        self.message_id.map(|id| Cow::Borrowed(id.as_bytes()))
    }

    fn payload(&self) -> &[u8] {
        self.body
    }
}

/// A header value as ID text: strings and byte arrays as they are, integers in decimal.
pub(crate) fn text_bytes(value: &AMQPValue) -> Option<Vec<u8>> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
        AMQPValue::ByteArray(b) => Some(b.as_slice().to_vec()),
        other => as_i128(other).map(|n| n.to_string().into_bytes()),
    }
}

/// Any header value as bytes for [`Message::headers`]: text as is, the rest as readable text.
pub(crate) fn value_bytes(value: &AMQPValue) -> Vec<u8> {
    match (text_bytes(value), value) {
        (Some(bytes), _) => bytes,
        (None, AMQPValue::Boolean(b)) => b.to_string().into_bytes(),
        (None, other) => format!("{other:?}").into_bytes(),
    }
}

fn as_i128(value: &AMQPValue) -> Option<i128> {
    Some(match value {
        AMQPValue::ShortShortInt(n) => i128::from(*n),
        AMQPValue::ShortShortUInt(n) => i128::from(*n),
        AMQPValue::ShortInt(n) => i128::from(*n),
        AMQPValue::ShortUInt(n) => i128::from(*n),
        AMQPValue::LongInt(n) => i128::from(*n),
        AMQPValue::LongUInt(n) => i128::from(*n),
        AMQPValue::LongLongInt(n) => i128::from(*n),
        AMQPValue::Timestamp(n) => i128::from(*n),
        _ => return None,
    })
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    as_i128(value).and_then(|n| u64::try_from(n).ok())
}

/// When the message was published: the `timestamp_in_ms` header (RabbitMQ's message timestamp
/// plugin), else the `timestamp` property (seconds), where the publisher or broker set one.
pub(crate) fn sent_at(headers: &FieldTable, seconds: Option<u64>) -> Option<std::time::SystemTime> {
    let since_epoch = match headers.inner().get("timestamp_in_ms").and_then(as_u64) {
        Some(ms) => std::time::Duration::from_millis(ms),
        None => std::time::Duration::from_secs(seconds?),
    };
    std::time::UNIX_EPOCH.checked_add(since_epoch)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_read_from_the_property_and_text_or_integer_headers() {
        use inbox_core::IdFrom;
        let mut headers = FieldTable::default();
        headers.insert("a".into(), AMQPValue::LongString("evt-1".into()));
        headers.insert("b".into(), AMQPValue::LongLongInt(42));
        headers.insert("c".into(), AMQPValue::Boolean(true));
        headers.insert(
            "cloudEvents_id".into(),
            AMQPValue::LongString("ce-1".into()),
        );
        let read = |from: IdFrom, message_id| {
            let amqp = Amqp {
                headers: &headers,
                message_id,
                body: b"",
            };
            from.read(&amqp)
                .map(|id| id.as_str().to_owned())
                .map_err(|e| e.to_string())
        };
        assert_eq!(read(IdFrom::header("a"), None).unwrap(), "evt-1");
        assert_eq!(read(IdFrom::header("b"), None).unwrap(), "42");
        let e = read(IdFrom::header("c"), None).unwrap_err();
        assert!(e.contains("as text or integer"), "{e}");
        let e = read(IdFrom::header("d"), None).unwrap_err();
        assert_eq!(e, "message has no ID: header d is missing");
        assert_eq!(read(IdFrom::MessageIdProperty, Some("m-1")).unwrap(), "m-1");
        assert_eq!(read(IdFrom::cloud_events(), Some("m-1")).unwrap(), "ce-1");
        let e = read(IdFrom::MessageIdProperty, None).unwrap_err();
        assert_eq!(e, "message has no ID: property message_id is missing");
    }

    #[test]
    fn the_send_time_comes_from_the_plugin_header_or_the_property() {
        let at = |ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
        let mut headers = FieldTable::default();
        assert_eq!(sent_at(&headers, None), None);
        assert_eq!(
            sent_at(&headers, Some(1_700_000_000)),
            Some(at(1_700_000_000_000))
        );
        headers.insert(
            "timestamp_in_ms".into(),
            AMQPValue::LongLongInt(1_700_000_000_123),
        );
        assert_eq!(
            sent_at(&headers, Some(1_700_000_000)),
            Some(at(1_700_000_000_123))
        );
    }
}
