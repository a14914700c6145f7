//! Delayed redelivery (a paused partition) under rebalances, on librdkafka's mock cluster:
//! - a redelivery schedule runs to its end and parks the poison record even when members join
//!   and leave faster than the schedule lasts: the redelivery count is committed with the
//!   partition's offset, so the partition's next owner (or this one again) goes on from it;
//! - a redelivery of a delivery received before a rebalance leaves the partition alone: the new
//!   generation keeps reading.

use crate::mock;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use inbox_core::{
    Ack, Consumer, Delivery, Handler, HandlerError, Message, MessageId, MessageSource,
    OutgoingMessage, Publish, RetryPolicy,
};
use inbox_kafka::rdkafka::config::ClientConfig;
use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use inbox_kafka::rdkafka::message::Headers;
use inbox_kafka::rdkafka::{Message as _, Offset, TopicPartitionList};
use inbox_kafka::{KafkaAck, KafkaConnection, KafkaSource};
use inbox_testkit::{MemoryStore, MemoryTx};
use mock::{cluster, evt, producer};

/// A member of group `topic` on `topic`, quick to notice a rebalance.
async fn member(brokers: &str, topic: &str) -> KafkaSource {
    KafkaConnection::new(brokers)
        .source([topic], topic)
        .poll_timeout(Duration::from_millis(200))
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "300")
        .connect()
        .await
        .expect("source")
}

/// Records the IDs applied; `evt-<poison>` always fails, and each failure is counted.
struct Ledger {
    poison: MessageId,
    failures: &'static AtomicU32,
}

impl Handler<MemoryTx<Vec<String>>> for Ledger {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Vec<String>>,
        id: &MessageId,
        _message: &Message,
    ) -> Result<(), HandlerError> {
        if *id == self.poison {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::transient("the record cannot be applied"));
        }
        tx.state_mut().push(id.to_string());
        Ok(())
    }
}

/// The dead letters parked on `topic` so far, as their `reason` headers.
fn dead_letters(brokers: &str, topic: &str) -> Vec<String> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "dead-letter-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, 0, Offset::Beginning)
        .expect("partition");
    reader.assign(&list).expect("assign");
    let (_, end) = reader
        .fetch_watermarks(topic, 0, Duration::from_secs(5))
        .expect("watermarks");
    let mut reasons = Vec::new();
    while (reasons.len() as i64) < end {
        let Some(record) = reader.poll(Duration::from_secs(5)) else {
            break;
        };
        let record = record.expect("dead letter");
        let reason = record
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "reason"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        reasons.push(reason);
    }
    reasons
}

