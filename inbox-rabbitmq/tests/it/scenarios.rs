//! What is RabbitMQ's own, over a real queue and a real PostgreSQL inbox: what a dead letter
//! keeps, the quorum queue's `x-delivery-limit`, multiple acks, the prefetch window and IDs in
//! headers. The scenarios every adapter shares are in `conformance.rs`.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;
use inbox_conformance::wallet::{self, Credit};
use inbox_conformance::TestDb;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Ack, Consumer, MessageSource, Publish};
use inbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use inbox_rabbitmq::lapin::BasicProperties;

/// What the adapter's dead letters keep of the message: the body, the headers and properties
/// (`message_id`, `content_type`), with the `inbox_core::dead_letter` headers: the reason, the
/// source queue and the position. That they are parked at all is the conformance suite's.
#[tokio::test]
async fn a_dead_letter_keeps_the_properties_and_the_reason_header() {
    let config = fresh_config("dlq-props");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    let props = BasicProperties::default()
        .with_headers(headers)
        .with_content_type("application/json".into());
    publisher
        .publish_with_properties(config.queue(), &credit(9, 5), props)
        .await
        .unwrap();
    let bad = publisher.send(config.queue(), b"not json").await.unwrap();

    let source = config.clone().connect().await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .run_until_idle()
        .await
        .unwrap();

    let parked = drain(&config.dead_letter_queue()).await;
    println!("dead letters: {stats:?}, parked {parked:?}");
    assert_eq!(parked.len(), 2);
    let no_id = &parked[0];
    assert_eq!(no_id.body, credit(9, 5));
    assert_eq!(
        no_id.header(REASON).as_deref(),
        Some("message has no ID: property message_id is missing")
    );
    assert_eq!(no_id.message_id(), None);
    assert_eq!(
        no_id.header(ORIGINAL_SOURCE).as_deref(),
        Some(config.queue())
    );
    let position = no_id.header(ORIGINAL_POSITION).unwrap_or_default();
    assert!(position.contains(" tag "), "{position}");
    assert_eq!(no_id.header("tenant").as_deref(), Some("acme"));
    assert_eq!(
        no_id
            .properties
            .content_type()
            .as_ref()
            .map(|c| c.to_string())
            .as_deref(),
        Some("application/json")
    );
    let not_json = &parked[1];
    assert_eq!(not_json.body, b"not json");
    assert_eq!(not_json.message_id(), Some(bad.to_string()));
    let reason = not_json.header(REASON).unwrap_or_default();
    assert!(reason.contains("not valid JSON"), "{reason}");
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
    db.drop().await;
}

/// A message that is only ever requeued (as one that crashes its consumer would be) is moved to
/// the DLQ by the quorum queue's `x-delivery-limit`, while the messages behind it are consumed.
#[tokio::test]
async fn a_requeue_loop_ends_in_the_dlq_without_starving_the_rest() {
    let config = fresh_config("requeue").delivery_limit(2).prefetch(4);
    let publisher = publisher(&config).await;
    let poison = publisher.send(config.queue(), b"poison").await.unwrap();
    for i in 0..6 {
        publisher
            .send(config.queue(), format!("good {i}").as_bytes())
            .await
            .unwrap();
    }

    let mut source = config.clone().connect().await.unwrap();
    let mut good = 0;
    let mut poison_counts = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline && (good < 6 || left_ready(&config).await) {
        for delivery in source.receive(4).await.unwrap() {
            if delivery.message.id.as_ref().ok() == Some(&poison) {
                poison_counts.push(delivery.message.meta.delivery_count);
                delivery.ack.nack(Duration::from_millis(50)).await.unwrap();
            } else {
                good += 1;
                delivery.ack.ack().await.unwrap();
            }
        }
    }
    source.close().await;
    // Read as an operator would (`inbox-admin dead-letters`), through the adapter's reader.
    let mut reader = config
        .connection()
        .dead_letters(config.dead_letter_queue())
        .connect()
        .await
        .unwrap();
    let mut parked = Vec::new();
    inbox_core::replay::scan(&mut reader, &mut |letter| parked.push(letter.clone()))
        .await
        .unwrap();
    println!(
        "requeue loop: good acked {good}, poison delivery counts {poison_counts:?}, dead-lettered {parked:?}"
    );
    assert_eq!(good, 6);
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].payload, b"poison");
    assert_eq!(
        parked[0].reason.as_deref(),
        Some("delivery_limit"),
        "the broker dead-lettered it, and its reason stands for the consumer's"
    );
    assert_eq!(poison_counts.first(), Some(&Some(1)));
    assert!(
        poison_counts.windows(2).all(|w| w[0] < w[1]),
        "{poison_counts:?}"
    );
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
}

