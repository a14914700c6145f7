//! How a [`KafkaSource`] is set up: inbox settings plus any librdkafka property.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::IdFrom;
use rdkafka::ClientConfig;

use crate::{Error, KafkaSource, Result, TokenProvider};

/// The broker list from the `KAFKA_BROKERS` environment variable; unset or empty is an error
/// that says so. There is no default: a missing setting must not reach a broker on localhost.
pub fn brokers_from_env() -> Result<String> {
    match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) if !brokers.trim().is_empty() => Ok(brokers),
        _ => Err(Error::Config(
            "no Kafka brokers: set KAFKA_BROKERS or call `.brokers(..)`".into(),
        )),
    }
}

/// Builds a [`KafkaSource`]: what it subscribes to and how. Start with [`KafkaSource::builder`],
/// finish with [`KafkaSourceBuilder::connect`].
///
/// The brokers come from the `KAFKA_BROKERS` environment variable unless
/// [`KafkaSourceBuilder::brokers`] sets them; with neither, `connect` fails saying so.
///
/// Every librdkafka property can be set with [`KafkaSourceBuilder::set`] (all clients: the
/// consumer and the dead-letter producer) or [`KafkaSourceBuilder::set_consumer`] (the consumer
/// only): TLS (`security.protocol`, `ssl.ca.location`, ... with the crate feature `tls`), SASL
/// (`sasl.mechanism`, `sasl.username`, `sasl.password`), timeouts (`session.timeout.ms`,
/// `max.poll.interval.ms`), so the same code runs against Apache Kafka, MSK, Confluent Cloud,
/// Redpanda or Tansu.
///
/// Defaults set here and overridable: `auto.offset.reset=earliest` (a new group reads the topic
/// from its start). Enforced: `enable.auto.commit=false`.
///
/// Its `Debug` output shows `***` for the value of every property that holds a secret
/// (`sasl.password`, `ssl.key.password`, any name with `password` or `secret`, a private key):
/// see [`inbox_core::is_secret_setting`].
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct KafkaSourceBuilder {
    pub(crate) brokers: Option<String>,
    pub(crate) group_id: String,
    pub(crate) topics: Vec<String>,
    pub(crate) id_from: IdFrom,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) create_dead_letter_topics: bool,
    pub(crate) poll_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) commit_interval: Duration,
    pub(crate) common: BTreeMap<String, String>,
    pub(crate) consumer: BTreeMap<String, String>,
    pub(crate) token_provider: Option<Arc<dyn crate::token::DynTokenProvider>>,
}

impl fmt::Debug for KafkaSourceBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSourceBuilder")
            .field("brokers", &self.brokers)
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("id_from", &self.id_from)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("create_dead_letter_topics", &self.create_dead_letter_topics)
            .field("poll_timeout", &self.poll_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("commit_interval", &self.commit_interval)
            .field("common", &Redacted(&self.common))
            .field("consumer", &Redacted(&self.consumer))
            .field("token_provider", &self.token_provider.is_some())
            .finish()
    }
}

/// librdkafka properties with the values of secret ones hidden.
pub(crate) struct Redacted<'a>(pub(crate) &'a BTreeMap<String, String>);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(key, value)| {
                let shown = if inbox_core::is_secret_setting(key) {
                    inbox_core::REDACTED
                } else {
                    value.as_str()
                };
                (key, shown)
            }))
            .finish()
    }
}

impl KafkaSourceBuilder {
    /// The header that carries the message ID unless [`KafkaSourceBuilder::id_header`] says
    /// otherwise.
    pub const DEFAULT_ID_HEADER: &'static str = "event_id";

    /// How often acked offsets are committed unless [`KafkaSourceBuilder::commit_interval`]
    /// says otherwise.
    pub const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_millis(250);

    pub(crate) fn new(
        topics: impl IntoIterator<Item = impl Into<String>>,
        group_id: impl Into<String>,
    ) -> Self {
        Self {
            brokers: None,
            group_id: group_id.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            id_from: IdFrom::Header(Self::DEFAULT_ID_HEADER.to_owned()),
            dead_letter_topic: None,
            create_dead_letter_topics: false,
            poll_timeout: Duration::from_secs(1),
            operation_timeout: Duration::from_secs(10),
            commit_interval: Self::DEFAULT_COMMIT_INTERVAL,
            common: BTreeMap::new(),
            consumer: BTreeMap::new(),
            token_provider: None,
        }
    }

