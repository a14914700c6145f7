//! The adapter's shape: a source and a producer built from the environment, what the source's
//! capabilities promise against what its deliveries carry, and one producer for many queues.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{client, delete_queue, fifo_queue, producer, queue, LOCAL_ENDPOINT};
use inbox_core::{Ack, MessageId, MessageSource, OutgoingMessage, Publish};
use inbox_sqs::{SqsConnection, SqsSource};

const SECOND: Duration = Duration::from_secs(1);

/// Set in the child process only: the queue it connects to.
const CHILD_QUEUE: &str = "INBOX_SQS_TEST_CHILD_QUEUE";

/// Runs [`child_connects_from_the_environment`] in a process of its own with
/// `AWS_ENDPOINT_URL_SQS=endpoint` (changing the environment of this process would race the
/// other tests), and returns whether it connected and what it printed.
async fn connect_in_child(endpoint: &str, queue_url: &str) -> (bool, String) {
    let mut envs = vec![
        ("AWS_ENDPOINT_URL_SQS", endpoint.to_owned()),
        (CHILD_QUEUE, queue_url.to_owned()),
    ];
    // Credentials and region as the local endpoint takes them, where none are configured.
    for (name, value) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
    ] {
        if std::env::var_os(name).is_none() {
            envs.push((name, value.to_owned()));
        }
    }
    let ran = inbox_conformance::child::run("child_connects_from_the_environment", &envs).await;
    (ran.printed.contains("CONNECTED"), ran.printed)
}

/// Not a test of its own: the child process of
/// [`connect_without_a_client_takes_the_endpoint_from_the_environment`].
#[tokio::test]
#[ignore = "run in a child process by connect_without_a_client_takes_the_endpoint_from_the_environment"]
async fn child_connects_from_the_environment() {
    let Ok(queue_url) = std::env::var(CHILD_QUEUE) else {
        return;
    };
    let source = SqsSource::builder(&queue_url)
        .poll_timeout(SECOND)
        .connect()
        .await;
    match source {
        Ok(source) => println!("CONNECTED to {}", source.queue_url()),
        Err(e) => println!("FAILED: {e}"),
    }
}

#[tokio::test]
async fn connect_without_a_client_takes_the_endpoint_from_the_environment() {
    let sqs = client().await;
    let url = queue(&sqs, "env", 30).await;
    let endpoint =
        std::env::var("AWS_ENDPOINT_URL_SQS").unwrap_or_else(|_| LOCAL_ENDPOINT.to_owned());

    let (connected, printed) = connect_in_child(&endpoint, &url).await;
    assert!(connected, "connects through {endpoint}: {printed}");
    // Nothing listens on port 9: the same queue URL fails there, so the endpoint came from
    // the variable, not from the queue URL.
    let (connected, printed) = connect_in_child("http://127.0.0.1:9", &url).await;
    assert!(!connected, "{printed}");
    assert!(printed.contains("FAILED"), "{printed}");
    delete_queue(&sqs, &url).await;
}

/// Receives until a delivery arrives or `limit` passes.
async fn next(
    source: &mut SqsSource,
    limit: Duration,
) -> Option<inbox_core::Delivery<inbox_sqs::SqsAck>> {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if let Some(delivery) = source.receive(1).await.unwrap().into_iter().next() {
            return Some(delivery);
        }
    }
    None
}

#[tokio::test]
async fn a_standard_queue_counts_deliveries_and_delays_nacks_without_lanes() {
    let sqs = client().await;
    let url = queue(&sqs, "caps", 30).await;
    let producer = producer(&sqs).await;
    let id = producer.send(&url, b"{}").await.unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let caps = source.capabilities();
    assert!(
        caps.delivery_count() && caps.delayed_nack() && !caps.lanes(),
        "{caps:?}"
    );

    let first = next(&mut source, Duration::from_secs(10)).await.unwrap();
    assert_eq!(first.message.id.as_ref().unwrap(), &id);
    assert_eq!(first.message.meta.delivery_count, Some(1));
    assert_eq!(first.message.meta.lane, None);
    first.ack.nack(Duration::from_secs(3)).await.unwrap();
    // Delayed: not back within the first second of the three.
    assert!(
        source.receive(1).await.unwrap().is_empty(),
        "a nacked message stays away for its delay"
    );
    let again = next(&mut source, Duration::from_secs(15)).await.unwrap();
    assert_eq!(again.message.id.as_ref().unwrap(), &id);
    assert_eq!(again.message.meta.delivery_count, Some(2));
    again.ack.ack().await.unwrap();
    delete_queue(&sqs, &url).await;
}

#[tokio::test]
async fn a_fifo_queue_hands_out_its_message_groups_as_lanes() {
    let sqs = client().await;
    let url = fifo_queue(&sqs, "caps", 30).await;
    let producer = producer(&sqs).await;
    let message = OutgoingMessage::generate(&b"{}"[..]).key("account-7");
    producer
        .send_batch(&url, std::slice::from_ref(&message))
        .await
        .unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let caps = source.capabilities();
    assert!(
        caps.delivery_count() && caps.delayed_nack() && caps.lanes(),
        "{caps:?}"
    );

    let delivery = next(&mut source, Duration::from_secs(10)).await.unwrap();
    assert_eq!(delivery.message.id.as_ref().unwrap(), &message.id);
    assert_eq!(delivery.message.meta.lane.as_deref(), Some("account-7"));
    assert_eq!(delivery.message.meta.delivery_count, Some(1));
    delivery.ack.ack().await.unwrap();
    delete_queue(&sqs, &url).await;
}

