//! Dead letters at the adapter level: what arrives in a FIFO dead-letter queue, the ID a dead
//! letter keeps, a send that fails, and a dead-letter queue that does not exist.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{client, drain, fifo_queue, producer, queue, queue_with_redrive, text};
use inbox_core::dead_letter::REASON;
use inbox_core::replay::DeadLetters;
use inbox_core::{Ack, MessageId, MessageSource, Publish, Recovery};
use inbox_sqs::aws_sdk_sqs::types::Message as SqsMessage;
use inbox_sqs::aws_sdk_sqs::types::MessageSystemAttributeName;
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::{Error, SqsConnection, SqsSource};

const SECOND: Duration = Duration::from_secs(1);

/// Receives everything visible on the source and dead-letters it (sent to the dead-letter
/// queue, then deleted), as the consumer does. Returns how many messages it dead-lettered.
async fn dead_letter_all(source: &mut SqsSource) -> usize {
    let mut n = 0;
    loop {
        let batch = source.receive(10).await.unwrap();
        if batch.is_empty() {
            return n;
        }
        for delivery in batch {
            delivery
                .ack
                .dead_letter(&delivery.message, "test: cannot be applied")
                .await
                .unwrap();
            n += 1;
        }
    }
}

/// Every message on `url`, left there (not deleted), with its FIFO system attributes.
async fn peek(sqs: &Client, url: &str) -> Vec<SqsMessage> {
    let dead = drain(sqs, url, SECOND).await;
    assert!(dead.iter().all(|m| m.receipt_handle().is_some()));
    dead
}

/// What SQS accepts as a deduplication or group ID: 1 to 128 characters, alphanumeric or
/// punctuation.
fn valid_fifo_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c.is_ascii_punctuation())
}

