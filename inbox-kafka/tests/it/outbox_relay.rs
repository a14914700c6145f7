//! Inbox, then outbox, on Kafka: outbox rows written in transactions are published by
//! `OutboxRelay` through `KafkaProducer`, each row's key choosing its partition, and a
//! downstream inbox consumer applies each once, in the order written per key.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::wallet::{Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::OutgoingMessage;
use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use inbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};

const PARTITIONS: i32 = 3;

/// The ID header of every record on `topic`, read from the start of each partition until
/// nothing more comes for 3 s. (Not the watermarks: Tansu 0.6 counts offsets per record batch,
/// and the relay produces batches.)
async fn ids_on(topic: &str) -> Vec<String> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", inbox_conformance::kafka::brokers())
            .set("group.id", random("reader"))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut list = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            list.add_partition_offset(&topic, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&list).unwrap();
        let mut ids = Vec::new();
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < Duration::from_secs(3) {
            if let Some(Ok(record)) = consumer.poll(Duration::from_millis(200)) {
                let record = record.detach();
                let id = header(&record, "event_id").unwrap();
                ids.push(String::from_utf8(id.to_vec()).unwrap());
                quiet_since = Instant::now();
            }
        }
        ids
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn the_relay_publishes_each_row_once_by_key_and_the_downstream_inbox_applies_them_in_order() {
    const ROWS: i64 = 120;
    const ACCOUNTS: i64 = 4;
    let topic = topic(PARTITIONS).await;
    let db = TestDb::new().await;
    let outbox = inbox_conformance::outbox_table::migrated(&db).await;
    let mut written: HashMap<i64, Vec<String>> = HashMap::new();
    for chunk in (0..ROWS).collect::<Vec<_>>().chunks(40) {
        let mut tx = db.pool.begin().await.unwrap();
        let messages: Vec<OutgoingMessage> = chunk
            .iter()
            .map(|i| {
                let account = 1 + i % ACCOUNTS;
                let message = OutgoingMessage::generate(CreditEvent::new(account, i + 1).to_json())
                    .key(format!("account-{account}"));
                written
                    .entry(account)
                    .or_default()
                    .push(message.id.to_string());
                message
            })
            .collect();
        outbox.write_all(&mut tx, &topic, &messages).await.unwrap();
        tx.commit().await.unwrap();
    }

    let relayed = outbox
        .relay(producer().await)
        .batch_size(50)
        .run_until_idle()
        .await
        .unwrap();
    let consumer = Running::start(
        "wallet",
        source(&topic, &random("group")).await,
        db.inbox(),
        Credit::new(db.clone()),
        20,
    );
    let all_applied = wait_for_events(&db, ROWS).await;
    let stats = consumer.stop().await.unwrap();

    assert!(all_applied, "{stats:?}");
    assert_eq!(relayed.published, ROWS as u64);
    let mut on_topic = ids_on(&topic).await;
    on_topic.sort();
    let mut rows: Vec<String> = written.values().flatten().cloned().collect();
    rows.sort();
    assert_eq!(on_topic, rows, "each row published once");
    assert_eq!((stats.applied, stats.skipped_duplicates), (ROWS as u64, 0));
    for (account, ids) in &written {
        let applied: Vec<String> =
            sqlx::query_scalar("SELECT event_id FROM ledger WHERE account_id = $1 ORDER BY id")
                .bind(account)
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(
            &applied, ids,
            "account {account}: one key, one partition, in order"
        );
    }
    db.drop().await;
}
