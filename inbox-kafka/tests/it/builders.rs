//! How a source and a producer are built and what they report: the brokers come from
//! `KAFKA_BROKERS` unless the builder names them, the capabilities match what deliveries carry,
//! and one producer sends to any topic.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use inbox_core::{Ack, MessageSource, Publish};
use inbox_kafka::{KafkaConnection, KafkaSource};
use inbox_testkit::publish::{as_sent, send_each_way};

/// Set in the child process of [`a_source_without_brokers_uses_kafka_brokers`]: the topic it
/// reads.
const CHILD_TOPIC: &str = "INBOX_TEST_CHILD_TOPIC";
/// The brokers that do run, for the child (whose `KAFKA_BROKERS` points nowhere).
const REAL_BROKERS: &str = "INBOX_TEST_REAL_BROKERS";

/// The test runs itself again in a child process with `KAFKA_BROKERS` set to a port nothing
/// listens on (the environment of a running test cannot be changed safely). There, a source
/// built without `brokers` fails its first receive naming that address, and one built with
/// `brokers` reads.
#[tokio::test]
async fn a_source_without_brokers_uses_kafka_brokers() {
    if let Ok(topic) = std::env::var(CHILD_TOPIC) {
        child(&topic).await;
        return;
    }
    if skip_on_mock("the child process reads the brokers, not the mock's control port") {
        return;
    }
    let topic = topic(1).await;
    let ran = inbox_conformance::child::run(
        "a_source_without_brokers_uses_kafka_brokers",
        &[
            (CHILD_TOPIC, topic),
            (REAL_BROKERS, inbox_conformance::kafka::brokers()),
            ("KAFKA_BROKERS", "127.0.0.1:1".to_owned()),
        ],
    )
    .await;
    assert!(ran.passed, "the child failed:\n{}", ran.printed);
}

async fn child(topic: &str) {
    let mut nowhere = KafkaConnection::from_env()
        .operation_timeout(Duration::from_secs(2))
        .source([topic], random("group"))
        .connect()
        .await
        .expect("connect does not wait for the brokers");
    let e = nowhere
        .receive(1)
        .await
        .expect_err("nothing listens on KAFKA_BROKERS");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");

    let real = std::env::var(REAL_BROKERS).expect("the parent sets it");
    let mut given = KafkaConnection::new(real)
        .source([topic], random("group"))
        .poll_timeout(Duration::from_millis(200))
        .connect()
        .await
        .expect("source");
    given.receive(1).await.expect("the given brokers answer");
}

#[tokio::test]
async fn capabilities_match_what_deliveries_carry() {
    let topic = topic(1).await;
    let producer = producer().await;
    let id = producer.send(&topic, b"1").await.expect("sent");
    let mut source = source(&topic, &random("group")).await;
    let capabilities = source.capabilities();
    assert!(capabilities.lanes());
    assert!(!capabilities.delivery_count());
    assert!(!capabilities.delayed_nack());

    let first = inbox_testkit::receive(&mut source, 1, WAIT).await.remove(0);
    assert_eq!(first.message.id.as_ref().ok(), Some(&id));
    // Lanes: every delivery carries its partition.
    assert_eq!(
        first.message.meta.lane.as_deref(),
        Some(format!("{topic}[0]").as_str())
    );
    // No delivery count: a first delivery does not carry one.
    assert_eq!(first.message.meta.delivery_count, None);

    // No delayed nack: the record is back long before the minute asked for.
    first.ack.nack(Duration::from_secs(60)).await.expect("nack");
    let started = tokio::time::Instant::now();
    let again = inbox_testkit::receive(&mut source, 1, WAIT).await.remove(0);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(again.message.id.as_ref().ok(), Some(&id));
    assert!(again.message.meta.redelivered);
    assert_eq!(
        again.message.meta.lane.as_deref(),
        Some(format!("{topic}[0]").as_str())
    );
    again.ack.ack().await.expect("ack");
}

#[tokio::test]
async fn one_producer_sends_to_two_topics() {
    let (a, b) = (topic(1).await, topic(1).await);
    let producer = producer().await;
    let sent = send_each_way(&producer, &a, &b).await;

    let mut source = KafkaSource::builder([&a, &b], random("group"))
        .poll_timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("source");
    let mut received = BTreeSet::new();
    for delivery in inbox_testkit::receive(&mut source, sent.len(), WAIT).await {
        received.insert(as_sent(&delivery.message));
        delivery.ack.ack().await.expect("ack");
    }
    assert_eq!(received, sent);
}

/// Without brokers given and with `KAFKA_BROKERS` unset or empty, a source, a producer and a
/// dead-letter reader refuse to connect, naming both ways to set the brokers: no silent broker
/// on localhost. Run in a child process whose `KAFKA_BROKERS` is empty.
#[tokio::test]
async fn without_brokers_anywhere_connect_fails_naming_kafka_brokers() {
    if inbox_conformance::child::is_child() {
        let e = KafkaSource::builder(["t"], "g")
            .connect()
            .await
            .expect_err("no brokers anywhere");
        assert!(e.to_string().contains("KAFKA_BROKERS"), "{e}");
        let e = inbox_kafka::KafkaProducer::builder()
            .connect()
            .await
            .expect_err("no brokers anywhere");
        assert!(e.to_string().contains("KAFKA_BROKERS"), "{e}");
        let e = inbox_kafka::KafkaDeadLetters::builder("t.dlq")
            .connect()
            .await
            .expect_err("no brokers anywhere");
        assert!(e.to_string().contains("KAFKA_BROKERS"), "{e}");
        return;
    }
    let ran = inbox_conformance::child::run(
        "without_brokers_anywhere_connect_fails_naming_kafka_brokers",
        &[("KAFKA_BROKERS", String::new())],
    )
    .await;
    assert!(ran.passed, "the child failed:\n{}", ran.printed);
}
