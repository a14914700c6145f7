//! What the broker the services start cannot show, on librdkafka's built-in mock cluster (a
//! Kafka-protocol server inside the test process; the client is the real one):
//! - offset commits refused because the partition moved are logged, not fatal, whether the
//!   commit task or an ack (with a zero commit interval) meets them (errors injected on cue);
//! - a dead letter whose produce is refused hands its record back (errors injected on cue);
//! - records sought back within one generation queue behind their first copies, and a second
//!   copy in one chunk never commits the offset past a first copy that failed;
//! - a consumer restarting from a commit inside a producer's record batch reads on from that
//!   offset. Tansu 0.6 serves such a fetch from the next batch on, skipping the rest of the
//!   batch, which is why the wallet publishes one record per batch there.

use crate::mock;

use std::time::Duration;

use inbox_conformance::kafka::send_raw;
use inbox_core::{
    Ack, Consumer, Delivery, Handler, HandlerError, Message, MessageId, MessageSource,
    OutgoingMessage, Publish, StatsSnapshot,
};
use inbox_kafka::rdkafka::consumer::Consumer as _;
use inbox_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use inbox_kafka::{KafkaAck, KafkaConnection, KafkaSource, KafkaSourceBuilder, OffsetCommits};
use inbox_testkit::{MemoryStore, MemoryTx};
use mock::{cluster, evt, producer};

/// Adds each message's number to the state, after `0` of pretend work.
struct Sum(Duration);

impl Handler<MemoryTx<i64>> for Sum {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        tokio::time::sleep(self.0).await;
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}

