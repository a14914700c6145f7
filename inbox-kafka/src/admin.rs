//! Topic administration the inbox needs: creating topics (tests, setup) and reading retention.

use std::fmt;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientConfig;

use crate::context::ProducerContext;
use crate::{brokers_from_env, Error, Result};

/// A small admin client.
pub struct KafkaAdmin {
    client: AdminClient<ProducerContext>,
    options: AdminOptions,
}

impl fmt::Debug for KafkaAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaAdmin").finish_non_exhaustive()
    }
}

impl KafkaAdmin {
    /// An admin client for the brokers in `KAFKA_BROKERS` (default `127.0.0.1:9092`).
    pub fn from_env() -> Result<Self> {
        Self::new(&brokers_from_env())
    }

    /// An admin client for `brokers`.
    pub fn new(brokers: &str) -> Result<Self> {
        Self::with_properties(brokers, std::iter::empty::<(String, String)>())
    }

    /// An admin client for `brokers` with extra librdkafka properties (TLS, SASL).
    pub fn with_properties(
        brokers: &str,
        properties: impl IntoIterator<Item = (impl Into<String>, impl Into<String>)>,
    ) -> Result<Self> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        for (key, value) in properties {
            config.set(key, value);
        }
        let client = config
            .create_with_context(ProducerContext)
            .map_err(|e| Error::kafka("creating the Kafka admin client", e))?;
        let timeout = Some(Duration::from_secs(30));
        Ok(Self {
            client,
            options: AdminOptions::new()
                .request_timeout(timeout)
                .operation_timeout(timeout),
        })
    }

    /// Creates `topic` with `partitions` partitions (replication factor: the broker's default).
    /// A topic that already exists is fine.
    pub async fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.create_topic_with(topic, partitions, &[]).await
    }

    /// Creates `topic` with `partitions` partitions and topic properties (`retention.ms`,
    /// `cleanup.policy`, ...). A topic that already exists is fine (its properties are left).
    pub async fn create_topic_with(
        &self,
        topic: &str,
        partitions: i32,
        properties: &[(&str, &str)],
    ) -> Result<()> {
        let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
        for (key, value) in properties {
            new = new.set(key, value);
        }
        let results = self
            .client
            .create_topics([&new], &self.options)
            .await
            .map_err(|e| Error::kafka(format!("creating topic `{topic}`"), e))?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(Error::kafka(
                        format!("creating topic `{name}`"),
                        KafkaError::AdminOp(code),
                    ))
                }
            }
        }
        Ok(())
    }

    /// The topic's `retention.ms`: how long the broker keeps a record. An inbox that forgets IDs
    /// sooner than this can apply an old replayed record twice, so keep inbox rows at least this
    /// long.
    pub async fn retention(&self, topic: &str) -> Result<Retention> {
        let context = || format!("reading retention.ms of topic `{topic}`");
        let results = self
            .client
            .describe_configs([&ResourceSpecifier::Topic(topic)], &self.options)
            .await
            .map_err(|e| Error::kafka(context(), e))?;
        let resource = results
            .into_iter()
            .next()
            .ok_or_else(|| Error::Config(format!("{}: the broker returned nothing", context())))?
            .map_err(|code| Error::kafka(context(), KafkaError::AdminOp(code)))?;
        let Some(value) = resource
            .get("retention.ms")
            .and_then(|entry| entry.value.clone())
        else {
            return Ok(Retention::NotReported);
        };
        let ms: i64 = value
            .parse()
            .map_err(|_| Error::Config(format!("{}: `{value}` is not a number", context())))?;
        Ok(match u64::try_from(ms) {
            Ok(ms) => Retention::Limited(Duration::from_millis(ms)),
            Err(_) => Retention::Unlimited,
        })
    }
}

/// A topic's retention, as the broker reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retention {
    /// Records are deleted after this long.
    Limited(Duration),
    /// `retention.ms=-1`: records are kept forever.
    Unlimited,
    /// The broker does not report `retention.ms` for the topic (some Kafka-compatible brokers
    /// report only the properties set on the topic).
    NotReported,
}
