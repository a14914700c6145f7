//! What only Kafka has, over a real Kafka-protocol broker and a real PostgreSQL: each test makes
//! its own topic (several partitions), group and schema. The scenarios every adapter passes
//! (a duplicate ID, a crash at each stage, racing members, dead letters) are in
//! `tests/it/conformance.rs`, from `inbox-conformance`.

use crate::common;

use std::time::Duration;

use common::*;
use inbox_conformance::wallet::{Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Consumer, IdFrom, Stage};
use inbox_kafka::rdkafka::Message as _;
use inbox_testkit::{AckOnReceive, Crash};

/// What the dead-letter topic keeps of a record it parks, here one without an ID (the
/// conformance suite checks the payload, the reason and the commit): its key and headers, and
/// the reason and origin under the header names the crate exports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_keeps_the_key_and_headers_and_names_its_origin() {
    let topic = topic(3).await;
    let group = random("group");
    let db = TestDb::new().await;
    let payload = CreditEvent::new(5, 70).to_json();
    let headers = [("trace", "abc")];
    let key = Some("account-5");
    send_raw(&producer().await, &topic, Some(1), key, &headers, &payload).await;

    let consumer = Running::start(
        "wallet",
        source(&topic, &group).await,
        db.inbox(),
        Credit::new(db.clone()),
        10,
    );
    let stats = consumer.stats.clone();
    assert!(
        eventually(|| async { stats.snapshot().dead_lettered >= 1 }).await,
        "never dead-lettered"
    );
    consumer.stop().await.expect("consumer");
    let dead = read_all(&format!("{topic}.dlq")).await;
    assert_eq!(dead.len(), 1);
    let letter = &dead[0];
    let text = |name| header(letter, name).map(|v| String::from_utf8_lossy(v).into_owned());
    let reason = text(REASON).expect("reason header");
    println!(
        "dead letter: reason {reason:?}, from {:?} at {:?}",
        text(ORIGINAL_SOURCE),
        text(ORIGINAL_POSITION)
    );
    assert_eq!(letter.key(), Some(&b"account-5"[..]));
    assert_eq!(letter.payload(), Some(payload.as_slice()));
    assert_eq!(header(letter, "trace"), Some(&b"abc"[..]));
    assert!(reason.contains("event_id"), "{reason}");
    assert_eq!(text(ORIGINAL_SOURCE), Some(topic.clone()));
    assert_eq!(
        text(ORIGINAL_POSITION).as_deref(),
        Some("partition 1 offset 0")
    );
    db.drop().await;
}

/// The redelivery window a source reports for `topic`, as the consumer's start-up check sees
/// it, read from the broker's topic configuration.
async fn window_of(topic: &str) -> Option<Duration> {
    let admin = inbox_kafka::KafkaConnection::from_env()
        .admin()
        .expect("admin");
    let retention = admin.retention(topic).await.expect("describe configs");
    println!("retention of {topic}: {retention:?}");
    let source = config(topic, &random("group"))
        .connect()
        .await
        .expect("source")
        .with_retention(retention);
    inbox_core::MessageSource::redelivery_window(&source)
}

/// The broker deletes a whole segment once its newest record is older than `retention.ms`, and
/// a segment takes records for up to `segment.ms`: its first record stays readable for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redelivery_window_is_retention_plus_segment_time() {
    if skip_on_mock("the mock lacks CreateTopics with configs and DescribeConfigs") {
        return;
    }
    let admin = inbox_kafka::KafkaConnection::from_env()
        .admin()
        .expect("admin");
    let topic = random("inbox-retention");
    let properties = [("retention.ms", "3600000"), ("segment.ms", "600000")];
    admin
        .create_topic_with(&topic, 1, &properties)
        .await
        .expect("create topic");
    assert_eq!(
        window_of(&topic).await,
        Some(Duration::from_secs(3600 + 600)),
        "a record can be read up to retention.ms + segment.ms after it was written"
    );
}

/// A compacted topic keeps the last record of every key, however old: the consumer must warn
/// whatever the inbox retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_topic_can_redeliver_arbitrarily_late() {
    if skip_on_mock("the mock lacks CreateTopics with configs and DescribeConfigs") {
        return;
    }
    let admin = inbox_kafka::KafkaConnection::from_env()
        .admin()
        .expect("admin");
    let topic = random("inbox-compacted");
    let properties = [("cleanup.policy", "compact"), ("retention.ms", "3600000")];
    admin
        .create_topic_with(&topic, 1, &properties)
        .await
        .expect("create topic");
    let window = window_of(&topic).await;
    let a_year = Duration::from_secs(365 * 24 * 3600);
    assert!(
        inbox_core::retention_shortfall(a_year, window).is_some(),
        "an inbox keeping IDs for a year is not warned about a compacted topic (window {window:?})"
    );
}

