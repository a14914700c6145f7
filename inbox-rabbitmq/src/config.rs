//! What a [`RabbitSource`](crate::RabbitSource) connects to and how it consumes.

use std::time::Duration;

use inbox_core::IdFrom;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use crate::short_string::short_string;
use crate::{Error, Result};

/// The smallest prefetch window when it follows the batch size.
const MIN_PREFETCH: u16 = 20;

/// Whether the source declares its queues or expects an operator to have done so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Topology {
    /// Declare the queue and its dead-letter queue (idempotent; a queue that exists with other
    /// arguments is a fatal `PRECONDITION_FAILED`). The default.
    Declare,
    /// Check with a passive declare that both queues exist, and change nothing: for brokers where
    /// the application may not declare.
    Expect,
}

/// Configures a [`RabbitSource`](crate::RabbitSource): how it connects, what it consumes and
/// what topology it expects. Made by [`RabbitSource::builder`](crate::RabbitSource::builder),
/// finished by [`connect`](Self::connect).
///
/// ```no_run
/// # async fn run() -> Result<(), inbox_rabbitmq::Error> {
/// use std::time::Duration;
/// use inbox_rabbitmq::RabbitSource;
///
/// // The broker from `AMQP_URL` unless `.url(..)` names one (with neither, connect fails).
/// let builder = RabbitSource::builder("payments")
///     .prefetch(50)
///     .id_header("event_id")
///     .delivery_limit(10)
///     .poll_timeout(Duration::from_millis(500));
/// assert_eq!(builder.dead_letter_queue(), "payments.dlq");
/// let source = builder.connect().await?; // declares `payments` and `payments.dlq`
/// # Ok(())
/// # }
/// ```
///
/// Its `Debug` output shows the URL with the password as `***`.
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct RabbitSourceBuilder {
    pub(crate) url: String,
    pub(crate) queue: String,
    /// `None`: follow the consumer's batch size.
    pub(crate) prefetch: Option<u16>,
    pub(crate) consumer_tag: String,
    pub(crate) id_from: IdFrom,
    pub(crate) topology: Topology,
    pub(crate) delivery_limit: Option<u32>,
    pub(crate) poll_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) connection_name: Option<String>,
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) ca_certificates: Option<String>,
    pub(crate) bindings: Vec<Binding>,
    pub(crate) queue_arguments: FieldTable,
}

/// The queue bound to an exchange: what [`RabbitSourceBuilder::bind`] declares.
#[derive(Debug, Clone)]
pub(crate) struct Binding {
    pub(crate) exchange: String,
    pub(crate) kind: ExchangeKind,
    pub(crate) routing_key: String,
}

impl std::fmt::Debug for RabbitSourceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitSourceBuilder")
            .field("url", &inbox_core::redact_url(&self.url))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("id_from", &self.id_from)
            .field("topology", &self.topology)
            .field("delivery_limit", &self.delivery_limit)
            .field("poll_timeout", &self.poll_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("connection_name", &self.connection_name)
            .field("heartbeat", &self.heartbeat)
            .field(
                "ca_certificates",
                &self.ca_certificates.as_ref().map(|_| "given"),
            )
            .field("bindings", &self.bindings)
            .field("queue_arguments", &self.queue_arguments)
            .finish()
    }
}

/// The broker address from `AMQP_URL`; empty when it is unset, which connecting refuses with
/// an error saying so. There is no default: a missing setting must not reach a broker on
/// localhost with the `guest` account.
pub(crate) fn url_from_env() -> String {
    std::env::var("AMQP_URL").unwrap_or_default()
}

