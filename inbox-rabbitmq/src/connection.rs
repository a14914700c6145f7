//! [`RabbitConnection`]: where and how to reach one broker, shared by everything built on it,
//! and opening a connection on the caller's tokio runtime.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use inbox_core::redact_url;
use lapin::tcp::OwnedTLSConfig;
use lapin::types::LongString;
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::{Error, RabbitDeadLettersBuilder, RabbitProducerBuilder, RabbitSourceBuilder, Result};

/// Where and how to reach one RabbitMQ broker: its URL, the certificate authorities it is
/// trusted with, the heartbeat and how long an operation may take. The source, the producer
/// and the dead-letter reader are all built from it, so a setting made here (a private CA, say)
/// reaches the three at once.
///
/// ```no_run
/// # async fn run(pem: String) -> Result<(), inbox_rabbitmq::Error> {
/// use std::time::Duration;
/// use inbox_rabbitmq::RabbitConnection;
///
/// let broker = RabbitConnection::new("amqps://app:secret@broker.internal:5671/%2f")
///     .ca_certificates(pem) // a private CA: for the source, the producer and the reader
///     .heartbeat(Duration::from_secs(10));
/// let source = broker.source("payments").prefetch(50).connect().await?;
/// let producer = broker.producer().connect().await?;
/// let dead_letters = broker.dead_letters("payments.dlq").connect().await?;
/// # let _ = (source, producer, dead_letters);
/// # Ok(())
/// # }
/// ```
///
/// Its `Debug` output shows the URL with the password as `***`.
#[derive(Clone)]
#[must_use]
pub struct RabbitConnection {
    pub(crate) url: String,
    pub(crate) ca_certificates: Option<String>,
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) operation_timeout: Duration,
}

