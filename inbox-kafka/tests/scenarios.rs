//! The foundation's scenarios over a real Kafka-protocol broker and a real PostgreSQL: each test
//! makes its own topic (several partitions), group and schema.

mod common;

use std::time::Duration;

use common::*;
use inbox_core::testkit::crash_at;
use inbox_core::{Consumer, Error, MessageId, Stage};
use inbox_kafka::rdkafka::Message as _;
use inbox_kafka::{AckMode, Record, Retention, REASON_HEADER};
use inbox_postgres::testkit::wallet::{self, Credit, CreditEvent};
use inbox_postgres::testkit::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_produced_twice_is_credited_once() {
    let topic = topic(3).await;
    let group = random("group");
    let db = TestDb::new().await;
    let id = MessageId::generate();
    let event = CreditEvent::new(1, 100);
    let producer = producer();
    for partition in [0, 0] {
        let record = Record::new(event.to_json())
            .id(id.clone())
            .partition(partition);
        producer.send(&topic, record).await.expect("produce");
    }

    let consumer = Running::start(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
        10,
    );
    let stats = consumer.stats.clone();
    assert!(
        eventually(|| async { stats.snapshot().skipped_duplicates >= 1 }).await,
        "second copy never seen"
    );
    let stats = consumer.stop().await.expect("consumer");
    let summary = summary(&db.pool).await;
    let lag = wait_for_no_lag(&topic, &group, 3).await;
    println!("double delivery: {stats:?} {summary:?} lag={lag}");
    assert_eq!(summary.ledger_rows, 1);
    assert_eq!(wallet::balance(&db.pool, 1).await, 100);
    assert_eq!(stats.applied, 1);
    assert_eq!(stats.skipped_duplicates, 1);
    assert_eq!(lag, 0, "both copies are committed");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_commit_and_ack_is_redelivered_and_skipped() {
    let topic = topic(3).await;
    let group = random("group");
    let db = TestDb::new().await;
    let total = produce_credits(&topic, 12, 3).await;

    // Dies right after the first database commit, before any offset commit.
    let first = Consumer::new(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
    )
    .batch_size(4)
    .on_stage(crash_at(Stage::Committed));
    let crashed = Running::spawn(first).join().await;
    assert!(matches!(crashed, Err(Error::Crashed { .. })), "{crashed:?}");
    let after_crash = summary(&db.pool).await;
    assert!(after_crash.ledger_rows >= 1);

    let second = Running::start(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
        4,
    );
    assert!(
        wait_for_events(&db.pool, 12).await,
        "not all events applied"
    );
    let lag = wait_for_no_lag(&topic, &group, 3).await;
    let stats = second.stop().await.expect("consumer");
    let summary = summary(&db.pool).await;
    println!("crash after commit: before restart {after_crash:?}; restarted {stats:?} {summary:?} lag={lag}");
    assert!(
        stats.skipped_duplicates >= after_crash.ledger_rows as u64,
        "the committed batch came back and was skipped"
    );
    assert_eq!(summary.ledger_rows, 12);
    assert_eq!(summary.distinct_events, 12);
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(lag, 0);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_consumers_credit_an_id_on_two_partitions_once() {
    let topic = topic(2).await;
    let group = random("group");
    let db = TestDb::new().await;
    let a = Running::start(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
        10,
    );
    let b = Running::start(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
        10,
    );
    // Let the group settle so that each member owns one partition.
    tokio::time::sleep(Duration::from_secs(4)).await;

    let id = MessageId::generate();
    let producer = producer();
    for partition in [0, 1] {
        let record = Record::new(CreditEvent::new(9, 100).to_json())
            .id(id.clone())
            .partition(partition);
        producer.send(&topic, record).await.expect("produce");
    }
    let (sa, sb) = (a.stats.clone(), b.stats.clone());
    let seen = eventually(|| async {
        let (x, y) = (sa.snapshot(), sb.snapshot());
        x.applied + y.applied + x.skipped_duplicates + y.skipped_duplicates >= 2
    })
    .await;
    assert!(seen, "both copies were not handled");
    let lag = wait_for_no_lag(&topic, &group, 2).await;
    let (sa, sb) = (a.stop().await.expect("a"), b.stop().await.expect("b"));
    let summary = summary(&db.pool).await;
    println!("racing: a={sa:?} b={sb:?} {summary:?} lag={lag}");
    assert_eq!(summary.ledger_rows, 1);
    assert_eq!(wallet::balance(&db.pool, 9).await, 100);
    assert_eq!(sa.applied + sb.applied, 1);
    assert_eq!(sa.skipped_duplicates + sb.skipped_duplicates, 1);
    assert_eq!(lag, 0);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_without_id_goes_to_the_dead_letter_topic_with_a_reason() {
    let topic = topic(3).await;
    let group = random("group");
    let db = TestDb::new().await;
    let producer = producer();
    let payload = CreditEvent::new(5, 70).to_json();
    let record = Record::new(payload.clone())
        .without_id()
        .key("account-5")
        .header("trace", "abc")
        .partition(1);
    producer.send(&topic, record).await.expect("produce");
    let good = Record::new(CreditEvent::new(6, 30).to_json()).partition(1);
    producer.send(&topic, good).await.expect("produce");

    let consumer = Running::start(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
        10,
    );
    assert!(wait_for_events(&db.pool, 1).await);
    let lag = wait_for_no_lag(&topic, &group, 3).await;
    let stats = consumer.stop().await.expect("consumer");
    let dead = read_all(&format!("{topic}.dlq")).await;
    let summary = summary(&db.pool).await;
    println!(
        "no id: {stats:?} {summary:?} lag={lag} dead letters={}",
        dead.len()
    );
    assert_eq!(dead.len(), 1);
    let letter = &dead[0];
    assert_eq!(letter.key(), Some(&b"account-5"[..]));
    assert_eq!(letter.payload(), Some(payload.as_slice()));
    assert_eq!(header(letter, "trace"), Some(&b"abc"[..]));
    let reason = String::from_utf8_lossy(header(letter, REASON_HEADER).expect("reason header"));
    println!("reason header: {reason}");
    assert!(reason.contains("event_id"), "{reason}");
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(
        summary.ledger_rows, 1,
        "only the record with an ID is applied"
    );
    assert_eq!(wallet::balance(&db.pool, 5).await, 0);
    assert_eq!(lag, 0, "the dead-lettered record is committed too");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_topic_retention_is_readable() {
    if skip_on_mock("the mock lacks CreateTopics with configs and DescribeConfigs") {
        return;
    }
    let admin = inbox_kafka::KafkaAdmin::from_env().expect("admin");
    let topic = random("inbox-retention");
    admin
        .create_topic_with(&topic, 1, &[("retention.ms", "3600000")])
        .await
        .expect("create topic");
    let retention = admin.retention(&topic).await.expect("describe configs");
    println!("retention.ms of {topic} created with 3600000: {retention:?}");
    assert_eq!(retention, Retention::Limited(Duration::from_secs(3600)));
    let source = config(&topic, &random("group"))
        .build()
        .expect("source")
        .with_retention(retention);
    assert_eq!(
        inbox_core::MessageSource::redelivery_window(&source),
        Some(Duration::from_secs(3600)),
        "the consumer's start-up check sees the topic's retention"
    );
}

/// The anti-pattern mode kept for the evidence harness: offsets stored on receipt and committed
/// by the client (here on close), so a crash before the database commit loses the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_commit_mode_loses_a_batch_that_crashed_before_the_database_commit() {
    let topic = topic(1).await;
    let group = random("group");
    let db = TestDb::new().await;
    produce_credits(&topic, 10, 1).await;

    let auto = config(&topic, &group)
        .ack_mode(AckMode::AutoCommit)
        .set_consumer("auto.commit.interval.ms", "100")
        .build()
        .expect("source");
    let crashing = Consumer::new("wallet", auto, db.inbox(), Credit::new(db.pool.clone()))
        .batch_size(10)
        .on_stage(crash_at(Stage::Claimed));
    let crashed = Running::spawn(crashing).join().await;
    assert!(matches!(crashed, Err(Error::Crashed { .. })), "{crashed:?}");

    // A correct consumer in the same group starts from what auto-commit committed.
    let restarted = Running::start(
        "wallet",
        source(&topic, &group),
        db.inbox(),
        Credit::new(db.pool.clone()),
        10,
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stats = restarted.stop().await.expect("consumer");
    let summary = summary(&db.pool).await;
    let lag = wait_for_no_lag(&topic, &group, 1).await;
    println!(
        "auto-commit crash: restarted {stats:?} {summary:?} lost={} lag={lag}",
        summary.lost(10)
    );
    assert!(
        summary.lost(10) > 0,
        "auto-commit committed offsets of messages never applied"
    );
    assert_eq!(lag, 0, "the broker considers them done");
    db.drop().await;
}
