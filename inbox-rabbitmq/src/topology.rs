//! The queues the adapter declares or expects (listed in the crate docs, "Topology"), and the
//! exchanges of [`RabbitSourceBuilder::bind`], each durable and of its kind, with `<queue>`
//! bound to it.
//!
//! A passive declare that fails closes its channel, so [`Topology::Expect`] checks each queue on
//! a throwaway channel.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use crate::short_string::{long_string, short_string};
use crate::{Error, RabbitSourceBuilder, Result, Topology};

/// A quorum queue's arguments, with `x-queue-type` only.
fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long_string("quorum"));
    args
}

/// The arguments of a quorum queue that dead-letters to the queue `routing_key` through the
/// default exchange, at least once, so that broker-side dead-lettering cannot drop a message
/// (`x-overflow = reject-publish` is what that strategy requires).
pub(crate) fn dead_lettering_to(routing_key: &str) -> FieldTable {
    let mut args = quorum();
    args.insert("x-dead-letter-exchange".into(), long_string(""));
    args.insert("x-dead-letter-routing-key".into(), long_string(routing_key));
    args.insert(
        "x-dead-letter-strategy".into(),
        long_string("at-least-once"),
    );
    args.insert("x-overflow".into(), long_string("reject-publish"));
    args
}

/// The arguments of the consumed queue.
fn queue_arguments(config: &RabbitSourceBuilder) -> FieldTable {
    let mut args = dead_lettering_to(&config.dead_letter_queue());
    if let Some(limit) = config.delivery_limit {
        let limit = i64::from(limit);
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
    }
    for (name, value) in config.queue_arguments.inner() {
        args.insert(name.clone(), value.clone());
    }
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

/// Declares the durable queue `name` with `args`; `what` (`queue`, `delay queue`, …) names it in
/// errors, and `hint` follows its name in a failed declare's.
pub(crate) async fn declare_queue(
    channel: &Channel,
    what: &'static str,
    name: &str,
    args: FieldTable,
    hint: &str,
) -> Result<()> {
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(short_string(what, name)?, options, args)
        .await
        .map_err(|e| Error::amqp(format!("declaring {what} `{name}`{hint}"), e))?;
    Ok(())
}

async fn declare(channel: &Channel, config: &RabbitSourceBuilder) -> Result<()> {
    let dlq = config.dead_letter_queue();
    declare_queue(channel, "dead-letter queue", &dlq, quorum(), "").await?;
    let hint = format!(
        " (a quorum queue with x-dead-letter-exchange \"\" and x-dead-letter-routing-key \
         `{dlq}`; an existing queue with other arguments fails with PRECONDITION_FAILED)"
    );
    let args = queue_arguments(config);
    declare_queue(channel, "queue", &config.queue, args, &hint).await?;
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
                let (name, kind) = (&binding.exchange, &binding.kind);
                let context = format!(
                    "declaring exchange `{name}` ({kind:?}, durable; an existing exchange of \
                     another kind fails with PRECONDITION_FAILED)"
                );
                Error::amqp(context, e)
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
                let context =
                    format!("binding queue `{queue}` to exchange `{name}` with key `{key}`");
                Error::amqp(context, e)
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

impl RabbitSourceBuilder {
    /// Declares the queue and its dead-letter queue now, on a short-lived connection, whatever
    /// [`topology`](Self::topology) says: for setup tools, and for producers that start before
    /// any consumer. Idempotent. Bounded by
    /// [`RabbitConnection::operation_timeout`](crate::RabbitConnection::operation_timeout), like
    /// the source's connect.
    pub async fn declare_topology(&self) -> Result<()> {
        self.connection
            .bounded(async {
                self.check()?;
                let name = self.effective_connection_name();
                let (connection, channel) = self.connection.open(&name, "topology").await?;
                let declared = declare(&channel, self).await;
                // Closing is a courtesy; the broker cleans up a dropped connection as well.
                let _ = connection.close(200, "topology declared".into()).await;
                declared
            })
            .await
    }
}
