//! The outbox relay on SQS, where it differs from the other brokers: a FIFO queue gets each row's
//! key as its message group, in order; rows SQS cannot take stay unsent. (Forwarding through the
//! outbox, a lost confirm and two relays at once are in the conformance suite, on a standard
//! queue in concurrent batches of 10.)

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use inbox_conformance::outbox_table::{migrated, unsent};
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::TestDb;
use inbox_core::{OutgoingMessage, Recovery};
use inbox_postgres::RelayError;
use inbox_sqs::aws_sdk_sqs::types::MessageSystemAttributeName;
use inbox_sqs::SqsConnection;

/// The queue's name: what outbox rows name as their destination.
fn name(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

#[tokio::test]
async fn a_fifo_queue_gets_each_key_as_its_message_group_in_the_order_written() {
    let sqs = client().await;
    let url = fifo_queue(&sqs, "outbox", 30).await;
    let db = TestDb::new().await;
    let outbox = migrated(&db).await;
    let mut written: HashMap<String, Vec<String>> = HashMap::new();
    let messages: Vec<OutgoingMessage> = (0..30)
        .map(|i: i64| {
            let key = format!("account {}", i % 3); // a space: SQS refuses it, so it is hashed
            let message = OutgoingMessage::generate(CreditEvent::new(1, i).to_json()).key(&key);
            written.entry(key).or_default().push(message.id.to_string());
            message
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.write_all(&mut tx, &url, &messages).await.unwrap();
    tx.commit().await.unwrap();

    outbox
        .relay(producer(&sqs).await)
        .run_until_idle()
        .await
        .unwrap();
    let received = drain(&sqs, &url, Duration::from_secs(2)).await;

    assert_eq!(received.len(), 30);
    let mut by_group: HashMap<String, Vec<String>> = HashMap::new();
    for message in &received {
        let group = message
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .unwrap()
            .clone();
        by_group
            .entry(group)
            .or_default()
            .push(attr(message, "event_id").unwrap());
    }
    assert_eq!(by_group.len(), 3, "one group per key");
    let mut groups: Vec<Vec<String>> = by_group.into_values().collect();
    let mut keys: Vec<Vec<String>> = written.into_values().collect();
    groups.sort();
    keys.sort();
    assert_eq!(
        groups, keys,
        "each key's messages in one group, in the order written"
    );
    delete_queue(&sqs, &url).await;
    db.drop().await;
}

#[tokio::test]
async fn rows_sqs_cannot_take_stop_the_relay_and_stay_unsent() {
    let sqs = client().await;
    let url = fifo_queue(&sqs, "outbox-refused", 30).await;
    let db = TestDb::new().await;
    let outbox = migrated(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    // No key, and the sender has no message group: a FIFO queue cannot take it.
    outbox.write(&mut tx, name(&url), b"{}").await.unwrap();
    tx.commit().await.unwrap();

    let error = outbox
        .relay(producer(&sqs).await)
        .run_until_idle()
        .await
        .unwrap_err();
    assert!(
        matches!(error, RelayError::Publish { row: 1, .. }),
        "{error}"
    );
    assert_eq!(error.recovery(), Recovery::Fatal);
    assert!(
        error.to_string().contains("needs a message group"),
        "{error}"
    );

    // A body that is not text, on a standard queue.
    let standard = queue(&sqs, "outbox-binary", 30).await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .write(&mut tx, name(&standard), [0xff, 0xfe])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let sender = inbox_core::Destinations::new()
        .route(
            name(&url),
            SqsConnection::new(sqs.clone())
                .producer()
                .message_group_id("g")
                .connect()
                .await
                .unwrap(),
        )
        .route(name(&standard), producer(&sqs).await);
    let error = outbox.relay(sender).run_until_idle().await.unwrap_err();
    assert!(
        matches!(error, RelayError::Publish { row: 2, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("not UTF-8"), "{error}");

    assert_eq!(unsent(&db).await, 1, "the FIFO row went out with the group");
    assert_eq!(
        drain(&sqs, &standard, Duration::from_secs(1)).await.len(),
        0
    );
    assert_eq!(drain(&sqs, &url, Duration::from_secs(1)).await.len(), 1);
    delete_queue(&sqs, &url).await;
    delete_queue(&sqs, &standard).await;
    db.drop().await;
}
