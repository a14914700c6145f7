//! RabbitMQ: a quorum queue; a1/a2 consume with `no_ack`.

use std::time::Duration;

use futures_util::stream::{self, StreamExt, TryStreamExt};
use inbox_core::{async_trait, BoxError, MessageId, Publish, StatsSnapshot};
use inbox_rabbitmq::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use inbox_rabbitmq::lapin::types::FieldTable;
use inbox_rabbitmq::lapin::{Channel, Connection, ConnectionProperties};
use inbox_rabbitmq::{
    AckMode, RabbitProducer, RabbitSource, RabbitSourceBuilder, DEFAULT_AMQP_URL,
};
use inbox_testkit::TestDb;

use super::{Broker, Outgoing};
use crate::cli::{BrokerKind, ConsumerSpec};
use crate::consume::{self, Shutdown, Watch};

/// Publishes awaiting their confirms at once.
const PUBLISHES_IN_FLIGHT: usize = 500;

pub(crate) struct Rabbit {
    url: String,
    /// Kept open for queue counts and deletes.
    admin: (Connection, Channel),
}

impl Rabbit {
    pub(crate) async fn connect() -> Result<Self, BoxError> {
        let url = std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned());
        // lapin's I/O runs on the wallet's tokio runtime (lapin's `tokio` feature).
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .map_err(|e| {
                format!(
                "cannot reach RabbitMQ at {url}: {e}; run `cargo xtask services` or set AMQP_URL"
            )
            })?;
        let channel = connection.create_channel().await?;
        Ok(Self {
            url,
            admin: (connection, channel),
        })
    }

    fn config(&self, name: &str) -> RabbitSourceBuilder {
        // No broker-side delivery limit: a message the kills requeue often must not be parked,
        // or it would count as lost.
        RabbitSource::builder(name)
            .url(&self.url)
            .no_delivery_limit()
            .poll_timeout(Duration::from_millis(500))
    }
}

fn connection_name(spec: &ConsumerSpec) -> String {
    format!("wallet {} {}", spec.name, spec.member)
}

#[async_trait]
impl Broker for Rabbit {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Rabbitmq
    }

    async fn create(&self, name: &str) -> Result<(), BoxError> {
        Ok(self.config(name).declare_topology().await?)
    }

    async fn publish(&self, name: &str, events: &[Outgoing]) -> Result<(), BoxError> {
        // Many publishes in flight on the one channel, each awaiting its own confirm: the queue
        // order does not matter to the wallet, and one at a time is a round-trip per event.
        let messages = events
            .iter()
            .map(|event| Ok((MessageId::new(event.id.clone())?, event.payload.clone())))
            .collect::<Result<Vec<_>, BoxError>>()?;
        let publisher = RabbitProducer::builder().url(&self.url).connect().await?;
        let published = stream::iter(messages)
            .map(|(id, payload)| {
                let publisher = &publisher;
                async move { publisher.send_with_id(name, &id, &payload).await }
            })
            .buffer_unordered(PUBLISHES_IN_FLIGHT)
            .try_for_each(|()| async { Ok(()) })
            .await;
        publisher.close().await;
        Ok(published?)
    }

    async fn consume(
        &self,
        spec: &ConsumerSpec,
        db: &TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError> {
        // The prefetch window follows the consumer's batch size.
        let mut config = self
            .config(&spec.name)
            .connection_name(connection_name(spec));
        if spec.variant.auto_ack() {
            config = config.ack_mode(AckMode::NoAck);
        }
        let source = config.connect().await?;
        crate::ready();
        Ok(consume::run(source, spec, db, watch, shutdown).await?)
    }

    async fn left(&self, name: &str) -> Result<Option<u64>, BoxError> {
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let queue = self
            .admin
            .1
            .queue_declare(name.into(), options, FieldTable::default())
            .await?;
        Ok(Some(u64::from(queue.message_count())))
    }

    fn redelivery_delay(&self) -> Duration {
        // A closed connection's unacked deliveries are requeued at once.
        Duration::from_secs(3)
    }

    async fn take_away(&self, spec: &ConsumerSpec) -> Result<(), BoxError> {
        let name = connection_name(spec);
        let output = tokio::process::Command::new("rabbitmqctl")
            .args([
                "list_connections",
                "-q",
                "--no-table-headers",
                "pid",
                "client_properties",
            ])
            .output()
            .await?;
        let listing = String::from_utf8_lossy(&output.stdout);
        let needles = [
            format!("\"connection_name\",\"{name}\""),
            format!("<<\"{name}\">>"),
        ];
        for line in listing
            .lines()
            .filter(|line| needles.iter().any(|n| line.contains(n.as_str())))
        {
            if let Some(pid) = line.split('\t').next() {
                tokio::process::Command::new("rabbitmqctl")
                    .args([
                        "close_connection",
                        pid,
                        "wallet zombie test: stalled consumer",
                    ])
                    .output()
                    .await?;
            }
        }
        Ok(())
    }

    async fn remove(&self, name: &str) {
        for queue in [name.to_owned(), format!("{name}.dlq")] {
            let _ = self
                .admin
                .1
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await;
        }
    }
}
