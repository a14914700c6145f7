//! The adapter's shape: a source and a producer that take the broker from `AMQP_URL`, what the
//! source's capabilities promise against what its deliveries carry, and one producer for many
//! queues.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use inbox_core::{Ack, MessageId, MessageSource, OutgoingMessage, Publish};
use inbox_rabbitmq::{RabbitAck, RabbitConnection, RabbitProducer, RabbitSource, Topology};

/// Set in the child process only: the queue it connects to.
const CHILD_QUEUE: &str = "INBOX_RABBITMQ_TEST_CHILD_QUEUE";

/// Runs [`child_connects_from_the_environment`] in a process of its own with `AMQP_URL=url`
/// (changing the environment of this process would race the other tests), and returns what it
/// printed.
async fn connect_in_child(url: &str, queue: &str) -> String {
    let envs = [
        ("AMQP_URL", url.to_owned()),
        (CHILD_QUEUE, queue.to_owned()),
    ];
    inbox_conformance::child::run("child_connects_from_the_environment", &envs)
        .await
        .printed
}

/// Not a test of its own: the child process of
/// [`source_and_producer_take_the_broker_from_amqp_url`].
#[tokio::test]
#[ignore = "run in a child process by source_and_producer_take_the_broker_from_amqp_url"]
async fn child_connects_from_the_environment() {
    let Ok(queue) = std::env::var(CHILD_QUEUE) else {
        return;
    };
    match RabbitSource::builder(&queue).connect().await {
        Ok(source) => {
            println!("SOURCE CONNECTED");
            source.close().await;
        }
        Err(e) => println!("SOURCE FAILED: {e}"),
    }
    match RabbitProducer::builder().connect().await {
        Ok(producer) => {
            println!("PRODUCER CONNECTED");
            producer.close().await;
        }
        Err(e) => println!("PRODUCER FAILED: {e}"),
    }
}

#[tokio::test]
async fn source_and_producer_take_the_broker_from_amqp_url() {
    let config = fresh_config("env");
    let printed = connect_in_child(&amqp_url(), config.queue()).await;
    assert!(printed.contains("SOURCE CONNECTED"), "{printed}");
    assert!(printed.contains("PRODUCER CONNECTED"), "{printed}");

    // Nothing listens on port 1: both fail, naming the address they were given.
    let printed = connect_in_child("amqp://guest:guest@127.0.0.1:1/%2f", config.queue()).await;
    assert!(printed.contains("SOURCE FAILED"), "{printed}");
    assert!(printed.contains("PRODUCER FAILED"), "{printed}");
    assert!(printed.contains("127.0.0.1:1"), "{printed}");
    cleanup(&config).await;
}

/// Receives until a delivery arrives or 10 s pass.
async fn next(source: &mut RabbitSource) -> inbox_core::Delivery<RabbitAck> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        if let Some(delivery) = source.receive(1).await.unwrap().into_iter().next() {
            return delivery;
        }
    }
    panic!("no delivery within 10 s");
}

#[tokio::test]
async fn a_declared_quorum_queue_counts_deliveries_and_nothing_else() {
    let config = fresh_config("caps");
    let producer = publisher(&config).await;
    let id = producer.send(config.queue(), b"{}").await.unwrap();
    let mut source = config.clone().connect().await.unwrap();
    let caps = source.capabilities();
    assert!(
        caps.delivery_count() && !caps.delayed_nack() && caps.delayed_redelivery() && !caps.lanes(),
        "{caps:?}"
    );

    let first = next(&mut source).await;
    assert_eq!(first.message.id.as_ref().unwrap(), &id);
    assert_eq!(first.message.meta.delivery_count, Some(1));
    assert_eq!(first.message.meta.lane, None);
    first.ack.nack(Duration::ZERO).await.unwrap();
    let again = next(&mut source).await;
    assert_eq!(again.message.id.as_ref().unwrap(), &id);
    assert!(again.message.meta.redelivered);
    assert_eq!(again.message.meta.delivery_count, Some(2));
    assert_eq!(again.message.meta.lane, None);
    again.ack.ack().await.unwrap();
    source.close().await;

    // An expected queue may be a classic one, whose redeliveries carry no count; its delay
    // queues are declared at first use all the same.
    let expecting = config
        .clone()
        .topology(Topology::Expect)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        expecting.capabilities(),
        inbox_core::Capabilities::NONE.with_delayed_redelivery()
    );
    expecting.close().await;
    producer.close().await;
    cleanup(&config).await;
}

/// Every message ID on the queue of `config`, acked.
async fn ids_on(
    config: &inbox_rabbitmq::RabbitSourceBuilder,
    expected: usize,
) -> BTreeSet<MessageId> {
    let mut source = config.clone().connect().await.unwrap();
    let mut ids = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ids.len() < expected && tokio::time::Instant::now() < deadline {
        for delivery in source.receive(50).await.unwrap() {
            ids.insert(delivery.message.id.clone().unwrap());
            delivery.ack.ack().await.unwrap();
        }
    }
    source.close().await;
    ids
}

#[tokio::test]
async fn one_producer_sends_to_two_queues() {
    let first = fresh_config("dest-a");
    let second = fresh_config("dest-b");
    first.declare_topology().await.unwrap();
    second.declare_topology().await.unwrap();
    let producer = RabbitConnection::new(amqp_url())
        .producer()
        .connect()
        .await
        .unwrap();

    let generated = producer.send(first.queue(), b"{}").await.unwrap();
    let given = MessageId::new("order-17").unwrap();
    producer
        .send_with_id(second.queue(), &given, b"{}")
        .await
        .unwrap();
    let batch_a: Vec<OutgoingMessage> = (0..12).map(|_| OutgoingMessage::generate("{}")).collect();
    let batch_b: Vec<OutgoingMessage> = (0..3).map(|_| OutgoingMessage::generate("{}")).collect();
    producer.send_batch(first.queue(), &batch_a).await.unwrap();
    producer.send_batch(second.queue(), &batch_b).await.unwrap();
    producer.close().await;

    let mut want_a: BTreeSet<MessageId> = batch_a.iter().map(|m| m.id.clone()).collect();
    want_a.insert(generated);
    let mut want_b: BTreeSet<MessageId> = batch_b.iter().map(|m| m.id.clone()).collect();
    want_b.insert(given);
    assert_eq!(ids_on(&first, want_a.len()).await, want_a);
    assert_eq!(ids_on(&second, want_b.len()).await, want_b);
    cleanup(&first).await;
    cleanup(&second).await;
}

/// Without `url` and with `AMQP_URL` unset or empty, a source and a producer refuse to connect,
/// naming both ways to set the broker: no silent `guest` login on localhost. Run in a child
/// process whose `AMQP_URL` is empty.
#[tokio::test]
async fn without_a_url_anywhere_connect_fails_naming_amqp_url() {
    if inbox_conformance::child::is_child() {
        let e = RabbitSource::builder("q").connect().await.unwrap_err();
        assert!(e.to_string().contains("AMQP_URL"), "{e}");
        let e = RabbitProducer::builder().connect().await.unwrap_err();
        assert!(e.to_string().contains("AMQP_URL"), "{e}");
        return;
    }
    let ran = inbox_conformance::child::run(
        "without_a_url_anywhere_connect_fails_naming_amqp_url",
        &[("AMQP_URL", String::new())],
    )
    .await;
    assert!(ran.passed, "the child failed:\n{}", ran.printed);
}