async fn left_ready(config: &inbox_rabbitmq::RabbitSourceBuilder) -> bool {
    drain_count(config.dead_letter_queue()).await == 0
}

async fn drain_count(queue: String) -> u32 {
    use inbox_rabbitmq::lapin::options::QueueDeclareOptions;
    let (_c, channel) = admin_channel().await;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.as_str().into(), options, FieldTable::default())
        .await
        .map(|q| q.message_count())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_batch_is_acked_in_one_multiple_ack_and_nothing_is_left() {
    let config = fresh_config("batch").prefetch(10);
    let publisher = publisher(&config).await;
    for i in 0..8 {
        publisher
            .send(config.queue(), format!("m{i}").as_bytes())
            .await
            .unwrap();
    }
    let mut source = config.clone().connect().await.unwrap();
    let mut seen = 0;
    while seen < 8 {
        let batch = source.receive(8).await.unwrap();
        assert!(!batch.is_empty(), "the queue ran dry after {seen}");
        seen += batch.len();
        let acks = batch.into_iter().map(|d| d.ack).collect();
        inbox_rabbitmq::RabbitAck::ack_all(acks).await.unwrap();
    }
    source.close().await;
    let left = left_on(config.queue()).await;
    println!("batch ack: received {seen}, left on queue {left}");
    assert_eq!(left, 0);
    cleanup(&config).await;
}

#[tokio::test]
async fn the_default_prefetch_follows_the_batch_size() {
    // No prefetch set: a consumer asking for batches of 100 must be able to get 100 at once.
    let config = fresh_config("prefetch");
    let publisher = publisher(&config).await;
    for i in 0..300 {
        publisher
            .send(config.queue(), format!("m{i}").as_bytes())
            .await
            .unwrap();
    }
    let mut source = config.clone().connect().await.unwrap();
    let mut largest = 0;
    for _ in 0..5 {
        let batch = source.receive(100).await.unwrap();
        largest = largest.max(batch.len());
        let acks = batch.into_iter().map(|d| d.ack).collect();
        inbox_rabbitmq::RabbitAck::ack_all(acks).await.unwrap();
        // Let the broker refill the prefetch window before the next receive.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    source.close().await;
    assert_eq!(largest, 100, "the largest batch received");
    cleanup(&config).await;
}

#[tokio::test]
async fn the_id_can_come_from_a_header() {
    let config = fresh_config("header").id_header("event_id");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    for _ in 0..2 {
        let mut headers = FieldTable::default();
        headers.insert("event_id".into(), AMQPValue::LongString("order-17".into()));
        let props = BasicProperties::default().with_headers(headers);
        publisher
            .publish_with_properties(config.queue(), &credit(2, 30), props)
            .await
            .unwrap();
    }
    let source = config.clone().connect().await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .run_until_idle()
        .await
        .unwrap();
    println!("header ID: {stats:?}");
    assert_eq!((stats.applied, stats.skipped_duplicates), (1, 1));
    assert_eq!(wallet::balance(&db, 2).await, 30);
    cleanup(&config).await;
    db.drop().await;
}
