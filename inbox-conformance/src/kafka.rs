//! The suite on a Kafka-protocol broker (feature `kafka`): [`Kafka`] gives each scenario a topic
//! of its own, read by the group `<topic>-group` and dead-lettered to `<topic>.dlq`.
//!
//! The brokers come from `KAFKA_BROKERS` (default `127.0.0.1:9092`); with `KAFKA_MOCK_CONTROL`
//! set, topics are created through librdkafka's mock cluster (`kafka-mock --control`). The
//! network-fault scenarios run on a twin of the topic on a Tansu of their own, which advertises
//! the fault proxy in front of it (`TANSU` names the binary, default `~/.cargo/bin/tansu`);
//! [`PrivateTansu`] starts such a broker for a test, also with TLS in front of it or with
//! authentication.

mod member;
mod private;
mod topics;

pub use member::Member;
pub use private::{PrivateTansu, PrivateTansuBuilder};
pub use topics::{create_topic, header, lag, mock_control, read_all};
use topics::{create_topic_on, lag_on};

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_core::DynPublish;
use inbox_kafka::rdkafka::message::{Header, OwnedHeaders};
use inbox_kafka::rdkafka::producer::FutureRecord;
use inbox_kafka::{KafkaConnection, KafkaProducer, KafkaProducerBuilder, KafkaSourceBuilder};

use crate::{LosingSource, Proxied, Restartable, TestBroker, TestQueue};

/// The local broker `cargo xtask services` starts: the tests' default, never the adapter's.
pub const LOCAL_BROKERS: &str = "127.0.0.1:9092";

/// `KAFKA_BROKERS`, or [`LOCAL_BROKERS`].
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS")
        .ok()
        .filter(|b| !b.trim().is_empty())
        .unwrap_or_else(|| LOCAL_BROKERS.to_owned())
}

/// A source of `topic` in `group` with timeouts short enough for tests: a dead member is noticed
/// after 6 s.
pub fn config(topic: &str, group: &str) -> KafkaSourceBuilder {
    config_on(&KafkaConnection::new(brokers()), topic, group)
}

/// [`config`] on `kafka`'s brokers and settings.
pub fn config_on(kafka: &KafkaConnection, topic: &str, group: &str) -> KafkaSourceBuilder {
    kafka
        .source([topic], group)
        .poll_timeout(Duration::from_millis(500))
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "1000")
}

/// A producer with the adapter's defaults.
pub async fn producer() -> KafkaProducer {
    KafkaConnection::new(brokers())
        .producer()
        .connect()
        .await
        .expect("producer")
}

/// Produces a record through `producer`'s client with exactly the `headers` given: without the
/// producer's own ID header, so that an `event_id` among them may be missing or invalid, for
/// records a consumer must dead-letter. To `partition` when given.
pub async fn send_raw(
    producer: &KafkaProducer,
    topic: &str,
    partition: Option<i32>,
    key: Option<&str>,
    headers: &[(&str, &str)],
    payload: &[u8],
) {
    let mut owned = OwnedHeaders::new_with_capacity(headers.len());
    for &(key, value) in headers {
        owned = owned.insert(Header {
            key,
            value: Some(value),
        });
    }
    let mut record = FutureRecord::<str, [u8]>::to(topic)
        .payload(payload)
        .headers(owned);
    if let Some(key) = key {
        record = record.key(key);
    }
    if let Some(partition) = partition {
        record = record.partition(partition);
    }
    producer
        .client()
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .expect("produce");
}

/// A Kafka-protocol broker under test. The default is the suite's: two partitions per topic, so
/// that two members of a group each own one, a 6 s session timeout, and the producer's defaults.
#[derive(Debug, Clone, Copy)]
pub struct Kafka {
    partitions: i32,
    session_timeout: Duration,
    one_record_per_batch: bool,
    delivery_timeout: Duration,
}

impl Default for Kafka {
    fn default() -> Self {
        Self {
            partitions: 2,
            session_timeout: Duration::from_secs(6),
            one_record_per_batch: false,
            delivery_timeout: Duration::from_secs(30),
        }
    }
}

impl Kafka {
    /// The partitions of each topic (default 2). Its dead-letter topic has one.
    pub fn partitions(mut self, partitions: i32) -> Self {
        self.partitions = partitions;
        self
    }

