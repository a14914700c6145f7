//! Kafka: a 6-partition topic (4 on librdkafka's mock without `kafka-mock --control`), group =
//! topic name; a1/a2 use the client's auto-commit.

use std::time::Duration;

use futures_util::stream::{self, StreamExt, TryStreamExt};
use inbox_core::{async_trait, BoxError, MessageId, StatsSnapshot};
use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use inbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use inbox_kafka::{AckMode, KafkaAdmin, KafkaProducer, KafkaSource, Record};
use inbox_testkit::TestDb;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::{Broker, Outgoing};
use crate::cli::{BrokerKind, ConsumerSpec, KafkaImpl};
use crate::consume::{self, Shutdown, Watch};

const PARTITIONS: i32 = 6;
/// As in the article: a dead member is noticed in about 6 s.
const SESSION_TIMEOUT: Duration = Duration::from_secs(6);

/// Tansu 0.6 (what `cargo xtask services` starts) answers a fetch from an offset inside a record
/// batch with the batches after it, where Kafka returns the batch holding the offset: a consumer
/// resuming from a commit in mid-batch would skip the rest of that batch. One record per batch
/// makes every offset a batch start. Harmless on Apache Kafka; it only slows publishing. Not set
/// with `--kafka-impl mock`, whose fetch starts at the offset asked for.
const ONE_RECORD_PER_BATCH: (&str, &str) = ("batch.num.messages", "1");
/// A loaded test machine once kept Tansu from acknowledging within the default 30 s.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// Sends awaiting their delivery reports at once: with one record per batch, Tansu's throughput
/// grows with the produce requests in flight.
const SENDS_IN_FLIGHT: usize = 5_000;

pub(crate) struct Kafka {
    brokers: String,
    implementation: KafkaImpl,
    admin: KafkaAdmin,
    producer: KafkaProducer,
}

impl Kafka {
    pub(crate) async fn connect(implementation: KafkaImpl) -> Result<Self, BoxError> {
        let brokers = inbox_kafka::brokers_from_env();
        // librdkafka connects lazily; a plain TCP connect says whether anyone listens.
        let first = brokers.split(',').next().unwrap_or_default().to_owned();
        tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(&first))
            .await
            .map_err(|_| format!("Kafka at {first} does not answer"))?
            .map_err(|e| {
                format!("cannot reach Kafka at {first}: {e}; run `cargo xtask services` or set KAFKA_BROKERS")
            })?;
        let mut producer = KafkaProducer::builder()
            .brokers(&brokers)
            .operation_timeout(DELIVERY_TIMEOUT);
        if implementation.tansu_workarounds() {
            let (key, value) = ONE_RECORD_PER_BATCH;
            producer = producer.set(key, value);
        }
        Ok(Self {
            admin: KafkaAdmin::new(&brokers)?,
            producer: producer.connect().await?,
            implementation,
            brokers,
        })
    }
}