/// Every message ID on `url`, acked.
async fn ids_on(
    sqs: &inbox_sqs::aws_sdk_sqs::Client,
    url: &str,
    expected: usize,
) -> BTreeSet<MessageId> {
    let mut source = SqsConnection::new(sqs.clone())
        .source(url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let mut ids = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ids.len() < expected && tokio::time::Instant::now() < deadline {
        for delivery in source.receive(10).await.unwrap() {
            ids.insert(delivery.message.id.clone().unwrap());
            delivery.ack.ack().await.unwrap();
        }
    }
    ids
}

#[tokio::test]
async fn one_producer_sends_to_two_queues_by_url_and_by_name() {
    let sqs = client().await;
    let first = queue(&sqs, "dest-a", 30).await;
    let second = queue(&sqs, "dest-b", 30).await;
    let second_name = second.rsplit('/').next().unwrap().to_owned();
    let producer = producer(&sqs).await;

    let generated = producer.send(&first, b"{}").await.unwrap();
    let given = MessageId::new("order-17").unwrap();
    producer
        .send_with_id(&second_name, &given, b"{}")
        .await
        .unwrap();
    let batch_a: Vec<OutgoingMessage> = (0..12).map(|_| OutgoingMessage::generate("{}")).collect();
    let batch_b: Vec<OutgoingMessage> = (0..3).map(|_| OutgoingMessage::generate("{}")).collect();
    producer.send_batch(&first, &batch_a).await.unwrap();
    producer.send_batch(&second_name, &batch_b).await.unwrap();
    assert_eq!(producer.queue_url(&second_name).await.unwrap(), second);

    let mut want_a: BTreeSet<MessageId> = batch_a.iter().map(|m| m.id.clone()).collect();
    want_a.insert(generated);
    let mut want_b: BTreeSet<MessageId> = batch_b.iter().map(|m| m.id.clone()).collect();
    want_b.insert(given);
    assert_eq!(ids_on(&sqs, &first, want_a.len()).await, want_a);
    assert_eq!(ids_on(&sqs, &second, want_b.len()).await, want_b);
    delete_queue(&sqs, &first).await;
    delete_queue(&sqs, &second).await;
}

/// The deduplication ID exists on FIFO queues only: a source reading it from a standard queue
/// is refused before it connects, naming the queue.
#[tokio::test]
async fn the_deduplication_id_is_refused_on_a_standard_queue() {
    let url = "http://127.0.0.1:4566/000000000000/payments";
    let e = SqsConnection::new(client().await)
        .source(url)
        .id_from(inbox_sqs::IdFrom::MessageIdProperty)
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("standard queue") && e.contains(url), "{e}");
}

/// A dead letter adds the attributes `reason`, `original_source` and `original_position`: an ID
/// read from one of them would be overwritten by it, and every letter of one reason would replay
/// under one ID. The source, the producer and the dead-letter reader refuse those names before
/// any call, naming the attribute and the fix.
#[tokio::test]
async fn an_id_attribute_named_like_a_dead_letter_attribute_is_refused() {
    use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
    let url = "http://127.0.0.1:4566/000000000000/payments";
    let sqs = client().await;
    let named = |e: String, name: &str| {
        assert!(
            e.contains(&format!("`{name}`")) && e.contains("dead letter") && e.contains("rename"),
            "{e}"
        );
    };
    for name in [REASON, ORIGINAL_SOURCE, ORIGINAL_POSITION] {
        let source = SqsConnection::new(sqs.clone())
            .source(url)
            .id_attribute(name)
            .connect()
            .await;
        let Err(inbox_sqs::Error::Config(e)) = source else {
            panic!("source with id_attribute({name}): {source:?}");
        };
        named(e, name);
        let source = SqsConnection::new(sqs.clone())
            .source(url)
            .id_from(inbox_sqs::IdFrom::header("event_id").or(inbox_sqs::IdFrom::header(name)))
            .connect()
            .await;
        let Err(inbox_sqs::Error::Config(e)) = source else {
            panic!("source with id_from(.. or {name}): {source:?}");
        };
        named(e, name);
        let producer = SqsConnection::new(sqs.clone())
            .producer()
            .id_attribute(name)
            .connect()
            .await;
        let Err(inbox_sqs::Error::Config(e)) = producer else {
            panic!("producer with id_attribute({name}): {producer:?}");
        };
        named(e, name);
        let reader = SqsConnection::new(sqs.clone())
            .dead_letters(format!("{url}-dlq"))
            .id_attribute(name)
            .connect()
            .await;
        let Err(inbox_sqs::Error::Config(e)) = reader else {
            panic!("dead-letter reader with id_attribute({name}): {reader:?}");
        };
        named(e, name);
    }
}