/// 30 records over 3 partitions, the first three offset commits refused as when the partitions
/// moved; the consumer commits every `commit_interval`.
async fn consume_with_refused_commits(commit_interval: Duration) -> (StatsSnapshot, OffsetCommits) {
    let (mock, brokers) = cluster(1, "credits", 3);
    let producer = producer(&brokers).await;
    for i in 1..=30i64 {
        let credit = OutgoingMessage::generate(i.to_string());
        producer
            .send_to("credits", Some((i % 3) as i32), &credit)
            .await
            .expect("produce");
    }
    mock.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION,
        ],
    );

    let store = MemoryStore::<i64>::new();
    let source = KafkaConnection::new(&brokers)
        .source(["credits"], "wallet")
        .poll_timeout(Duration::from_millis(500))
        .commit_interval(commit_interval)
        // A refused commit makes the member rejoin; the mock coordinator waits for the old
        // member's session to end first.
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("max.poll.interval.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "500")
        .connect()
        .await
        .expect("source");
    let commits = source.offset_commits();
    let consumer =
        Consumer::new("wallet", source, store.clone(), Sum(Duration::ZERO)).batch_size(5);
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run_until(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while stats.snapshot().applied < 30 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Let the re-read copies of the batches whose commit was refused come back.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }));
    let stats = run
        .await
        .expect("task")
        .expect("the consumer keeps running");
    println!("mock cluster with refused commits, commit interval {commit_interval:?}: {stats:?} {commits:?}");
    assert_eq!(stats.applied, 30);
    assert_eq!(store.state().await, (1..=30).sum::<i64>());
    assert_eq!(stats.errors, 0);
    (stats, commits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_refused_by_a_rebalance_are_not_fatal() {
    let (_, commits) =
        consume_with_refused_commits(KafkaSourceBuilder::DEFAULT_COMMIT_INTERVAL).await;
    assert!(
        commits.failed() >= 1,
        "the commit task met the refusals: {commits:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_refused_by_a_rebalance_are_not_ack_failures() {
    let (stats, commits) = consume_with_refused_commits(Duration::ZERO).await;
    assert!(
        commits.failed() >= 1,
        "the acks met the refusals: {commits:?}"
    );
    assert_eq!(
        stats.ack_failures, 0,
        "moved-partition commit errors are logged, not failures"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_inside_a_record_batch_resumes_at_the_committed_offset() {
    let (_mock, brokers) = cluster(1, "credits", 1);
    // Sent together with a linger, the 60 records travel in a few multi-record batches.
    let producer = KafkaConnection::new(&brokers)
        .producer()
        .set("linger.ms", "100")
        .connect()
        .await
        .expect("producer");
    let credits: Vec<OutgoingMessage> = (1..=60i64)
        .map(|i| OutgoingMessage::generate(i.to_string()))
        .collect();
    producer
        .send_batch("credits", &credits)
        .await
        .expect("produce");

    let store = MemoryStore::<i64>::new();
    let config = KafkaConnection::new(&brokers)
        .source(["credits"], "wallet")
        .poll_timeout(Duration::from_millis(300))
        // The mock coordinator hands the partition on once the first member's session ends.
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "500");
    // The first consumer stops after a few batches of 7: its last commit lies inside a batch.
    let first = Consumer::new(
        "wallet",
        config.clone().connect().await.expect("source"),
        store.clone(),
        Sum(Duration::from_millis(5)),
    )
    .batch_size(7);
    let stats = first.stats();
    let first = first
        .run_until(async move {
            while stats.snapshot().applied < 20 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("first consumer");
    assert!(
        first.applied < 60,
        "the first consumer must stop early: {first:?}"
    );

    let second = Consumer::new(
        "wallet",
        config.connect().await.expect("source"),
        store.clone(),
        Sum(Duration::from_millis(5)),
    )
    .batch_size(7);
    let stats = second.stats();
    let rest = 60 - first.applied;
    let second = second
        .run_until(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while stats.snapshot().applied < rest && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Anything read twice or past the end would show up now.
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
        .await
        .expect("second consumer");
    println!("first {first:?}\nsecond {second:?}");
    assert_eq!(
        first.applied + second.applied,
        60,
        "every record applied once, none skipped"
    );
    assert_eq!(
        second.skipped_duplicates, 0,
        "the second consumer starts at the commit"
    );
    assert_eq!(store.state().await, (1..=60).sum::<i64>());
}

/// Every broker of the cluster down for 3 s mid-stream, then up again with its log kept, as in
/// a restart of a durable cluster: connections refused, the coordinator gone, commits failing.
/// Half the records are produced before, half after; the consumer recovers by itself (it
/// applies records produced after the restart); what it reads again is skipped by the inbox, so
/// the sum is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_stream_loses_nothing_and_applies_nothing_twice() {
    let (mock, brokers) = cluster(3, "credits", 3);
    let producer = producer(&brokers).await;
    let (half, total) = (150i64, 300i64);
    let produce = |range: std::ops::RangeInclusive<i64>| {
        let producer = &producer;
        async move {
            for i in range {
                let credit = OutgoingMessage::generate(i.to_string());
                producer
                    .send_to("credits", Some((i % 3) as i32), &credit)
                    .await
                    .expect("produce");
            }
        }
    };
    produce(1..=half).await;

    let store = MemoryStore::<i64>::new();
    let source = KafkaConnection::new(&brokers)
        .source(["credits"], "wallet")
        .poll_timeout(Duration::from_millis(300))
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "500")
        .connect()
        .await
        .expect("source");
    let consumer = Consumer::new(
        "wallet",
        source,
        store.clone(),
        Sum(Duration::from_millis(5)),
    )
    .batch_size(10);
    let stats = consumer.stats();
    let watch = stats.clone();
    let run = tokio::spawn(consumer.run_until(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while watch.snapshot().applied < total as u64 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Anything read again after the restart would show up now.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }));

    while stats.snapshot().applied < 100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at_restart = stats.snapshot().applied;
    for broker in 1..=3 {
        mock.broker_down(broker).expect("broker down");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    for broker in 1..=3 {
        mock.broker_up(broker).expect("broker up");
    }
    let back = std::time::Instant::now();
    let resumed = stats.snapshot().applied;
    produce(half + 1..=total).await;
    let mut recovered = None;
    while recovered.is_none() && back.elapsed() < Duration::from_secs(60) {
        if stats.snapshot().applied > half as u64 {
            recovered = Some(back.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = run
        .await
        .expect("task")
        .expect("the consumer keeps running");
    println!(
        "brokers down 3 s after {at_restart} applied ({resumed} when they came back): {stats:?}; \
         applying records produced after the restart {recovered:?} after they came back"
    );
    assert!(recovered.is_some(), "the consumer recovered by itself");
    assert_eq!(stats.applied, total as u64, "every record applied once");
    assert_eq!(store.state().await, (1..=total).sum::<i64>());
    assert_eq!(stats.dead_lettered, 0);
}

/// The next delivery from `source`, within 30 s.
async fn next_delivery(source: &mut KafkaSource) -> Delivery<KafkaAck> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let batch = source.receive(1).await.expect("receive");
        if let Some(delivery) = batch.into_iter().next() {
            return delivery;
        }
        assert!(tokio::time::Instant::now() < deadline, "nothing received");
    }
}

/// A dead letter whose produce the broker refuses seeks the partition back, as a nack does: the
/// record comes again (and is parked on the next try) instead of its partition stalling behind
/// an offset that is never finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_whose_produce_fails_hands_the_record_back() {
    let (mock, brokers) = cluster(1, "parked", 1);
    producer(&brokers)
        .await
        .send("parked", b"1")
        .await
        .expect("produce");
    let mut source = KafkaConnection::new(&brokers)
        .source(["parked"], "wallet")
        .poll_timeout(Duration::from_millis(300))
        .connect()
        .await
        .expect("source");

    let first = next_delivery(&mut source).await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let e = first
        .ack
        .dead_letter(&first.message, "test: cannot be applied")
        .await
        .expect_err("the broker refuses the dead letter");
    println!("failed dead letter: {e}");
    mock.clear_request_errors(RDKafkaApiKey::Produce);

    let again = next_delivery(&mut source).await;
    assert_eq!(again.message.meta.position, first.message.meta.position);
    assert_eq!(again.message.meta.delivery_count, Some(2));
    again
        .ack
        .dead_letter(&again.message, "test: cannot be applied")
        .await
        .expect("parked on the next try");
    let (_, parked) = source
        .consumer()
        .fetch_watermarks("parked.dlq", 0, Duration::from_secs(5))
        .expect("watermarks");
    assert_eq!(parked, 1, "one dead letter");
}

/// Records the IDs applied; `bad` fails while `failures` lasts, and says so on `failed` each time;
/// every message takes `work`, so a chunk keeps its lane busy while more arrive.
struct Ledger {
    bad: MessageId,
    failures: std::sync::atomic::AtomicU32,
    failed: tokio::sync::mpsc::UnboundedSender<()>,
    work: Duration,
}

impl Ledger {
    /// Fails `bad` `failures` times; the receiver hears of each failure.
    fn failing(
        bad: &str,
        failures: u32,
        work: Duration,
    ) -> (Self, tokio::sync::mpsc::UnboundedReceiver<()>) {
        let (failed, heard) = tokio::sync::mpsc::unbounded_channel();
        let ledger = Self {
            bad: MessageId::new(bad).expect("id"),
            failures: failures.into(),
            failed,
            work,
        };
        (ledger, heard)
    }

    /// Applies everything.
    fn working(work: Duration) -> Self {
        Self::failing("none", 0, work).0
    }
}

impl Handler<MemoryTx<Vec<String>>> for Ledger {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Vec<String>>,
        id: &MessageId,
        _message: &Message,
    ) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering;
        tokio::time::sleep(self.work).await;
        if *id == self.bad
            && self
                .failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            let _ = self.failed.send(());
            return Err(HandlerError::transient("the downstream is down"));
        }
        tx.state_mut().push(id.to_string());
        Ok(())
    }
}

/// A member of group `topic` on `topic`.
async fn member(brokers: &str, topic: &str) -> KafkaSource {
    KafkaConnection::new(brokers)
        .source([topic], topic)
        .poll_timeout(Duration::from_millis(200))
        // The mock coordinator hands partitions on once a member's session ends.
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "500")
        .connect()
        .await
        .expect("source")
}