impl RabbitSourceBuilder {
    /// Consumes `queue` on the broker at `url`.
    pub(crate) fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue: queue.into(),
            prefetch: None,
            consumer_tag: String::new(),
            id_from: IdFrom::MessageIdProperty,
            topology: Topology::Declare,
            delivery_limit: Some(20),
            poll_timeout: Duration::from_secs(1),
            operation_timeout: Duration::from_secs(10),
            connection_name: None,
            heartbeat: None,
            ca_certificates: None,
            bindings: Vec::new(),
            queue_arguments: FieldTable::default(),
        }
    }

    /// The broker to connect to (`amqp://user:pass@host:port/vhost`; `amqps://` needs the
    /// `tls` or `native-tls` feature), instead of `AMQP_URL`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = url.into();
        self
    }

    /// Unacked deliveries the broker sends ahead (`basic.qos`, per consumer). By default it
    /// follows the consumer's batch size: twice the largest batch asked for (so the next batch
    /// arrives while one commits), at least 20, at most 65,535. Set it to fix the window.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// The prefetch window for batches of up to `batch` messages.
    pub(crate) fn prefetch_for(&self, batch: usize) -> u16 {
        self.prefetch.unwrap_or_else(|| {
            u16::try_from(batch.saturating_mul(2).max(MIN_PREFETCH as usize)).unwrap_or(u16::MAX)
        })
    }

    /// The consumer tag (default: the broker makes one up).
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// Reads the message ID from header `name` instead of the `message_id` property: text,
    /// bytes or an integer (written in decimal). Shorthand for
    /// [`id_from`](Self::id_from)`(IdFrom::Header(name))`.
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_from = IdFrom::Header(name.into());
        self
    }

    /// Where the message ID is read from (default: the AMQP `message_id` property, what
    /// [`RabbitProducer`](crate::RabbitProducer) sets): the property, a header, a CloudEvent's
    /// `id` (binary mode `cloudEvents_id` or `cloudEvents:id` header, or a structured-mode JSON
    /// event), the Debezium outbox router's `id` header, or a JSON field of the body. Never the
    /// delivery tag: it numbers deliveries on one channel, not messages.
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.id_from = from;
        self
    }

    /// Declare the queues (default) or only check that they exist.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = topology;
        self
    }

    /// The quorum queue's `x-delivery-limit` (default 20): a message returned to the queue more
    /// often than this (nacked, or in flight when a consumer died; from RabbitMQ 4.3 nacks no
    /// longer count) is dead-lettered by the broker itself. Before 4.3 the hand-backs of a store
    /// outage count too: see the crate docs, "Ack semantics". It is the backstop for a message that crashes the process, which no in-process
    /// retry count can see. Set the consumer's `max_deliveries` below it so the adapter
    /// dead-letters with a reason first.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Declares the queue without `x-delivery-limit`: a message that kills the process loops
    /// forever.
    pub fn no_delivery_limit(mut self) -> Self {
        self.delivery_limit = None;
        self
    }

    /// How long a receive waits for the first message before returning an empty batch
    /// (default 1 s).
    pub fn poll_timeout(mut self, wait: Duration) -> Self {
        self.poll_timeout = wait;
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
    ///   good: no heartbeat runs before the handshake ends.
    /// - Dead letters: past it the publish fails with [`Recovery::Retry`](inbox_core::Recovery)
    ///   and the consumer hands the message back, instead of waiting out a broker memory or disk
    ///   alarm, which holds every publish unconfirmed until it clears.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// The client-provided connection name (`connection_name` client property) shown by the
    /// management UI and `rabbitmqctl list_connections client_properties`. Default:
    /// `inbox-rabbitmq <queue>`. Dead letters go out on a second connection, named
    /// `<name> dead letters`.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// For `amqps://` (feature `tls`): trust the certificate authorities in `pem` (one or more
    /// PEM certificates) instead of the system's roots: a private CA, a managed broker's own.
    pub fn ca_certificates(mut self, pem: impl Into<String>) -> Self {
        self.ca_certificates = Some(pem.into());
        self
    }

    /// Binds the queue to `exchange`, a durable exchange of `kind`, with `routing_key`
    /// (ignored by a fanout exchange; a pattern such as `orders.*` or `orders.#` for a topic
    /// one), declaring both at connect with [`Topology::Declare`]; with [`Topology::Expect`]
    /// bindings are the operator's and this declares nothing. Call it once per binding: a queue
    /// may take messages from several exchanges, or several keys of one. Each consumer group
    /// is one queue: bind a queue per group to fan a message out to every group, each applying
    /// it once through its own inbox consumer name.
    pub fn bind(
        mut self,
        exchange: impl Into<String>,
        kind: ExchangeKind,
        routing_key: impl Into<String>,
    ) -> Self {
        self.bindings.push(Binding {
            exchange: exchange.into(),
            kind,
            routing_key: routing_key.into(),
        });
        self
    }

    /// Sets a queue argument (`x-max-length`, `x-queue-type`, `x-overflow`, ...), replacing the
    /// adapter's where it sets the same one. The defaults: a quorum queue, dead-lettering to
    /// `<queue>.dlq` at least once (`x-dead-letter-strategy = at-least-once`, which needs
    /// `x-overflow = reject-publish` and a quorum queue), and [`delivery_limit`](Self::delivery_limit).
    /// Arguments are fixed when the queue is first declared: a queue that exists with other
    /// arguments fails the connect with `PRECONDITION_FAILED`.
    pub fn queue_argument(mut self, name: impl Into<String>, value: AMQPValue) -> Self {
        self.queue_arguments.insert(name.into().into(), value);
        self
    }

    /// The AMQP heartbeat interval to ask for (whole seconds, rounded up; default: the broker's,
    /// 60 s on RabbitMQ). Client and broker each send a frame at least every half interval and
    /// give the connection up after two intervals without one from the other side, so a
    /// connection that went silent (a network partition, a black-holing firewall, a frozen
    /// broker) is noticed after about twice this: the consumer then reconnects, and the broker
    /// requeues the deliveries the dead connection held. With the default that takes about two
    /// minutes; 5–20 s is a common choice. The lower of this and the broker's `heartbeat`
    /// setting applies. It also applies to the dead-letter connection.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = Some(interval);
        self
    }

    /// The broker address it connects to: the one set with [`url`](Self::url), else
    /// `AMQP_URL` (read by [`RabbitSource::builder`](crate::RabbitSource::builder)); empty when neither
    /// names one.
    pub fn broker_url(&self) -> &str {
        &self.url
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The dead-letter queue: `<queue>.dlq`.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// The connection name in use: the one set with [`connection_name`](Self::connection_name),
    /// or the default.
    pub fn effective_connection_name(&self) -> String {
        self.connection_name
            .clone()
            .unwrap_or_else(|| format!("inbox-rabbitmq {}", self.queue))
    }

    /// The heartbeat to ask for, in the whole seconds AMQP uses.
    pub(crate) fn heartbeat_secs(&self) -> Option<u16> {
        self.heartbeat.map(|interval| {
            let secs = interval.as_secs() + u64::from(interval.subsec_nanos() > 0);
            u16::try_from(secs).unwrap_or(u16::MAX)
        })
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.queue.is_empty() {
            return Err(Error::Config("the queue name is empty".into()));
        }
        // The `.dlq` suffix must fit the 255-byte AMQP short string too.
        if self.queue.len() > 251 {
            return Err(Error::Config(format!(
                "queue name `{}` is {} bytes; at most 251 leave room for the `.dlq` suffix",
                self.queue,
                self.queue.len()
            )));
        }
        if self.prefetch == Some(0) {
            return Err(Error::Config(
                "prefetch is 0, which RabbitMQ reads as unlimited; use at least 1".into(),
            ));
        }
        if self.delivery_limit == Some(0) {
            return Err(Error::Config(
                "delivery_limit is 0; use at least 1, or no_delivery_limit()".into(),
            ));
        }
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
        self.id_from
            .check(&crate::source::ID_BINDING)
            .map_err(Error::Config)?;
        if let Some(name) = self.id_from.header_name() {
            short_string("ID header name", name)?;
        }
        short_string("consumer tag", &self.consumer_tag)?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_with_the_fix() {
        let ok = RabbitSourceBuilder::new("amqp://localhost", "q");
        assert!(ok.check().is_ok());
        let e = ok.clone().prefetch(0).check().unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        assert!(RabbitSourceBuilder::new("amqp://localhost", "")
            .check()
            .is_err());
        assert!(ok.clone().id_header("").check().is_err());
        assert!(ok.clone().delivery_limit(0).check().is_err());
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
}
