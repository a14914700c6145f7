//! [`KafkaConnection`]: the brokers and how to reach them, shared by every client built on it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientConfig;

use crate::context::ProducerContext;
use crate::failure::Failures;
use crate::source::millis;
use crate::token::{DynTokenProvider, TokenRefresh};
use crate::{
    Error, KafkaAdmin, KafkaDeadLettersBuilder, KafkaProducerBuilder, KafkaSourceBuilder, Result,
    TokenProvider,
};

/// The broker list from the `KAFKA_BROKERS` environment variable; unset or empty is an error
/// that says so. There is no default: a missing setting must not reach a broker on localhost.
pub fn brokers_from_env() -> Result<String> {
    match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) if !brokers.trim().is_empty() => Ok(brokers),
        _ => Err(Error::Config(
            "no Kafka brokers: set KAFKA_BROKERS or use `KafkaConnection::new(brokers)`".into(),
        )),
    }
}

/// Where and how to reach one Kafka cluster: its brokers, any librdkafka property every client
/// needs ([`set`](Self::set): TLS, SASL, socket settings, `client.id`), a token provider and
/// how long an operation may take. The source, the producer, the dead-letter reader and the
/// admin client are all built from it, so a setting made here (a CA, an IAM token provider)
/// reaches them all at once; a client's own properties go on its builder.
///
/// ```no_run
/// # async fn run() -> Result<(), inbox_kafka::Error> {
/// use inbox_kafka::KafkaConnection;
///
/// let kafka = KafkaConnection::new("broker-1.internal:9093")
///     .set("security.protocol", "ssl")
///     .set("ssl.ca.location", "/etc/kafka/ca.pem"); // for every client below
/// let source = kafka.source(["payments"], "payments-inbox").connect().await?;
/// let producer = kafka.producer().connect().await?;
/// let dead_letters = kafka.dead_letters("payments.dlq").connect().await?;
/// # let _ = (source, producer, dead_letters);
/// # Ok(())
/// # }
/// ```
///
/// Its `Debug` output shows `***` for the value of every secret property (`sasl.password`, a
/// private key, ...: see [`inbox_core::is_secret_setting`]).
#[derive(Clone, Debug)]
#[must_use]
pub struct KafkaConnection {
    brokers: Option<String>,
    properties: Properties,
    token_provider: Option<Arc<dyn DynTokenProvider>>,
    pub(crate) operation_timeout: Duration,
}

/// librdkafka properties, as a connection and each builder keep them; `Debug` shows `***` for
/// the value of a secret one.
#[derive(Clone, Default)]
pub(crate) struct Properties(BTreeMap<String, String>);

impl Properties {
    pub(crate) fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.insert(key.into(), value.into());
    }

    /// Sets every property on `config`, over what it had.
    pub(crate) fn apply(&self, config: &mut ClientConfig) {
        for (key, value) in &self.0 {
            config.set(key, value);
        }
    }
}

impl fmt::Debug for Properties {
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

impl KafkaConnection {
    /// The cluster bootstrapped from `brokers` (`host:port[,host:port]`).
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: Some(brokers.into()),
            ..Self::from_env()
        }
    }

    /// The cluster `KAFKA_BROKERS` names, read when a client connects. Unset, connecting fails
    /// with an error saying so: there is no default, so a missing setting never reaches a broker
    /// on localhost.
    pub fn from_env() -> Self {
        Self {
            brokers: None,
            properties: Properties::default(),
            token_provider: None,
            operation_timeout: Duration::from_secs(10),
        }
    }

    /// Sets a librdkafka property on every client built from this connection.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key, value);
        self
    }

    /// Logs in with SASL OAUTHBEARER tokens from `provider` (see [`TokenProvider`]), for every
    /// client built from this connection. Sets `sasl.mechanism=OAUTHBEARER` (another mechanism
    /// is refused at `connect`); `security.protocol` stays yours to set, `sasl_ssl` in
    /// production.
    pub fn token_provider(mut self, provider: impl TokenProvider) -> Self {
        self.token_provider = Some(Arc::new(provider));
        self
    }

    /// How long a request, a blocking commit or seek, a send's delivery (librdkafka's
    /// `message.timeout.ms`) and a token request may take (default 10 s).
    ///
    /// It is also librdkafka's `socket.timeout.ms` (unless [`set`](Self::set)): a request
    /// without an answer for that long closes its broker connection, which is made anew.
    /// librdkafka's own 60 s kept a consumer stuck on a dead connection for a minute after a
    /// network black hole of a few seconds.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// A source consuming `topics` (a name, or a pattern starting with `^`) in the consumer
    /// group `group`; finish with [`connect`](KafkaSourceBuilder::connect).
    pub fn source(
        &self,
        topics: impl IntoIterator<Item = impl Into<String>>,
        group: impl Into<String>,
    ) -> KafkaSourceBuilder {
        KafkaSourceBuilder::new(self.clone(), topics, group)
    }

    /// An idempotent producer; finish with [`connect`](KafkaProducerBuilder::connect).
    pub fn producer(&self) -> KafkaProducerBuilder {
        KafkaProducerBuilder::new(self.clone())
    }

    /// A reader of the dead-letter topic `topic` (like `payments.dlq`), for
    /// [`inbox_core::replay`]; finish with [`connect`](KafkaDeadLettersBuilder::connect).
    pub fn dead_letters(&self, topic: impl Into<String>) -> KafkaDeadLettersBuilder {
        KafkaDeadLettersBuilder::new(self.clone(), topic)
    }

    /// An admin client (creating topics, reading retention).
    pub fn admin(&self) -> Result<KafkaAdmin> {
        let (config, context) = self.client(&Failures::default())?;
        KafkaAdmin::with_config(&config, context)
    }

    /// The brokers: the ones given, or `KAFKA_BROKERS`.
    pub(crate) fn brokers(&self) -> Result<String> {
        self.brokers.clone().map_or_else(brokers_from_env, Ok)
    }

    /// A client's configuration and its context (connection failures kept in `failures`, the
    /// token refresh), before the client's own properties are added.
    pub(crate) fn client(&self, failures: &Failures) -> Result<(ClientConfig, ProducerContext)> {
        let mut config = ClientConfig::new();
        crate::failure::log_connection_failures(&mut config);
        config.set("bootstrap.servers", self.brokers()?).set(
            "socket.timeout.ms",
            // librdkafka's bounds for the property.
            millis(
                self.operation_timeout
                    .clamp(Duration::from_millis(10), Duration::from_secs(300)),
            ),
        );
        self.properties.apply(&mut config);
        let token = match &self.token_provider {
            Some(provider) => {
                crate::token::require_oauthbearer(&mut config)?;
                let (timeout, failures) = (self.operation_timeout, failures.clone());
                Some(TokenRefresh::new(Arc::clone(provider), timeout, failures)?)
            }
            None => None,
        };
        let failures = failures.clone();
        Ok((config, ProducerContext { failures, token }))
    }

    /// [`client`](Self::client) for an idempotent producer (`enable.idempotence`, so its own
    /// retries add no copies) whose delivery wait is bounded like any other operation.
    pub(crate) fn producer_client(
        &self,
        failures: &Failures,
    ) -> Result<(ClientConfig, ProducerContext)> {
        let (mut config, context) = self.client(failures)?;
        config
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", millis(self.operation_timeout));
        Ok((config, context))
    }
}