/// Retries far enough apart that a stop always comes during the wait.
fn retry_later() -> inbox_core::RetryPolicy {
    inbox_core::RetryPolicy::default()
        .max_attempts(5)
        .backoff(Duration::from_secs(30), Duration::from_secs(30))
}

/// A restarted member of `topic` applying everything over `lanes`, until `done` holds of the
/// ledger (30 s at most), then 1 s more for anything read twice to show up.
async fn restart(
    brokers: &str,
    topic: &str,
    lanes: usize,
    store: &MemoryStore<Vec<String>>,
    done: impl Fn(&[String]) -> bool + Send + Sync + 'static,
) -> StatsSnapshot {
    let ledger = store.clone();
    let stats = Consumer::new(
        "ledger",
        member(brokers, topic).await,
        store.clone(),
        Ledger::working(Duration::ZERO),
    )
    .batch_size(50)
    .parallel_lanes(lanes)
    .run_until(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !done(&ledger.state().await) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    })
    .await
    .expect("the restarted member stops cleanly");
    println!("after the restart: {stats:?}");
    stats
}

/// `ledger` holds `count` IDs, `must` among them, none twice.
fn assert_each_once(ledger: &[String], count: usize, must: &str, lost: &str) {
    let mut distinct = ledger.to_vec();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), ledger.len(), "nothing applied twice");
    assert!(ledger.iter().any(|id| id == must), "{lost}");
    assert_eq!(ledger.len(), count, "every record with an ID applied once");
}

