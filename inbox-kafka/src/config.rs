//! How a [`KafkaSource`] is set up: inbox settings plus any librdkafka property.

use std::time::Duration;

use inbox_core::IdFrom;
use rdkafka::ClientConfig;

use crate::connection::Properties;
use crate::context::ProducerContext;
use crate::failure::Failures;
use crate::{Error, KafkaConnection, KafkaSource, Result};

/// Builds a [`KafkaSource`]; start with [`KafkaConnection::source`] (or
/// [`KafkaSource::builder`], on the brokers `KAFKA_BROKERS` names).
///
/// The connection's properties reach every client the source makes: the consumer, the
/// dead-letter producer and the admin client that checks the dead-letter topics. Set here and
/// overridable: `auto.offset.reset=earliest` (a new group reads the topic from its start).
/// Enforced: `enable.auto.commit=false`. `Debug` hides secret properties, as
/// [`KafkaConnection`]'s does.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct KafkaSourceBuilder {
    pub(crate) connection: KafkaConnection,
    pub(crate) group_id: String,
    pub(crate) topics: Vec<String>,
    pub(crate) id_from: IdFrom,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) create_dead_letter_topics: bool,
    pub(crate) poll_timeout: Duration,
    pub(crate) commit_interval: Duration,
    pub(crate) consumer: Properties,
}

impl KafkaSourceBuilder {
    /// The header that carries the message ID unless [`KafkaSourceBuilder::id_header`] says
    /// otherwise.
    pub const DEFAULT_ID_HEADER: &'static str = "event_id";

    /// How often acked offsets are committed unless [`KafkaSourceBuilder::commit_interval`]
    /// says otherwise.
    pub const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_millis(250);

    pub(crate) fn new(
        connection: KafkaConnection,
        topics: impl IntoIterator<Item = impl Into<String>>,
        group_id: impl Into<String>,
    ) -> Self {
        Self {
            connection,
            group_id: group_id.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            id_from: IdFrom::Header(Self::DEFAULT_ID_HEADER.to_owned()),
            dead_letter_topic: None,
            create_dead_letter_topics: false,
            poll_timeout: Duration::from_secs(1),
            commit_interval: Self::DEFAULT_COMMIT_INTERVAL,
            consumer: Properties::default(),
        }
    }

    /// The header that holds the message ID (default `event_id`): shorthand for
    /// [`id_from`](Self::id_from)`(IdFrom::Header(name))`.
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_from = IdFrom::Header(name.into());
        self
    }

    /// Where the message ID is read from (default: the header `event_id`): a header, a
    /// CloudEvent's `id` (binary mode `ce_id` header, or a structured-mode JSON event), the
    /// Debezium outbox router's `id` header, or a JSON field of the value. Kafka has no
    /// message-ID property, so [`IdFrom::MessageIdProperty`] is refused at `connect`.
    /// [`IdFrom::Position`] (topic, partition and offset) serves topics whose producers set no
    /// ID, with the weaker promise it documents: a producer's resend is applied again.
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.id_from = from;
        self
    }

    /// Where dead letters go (default: `<topic>.dlq` of the message's own topic). The source
    /// checks at start that every one exists (for a pattern subscription, `^…`, only an explicit
    /// one) and fails with [`Error::Config`] naming a missing one, unless
    /// [`create_dead_letter_topics`](Self::create_dead_letter_topics) allows creating it.
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

    /// How often the offsets acked since the last commit are committed, in one request for all
    /// partitions (default 250 ms); `Duration::ZERO` commits synchronously in every ack. See
    /// the crate docs, "Ack semantics", for what each costs.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every;
        self
    }

    /// Sets a librdkafka consumer property (`session.timeout.ms`, `max.poll.interval.ms`,
    /// `auto.offset.reset`, `partition.assignment.strategy`, ...).
    pub fn set_consumer(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.consumer.insert(key, value);
        self
    }

    /// Creates the clients and subscribes. librdkafka connects in the background, so a broker
    /// that is down does not fail this. The first
    /// [`receive`](inbox_core::MessageSource::receive) checks the dead-letter topics (waiting up
    /// to the operation timeout) before it joins the group: a missing one fails it with
    /// [`Error::Config`], which stops the consumer; unreachable brokers fail it naming them.
    pub async fn connect(self) -> Result<KafkaSource> {
        KafkaSource::new(&self)
    }

    /// The consumer's configuration and context, the connection's with the consumer's
    /// properties added.
    pub(crate) fn consumer_config(
        &self,
        failures: &Failures,
    ) -> Result<(ClientConfig, ProducerContext)> {
        if self.topics.is_empty() {
            return Err(Error::Config("no topic to subscribe to".into()));
        }
        if self.group_id.is_empty() {
            return Err(Error::Config("the group id is empty".into()));
        }
        self.id_from
            .check(&crate::source::ID_BINDING)
            .map_err(Error::Config)?;
        let (mut config, context) = self.connection.client(failures)?;
        config
            .set("group.id", &self.group_id)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false");
        self.consumer.apply(&mut config);
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
        Ok((config, context))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_conventions_kafka_cannot_carry_are_refused() {
        let config = |from| {
            KafkaConnection::new("b:9092")
                .source(["t"], "g")
                .id_from(from)
                .consumer_config(&Failures::default())
                .map(drop) // only the outcome: the context is not `Debug`
        };
        let e = config(IdFrom::MessageIdProperty).unwrap_err().to_string();
        assert!(e.contains("Kafka has no message-ID property"), "{e}");
        assert!(config(IdFrom::header("")).is_err());
        assert!(config(IdFrom::cloud_events_source_and_id()).is_ok());
        assert!(config(IdFrom::Debezium).is_ok());
    }

    #[test]
    fn enable_auto_commit_is_refused() {
        let failures = Failures::default();
        let config = KafkaConnection::new("b:9092")
            .source(["t"], "g")
            .set_consumer("enable.auto.commit", "true");
        assert!(matches!(
            config.consumer_config(&failures),
            Err(Error::Config(_))
        ));
        let config = KafkaConnection::new("b:9092")
            .set("security.protocol", "plaintext")
            .source(["t"], "g")
            .set_consumer("auto.offset.reset", "latest");
        let (client, _) = config.consumer_config(&failures).expect("valid");
        assert_eq!(client.get("enable.auto.commit"), Some("false"));
        assert_eq!(client.get("auto.offset.reset"), Some("latest"));
        assert_eq!(client.get("security.protocol"), Some("plaintext"));
        assert_eq!(client.get("socket.timeout.ms"), Some("10000"));
        let own = KafkaConnection::new("b:9092")
            .set("socket.timeout.ms", "30000")
            .source(["t"], "g");
        let (client, _) = own.consumer_config(&failures).expect("valid");
        assert_eq!(client.get("socket.timeout.ms"), Some("30000"));
    }

    #[test]
    fn debug_output_hides_secret_properties() {
        let config = KafkaConnection::new("b:9092")
            .set("sasl.username", "app")
            .set("sasl.password", "pw-one")
            .set("ssl.key.password", "pw-two")
            .set("sasl.oauthbearer.client.secret", "pw-three")
            .source(["t"], "g")
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
        let (client, _) = config.consumer_config(&Failures::default()).expect("valid");
        assert_eq!(client.get("sasl.password"), Some("pw-one"));
    }
}
