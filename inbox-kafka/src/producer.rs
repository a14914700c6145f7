//! An idempotent producer that puts a message ID header on every record.

use std::fmt;
use std::time::Duration;

use futures_util::future::try_join_all;
use inbox_core::{OutgoingMessage, Publish, PublishError};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::connection::Properties;
use crate::context::ProducerContext;
use crate::failure::Failures;
use crate::{Error, KafkaConnection, KafkaSourceBuilder, Result};

/// An idempotent Kafka producer (`enable.idempotence=true`, so its own retries add no copies)
/// that sets the ID header (default `event_id`) on every record, and a message's headers as
/// record headers. Build it with [`KafkaProducer::builder`]; send with the [`Publish`] methods
/// (`send`, `send_with_id`, `send_batch`, each naming the topic) or [`KafkaProducer::send_to`]
/// for a partition of your choosing.
///
/// Idempotence covers one producer session only: a process that resends after a restart
/// produces a second copy with a new offset. Both carry the same ID, which is what the consuming
/// inbox deduplicates on.
pub struct KafkaProducer {
    producer: FutureProducer<ProducerContext>,
    id_header: String,
    timeout: Duration,
}

impl fmt::Debug for KafkaProducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaProducer")
            .field("id_header", &self.id_header)
            .finish_non_exhaustive()
    }
}

/// Builds a [`KafkaProducer`]; start with [`KafkaConnection::producer`] (or
/// [`KafkaProducer::builder`], on the brokers `KAFKA_BROKERS` names). Its `Debug` output hides
/// the values of secret properties, like [`KafkaConnection`]'s.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct KafkaProducerBuilder {
    connection: KafkaConnection,
    id_header: String,
    properties: Properties,
}

impl KafkaProducerBuilder {
    pub(crate) fn new(connection: KafkaConnection) -> Self {
        Self {
            connection,
            id_header: KafkaSourceBuilder::DEFAULT_ID_HEADER.to_owned(),
            properties: Properties::default(),
        }
    }

    /// The header the message ID goes in (default `event_id`); consumers must read the same
    /// one.
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Sets a librdkafka producer property (`linger.ms`, `compression.type`, ...) for this
    /// producer only. `enable.idempotence` must stay `true`. A send waits for the broker's
    /// acknowledgement, retries included, for the connection's operation timeout
    /// (`message.timeout.ms`, which can be set here too).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key, value);
        self
    }

    /// Creates the producer. librdkafka connects in the background: brokers that are down fail
    /// the first send (after the operation timeout), not this.
    pub async fn connect(self) -> Result<KafkaProducer> {
        if self.id_header.is_empty() {
            return Err(Error::Config("the ID header name is empty".into()));
        }
        let (mut config, context) = self.connection.producer_client(&Failures::default())?;
        self.properties.apply(&mut config);
        if config.get("enable.idempotence") != Some("true") {
            return Err(Error::Config(
                "KafkaProducer keeps enable.idempotence=true; remove the property".into(),
            ));
        }
        let producer = config.create_with_context(context).map_err(|e| {
            let brokers = config.get("bootstrap.servers").unwrap_or_default();
            Error::kafka(format!("creating the Kafka producer for {brokers}"), e)
        })?;
        Ok(KafkaProducer {
            producer,
            id_header: self.id_header,
            timeout: self.connection.operation_timeout,
        })
    }
}

impl KafkaProducer {
    /// Starts configuring a producer on the brokers `KAFKA_BROKERS` names (another cluster,
    /// TLS, SASL or a token provider: [`KafkaConnection::producer`]). It is not bound to a
    /// topic: each send names one.
    ///
    /// ```no_run
    /// use inbox_core::Publish;
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let producer = inbox_kafka::KafkaProducer::builder()
    ///     .set("linger.ms", "5")
    ///     .connect()
    ///     .await?;
    /// let id = producer.send("payments", br#"{"amount":100}"#).await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub fn builder() -> KafkaProducerBuilder {
        KafkaConnection::from_env().producer()
    }

    /// Produces `message` to `topic` and waits for the broker's acknowledgement, for what the
    /// [`Publish`] methods do not offer: a `partition` of your choosing (`None`: the key's, or
    /// the partitioner's pick), and where the record landed: its partition and offset.
    ///
    /// Every record of this producer carries a valid ID; to produce one the consumer must
    /// dead-letter (no ID header, an invalid one), use [`client`](Self::client).
    pub async fn send_to(
        &self,
        topic: &str,
        partition: Option<i32>,
        message: &OutgoingMessage,
    ) -> Result<(i32, i64)> {
        if message
            .headers
            .iter()
            .any(|(name, _)| *name == self.id_header)
        {
            return Err(Error::Config(format!(
                "header `{}` would shadow the ID header; rename it",
                self.id_header
            )));
        }
        let traced: Vec<_> = message.traced_headers().collect();
        let id = (self.id_header.as_str(), message.id.as_str().as_bytes());
        let headers = record_headers(
            std::iter::once(id).chain(traced.iter().map(|(key, value)| (*key, value.as_ref()))),
        );
        let mut record = FutureRecord::<str, [u8]>::to(topic)
            .payload(&message.payload)
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_str());
        }
        if let Some(partition) = partition {
            record = record.partition(partition);
        }
        match self.producer.send(record, self.timeout).await {
            Ok(delivery) => Ok((delivery.partition, delivery.offset)),
            Err((e, _)) => Err(Error::kafka(format!("producing to `{topic}`"), e)),
        }
    }

    /// The underlying rdkafka producer, for records this one does not make (no ID header, an
    /// invalid one, a key that is not UTF-8).
    pub fn client(&self) -> &FutureProducer<impl rdkafka::ClientContext + 'static> {
        &self.producer
    }
}

/// Record headers from names and values, in order.
pub(crate) fn record_headers<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> OwnedHeaders {
    let headers = headers.into_iter();
    let all = OwnedHeaders::new_with_capacity(headers.size_hint().0);
    headers.fold(all, |all, (key, value)| {
        all.insert(Header {
            key,
            value: Some(value),
        })
    })
}

/// `destination` is the topic; a message's key is the record key (one partition per key). Every
/// record of the batch is handed to librdkafka before the first delivery report is awaited, so
/// the batch travels in a few produce requests; with idempotence on, records of one partition
/// keep their order, retries included.
impl Publish for KafkaProducer {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let traced =
            inbox_core::telemetry::traced_send("kafka", destination, messages.len(), async {
                let sends = messages
                    .iter()
                    .map(|message| self.send_to(destination, None, message));
                try_join_all(sends).await.map_err(|e| {
                    PublishError::new(
                        e.recovery(),
                        format!("producing to Kafka topic `{destination}`"),
                        e,
                    )
                })?;
                Ok(())
            });
        traced.await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_hides_secret_properties() {
        let builder = KafkaConnection::new("b:9092")
            .set("sasl.username", "app")
            .set("sasl.password", "pw-one")
            .producer()
            .set("sasl.oauthbearer.client.secret", "pw-two");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("pw-one"), "{shown}");
        assert!(!shown.contains("pw-two"), "{shown}");
        assert!(shown.contains(r#""sasl.username": "app""#), "{shown}");
        assert!(shown.contains("b:9092"), "{shown}");
    }

    #[tokio::test]
    async fn idempotence_cannot_be_turned_off() {
        let e = KafkaConnection::new("127.0.0.1:9")
            .producer()
            .set("enable.idempotence", "false")
            .connect()
            .await
            .expect_err("refused");
        assert!(matches!(e, Error::Config(_)), "{e}");
        assert!(e.to_string().contains("enable.idempotence"), "{e}");
    }
}
