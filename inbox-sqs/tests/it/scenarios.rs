//! What is SQS's own, over a real SQS endpoint and a real PostgreSQL: duplicates within one
//! receive, the dead letter's attributes, the redrive-policy dead-letter queue or none at all,
//! batched sends and deletes, delete-on-receive, and the FIFO deduplication-ID fallback. The
//! scenarios every adapter shares are in `conformance.rs`.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{client, counts, credit, drain, producer, queue, queue_with_redrive};
use inbox_conformance::wallet::{balance, summary, Credit};
use inbox_conformance::TestDb;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Consumer, Error, MessageId, OutgoingMessage, Publish, Recovery, Stage};
use inbox_sqs::aws_sdk_sqs::types::MessageAttributeValue;
use inbox_sqs::SqsConnection;
use inbox_testkit::{AckOnReceive, Crash};

const SECOND: Duration = Duration::from_secs(1);

/// Both copies of an ID in one receive of 10: the second is skipped within the batch, and both
/// are deleted in one `DeleteMessageBatch`.
#[tokio::test]
async fn the_same_id_twice_in_one_receive_is_applied_once() {
    let sqs = client().await;
    let url = queue(&sqs, "double", 3).await;
    let db = TestDb::new().await;
    let sender = producer(&sqs).await;
    let id = MessageId::generate();
    let twice = [
        OutgoingMessage::new(id.clone(), credit(1, 100)),
        OutgoingMessage::generate(credit(2, 7)),
        OutgoingMessage::new(id, credit(1, 100)),
    ];
    sender.send_batch(&url, &twice).await.unwrap();

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();

    let ledger = summary(&db).await.unwrap();
    let left = counts(&sqs, &url).await;
    println!("the same ID twice in one receive: {stats:?}, {ledger:?}, queue (visible, in flight) {left:?}");
    assert_eq!((ledger.ledger_rows, ledger.distinct_events), (2, 2));
    assert_eq!(balance(&db, 1).await, 100);
    assert_eq!((stats.applied, stats.skipped_duplicates), (2, 1));
    assert_eq!(left, (0, 0), "every copy is deleted from the queue");
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
}

/// A dead letter in a standard dead-letter queue keeps the original's attributes with their
/// data types (the `event_id` of the unparsable one, a Number attribute of the one without an
/// ID) and carries why, and where it was read from, in the [`inbox_core::dead_letter`]
/// attributes.
#[tokio::test]
async fn a_dead_letter_keeps_its_attributes_and_carries_a_reason_attribute() {
    let sqs = client().await;
    let url = queue(&sqs, "noid", 3).await;
    let dlq = queue(&sqs, "noid-dlq", 30).await;
    let db = TestDb::new().await;
    // No ID attribute at all, but another attribute that must survive with its data type.
    let number = MessageAttributeValue::builder()
        .data_type("Number")
        .string_value("42")
        .build()
        .unwrap();
    sqs.send_message()
        .queue_url(&url)
        .message_body(credit(1, 500))
        .message_attributes("tenant", number)
        .send()
        .await
        .unwrap();
    // An ID, but a body no handler can parse: a permanent failure.
    let bad = producer(&sqs).await.send(&url, b"not json").await.unwrap();

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();

    let dead = drain(&sqs, &dlq, SECOND).await;
    let reasons: Vec<_> = dead.iter().map(|m| common::attr(m, REASON)).collect();
    println!("dead letters: {stats:?}; reasons {reasons:?}");
    assert_eq!(dead.len(), 2);

    let no_id = dead
        .iter()
        .find(|m| common::attr(m, "event_id").is_none())
        .expect("the message without ID is in the DLQ");
    let reason = common::attr(no_id, REASON).unwrap();
    assert!(reason.contains("event_id is missing"), "{reason}");
    let tenant = &no_id.message_attributes().unwrap()["tenant"];
    assert_eq!(
        (tenant.data_type(), tenant.string_value()),
        ("Number", Some("42"))
    );

    let unparsable = dead
        .iter()
        .find(|m| common::attr(m, "event_id").as_deref() == Some(bad.as_str()))
        .expect("the unparsable message is in the DLQ with its ID");
    let reason = common::attr(unparsable, REASON).unwrap();
    assert!(reason.contains("not valid JSON"), "{reason}");
    assert_eq!(
        common::attr(unparsable, ORIGINAL_SOURCE).as_deref(),
        Some(url.as_str())
    );
    let position = common::attr(unparsable, ORIGINAL_POSITION).unwrap_or_default();
    assert!(position.starts_with("message "), "{position}");
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
    db.drop().await;
}

#[tokio::test]
async fn without_explicit_dlq_the_redrive_policy_target_gets_the_dead_letter() {
    let sqs = client().await;
    let (url, dlq) = queue_with_redrive(&sqs, "redrive", 3, 5).await;
    let db = TestDb::new().await;
    sqs.send_message()
        .queue_url(&url)
        .message_body(credit(1, 1))
        .send()
        .await
        .unwrap();

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        source.dead_letter_queue(),
        Some(dlq.as_str()),
        "resolved from the RedrivePolicy"
    );
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .run_until_idle()
        .await
        .unwrap();

    let dead = drain(&sqs, &dlq, SECOND).await;
    println!("redrive DLQ: {stats:?}; {} dead letter(s)", dead.len());
    assert_eq!(dead.len(), 1);
    assert!(common::attr(&dead[0], REASON).unwrap().contains("missing"));
    assert_eq!(summary(&db).await.unwrap().ledger_rows, 0);
    assert_eq!(counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
    db.drop().await;
}