    /// The consumers' `session.timeout.ms` (default 6 s): a member that died is noticed after
    /// this, and its partitions go to the others.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Producers send one record per batch (`batch.num.messages=1`; default off). Tansu 0.6
    /// answers a fetch from an offset inside a record batch with the batches after it, where
    /// Kafka returns the batch holding the offset: a consumer resuming from a commit in
    /// mid-batch would skip the rest of that batch. One record per batch makes every offset a
    /// batch start; it only slows publishing.
    pub fn one_record_per_batch(mut self, on: bool) -> Self {
        self.one_record_per_batch = on;
        self
    }

    /// How long a producer's send waits for the broker, retries included (default 30 s, the
    /// adapter's): a loaded machine once kept Tansu from acknowledging within it.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    fn producer_builder(&self, brokers: &str) -> KafkaProducerBuilder {
        let builder = KafkaConnection::new(brokers).producer().set(
            "message.timeout.ms",
            self.delivery_timeout.as_millis().to_string(),
        );
        if self.one_record_per_batch {
            builder.set("batch.num.messages", "1")
        } else {
            builder
        }
    }

    async fn producer(&self, brokers: &str) -> KafkaProducer {
        self.producer_builder(brokers)
            .connect()
            .await
            .expect("producer")
    }

    fn topic(&self, name: &str, brokers: String, producer: KafkaProducer) -> Topic {
        Topic {
            group: format!("{name}-group"),
            name: name.to_owned(),
            kafka: *self,
            producer,
            next: AtomicI32::new(0),
            brokers,
            private: None,
        }
    }
}

/// A topic of its own and its dead-letter topic `<topic>.dlq`.
#[derive(Debug)]
pub struct Topic {
    name: String,
    group: String,
    kafka: Kafka,
    producer: KafkaProducer,
    /// The partition of the next send: round robin, so that two sends of one ID in a row land
    /// on different partitions.
    next: AtomicI32,
    /// The broker: `KAFKA_BROKERS`, or the proxy of `private`.
    brokers: String,
    /// The broker of this topic's own, where it is a twin for the network-fault scenarios.
    private: Option<PrivateTansu>,
}

impl TestBroker for Kafka {
    type Queue = Topic;

    async fn queue(&self, scenario: &str) -> Topic {
        let name = crate::unique_name(&format!("inbox-conformance-{scenario}"));
        create_topic(&name, self.partitions).await;
        create_topic(&format!("{name}.dlq"), 1).await;
        self.attach(&name).await
    }

    async fn attach(&self, name: &str) -> Topic {
        let producer = self.producer(&brokers()).await;
        self.topic(name, brokers(), producer)
    }
}

impl Topic {
    /// The settings of `member`'s source.
    fn builder(&self, member: &str) -> KafkaSourceBuilder {
        self.builder_on(&KafkaConnection::new(&self.brokers), member)
    }

    /// The settings of `member`'s source on `kafka`.
    fn builder_on(&self, kafka: &KafkaConnection, member: &str) -> KafkaSourceBuilder {
        // librdkafka keeps one fetch in flight per broker, and the broker holds a fetch that
        // finds nothing for `fetch.wait.max.ms` (default 500 ms), so a partition whose start is
        // still being looked up (no committed offset) is read only by the next fetch. With a
        // poll as long as that wait, `run_until_idle` went idle before reading it: after the
        // crash at `Acked` one partition was committed and the other not, and every restart read
        // the first and stopped. Hence a 100 ms wait under a 500 ms poll, and a 200 ms heartbeat
        // so that a member sees the rebalance of a second member's join sooner.
        config_on(kafka, &self.name, &self.group)
            .set_consumer(
                "session.timeout.ms",
                self.kafka.session_timeout.as_millis().to_string(),
            )
            .set_consumer("fetch.wait.max.ms", "100")
            .set_consumer("heartbeat.interval.ms", "200")
            .set_consumer("client.id", member)
            .commit_interval(Duration::from_millis(50))
    }
}

/// The member of a source with `builder`'s settings.
async fn connect(builder: KafkaSourceBuilder) -> Member {
    Member::new(builder.connect().await.expect("kafka source"))
}

