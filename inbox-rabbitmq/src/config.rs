//! What a [`RabbitSource`](crate::RabbitSource) connects to and how it consumes.

use std::time::Duration;

use inbox_core::IdFrom;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use crate::short_string::short_string;
use crate::{Error, RabbitConnection, Result};

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

/// Configures a [`RabbitSource`](crate::RabbitSource): what it consumes and what topology it
/// expects, on the broker its [`RabbitConnection`] reaches. Made by
/// [`RabbitConnection::source`] (or [`RabbitSource::builder`](crate::RabbitSource::builder), on
/// the broker `AMQP_URL` names), finished by [`connect`](Self::connect).
///
/// ```no_run
/// # async fn run() -> Result<(), inbox_rabbitmq::Error> {
/// use std::time::Duration;
/// use inbox_rabbitmq::RabbitSource;
///
/// // The broker `AMQP_URL` names (unset, connect fails); `RabbitConnection::new(url)` names one.
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
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct RabbitSourceBuilder {
    pub(crate) connection: RabbitConnection,
    pub(crate) queue: String,
    /// `None`: follow the consumer's batch size.
    pub(crate) prefetch: Option<u16>,
    pub(crate) consumer_tag: String,
    pub(crate) id_from: IdFrom,
    pub(crate) topology: Topology,
    pub(crate) delivery_limit: Option<u32>,
    pub(crate) poll_timeout: Duration,
    pub(crate) connection_name: Option<String>,
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

impl RabbitSourceBuilder {
    /// Consumes `queue` on the broker `connection` reaches.
    pub(crate) fn new(connection: RabbitConnection, queue: impl Into<String>) -> Self {
        Self {
            connection,
            queue: queue.into(),
            prefetch: None,
            consumer_tag: String::new(),
            id_from: IdFrom::MessageIdProperty,
            topology: Topology::Declare,
            delivery_limit: Some(20),
            poll_timeout: Duration::from_secs(1),
            connection_name: None,
            bindings: Vec::new(),
            queue_arguments: FieldTable::default(),
        }
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
    pub fn id_header(self, name: impl Into<String>) -> Self {
        self.id_from(IdFrom::Header(name.into()))
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

    /// The quorum queue's `x-delivery-limit` (default 20): past it the broker dead-letters a
    /// message by itself (what counts against it: the crate docs, "Ack semantics"). It is the
    /// backstop for a message that crashes the process, which no in-process retry count can
    /// see. Set the consumer's `max_deliveries` below it so the adapter dead-letters with a
    /// reason first.
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

    /// The client-provided connection name (`connection_name` client property) shown by the
    /// management UI and `rabbitmqctl list_connections client_properties`. Default:
    /// `inbox-rabbitmq <queue>`. Dead letters go out on a second connection, named
    /// `<name> dead letters`.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
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
    /// adapter's where it sets the same one (the crate docs, "Topology", list them; the
    /// `at-least-once` dead-letter strategy needs a quorum queue and `x-overflow =
    /// reject-publish`). Arguments are fixed when the queue is first declared: a queue that exists with other
    /// arguments fails the connect with `PRECONDITION_FAILED`.
    pub fn queue_argument(mut self, name: impl Into<String>, value: AMQPValue) -> Self {
        self.queue_arguments.insert(name.into().into(), value);
        self
    }

    /// The broker address it connects to ([`RabbitConnection::url`]).
    pub fn broker_url(&self) -> &str {
        self.connection.url()
    }

    /// The connection it is built on.
    pub fn connection(&self) -> &RabbitConnection {
        &self.connection
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
        self.connection.check()?;
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
        let ok = RabbitConnection::new("amqp://localhost").source("q");
        assert!(ok.check().is_ok());
        let e = ok.clone().prefetch(0).check().unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        assert!(RabbitConnection::new("amqp://localhost")
            .source("")
            .check()
            .is_err());
        assert!(ok.clone().id_header("").check().is_err());
        assert!(ok.clone().delivery_limit(0).check().is_err());
        let slow = RabbitConnection::new("amqp://localhost").operation_timeout(Duration::ZERO);
        assert!(
            slow.source("q").check().is_err(),
            "the connection is checked too"
        );
    }
}
