//! The conformance suite (`inbox-conformance`) on a real Kafka-protocol broker.

mod common;

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::{async_trait, DeadLetter, LosingSource, Proxied, TestBroker, TestQueue};
use inbox_core::dead_letter::REASON;
use inbox_core::{Delivery, MessageSource, Publish, SourceError};
use inbox_kafka::rdkafka::consumer::Consumer as _;
use inbox_kafka::rdkafka::Message as _;
use inbox_kafka::{KafkaAck, KafkaProducer, KafkaSource, KafkaSourceBuilder, Record};

const PARTITIONS: i32 = 2;

/// How long a member without partitions keeps polling before it reports an empty batch.
const ASSIGNMENT_WAIT: Duration = Duration::from_secs(15);

struct Kafka;

/// A topic of its own with two partitions, so that two members of its group each own one; its
/// dead letters go to `<topic>.dlq`.
struct Topic {
    name: String,
    group: String,
    producer: KafkaProducer,
    /// The partition of the next send: round robin, so that two sends of one ID in a row land
    /// on different partitions.
    next: AtomicI32,
}

#[async_trait]
impl TestBroker for Kafka {
    type Queue = Topic;
    async fn queue(&self, scenario: &str) -> Topic {
        init_tracing();
        let name = random(&format!("inbox-conformance-{scenario}"));
        create_topic(&name, PARTITIONS).await;
        create_topic(&format!("{name}.dlq"), 1).await;
        self.attach(&name).await
    }

    async fn attach(&self, name: &str) -> Topic {
        Topic {
            group: format!("{name}-group"),
            name: name.to_owned(),
            producer: producer().await,
            next: AtomicI32::new(0),
        }
    }
}

/// The adapter's source, except that a receive does not come back empty while the member owns
/// no partition: before its group join completes, or between a rebalance's revoke and assign.
/// On Tansu the join of a second member takes seconds, longer than a poll; without this the
/// member's `run_until_idle` returned before it was given a partition, and the other member
/// read both.
struct Member(KafkaSource);

impl Member {
    /// The partitions this member owns.
    fn assignment(&self) -> Vec<i32> {
        self.0.consumer().assignment().map_or_else(
            |_| Vec::new(),
            |list| list.elements().iter().map(|e| e.partition()).collect(),
        )
    }
}

#[async_trait]
impl MessageSource for Member {
    type Ack = KafkaAck;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<KafkaAck>>, SourceError> {
        let deadline = Instant::now() + ASSIGNMENT_WAIT;
        loop {
            let before = self.assignment();
            // Cancel safe: only the adapter's own (cancel-safe) receive is awaited.
            let batch = self.0.receive(max).await?;
            // Empty is idle only after a whole poll with the same partitions: one assigned
            // during the poll may not have been fetched yet.
            let settled = !before.is_empty() && before == self.assignment();
            if !batch.is_empty() || settled || Instant::now() > deadline {
                return Ok(batch);
            }
        }
    }

    fn redelivery_window(&self) -> Option<Duration> {
        self.0.redelivery_window()
    }

    fn system(&self) -> &'static str {
        self.0.system()
    }

    fn capabilities(&self) -> inbox_core::Capabilities {
        self.0.capabilities()
    }
}

impl Topic {
    /// The settings of `member`'s source.
    fn builder(&self, member: &str) -> KafkaSourceBuilder {
        // librdkafka keeps one fetch in flight per broker, and the broker holds a fetch that
        // finds nothing for `fetch.wait.max.ms` (default 500 ms), so a partition whose start is
        // still being looked up (no committed offset) is read only by the next fetch. With a
        // poll as long as that wait, `run_until_idle` went idle before reading it: after the
        // crash at `Acked` one partition was committed and the other not, and every restart read
        // the first and stopped. Hence a 100 ms wait under a 500 ms poll, and a 200 ms heartbeat
        // so that a member sees the rebalance of a second member's join sooner.
        config(&self.name, &self.group)
            .poll_timeout(Duration::from_millis(500))
            .set_consumer("fetch.wait.max.ms", "100")
            .set_consumer("heartbeat.interval.ms", "200")
            .set_consumer("client.id", member)
            .commit_interval(Duration::from_millis(50))
    }
}

#[async_trait]
impl TestQueue for Topic {
    type Source = Member;

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let partition = self.next.fetch_add(1, Ordering::Relaxed) % PARTITIONS;
        // The raw header, not `Record::id`, which takes only a valid ID.
        let mut record = Record::new(payload).without_id().partition(partition);
        if let Some(id) = id {
            record = record.header("event_id", id);
        }
        self.producer
            .send_record(&self.name, record)
            .await
            .expect("produce");
    }

    async fn source(&self, member: &str) -> Member {
        Member(self.builder(member).connect().await.expect("kafka source"))
    }

    async fn losing_source(&self, member: &str) -> Option<LosingSource<Member>> {
        // A member that does not poll for `max.poll.interval.ms` leaves the group, and the
        // rebalance hands its partitions to the other member, which reads from the last
        // committed offset.
        let source = self
            .builder(member)
            .set_consumer("session.timeout.ms", "3000")
            .set_consumer("max.poll.interval.ms", "3000")
            .connect()
            .await
            .expect("kafka source");
        Some(LosingSource {
            source: Member(source),
            stall: Duration::from_secs(10),
        })
    }

    async fn proxied_source(&self, _member: &str) -> Option<Proxied<Member>> {
        // A Kafka client connects to the address the broker advertises, not the one it was
        // given: a proxy in front of the shared broker would carry only the bootstrap.
        // tests/network_faults.rs runs a broker of its own, advertising its proxy.
        None
    }

    async fn producer(&self) -> Arc<dyn Publish> {
        Arc::new(producer().await)
    }

    fn destination(&self) -> String {
        self.name.clone()
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        read_all(&format!("{}.dlq", self.name))
            .await
            .iter()
            .map(|letter| DeadLetter {
                payload: letter.payload().unwrap_or_default().to_vec(),
                reason: header(letter, REASON)
                    .map(|r| String::from_utf8_lossy(r).into_owned())
                    .unwrap_or_default(),
            })
            .collect()
    }

    async fn left(&self) -> u64 {
        // Per partition, the records after the group's committed offset (all of them before
        // its first commit).
        let (topic, group) = (self.name.clone(), self.group.clone());
        let lag = tokio::task::spawn_blocking(move || lag(&topic, &group, PARTITIONS))
            .await
            .expect("lag task");
        u64::try_from(lag).unwrap_or(0)
    }

    async fn cleanup(&self) {
        // Left on the broker (Tansu keeps them in memory): deleting them made librdkafka 2.12
        // crash now and then (SIGSEGV in `rd_kafka_metadata_cache_find`, on its main thread,
        // when a metadata update follows the deletion).
    }
}

inbox_conformance::suite!(Kafka);