/// One partition read twice in one generation: a dead letter whose produce fails seeks the
/// partition back while later records wait in their lane (lanes 4, batch 50), so their second
/// copies queue behind their first and one chunk holds both. A record of that chunk fails twice
/// and the consumer stops during its retry: its second copy must go back with it, not commit the
/// offset past it. After a restart the record is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_read_twice_in_one_chunk_is_not_committed_past_its_failed_first_copy() {
    let (mock, brokers) = cluster(1, "ledger", 1);
    let producer = producer(&brokers).await;
    // Offsets 0..60; offset 49, the last of the first chunk, has no ID; offset 52 fails twice.
    for i in 0..60 {
        if i == 49 {
            send_raw(&producer, "ledger", None, None, &[], b"{}").await;
        } else {
            producer
                .send_with_id("ledger", &evt(i), b"{}")
                .await
                .expect("produce");
        }
    }
    let store = MemoryStore::<Vec<String>>::new();
    // The first chunk takes 1.5 s: the records sought back arrive meanwhile.
    let (handler, mut failed) = Ledger::failing("evt-52", 2, Duration::from_millis(30));
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let stats = Consumer::new(
        "ledger",
        member(&brokers, "ledger").await,
        store.clone(),
        handler,
    )
    .batch_size(50)
    .parallel_lanes(4)
    .retry(retry_later())
    .run_until(async move {
        // Stopped while evt-52 waits for its third try.
        for _ in 0..2 {
            failed.recv().await;
        }
    })
    .await
    .expect("the first consumer stops cleanly");
    println!("first consumer: {stats:?}");
    assert!(
        !store.state().await.contains(&"evt-52".to_owned()),
        "evt-52 failed until the stop"
    );

    restart(&brokers, "ledger", 1, &store, |ledger| {
        ledger.iter().any(|id| id == "evt-52")
    })
    .await;
    assert_each_once(
        &store.state().await,
        59,
        "evt-52",
        "evt-52 was lost: its second copy committed the offset past its first",
    );
}

/// A rebalance under lanes 4 and batch 50: a second member joining revokes the first member's
/// partitions (on the mock cluster they come back to it before the second gets any), so records
/// it still holds go stale and are read again behind themselves. One record fails twice and the
/// first member stops during its retry; after a restart every record is in the ledger once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_read_again_after_a_member_joins_and_leaves_are_each_applied_once() {
    let (_mock, brokers) = cluster(1, "moves", 4);
    let producer = producer(&brokers).await;
    const RECORDS: usize = 400;
    for i in 0..RECORDS as i32 {
        let record = OutgoingMessage::new(evt(i), "{}");
        producer
            .send_to("moves", Some(i % 4), &record)
            .await
            .expect("produce");
    }
    let store = MemoryStore::<Vec<String>>::new();

    // The first member: evt-201 (partition 1, offset 50) fails twice; it stops during the
    // retry that follows, or after 60 s.
    let (handler, mut failed) = Ledger::failing("evt-201", 2, Duration::from_millis(20));
    let first = Consumer::new(
        "ledger",
        member(&brokers, "moves").await,
        store.clone(),
        handler,
    )
    .batch_size(50)
    .parallel_lanes(4)
    .retry(retry_later());
    let applied = first.stats();
    let first = tokio::spawn(first.run_until(async move {
        let deadline = tokio::time::sleep(Duration::from_secs(60));
        tokio::pin!(deadline);
        for _ in 0..2 {
            tokio::select! {
                _ = failed.recv() => {}
                () = &mut deadline => return,
            }
        }
    }));

    // A second member joins once the first has applied some, and leaves 4 s after.
    while applied.snapshot().applied < 20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = Consumer::new(
        "ledger",
        member(&brokers, "moves").await,
        store.clone(),
        Ledger::working(Duration::from_millis(20)),
    )
    .batch_size(50)
    .parallel_lanes(4)
    .run_until(tokio::time::sleep(Duration::from_secs(4)))
    .await
    .expect("the second member stops cleanly");
    let first = first
        .await
        .expect("task")
        .expect("the first member stops cleanly");
    println!("first member: {first:?}\nsecond member: {second:?}");

    restart(&brokers, "moves", 4, &store, |ledger| {
        ledger.len() >= RECORDS
    })
    .await;
    assert_each_once(
        &store.state().await,
        RECORDS,
        "evt-201",
        "evt-201 was lost: a copy read again committed the offset past it",
    );
}