#[async_trait]
impl Broker for Kafka {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Kafka
    }

    async fn create(&self, name: &str) -> Result<(), BoxError> {
        if self.implementation == KafkaImpl::Mock {
            // The mock has no CreateTopics (the request times out): `kafka-mock --control`
            // creates topics when asked, else a metadata request that allows it creates the
            // topic, with the mock's default partition count.
            if let Ok(control) = std::env::var("KAFKA_MOCK_CONTROL") {
                create_through_control(&control, name, PARTITIONS).await?;
                return create_through_control(&control, &format!("{name}.dlq"), 1).await;
            }
            for topic in [name.to_owned(), format!("{name}.dlq")] {
                let brokers = self.brokers.clone();
                tokio::task::spawn_blocking(move || create_on_first_use(&brokers, &topic))
                    .await??;
            }
            return Ok(());
        }
        self.admin.create_topic(name, PARTITIONS).await?;
        self.admin.create_topic(&format!("{name}.dlq"), 1).await?;
        Ok(())
    }

    async fn publish(&self, name: &str, events: &[Outgoing]) -> Result<(), BoxError> {
        // Keyed by account, so the events spread over the partitions.
        let mut records = Vec::with_capacity(events.len());
        for event in events {
            records.push(
                Record::new(event.payload.clone())
                    .id(MessageId::new(event.id.clone())?)
                    .key(event.key.clone()),
            );
        }
        let producer = &self.producer;
        stream::iter(records)
            .map(|record| producer.send_record(name, record))
            .buffer_unordered(SENDS_IN_FLIGHT)
            .try_for_each(|_sent| async { Ok(()) })
            .await?;
        Ok(())
    }

    async fn consume(
        &self,
        spec: &ConsumerSpec,
        db: &TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError> {
        let mut config = KafkaSource::builder([spec.name.clone()], spec.name.clone())
            .brokers(&self.brokers)
            .set_consumer(
                "session.timeout.ms",
                SESSION_TIMEOUT.as_millis().to_string(),
            );
        if spec.zombie {
            // The article's eviction: a handler stalled past this leaves the group.
            config = config.set_consumer("max.poll.interval.ms", "10000");
        }
        if spec.variant.auto_ack() {
            config = config.ack_mode(AckMode::AutoCommit);
        }
        let source = config.connect().await?;
        crate::ready();
        Ok(consume::run(source, spec, db, watch, shutdown).await?)
    }

    async fn left(&self, name: &str) -> Result<Option<u64>, BoxError> {
        let (brokers, topic) = (self.brokers.clone(), name.to_owned());
        Ok(Some(
            tokio::task::spawn_blocking(move || lag(&brokers, &topic)).await??,
        ))
    }

    fn redelivery_delay(&self) -> Duration {
        SESSION_TIMEOUT * 2
    }

    fn drain_restarts(&self) -> u32 {
        // Replacing a stalled member only works around Tansu's empty assignments; elsewhere a
        // stalled drain is a finding, not something to paper over.
        if self.implementation.tansu_workarounds() {
            super::DRAIN_RESTARTS
        } else {
            0
        }
    }

    async fn remove(&self, _name: &str) {
        // Topics stay; their names are random.
    }
}

/// Asks `kafka-mock --control` at `control` to create `topic`.
async fn create_through_control(
    control: &str,
    topic: &str,
    partitions: i32,
) -> Result<(), BoxError> {
    let talk = async {
        let mut stream = tokio::net::TcpStream::connect(control).await?;
        stream
            .write_all(format!("create-topic {topic} {partitions}\n").as_bytes())
            .await?;
        let mut answer = String::new();
        BufReader::new(stream).read_line(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), talk)
        .await
        .map_err(|_| format!("kafka-mock at KAFKA_MOCK_CONTROL={control} does not answer"))?
        .map_err(|e| format!("kafka-mock at KAFKA_MOCK_CONTROL={control}: {e}"))?;
    match answer.trim_end() {
        "ok" => Ok(()),
        other => Err(format!("kafka-mock at KAFKA_MOCK_CONTROL={control}: {other}").into()),
    }
}

/// Creates `topic` through broker-side automatic creation (librdkafka's mock cluster, which has
/// no admin API) and checks that it has partitions.
fn create_on_first_use(brokers: &str, topic: &str) -> Result<(), BoxError> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("allow.auto.create.topics", "true")
        .create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    match metadata.topics().first() {
        Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(()),
        Some(t) => Err(format!(
            "the broker did not create topic `{topic}` on first use ({:?}, {} partitions); is \
             KAFKA_BROKERS librdkafka's mock cluster (`kafka-mock`)?",
            t.error(),
            t.partitions().len()
        )
        .into()),
        None => Err(format!("the broker did not answer for topic `{topic}`").into()),
    }
}

/// Records past the group's committed offsets (the group is the topic's name), summed over the
/// partitions: what a restarted consumer would still read.
fn lag(brokers: &str, topic: &str) -> Result<u64, BoxError> {
    let timeout = Duration::from_secs(10);
    // Never subscribes, so it never joins the group: it only reads the group's offsets.
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", topic)
        .set("enable.auto.commit", "false")
        .create()?;
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions = metadata
        .topics()
        .first()
        .map_or(0, |t| t.partitions().len() as i32);
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        list.add_partition(topic, partition);
    }
    let committed = consumer.committed_offsets(list, timeout)?;
    let mut left = 0;
    for element in committed.elements() {
        let (low, high) = consumer.fetch_watermarks(topic, element.partition(), timeout)?;
        let done = match element.offset() {
            Offset::Offset(o) => o,
            _ => low,
        };
        left += (high - done).max(0) as u64;
    }
    Ok(left)
}