impl fmt::Debug for RabbitConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConnection")
            .field("url", &redact_url(&self.url))
            .field(
                "ca_certificates",
                &self.ca_certificates.as_ref().map(|_| "given"),
            )
            .field("heartbeat", &self.heartbeat)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl RabbitConnection {
    /// The broker at `url` (`amqp://user:pass@host:port/vhost`; `amqps://` needs the `tls` or
    /// `native-tls` feature).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ca_certificates: None,
            heartbeat: None,
            operation_timeout: Duration::from_secs(10),
        }
    }

    /// The broker `AMQP_URL` names. Unset, connecting fails with an error saying so: there is
    /// no default, so a missing setting never reaches a broker on localhost with the `guest`
    /// account.
    pub fn from_env() -> Self {
        Self::new(std::env::var("AMQP_URL").unwrap_or_default())
    }

    /// For `amqps://` (feature `tls`): trust the certificate authorities in `pem` (one or more
    /// PEM certificates) instead of the system's roots: a private CA, a managed broker's own.
    pub fn ca_certificates(mut self, pem: impl Into<String>) -> Self {
        self.ca_certificates = Some(pem.into());
        self
    }

    /// The AMQP heartbeat interval to ask for (whole seconds, rounded up; default: the broker's,
    /// 60 s on RabbitMQ). Client and broker each send a frame at least every half interval and
    /// give the connection up after two intervals without one from the other side, so a
    /// connection that went silent (a network partition, a black-holing firewall, a frozen
    /// broker) is noticed after about twice this: the consumer then reconnects, and the broker
    /// requeues the deliveries the dead connection held. With the default that takes about two
    /// minutes; 5–20 s is a common choice. The lower of this and the broker's `heartbeat`
    /// setting applies.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = Some(interval);
        self
    }

    /// How long connecting may take, and how long a dead-letter publish may wait for the
    /// broker's confirm, connecting included (default 10 s).
    ///
    /// - Connecting (TCP, the AMQP handshake, the channel, the topology, `basic.consume`): past
    ///   it the attempt fails with [`Error::ConnectTimeout`], a
    ///   [`Recovery::Reconnect`](inbox_core::Recovery), and the consumer tries again after its
    ///   backoff. Without it a broker that accepts the TCP connection but never answers (a hung
    ///   node, a network that drops packets after the handshake started) stalls the consumer for
    ///   good: no heartbeat runs before the handshake ends. The producer's connect, and its
    ///   reconnect on a publish after a lost connection, are bounded the same way.
    /// - Dead letters: past it the publish fails with [`Recovery::Retry`](inbox_core::Recovery)
    ///   and the consumer hands the message back, instead of waiting out a broker memory or disk
    ///   alarm, which holds every publish unconfirmed until it clears.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// The broker's URL; empty when [`from_env`](Self::from_env) found no `AMQP_URL`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A source consuming `queue` on this broker; finish with
    /// [`connect`](RabbitSourceBuilder::connect).
    pub fn source(&self, queue: impl Into<String>) -> RabbitSourceBuilder {
        RabbitSourceBuilder::new(self.clone(), queue)
    }

    /// A producer publishing to this broker; finish with
    /// [`connect`](RabbitProducerBuilder::connect).
    pub fn producer(&self) -> RabbitProducerBuilder {
        RabbitProducerBuilder::new(self.clone())
    }

    /// A reader of the dead-letter queue `queue` (like `payments.dlq`) on this broker, for
    /// [`inbox_core::replay`]; finish with [`connect`](RabbitDeadLettersBuilder::connect).
    pub fn dead_letters(&self, queue: impl Into<String>) -> RabbitDeadLettersBuilder {
        RabbitDeadLettersBuilder::new(self.clone(), queue)
    }

    /// The heartbeat to ask for, in the whole seconds AMQP uses.
    pub(crate) fn heartbeat_secs(&self) -> Option<u16> {
        self.heartbeat.map(|interval| {
            let secs = interval.as_secs() + u64::from(interval.subsec_nanos() > 0);
            u16::try_from(secs).unwrap_or(u16::MAX)
        })
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.operation_timeout.is_zero() {
            return Err(Error::Config(
                "operation_timeout is 0, which fails every connect and dead-letter publish; use at least 1 s"
                    .into(),
            ));
        }
        if let Some(interval) = self.heartbeat {
            if interval.is_zero() || interval > Duration::from_secs(u64::from(u16::MAX)) {
                return Err(Error::Config(format!(
                    "heartbeat {interval:?} is out of range; use 1 s to {} s (AMQP counts it in \
                     whole seconds; leave it unset for the broker's)",
                    u16::MAX
                )));
            }
        }
        Ok(())
    }

    /// Opens a connection named `name` (the `connection_name` client property, which
    /// `rabbitmqctl list_connections client_properties` and the management UI show) and a
    /// channel on it, which `purpose` names in errors (`consuming`, …). For
    /// `amqps://`, the server's certificate chains up to the CA certificates when given, else to
    /// the system's roots.
    ///
    /// Not bounded in time: lapin starts its heartbeat only once the handshake is done, so
    /// callers that must not hang wrap it in [`bounded`](Self::bounded).
    pub(crate) async fn open(&self, name: &str, purpose: &str) -> Result<(Connection, Channel)> {
        // With its `tokio` feature lapin runs its I/O loop on the runtime it is called from;
        // without one it would panic deep inside, so say what is wrong instead.
        if self.url.trim().is_empty() {
            return Err(Error::Config(
                "no RabbitMQ broker: set AMQP_URL or name one with RabbitConnection::new(url)"
                    .into(),
            ));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Config(
                "the RabbitMQ adapter must run inside a tokio runtime".into(),
            ));
        }
        // lapin 4's automatic recovery stays off (its default): it would reopen channels and
        // consume again behind the source's back, which reconnects itself into a new generation
        // instead, so that no ack goes to a channel its delivery did not come on.
        let properties =
            ConnectionProperties::default().with_connection_name(LongString::from(name.to_owned()));
        let mut uri: AMQPUri = self.url.parse().map_err(|e| {
            Error::Config(format!(
                "the AMQP URL {} does not parse: {e}; write it as amqp://user:password@host:port/vhost",
                redact_url(&self.url)
            ))
        })?;
        // Else the URL's `heartbeat` query parameter, else the broker's.
        if let Some(secs) = self.heartbeat_secs() {
            uri.query.heartbeat = Some(secs);
        }
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: self.ca_certificates.clone(),
        };
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| Error::amqp("finding the tokio runtime", e))?;
        let connection = Connection::connect_uri_with_config(uri, properties, tls, runtime)
            .await
            .map_err(|e| Error::amqp(format!("connecting to {}", redact_url(&self.url)), e))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| Error::amqp(format!("opening the {purpose} channel"), e))?;
        Ok((connection, channel))
    }

    /// `connecting` (a connect and whatever follows it before the first message) within
    /// [`operation_timeout`](Self::operation_timeout), else [`Error::ConnectTimeout`]: a broker
    /// that accepts the TCP connection and then says nothing would otherwise hold it forever.
    pub(crate) async fn bounded<T>(
        &self,
        connecting: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let waited = self.operation_timeout;
        tokio::time::timeout(waited, connecting)
            .await
            .map_err(|_elapsed| Error::ConnectTimeout {
                url: redact_url(&self.url),
                waited,
            })?
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_with_the_fix() {
        let ok = RabbitConnection::new("amqp://localhost");
        assert!(ok.check().is_ok());
        assert!(ok
            .clone()
            .operation_timeout(Duration::ZERO)
            .check()
            .is_err());
        let e = ok.clone().heartbeat(Duration::ZERO).check().unwrap_err();
        assert!(e.to_string().contains("1 s to 65535 s"), "{e}");
        assert!(ok
            .clone()
            .heartbeat(Duration::from_millis(1500))
            .check()
            .is_ok());
        assert_eq!(
            ok.heartbeat(Duration::from_millis(1500)).heartbeat_secs(),
            Some(2)
        );
    }

    #[test]
    fn config_debug_output_hides_the_password() {
        let config = RabbitConnection::new("amqp://app:hunter2@broker:5672/%2f").source("payments");
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("amqp://app:***@broker:5672/%2f"), "{shown}");
        assert!(shown.contains("payments"), "{shown}");
        // The password is still what connects.
        assert_eq!(config.broker_url(), "amqp://app:hunter2@broker:5672/%2f");
    }
}
