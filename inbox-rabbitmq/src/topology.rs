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

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Channel;

use crate::{Error, RabbitConfig, Result, Topology};

/// The arguments of the consumed queue.
pub(crate) fn queue_arguments(config: &RabbitConfig) -> FieldTable {
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

/// Declares (or checks) both queues on `channel`.
pub(crate) async fn prepare(channel: &Channel, config: &RabbitConfig) -> Result<()> {
    let dlq = config.dead_letter_queue();
    let passive = config.topology == Topology::Expect;
    let options = QueueDeclareOptions {
        passive,
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let (main_args, dlq_args) = if passive {
        (FieldTable::default(), FieldTable::default())
    } else {
        (queue_arguments(config), dead_letter_arguments())
    };
    let verb = if passive { "checking" } else { "declaring" };
    channel
        .queue_declare(&dlq, options, dlq_args)
        .await
        .map_err(|e| Error::amqp(format!("{verb} dead-letter queue `{dlq}`"), e))?;
    channel
        .queue_declare(&config.queue, options, main_args)
        .await
        .map_err(|e| {
            Error::amqp(
                format!(
                    "{verb} queue `{}` (a quorum queue with x-dead-letter-exchange \"\" and \
                     x-dead-letter-routing-key `{dlq}`; an existing queue with other arguments \
                     fails with PRECONDITION_FAILED)",
                    config.queue
                ),
                e,
            )
        })?;
    Ok(())
}

/// Declares the topology of `config` once, on a short-lived connection: for setup tools and for
/// publishers that start before any consumer.
async fn declare_once(config: &RabbitConfig) -> Result<()> {
    config.check()?;
    let connection = crate::connect::open(&config.url, &config.effective_connection_name()).await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| Error::amqp("opening a channel", e))?;
    let declared = prepare(&channel, &config.clone().topology(Topology::Declare)).await;
    // Closing is a courtesy; the broker cleans up a dropped connection as well.
    let _ = connection.close(200, "topology declared").await;
    declared
}

impl RabbitConfig {
    /// Declares the queue and its dead-letter queue now, on a short-lived connection, whatever
    /// [`RabbitConfig::topology`] says: for setup tools, and for producers that start before any
    /// consumer. Idempotent.
    pub async fn declare_topology(&self) -> Result<()> {
        declare_once(self).await
    }
}