#[tokio::test]
async fn without_any_dead_letter_queue_the_consumer_stops_and_loses_nothing() {
    let sqs = client().await;
    let url = queue(&sqs, "nodlq", 2).await;
    let db = TestDb::new().await;
    sqs.send_message()
        .queue_url(&url)
        .message_body(credit(1, 1))
        .send()
        .await
        .unwrap();

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let result = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .run_until_idle()
        .await;
    let Err(Error::Source(e)) = &result else {
        panic!("expected a fatal source error, got {result:?}");
    };
    println!("no DLQ: {e}");
    assert_eq!(e.recovery(), Recovery::Fatal);
    assert!(e.to_string().contains("dead_letter_queue"), "{e}");
    let (visible, in_flight) = counts(&sqs, &url).await;
    assert_eq!(visible + in_flight, 1, "the message is still on the queue");
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
}

#[tokio::test]
async fn batched_sends_are_all_applied_and_batch_deleted() {
    const EVENTS: i64 = 25;
    let sqs = client().await;
    let url = queue(&sqs, "batch", 10).await;
    let db = TestDb::new().await;
    let outgoing: Vec<_> = (0..EVENTS)
        .map(|n| OutgoingMessage::generate(credit(n % 3, n)))
        .collect();
    producer(&sqs)
        .await
        .send_batch(&url, &outgoing)
        .await
        .unwrap();
    assert_eq!(counts(&sqs, &url).await, (EVENTS as u64, 0));

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let retention = source.queue_retention().await.unwrap();
    assert_eq!(
        inbox_core::MessageSource::redelivery_window(&source),
        Some(retention),
        "the consumer's start-up check sees the queue's retention"
    );
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();
    let ledger = summary(&db).await.unwrap();
    println!("batched: {stats:?}; {ledger:?}; queue retention {retention:?}");
    assert_eq!(stats.applied, EVENTS as u64);
    assert_eq!(stats.ack_failures, 0);
    assert!(stats.commits < EVENTS as u64, "batches share a transaction");
    assert_eq!(ledger.distinct_events, EVENTS);
    assert_eq!(ledger.ledger_rows, EVENTS);
    assert_eq!(ledger.total_balance, (0..EVENTS).sum::<i64>());
    assert_eq!(counts(&sqs, &url).await, (0, 0));
    assert!(retention >= Duration::from_secs(60));
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
}

#[tokio::test]
async fn delete_on_receive_loses_a_message_on_crash() {
    // The anti-pattern (evidence variant a1), the source in `AckOnReceive`: the message is
    // deleted before it is applied, so a crash before the commit loses it for good.
    let sqs = client().await;
    let url = queue(&sqs, "a1", 2).await;
    let db = TestDb::new().await;
    producer(&sqs)
        .await
        .send(&url, credit(1, 10).as_bytes())
        .await
        .unwrap();

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let crash = Crash::at(Stage::Claimed);
    let consumer = Consumer::new(
        "wallet",
        AckOnReceive::new(source),
        crash.store(db.inbox()),
        Credit::new(db.clone()),
    );
    let crashed = crash.run(consumer.run_until_idle()).await;
    assert!(crashed.is_err(), "{crashed:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let left = counts(&sqs, &url).await;
    let ledger = summary(&db).await.unwrap();
    println!("delete on receive + crash: queue {left:?}; {ledger:?}");
    assert_eq!(left, (0, 0), "nothing comes back");
    assert_eq!(ledger.ledger_rows, 0, "and nothing was applied: lost");
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
}

#[tokio::test]
async fn fifo_queue_with_the_deduplication_id_fallback() {
    let sqs = client().await;
    let url = common::fifo_queue(&sqs, "fifo", 3).await;
    let db = TestDb::new().await;
    let sender = SqsConnection::new(sqs.clone())
        .producer()
        .message_group_id("account-1")
        .connect()
        .await
        .unwrap();
    let first = sender.send(&url, credit(1, 1).as_bytes()).await.unwrap();
    sender.send(&url, credit(1, 2).as_bytes()).await.unwrap();
    // A producer without the attribute, relying on a stable deduplication ID per event.
    sqs.send_message()
        .queue_url(&url)
        .message_body(credit(1, 4))
        .message_group_id("account-1")
        .message_deduplication_id("legacy-evt-1")
        .send()
        .await
        .unwrap();
    // A resend of the first event with its ID: SQS drops it within its 5-minute window, and
    // the inbox would skip it after that.
    sender
        .send_with_id(&url, &first, credit(1, 1).as_bytes())
        .await
        .unwrap();

    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dedup_id_fallback(true)
        .connect()
        .await
        .unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();
    let ledger = summary(&db).await.unwrap();
    println!("fifo: {stats:?}; {ledger:?}");
    assert_eq!(stats.applied, 3);
    assert_eq!(stats.dead_lettered, 0);
    assert_eq!(balance(&db, 1).await, 7);
    assert_eq!(ledger.ledger_rows, 3);
    assert_eq!(counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
}