impl TestQueue for Topic {
    type Source = Member;

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let partition = self.next.fetch_add(1, Ordering::Relaxed) % self.kafka.partitions;
        let headers: Vec<(&str, &str)> = id.map(|id| ("event_id", id)).into_iter().collect();
        send_raw(
            &self.producer,
            &self.name,
            Some(partition),
            None,
            &headers,
            payload,
        )
        .await;
    }

    async fn source(&self, member: &str) -> Member {
        connect(self.builder(member)).await
    }

    async fn losing_source(&self, member: &str) -> Option<LosingSource<Member>> {
        // A member that does not poll for `max.poll.interval.ms` leaves the group, and the
        // rebalance hands its partitions to the other member, which reads from the last
        // committed offset.
        let source = self
            .builder(member)
            .set_consumer("session.timeout.ms", "3000")
            .set_consumer("max.poll.interval.ms", "3000");
        Some(LosingSource {
            source: connect(source).await,
            stall: Duration::from_secs(10),
        })
    }

    async fn proxied_source(&self, member: &str) -> Option<Proxied<Member>> {
        // Only on a twin: a proxy in front of the shared broker would carry only the bootstrap.
        let proxy = self.private.as_ref()?.proxy.clone();
        // A request without an answer for 3 s closes its connection, and a new one is made.
        let kafka = KafkaConnection::new(&self.brokers).operation_timeout(Duration::from_secs(3));
        Some(Proxied {
            source: connect(self.builder_on(&kafka, member)).await,
            proxy,
            blackhole: Duration::from_secs(8),
            counts_faults: false,
        })
    }

    async fn proxied_twin(&self) -> Option<Topic> {
        if mock_control().is_some() {
            println!(
                "no proxied twin on librdkafka's mock cluster (KAFKA_MOCK_CONTROL is set): it \
                 advertises its own listeners, so clients would bypass a proxy; the Tansu run \
                 covers the network faults"
            );
            return None;
        }
        let tansu = PrivateTansu::start().await;
        let brokers = tansu.brokers();
        create_topic_on(&brokers, &self.name, self.kafka.partitions).await;
        create_topic_on(&brokers, &format!("{}.dlq", self.name), 1).await;
        // The producer's connections cross the proxy too: a request lost in a black hole is
        // given up after 3 s and sent again, well within the minute a send may take.
        let producer = Kafka {
            delivery_timeout: self.kafka.delivery_timeout.max(Duration::from_secs(60)),
            ..self.kafka
        }
        .producer_builder(&brokers)
        .set("socket.timeout.ms", "3000")
        .connect()
        .await
        .expect("producer");
        let mut twin = self.kafka.topic(&self.name, brokers, producer);
        twin.private = Some(tansu);
        Some(twin)
    }

    async fn restartable(&self) -> Result<Restartable<Topic>, String> {
        Err(
            "the Tansu built here keeps topics in memory only, so a restart would lose them \
             (inbox-kafka's tests/it/mock_cluster.rs restarts librdkafka's mock brokers)"
                .into(),
        )
    }

    /// Offsets acked on receipt and committed every 5 s: `enable.auto.commit` with its default
    /// `auto.commit.interval.ms`.
    #[cfg(feature = "at-most-once")]
    async fn at_most_once_source(&self, member: &str) -> inbox_testkit::AckOnReceive<Member> {
        let source = self.builder(member).commit_interval(Duration::from_secs(5));
        inbox_testkit::AckOnReceive::new(connect(source).await)
    }

    fn redelivery_delay(&self) -> Duration {
        // The session timeout for the broker to notice, as much again for the rebalance.
        self.kafka.session_timeout * 2
    }

    async fn producer(&self) -> Arc<dyn DynPublish> {
        Arc::new(self.kafka.producer(&self.brokers).await)
    }

    async fn left(&self) -> u64 {
        // Per partition, the records after the group's committed offset (all of them before
        // its first commit).
        let (topic, group) = (self.name.clone(), self.group.clone());
        let (brokers, partitions) = (self.brokers.clone(), self.kafka.partitions);
        let lag = tokio::task::spawn_blocking(move || lag_on(&brokers, &topic, &group, partitions))
            .await
            .expect("lag task");
        u64::try_from(lag).unwrap_or(0)
    }

    async fn dead_letter_reader(&self) -> Option<Box<dyn inbox_core::replay::DynDeadLetters>> {
        let reader = KafkaConnection::new(&self.brokers).dead_letters(format!("{}.dlq", self.name));
        crate::connected_reader(reader.connect().await)
    }

    async fn cleanup(&self) {
        // Left on the broker (Tansu keeps them in memory): deleting them made librdkafka 2.12
        // crash now and then (SIGSEGV in `rd_kafka_metadata_cache_find`, on its main thread,
        // when a metadata update follows the deletion).
    }

    fn python_target(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({"broker": "kafka", "brokers": self.brokers, "topic": self.name}))
    }

    async fn source_reading(&self, member: &str, from: inbox_core::IdFrom) -> Option<Member> {
        Some(connect(self.builder(member).id_from(from)).await)
    }
}
