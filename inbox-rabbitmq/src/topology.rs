//! The queues the adapter declares or expects.
//!
//! - `<queue>`: a durable **quorum** queue with
//!   `x-dead-letter-exchange = ""` (the default exchange) and
//!   `x-dead-letter-routing-key = <queue>.dlq`, so whatever the broker dead-letters on its own
//!   (a message over `x-delivery-limit`) lands in the dead-letter queue;
//!   `x-dead-letter-strategy = at-least-once` with `x-overflow = reject-publish` (required by it)
//!   so broker-side dead-lettering cannot drop a message; and `x-delivery-limit` when set.
//! - `<queue>.dlq`: a durable quorum queue. The adapter's own dead-lettering (no ID, handler gave
//!   up) publishes there through the default exchange, with publisher confirms.
//!
//! - each exchange of [`RabbitSourceBuilder::bind`]: durable, of its kind, with `<queue>` bound
//!   to it under the routing key given.
//!
//! With [`Topology::Expect`] each queue is checked with a passive declare on a throwaway channel
//! (a failed passive declare closes its channel), and a missing one fails the connect with
//! [`Error::MissingQueue`], which names it.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection};

use crate::short_string::short_string;
use crate::{Error, RabbitSourceBuilder, Result, Topology};

/// The arguments of the consumed queue.
pub(crate) fn queue_arguments(config: &RabbitSourceBuilder) -> FieldTable {
    let mut args = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s.to_owned()));
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-dead-letter-exchange".into(), text(""));
    args.insert(
        "x-dead-letter-routing-key".into(),
        text(&config.dead_letter_queue()),
    );
    args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    args.insert("x-overflow".into(), text("reject-publish"));
    if let Some(limit) = config.delivery_limit {
        let limit = i64::from(limit);
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
    }
    for (name, value) in config.queue_arguments.inner() {
        args.insert(name.clone(), value.clone());
    }
    args
}

fn dead_letter_arguments() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum".to_owned())),
    );
    args
}

/// Declares both queues on `channel` ([`Topology::Declare`]), or checks that both exist
/// ([`Topology::Expect`]), each on a throwaway channel of `connection`.
pub(crate) async fn prepare(
    connection: &Connection,
    channel: &Channel,
    config: &RabbitSourceBuilder,
) -> Result<()> {
    match config.topology {
        Topology::Declare => declare(channel, config).await,
        Topology::Expect => {
            expect(connection, "queue", &config.queue).await?;
            expect(connection, "dead-letter queue", &config.dead_letter_queue()).await
        }
    }
}

async fn declare(channel: &Channel, config: &RabbitSourceBuilder) -> Result<()> {
    let dlq = config.dead_letter_queue();
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(
            short_string("dead-letter queue name", &dlq)?,
            options,
            dead_letter_arguments(),
        )
        .await
        .map_err(|e| Error::amqp(format!("declaring dead-letter queue `{dlq}`"), e))?;
    channel
        .queue_declare(
            short_string("queue name", &config.queue)?,
            options,
            queue_arguments(config),
        )
        .await
        .map_err(|e| {
            Error::amqp(
                format!(
                    "declaring queue `{}` (a quorum queue with x-dead-letter-exchange \"\" and \
                     x-dead-letter-routing-key `{dlq}`; an existing queue with other arguments \
                     fails with PRECONDITION_FAILED)",
                    config.queue
                ),
                e,
            )
        })?;
    for binding in &config.bindings {
        let exchange = short_string("exchange name", &binding.exchange)?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                exchange.clone(),
                binding.kind.clone(),
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                let kind = &binding.kind;
                let name = &binding.exchange;
                Error::amqp(
                    format!(
                        "declaring exchange `{name}` ({kind:?}, durable; an existing exchange \
                         of another kind fails with PRECONDITION_FAILED)"
                    ),
                    e,
                )
            })?;
        channel
            .queue_bind(
                short_string("queue name", &config.queue)?,
                exchange,
                short_string("routing key", &binding.routing_key)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                let (queue, name, key) = (&config.queue, &binding.exchange, &binding.routing_key);
                Error::amqp(
                    format!("binding queue `{queue}` to exchange `{name}` with key `{key}`"),
                    e,
                )
            })?;
    }
    Ok(())
}

/// Checks with a passive declare that `queue` exists, on a channel of its own: the broker closes
/// the channel of a passive declare that fails.
async fn expect(connection: &Connection, role: &'static str, queue: &str) -> Result<()> {
    let name = short_string("queue name", queue)?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| Error::amqp(format!("opening a channel to check {role} `{queue}`"), e))?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(name, options, FieldTable::default())
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(())
        }
        Err(e) if is_not_found(&e) => Err(Error::MissingQueue {
            role,
            queue: queue.to_owned(),
        }),
        Err(e) => Err(Error::amqp(format!("checking {role} `{queue}`"), e)),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
    )
}

/// Declares the topology of `config` once, on a short-lived connection: for setup tools and for
/// producers that start before any consumer.
async fn declare_once(config: &RabbitSourceBuilder) -> Result<()> {
    config.check()?;
    let connection = config
        .connection
        .open(&config.effective_connection_name())
        .await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| Error::amqp("opening a channel", e))?;
    let declared = declare(&channel, config).await;
    // Closing is a courtesy; the broker cleans up a dropped connection as well.
    let _ = connection.close(200, "topology declared".into()).await;
    declared
}

impl RabbitSourceBuilder {
    /// Declares the queue and its dead-letter queue now, on a short-lived connection, whatever
    /// [`topology`](Self::topology) says: for setup tools, and for producers that start before
    /// any consumer. Idempotent. Bounded by [`RabbitConnection::operation_timeout`](crate::RabbitConnection::operation_timeout), like
    /// the source's connect.
    pub async fn declare_topology(&self) -> Result<()> {
        let waited = self.connection.operation_timeout;
        tokio::time::timeout(waited, declare_once(self))
            .await
            .map_err(|_elapsed| Error::ConnectTimeout {
                url: crate::connect::redact(&self.connection.url),
                waited,
            })?
    }
}
