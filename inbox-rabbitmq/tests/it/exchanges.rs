//! Publishing to exchanges and consuming through bindings: a fanout exchange gives each bound
//! queue (each consumer group) every message, each applied once by its own inbox; a topic
//! binding takes only the keys it matches, and a message no queue takes fails its publish; a
//! queue argument of the user's is declared with the queue.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;
use inbox_conformance::wallet::{self, Credit};
use inbox_conformance::{unique_name, TestDb};
use inbox_core::{Consumer, MessageId, OutgoingMessage, Publish};
use inbox_rabbitmq::lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions};
use inbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use inbox_rabbitmq::lapin::ExchangeKind;
use inbox_rabbitmq::{RabbitConnection, RabbitProducer, RabbitSourceBuilder};

async fn producer_to(exchange: &str) -> RabbitProducer {
    RabbitConnection::new(amqp_url())
        .producer()
        .exchange(exchange)
        .connect()
        .await
        .unwrap()
}

async fn delete_exchange(exchange: &str) {
    let (_connection, channel) = admin_channel().await;
    let _ = channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await;
}

/// Applies what `config`'s queue holds with the wallet in a schema of its own: (applied,
/// skipped, ledger rows).
async fn apply_all(config: RabbitSourceBuilder) -> (u64, u64, i64) {
    let db = TestDb::new().await;
    let source = config.connect().await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(20)
        .run_until_idle()
        .await
        .unwrap();
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!(summary.duplicates(), 0);
    db.drop().await;
    (stats.applied, stats.skipped_duplicates, summary.ledger_rows)
}

#[tokio::test]
async fn a_fanout_exchange_gives_every_group_each_message_once() {
    let exchange = unique_name("inbox-test-fanout");
    let groups: Vec<RabbitSourceBuilder> = ["ledger", "audit"]
        .iter()
        .map(|group| fresh_config(group).bind(&exchange, ExchangeKind::Fanout, ""))
        .collect();
    for group in &groups {
        group.declare_topology().await.unwrap();
    }
    let producer = producer_to(&exchange).await;
    let mut batch = Vec::new();
    for i in 0..50 {
        let message = OutgoingMessage::new(MessageId::generate(), credit(1 + i % 3, 1));
        if i % 10 == 0 {
            batch.push(message.clone()); // a resent copy
        }
        batch.push(message);
    }
    producer.send_batch("", &batch).await.unwrap();

    for group in groups {
        let queue = group.queue().to_owned();
        let cleanup_config = group.clone();
        let (applied, skipped, rows) = apply_all(group).await;
        println!("fanout to {queue}: applied {applied}, skipped {skipped}, ledger {rows}");
        assert_eq!((applied, skipped, rows), (50, 5, 50), "{queue}");
        cleanup(&cleanup_config).await;
    }
    delete_exchange(&exchange).await;
}

#[tokio::test]
async fn a_topic_binding_takes_only_the_keys_it_matches_and_an_unmatched_publish_fails() {
    let exchange = unique_name("inbox-test-topic");
    let orders = fresh_config("orders").bind(&exchange, ExchangeKind::Topic, "orders.*");
    orders.declare_topology().await.unwrap();
    let producer = producer_to(&exchange).await;
    for key in ["orders.created", "orders.paid", "orders.created"] {
        producer.send(key, &credit(1, 10)).await.unwrap();
    }
    let unmatched = producer.send("payments.done", &credit(1, 1000)).await;
    let error = unmatched.unwrap_err();
    println!("unmatched: {error}");
    assert!(
        error.to_string().contains("exchange") && error.to_string().contains("payments.done"),
        "{error}"
    );

    let (applied, _, rows) = apply_all(orders.clone()).await;
    assert_eq!((applied, rows), (3, 3), "only orders.* reached the queue");
    cleanup(&orders).await;
    delete_exchange(&exchange).await;
}

#[tokio::test]
async fn a_queue_argument_of_the_users_is_declared_with_the_queue() {
    let config =
        fresh_config("arguments").queue_argument("x-max-length", AMQPValue::LongLongInt(1000));
    config.declare_topology().await.unwrap();
    // Declaring the queue again without the argument is refused: the broker has it.
    let (_connection, channel) = admin_channel().await;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".to_owned().into()),
    );
    let redeclared = channel
        .queue_declare(
            config.queue().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await;
    let refused = redeclared.unwrap_err().to_string();
    assert!(refused.contains("PRECONDITION_FAILED"), "{refused}");
    cleanup(&config).await;
}