fn system(message: &SqsMessage, name: MessageSystemAttributeName) -> String {
    message
        .attributes()
        .and_then(|a| a.get(&name))
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn one_id_dead_lettered_twice_within_five_minutes_arrives_twice_in_a_fifo_dlq() {
    let sqs = client().await;
    let url = queue(&sqs, "dl-twice", 30).await;
    let dlq = fifo_queue(&sqs, "dl-twice-dlq", 30).await;
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    let sender = producer(&sqs).await;
    let id = MessageId::generate();
    // The first copy is dead-lettered; then an operator redrives it (or the producer resends
    // it) and it fails again, all within SQS's 5-minute deduplication window. The first dead
    // letter is still in the DLQ, where SQS compares deduplication IDs.
    sender.send_with_id(&url, &id, b"first").await.unwrap();
    assert_eq!(dead_letter_all(&mut source).await, 1);
    sender.send_with_id(&url, &id, b"second").await.unwrap();
    assert_eq!(dead_letter_all(&mut source).await, 1);

    let dead = peek(&sqs, &dlq).await;
    let bodies: Vec<_> = dead.iter().filter_map(SqsMessage::body).collect();
    println!("dead letters of one ID: {bodies:?}");
    assert_eq!(bodies, ["first", "second"], "both dead letters arrived");
    assert!(dead
        .iter()
        .all(|m| common::attr(m, "event_id").as_deref() == Some(id.as_str())));
    assert_eq!(common::counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
}

#[tokio::test]
async fn messages_without_an_id_or_with_a_non_ascii_id_dead_letter_to_a_fifo_dlq() {
    let sqs = client().await;
    let url = queue(&sqs, "dl-odd", 30).await;
    let dlq = fifo_queue(&sqs, "dl-odd-dlq", 30).await;
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    sqs.send_message()
        .queue_url(&url)
        .message_body("no id")
        .send()
        .await
        .unwrap();
    let odd = MessageId::new("évènement n°1").unwrap();
    producer(&sqs)
        .await
        .send_with_id(&url, &odd, b"non-ascii id")
        .await
        .unwrap();
    assert_eq!(dead_letter_all(&mut source).await, 2);

    let dead = peek(&sqs, &dlq).await;
    let mut bodies: Vec<_> = dead.iter().filter_map(SqsMessage::body).collect();
    bodies.sort_unstable();
    assert_eq!(bodies, ["no id", "non-ascii id"]);
    for message in &dead {
        let dedup = system(message, MessageSystemAttributeName::MessageDeduplicationId);
        let group = system(message, MessageSystemAttributeName::MessageGroupId);
        println!("{:?}: dedup {dedup:?}, group {group:?}", message.body());
        // Real SQS refuses the send otherwise; the message would loop on the source.
        assert!(valid_fifo_id(&dedup), "deduplication ID {dedup:?}");
        assert!(valid_fifo_id(&group), "group ID {group:?}");
        assert!(common::attr(message, REASON).is_some());
    }
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
}

/// The dead-letter queue is deleted after the source was built, so the send fails: the message
/// is not deleted but handed back, visible again after `dead_letter::RETRY_AFTER` (1 s) rather
/// than after its 30 s visibility timeout.
#[tokio::test]
async fn a_dead_letter_whose_send_fails_hands_the_message_back() {
    let sqs = client().await;
    let url = queue(&sqs, "dl-fails", 30).await;
    let dlq = queue(&sqs, "dl-fails-dlq", 30).await;
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    common::delete_queue(&sqs, &dlq).await;
    sqs.send_message()
        .queue_url(&url)
        .message_body("no id")
        .send()
        .await
        .unwrap();
    let first = loop {
        if let Some(d) = source.receive(1).await.unwrap().pop() {
            break d;
        }
    };
    let e = first
        .ack
        .dead_letter(&first.message, "test: cannot be applied")
        .await
        .expect_err("the dead-letter queue is gone");
    println!("failed dead letter ({:?}): {e}", e.recovery());

    let mut again = None;
    for _ in 0..5 {
        again = source.receive(1).await.unwrap().pop();
        if again.is_some() {
            break;
        }
    }
    let again = again.expect("handed back within seconds, not after its visibility timeout");
    assert_eq!(again.message.payload, b"no id");
    assert_eq!(again.message.meta.delivery_count, Some(2));
    again.ack.ack().await.unwrap();
    assert_eq!(common::counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
}

#[tokio::test]
async fn a_dead_letter_queue_that_does_not_exist_fails_the_build() {
    let sqs = client().await;
    let url = queue(&sqs, "dl-missing", 30).await;
    let missing = format!("{url}-gone");
    let built = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&missing)
        .connect()
        .await;
    let Err(e) = built else {
        panic!("built a source whose dead-letter queue {missing} does not exist");
    };
    println!("missing DLQ: {e}");
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert_eq!(e.recovery(), Recovery::Fatal);
    let text = e.to_string();
    assert!(text.contains(&missing), "names the queue: {text}");
    assert!(text.contains("dead_letter_queue"), "names the fix: {text}");
    common::delete_queue(&sqs, &url).await;
}

#[tokio::test]
async fn a_deleted_redrive_dead_letter_queue_fails_the_build() {
    let sqs = client().await;
    let (url, dlq) = queue_with_redrive(&sqs, "dl-deleted", 30, 5).await;
    common::delete_queue(&sqs, &dlq).await;
    let built = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await;
    let Err(e) = built else {
        panic!("built a source whose redrive dead-letter queue was deleted");
    };
    println!("deleted redrive DLQ: {e}");
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("RedrivePolicy"), "{e}");
    common::delete_queue(&sqs, &url).await;
}

/// Receives the one message on the dead-letter queue `dlq` as a source configured like the
/// original (`id_attribute`), as a replay from the dead-letter queue into the source would.
async fn replayed_id(sqs: &Client, dlq: &str, id_attribute: &str) -> Option<MessageId> {
    let mut replay = SqsConnection::new(sqs.clone())
        .source(dlq)
        .poll_timeout(SECOND)
        .id_attribute(id_attribute)
        .connect()
        .await
        .unwrap();
    for _ in 0..5 {
        if let Some(delivery) = replay.receive(1).await.unwrap().pop() {
            println!(
                "read back from the dead-letter queue: {:?}",
                delivery.message.id
            );
            return delivery.message.id.ok();
        }
    }
    panic!("nothing arrived on the dead-letter queue {dlq}");
}

/// SQS takes 10 message attributes and a dead letter adds 3; the 9 user attributes here all
/// sort before `event_id`, so the ID is the one an order-by-name cut would drop.
#[tokio::test]
async fn a_dead_letter_keeps_the_id_attribute_when_attributes_are_cut() {
    let sqs = client().await;
    let url = queue(&sqs, "dl-cut", 30).await;
    let dlq = queue(&sqs, "dl-cut-dlq", 30).await;
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    let id = MessageId::generate();
    let mut send = sqs
        .send_message()
        .queue_url(&url)
        .message_body("many attributes")
        .message_attributes("event_id", text(id.as_str()));
    for i in 0..9 {
        send = send.message_attributes(format!("a{i}"), text("user value"));
    }
    send.send().await.unwrap();
    assert_eq!(dead_letter_all(&mut source).await, 1);

    assert_eq!(replayed_id(&sqs, &dlq, "event_id").await, Some(id));
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
}

/// With `dedup_id_fallback`, the ID is the FIFO message's `MessageDeduplicationId`, a system
/// attribute a send cannot copy: the dead letter must carry it as the ID attribute, under the
/// name the source reads, or each dead letter of one message replays as a new ID.
#[tokio::test]
async fn a_dead_letter_carries_an_id_taken_from_the_deduplication_id() {
    let sqs = client().await;
    let url = fifo_queue(&sqs, "dl-dedup", 30).await;
    let dlq = queue(&sqs, "dl-dedup-dlq", 30).await;
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .id_attribute("order_ref")
        .dedup_id_fallback(true)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    sqs.send_message()
        .queue_url(&url)
        .message_body("id in the deduplication ID")
        .message_group_id("orders")
        .message_deduplication_id("order-42")
        .send()
        .await
        .unwrap();
    assert_eq!(dead_letter_all(&mut source).await, 1);

    assert_eq!(
        replayed_id(&sqs, &dlq, "order_ref").await,
        Some(MessageId::new("order-42").unwrap())
    );
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
}

/// The endpoint, region and credentials are given once, on the connection: the source
/// dead-letters through them, and the dead-letter reader built from the same connection reads
/// the parked message back and removes it.
#[tokio::test]
async fn the_dead_letter_reader_reaches_sqs_through_the_sources_connection() {
    let admin = client().await;
    let url = queue(&admin, "dl-conn", 30).await;
    let dlq = queue(&admin, "dl-conn-dlq", 30).await;
    // Outside AWS, the local endpoint and dummy credentials are set here and nowhere else.
    let sqs = SqsConnection::new(client().await);
    let mut source = sqs
        .source(&url)
        .poll_timeout(SECOND)
        .dead_letter_queue(&dlq)
        .connect()
        .await
        .unwrap();
    let producer = sqs.producer().connect().await.unwrap();
    let id = producer.send(&url, b"parked").await.unwrap();
    assert_eq!(dead_letter_all(&mut source).await, 1);

    let mut reader = sqs.dead_letters(&dlq).connect().await.unwrap();
    let letters = reader.next(10).await.unwrap();
    let shown: Vec<_> = letters.iter().map(|l| (&l.id, &l.reason)).collect();
    println!("read through the connection: {shown:?}");
    assert_eq!(letters.len(), 1, "{shown:?}");
    let letter = &letters[0];
    assert_eq!(letter.id.as_ref(), Some(&id));
    assert_eq!(letter.payload, b"parked");
    assert_eq!(letter.reason.as_deref(), Some("test: cannot be applied"));
    assert_eq!(letter.original_source.as_deref(), Some(url.as_str()));
    reader.remove(&letters).await.unwrap();
    reader.close().await.unwrap();
    assert_eq!(common::counts(&admin, &dlq).await, (0, 0));
    common::delete_queue(&admin, &url).await;
    common::delete_queue(&admin, &dlq).await;
}
