//! One small trait over the four brokers, so the kill and zombie tests share their harness.

#[cfg(feature = "kafka")]
mod kafka;
mod rabbitmq;
mod redis;
mod sqs;

use std::time::Duration;

use inbox_core::{async_trait, BoxError, StatsSnapshot};
use inbox_testkit::TestDb;

use crate::cli::{BrokerKind, ConsumerSpec, KafkaImpl};
use crate::consume::{Shutdown, Watch};

/// A credit event ready to publish: its producer-set ID and JSON payload.
#[derive(Debug, Clone)]
pub(crate) struct Outgoing {
    pub(crate) id: String,
    /// Kafka's record key (the account), which picks the partition.
    pub(crate) key: String,
    pub(crate) payload: Vec<u8>,
}

/// What the harness needs from a broker.
#[async_trait]
pub(crate) trait Broker: Send + Sync {
    fn kind(&self) -> BrokerKind;

    /// Creates a fresh queue, topic (6 partitions) or stream called `name`.
    async fn create(&self, name: &str) -> Result<(), BoxError>;

    /// Publishes `events` to `name`, in order.
    async fn publish(&self, name: &str, events: &[Outgoing]) -> Result<(), BoxError>;

    /// Runs one consumer of `spec` in this process until `shutdown`.
    async fn consume(
        &self,
        spec: &ConsumerSpec,
        db: &TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError>;

    /// Messages still on the broker, in flight included, where the broker can tell.
    async fn left(&self, name: &str) -> Result<Option<u64>, BoxError>;

    /// How long a dead consumer's unacked messages may take to come back to another.
    fn redelivery_delay(&self) -> Duration;

    /// Takes a stalled consumer's messages away from it where the broker needs a push to do so
    /// (RabbitMQ: the broker closes its connection). Others lose ownership on a timer.
    async fn take_away(&self, _spec: &ConsumerSpec) -> Result<(), BoxError> {
        Ok(())
    }

    /// How often a draining consumer that applies nothing while the broker still holds messages
    /// is replaced by a new one; 0: such a stall fails the run (see `kill::drain`).
    fn drain_restarts(&self) -> u32 {
        DRAIN_RESTARTS
    }

    /// Deletes `name` (best effort).
    async fn remove(&self, name: &str);
}

/// The default of [`Broker::drain_restarts`].
const DRAIN_RESTARTS: u32 = 5;

/// Connects to `kind`, failing with the reason when it is not reachable; `kafka_impl` says what
/// `KAFKA_BROKERS` points at.
pub(crate) async fn connect(
    kind: BrokerKind,
    kafka_impl: KafkaImpl,
) -> Result<Box<dyn Broker>, BoxError> {
    #[cfg(not(feature = "kafka"))]
    let _ = kafka_impl;
    Ok(match kind {
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => Box::new(kafka::Kafka::connect(kafka_impl).await?),
        #[cfg(not(feature = "kafka"))]
        BrokerKind::Kafka => {
            return Err("this evidence binary was built without the `kafka` feature".into())
        }
        BrokerKind::Sqs => Box::new(sqs::Sqs::connect().await?),
        BrokerKind::Rabbitmq => Box::new(rabbitmq::Rabbit::connect().await?),
        BrokerKind::Redis => Box::new(redis::Redis::connect().await?),
    })
}

/// A throw-away name for one run's queue, topic or stream.
pub(crate) fn fresh_name(label: &str) -> String {
    format!("wallet-{label}-{:08x}", rand::random::<u32>())
}