/// The anti-pattern the evidence measures, auto-commit: offsets acked on receipt and committed
/// on a timer (here also on close), so a crash before the database commit loses the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_on_receipt_a_batch_that_crashed_before_the_database_commit_is_lost() {
    let topic = topic(1).await;
    let group = random("group");
    let db = TestDb::new().await;
    produce_credits(&topic, 10, 1).await;

    let auto = config(&topic, &group)
        .commit_interval(Duration::from_millis(100))
        .connect()
        .await
        .expect("source");
    let crash = Crash::at(Stage::Claimed);
    let crashing = Consumer::new(
        "wallet",
        AckOnReceive::new(auto),
        crash.store(db.inbox()),
        Credit::new(db.clone()),
    )
    .batch_size(10);
    let crashed = crash.run(crashing.run_until(std::future::pending())).await;
    assert!(crashed.is_err(), "{crashed:?}");

    // A correct consumer in the same group starts from what was committed.
    let restarted = Running::start(
        "wallet",
        source(&topic, &group).await,
        db.inbox(),
        Credit::new(db.clone()),
        10,
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stats = restarted.stop().await.expect("consumer");
    let summary = summary(&db).await;
    let lag = wait_for_no_lag(&topic, &group, 1).await;
    println!(
        "acked on receipt, crashed: restarted {stats:?} {summary:?} lost={} lag={lag}",
        summary.lost(10)
    );
    assert!(
        summary.lost(10) > 0,
        "committed offsets of messages never applied"
    );
    assert_eq!(lag, 0, "the broker considers them done");
    db.drop().await;
}

/// Records a producer outside this crate wrote without an ID, read under `IdFrom::Position`
/// (topic, partition, offset): a consumer that dies after its commit and before its ack leaves
/// its records to the group's next member, which skips them; a resend of a credit is a new
/// record at a new offset and is applied again, the weaker promise the variant states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positions_as_ids_skip_redeliveries_but_not_resends() {
    let topic = topic(1).await;
    let group = random("group");
    let db = TestDb::new().await;
    let producer = producer().await;
    for amount in 1..=10 {
        let credit = CreditEvent::new(1, amount).to_json();
        send_raw(&producer, &topic, Some(0), None, &[], &credit).await;
    }
    let positioned = || async {
        config(&topic, &group)
            .id_from(IdFrom::Position)
            .connect()
            .await
            .expect("source")
    };

    let crash = Crash::at(Stage::Committed);
    let crashing = Consumer::new(
        "wallet",
        crash.source(positioned().await),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(10);
    let crashed = crash.run(crashing.run_until(std::future::pending())).await;
    assert!(crashed.is_err(), "{crashed:?}");
    let first = summary(&db).await;
    assert!(
        first.ledger_rows > 0,
        "the first batch committed: {first:?}"
    );

    let restarted = Running::start(
        "wallet",
        positioned().await,
        db.inbox(),
        Credit::new(db.clone()),
        10,
    );
    assert!(wait_for_events(&db, 10).await, "every record applied");
    assert_eq!(wait_for_no_lag(&topic, &group, 1).await, 0);
    let stats = restarted.stop().await.expect("consumer");
    assert_eq!(
        stats.skipped_duplicates,
        u64::try_from(first.ledger_rows).unwrap(),
        "the redelivered records are skipped: {stats:?}"
    );
    let redelivered = summary(&db).await;
    assert_eq!((redelivered.ledger_rows, redelivered.duplicates()), (10, 0));
    assert_eq!(redelivered.total_balance, 55);

    // The producer sends the first credit again: a new offset, applied again.
    send_raw(
        &producer,
        &topic,
        Some(0),
        None,
        &[],
        &CreditEvent::new(1, 1).to_json(),
    )
    .await;
    let again = Running::start(
        "wallet",
        positioned().await,
        db.inbox(),
        Credit::new(db.clone()),
        10,
    );
    assert!(wait_for_events(&db, 11).await, "the resend applied");
    again.stop().await.expect("consumer");
    let resent = summary(&db).await;
    assert_eq!((resent.ledger_rows, resent.total_balance), (11, 56));
    let ids: Vec<String> =
        inbox_postgres::sqlx::query_scalar("SELECT event_id FROM ledger ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        ids[0],
        format!("{topic}/0/0"),
        "the ID is the record's position"
    );
    db.drop().await;
}