    /// The brokers to bootstrap from (`host:port[,host:port]`), instead of `KAFKA_BROKERS`.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.brokers = Some(brokers.into());
        self
    }

    /// The header that holds the message ID (default `event_id`). The ID never comes from the
    /// offset: a relay that republishes an event gives it a new offset, not a new ID.
    ///
    /// Shorthand for [`id_from`](Self::id_from)`(IdFrom::Header(name))`.
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_from = IdFrom::Header(name.into());
        self
    }

    /// Where the message ID is read from (default: the header `event_id`): a header, a
    /// CloudEvent's `id` (binary mode `ce_id` header, or a structured-mode JSON event), the
    /// Debezium outbox router's `id` header, or a JSON field of the value. Kafka has no
    /// message-ID property, so [`IdFrom::MessageIdProperty`] is refused at `connect`.
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.id_from = from;
        self
    }

    /// Where dead letters go (default: `<topic>.dlq` of the message's own topic).
    ///
    /// The source checks at start that every dead-letter topic exists (for a pattern
    /// subscription, `^…`, only an explicit one is checked) and fails with [`Error::Config`]
    /// naming a missing one, unless [`KafkaSourceBuilder::create_dead_letter_topics`] allows
    /// creating it.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Whether the source creates a missing dead-letter topic at start (default `false`: it
    /// fails naming the topic). A created topic has one partition and the broker's default
    /// replication and settings; create it yourself for anything else.
    pub fn create_dead_letter_topics(mut self, create: bool) -> Self {
        self.create_dead_letter_topics = create;
        self
    }

    /// How long a receive waits for a first message before returning an empty batch
    /// (default 1 s).
    pub fn poll_timeout(mut self, wait: Duration) -> Self {
        self.poll_timeout = wait;
        self
    }

    /// How long a blocking commit, seek or dead-letter delivery may take (default 10 s).
    ///
    /// It is also librdkafka's `socket.timeout.ms` for every client this source makes (unless
    /// set with [`KafkaSourceBuilder::set`]): a request without an answer for that long fails
    /// and its broker connection is closed and made anew. librdkafka's own default is 60 s, so
    /// after a network black hole of a few seconds the consumer stayed stuck on the dead
    /// connection for a minute, fetching and committing nothing.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// How often the offsets acked since the last commit are committed, in one request for all
    /// partitions (default 250 ms; see the crate docs, "Ack semantics").
    ///
    /// An ack then only records its offsets; a commit task commits each partition's finished
    /// prefix at this interval, and a revoke and the source's close commit what is left. A crash
    /// costs the redelivery of up to an interval of acked messages, which the inbox skips.
    /// `Duration::ZERO` commits synchronously in every ack instead: one round-trip per batch
    /// (per lane), and an ack's `Ok` means the broker has the offset.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every;
        self
    }

    /// Sets a librdkafka property on every client this source makes (consumer and dead-letter
    /// producer): TLS, SASL, `client.id`, socket settings.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.common.insert(key.into(), value.into());
        self
    }

    /// Sets a librdkafka consumer property (`session.timeout.ms`, `max.poll.interval.ms`,
    /// `auto.offset.reset`, `partition.assignment.strategy`, ...).
    pub fn set_consumer(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.consumer.insert(key.into(), value.into());
        self
    }

    /// Logs in with SASL OAUTHBEARER tokens from `provider` (see [`TokenProvider`]): every
    /// client this source makes asks it for a token at start and again before the token
    /// expires. Sets `sasl.mechanism=OAUTHBEARER` (another mechanism is refused at `connect`);
    /// `security.protocol` stays yours to set, `sasl_ssl` in production.
    pub fn token_provider(mut self, provider: impl TokenProvider) -> Self {
        self.token_provider = Some(Arc::new(provider));
        self
    }

    /// Creates the clients and subscribes. librdkafka connects in the background, so a broker
    /// that is down does not fail this. Nothing is fetched yet: the first
    /// [`receive`](inbox_core::MessageSource::receive) checks that the dead-letter topics exist
    /// (a metadata request for all topics, waiting up to the operation timeout) before it joins
    /// the group and reads; a missing one fails it with [`Error::Config`], which stops the
    /// consumer, and unreachable brokers fail it with an error naming them.
    pub async fn connect(self) -> Result<KafkaSource> {
        KafkaSource::new(&self)
    }

    /// The brokers this builder connects to: the ones set, or `KAFKA_BROKERS`.
    pub(crate) fn resolved_brokers(&self) -> Result<String> {
        match &self.brokers {
            Some(brokers) => Ok(brokers.clone()),
            None => brokers_from_env(),
        }
    }

    pub(crate) fn consumer_config(&self) -> Result<ClientConfig> {
        if self.topics.is_empty() {
            return Err(Error::Config("no topic to subscribe to".into()));
        }
        if self.group_id.is_empty() {
            return Err(Error::Config("the group id is empty".into()));
        }
        self.id_from
            .check(&crate::source::ID_BINDING)
            .map_err(Error::Config)?;
        let mut config = self.client_config()?;
        config
            .set("group.id", &self.group_id)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false");
        for (key, value) in &self.consumer {
            config.set(key, value);
        }
        if config
            .get("enable.auto.commit")
            .is_some_and(|v| v != "false")
        {
            return Err(Error::Config(
                "enable.auto.commit must stay false: offsets are committed after the database \
                 commit; remove the property"
                    .into(),
            ));
        }
        Ok(config)
    }

    pub(crate) fn client_config(&self) -> Result<ClientConfig> {
        let mut config = ClientConfig::new();
        crate::failure::log_connection_failures(&mut config);
        config
            .set("bootstrap.servers", self.resolved_brokers()?)
            .set(
                "socket.timeout.ms",
                // librdkafka's bounds for the property.
                crate::source::millis(
                    self.operation_timeout
                        .clamp(Duration::from_millis(10), Duration::from_secs(300)),
                ),
            );
        for (key, value) in &self.common {
            config.set(key, value);
        }
        if self.token_provider.is_some() {
            crate::token::require_oauthbearer(&mut config)?;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_conventions_kafka_cannot_carry_are_refused() {
        let config = |from| {
            KafkaSourceBuilder::new(["t"], "g")
                .brokers("b:9092")
                .id_from(from)
                .consumer_config()
        };
        let e = config(IdFrom::MessageIdProperty).unwrap_err().to_string();
        assert!(e.contains("Kafka has no message-ID property"), "{e}");
        assert!(config(IdFrom::header("")).is_err());
        assert!(config(IdFrom::cloud_events_source_and_id()).is_ok());
        assert!(config(IdFrom::Debezium).is_ok());
    }

    #[test]
    fn enable_auto_commit_is_refused() {
        let config = KafkaSourceBuilder::new(["t"], "g")
            .brokers("b:9092")
            .set_consumer("enable.auto.commit", "true");
        assert!(matches!(config.consumer_config(), Err(Error::Config(_))));
        let config = KafkaSourceBuilder::new(["t"], "g")
            .brokers("b:9092")
            .set_consumer("auto.offset.reset", "latest")
            .set("security.protocol", "plaintext");
        let client = config.consumer_config().expect("valid");
        assert_eq!(client.get("enable.auto.commit"), Some("false"));
        assert_eq!(client.get("auto.offset.reset"), Some("latest"));
        assert_eq!(client.get("security.protocol"), Some("plaintext"));
        assert_eq!(client.get("socket.timeout.ms"), Some("10000"));
        let own = KafkaSourceBuilder::new(["t"], "g")
            .brokers("b:9092")
            .set("socket.timeout.ms", "30000");
        let client = own.consumer_config().expect("valid");
        assert_eq!(client.get("socket.timeout.ms"), Some("30000"));
    }

    #[test]
    fn debug_output_hides_secret_properties() {
        let config = KafkaSourceBuilder::new(["t"], "g")
            .brokers("b:9092")
            .set("sasl.username", "app")
            .set("sasl.password", "pw-one")
            .set("ssl.key.password", "pw-two")
            .set("sasl.oauthbearer.client.secret", "pw-three")
            .set_consumer("Custom.Secret.Token", "pw-four");
        let shown = format!("{config:?}");
        for secret in ["pw-one", "pw-two", "pw-three", "pw-four"] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        // What is not secret still shows, so the output stays useful.
        assert!(shown.contains(r#""sasl.username": "app""#), "{shown}");
        assert!(shown.contains(r#""sasl.password": "***""#), "{shown}");
        assert!(shown.contains("b:9092"), "{shown}");
        // The client configuration itself keeps the real values.
        let client = config.consumer_config().expect("valid");
        assert_eq!(client.get("sasl.password"), Some("pw-one"));
    }
}