/// One partition, the record `evt-5` failing always among nine healthy ones, a schedule of three
/// 3 s redeliveries (9 s), and a second member joining, staying 6 s and leaving, again and again:
/// two rebalances every 6.5 s, so most redeliveries' pauses are cut by one, and without the count
/// in the commit the schedule starts again every time (tried: 47 failures and nothing parked in
/// 2 minutes). The poison record is parked after its three redeliveries, no sooner than the
/// schedule lasts, and each healthy record is applied once.
///
/// The mock cluster refuses every offset commit while a rebalance is in progress (Kafka takes
/// them until the group waits for its members' sync): a second member that handed the record
/// back and left mid-rebalance takes its count with it, and a delivery cut by a revoke between
/// two attempts counts nothing, so the record fails 8 to 12 times before it is parked (about
/// 20 s here). The first member keeps the counts of a partition it gave up, for when the
/// partition comes back with an older count. A member that stays less than a join lasts (about
/// 5 s on the mock) keeps the group rebalancing nearly all the time, and then no member reads
/// the partition long enough for the schedule to go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_survives_members_joining_and_leaving_faster_than_it_lasts() {
    static FAILURES: AtomicU32 = AtomicU32::new(0);
    const SCHEDULE: [Duration; 3] = [Duration::from_secs(3); 3];
    let (_mock, brokers) = cluster(1, "churn", 1);
    let producer = producer(&brokers).await;
    for i in 0..10 {
        producer
            .send_to("churn", Some(0), &OutgoingMessage::new(evt(i), "{}"))
            .await
            .expect("produce");
    }
    let store = MemoryStore::<Vec<String>>::new();
    let policy = || {
        RetryPolicy::default()
            .max_attempts(2)
            .backoff(Duration::from_millis(20), Duration::from_millis(20))
            .redeliver_after(SCHEDULE)
    };
    let consumer = |source| {
        Consumer::new(
            "ledger",
            source,
            store.clone(),
            Ledger {
                poison: evt(5),
                failures: &FAILURES,
            },
        )
        .batch_size(10)
        .retry(policy())
    };

    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    let stop_brokers = brokers.clone();
    let first = tokio::spawn(
        consumer(member(&brokers, "churn").await).run_until(async move {
            while tokio::task::spawn_blocking({
                let brokers = stop_brokers.clone();
                move || dead_letters(&brokers, "churn.dlq").is_empty()
            })
            .await
            .expect("reader")
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }),
    );
    // Wait for the first failure, then churn until the first member stops.
    while FAILURES.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the poison record never failed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let failed_at = Instant::now();
    let mut churns = 0;
    while !first.is_finished() {
        consumer(member(&brokers, "churn").await)
            .run_until(tokio::time::sleep(Duration::from_millis(6000)))
            .await
            .expect("the second member stops cleanly");
        churns += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let stats = first
        .await
        .expect("task")
        .expect("the first member stops cleanly");
    let parked_after = failed_at.elapsed();
    let reasons = dead_letters(&brokers, "churn.dlq");
    println!(
        "first member {stats:?}; {churns} joins and leaves; {} failures; parked after \
         {parked_after:?}: {reasons:?}",
        FAILURES.load(Ordering::SeqCst)
    );
    assert_eq!(
        reasons.len(),
        1,
        "the poison record is parked once, within 120 s"
    );
    assert!(
        reasons[0].contains("after 3 delayed redeliveries"),
        "parked at the end of the schedule: {}",
        reasons[0]
    );
    assert!(
        parked_after >= SCHEDULE.iter().sum::<Duration>(),
        "no sooner than the schedule lasts"
    );
    let mut ledger = store.state().await;
    ledger.sort();
    let healthy: Vec<String> = (0..10)
        .filter(|&i| i != 5)
        .map(|i| format!("evt-{i}"))
        .collect();
    let mut expected = healthy.clone();
    expected.sort();
    assert_eq!(ledger, expected, "every healthy record applied once");
}

/// The next deliveries from `source` until one of offset `offset` comes, within `wait`.
async fn delivery_at(
    source: &mut KafkaSource,
    offset: i64,
    wait: Duration,
) -> Option<Delivery<KafkaAck>> {
    let deadline = Instant::now() + wait;
    let position = format!("partition 0 offset {offset}");
    while Instant::now() < deadline {
        for delivery in source.receive(10).await.expect("receive") {
            if delivery.message.meta.position == position {
                return Some(delivery);
            }
        }
    }
    None
}

/// A delivery received before a second member joined and left is redelivered with a long delay
/// after the partition came back to its member under a new generation: the partition is not
/// paused, so the record produced next is received at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_redelivery_leaves_the_new_generation_reading() {
    let (_mock, brokers) = cluster(1, "stale", 1);
    let producer = producer(&brokers).await;
    producer.send("stale", b"0").await.expect("produce");
    let mut first = member(&brokers, "stale").await;
    let old = delivery_at(&mut first, 0, Duration::from_secs(30))
        .await
        .expect("the first record");

    // A second member joins and leaves while the first keeps polling.
    let second = tokio::spawn({
        let brokers = brokers.clone();
        async move {
            let mut second = member(&brokers, "stale").await;
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until {
                drop(second.receive(10).await.expect("receive"));
            }
        }
    });
    let mut current = None;
    let deadline = Instant::now() + Duration::from_secs(40);
    while !(second.is_finished()
        && old.ack.is_stale()
        && current
            .as_ref()
            .is_some_and(|d: &Delivery<KafkaAck>| !d.ack.is_stale()))
    {
        assert!(
            Instant::now() < deadline,
            "the partition never came back to the first member"
        );
        if let Some(again) = delivery_at(&mut first, 0, Duration::from_millis(500)).await {
            current = Some(again);
        }
    }
    let current = current.expect("read again");

    old.ack
        .redeliver(&old.message, Duration::from_secs(60), 0)
        .await
        .expect("a stale redelivery is no error");
    current.ack.ack().await.expect("ack");
    producer.send("stale", b"1").await.expect("produce");
    let next = delivery_at(&mut first, 1, Duration::from_secs(15)).await;
    assert!(
        next.is_some(),
        "the record after it was not received: the stale redelivery paused the partition"
    );
}
