//! A missing dead-letter topic is found at start, not when the first record must be parked:
//! otherwise that record fails to park, is handed back, fails again, and its partition stalls
//! behind it while the consumer looks healthy.

use crate::common;

use std::time::Duration;

use common::*;
use inbox_core::dead_letter::REASON;
use inbox_core::{Consumer, Publish};
use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use inbox_kafka::rdkafka::ClientConfig;
use inbox_testkit::{MemoryStore, Sum};

/// Whether the broker knows `topic`, from a metadata request for all topics (one naming the
/// topic could make a broker that auto-creates topics create it).
async fn topic_exists(topic: &str) -> bool {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", inbox_conformance::kafka::brokers())
            .create()
            .expect("client");
        let metadata = client
            .fetch_metadata(None, Duration::from_secs(10))
            .expect("metadata");
        metadata.topics().iter().any(|t| t.name() == topic)
    })
    .await
    .expect("metadata task")
}

/// A topic without a dead-letter topic, holding a record without an ID and a good one.
async fn topic_with_a_poison_record() -> String {
    init_tracing();
    let topic = random("inbox-test");
    create_topic(&topic, 1).await;
    let producer = producer().await;
    send_raw(&producer, &topic, None, None, &[], b"7").await;
    producer.send(&topic, b"5").await.expect("produce");
    topic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_stops_the_consumer_at_start() {
    let topic = topic_with_a_poison_record().await;
    let dlq = format!("{topic}.dlq");
    let kafka = KafkaConnection::new(brokers()).operation_timeout(Duration::from_secs(3));
    let source = config_on(&kafka, &topic, &random("group"))
        .connect()
        .await
        .expect("source");
    let store = MemoryStore::<i64>::new();
    let run = Consumer::new("sum", source, store.clone(), Sum)
        .error_backoff(Duration::from_millis(100))
        .run_until_idle();
    let outcome = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the consumer stops instead of stalling on the record it cannot park");
    let message = match &outcome {
        Ok(stats) => format!("ran on: {stats:?}"),
        Err(e) => format!(
            "{e} / {:?}",
            std::error::Error::source(e).map(|s| s.to_string())
        ),
    };
    println!("no dead-letter topic: {message}");
    assert!(outcome.is_err(), "{message}");
    assert!(
        message.contains(&format!("`{dlq}`")),
        "names the topic: {message}"
    );
    assert!(
        message.contains("create_dead_letter_topics"),
        "names the fix: {message}"
    );
    assert!(
        !topic_exists(&dlq).await,
        "the check did not create the topic"
    );
    assert_eq!(
        store.state().await,
        0,
        "nothing was applied before the check"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_is_created_when_allowed_and_receives_the_record() {
    if skip_on_mock("the source creates the topic with CreateTopics, which the mock lacks") {
        return;
    }
    let topic = topic_with_a_poison_record().await;
    let dlq = format!("{topic}.dlq");
    // `run_until_idle` stops at the first empty poll. With the suite's 500 ms poll, a group
    // join slower than that on a loaded machine ended the run before the first record (a CI run
    // received 0; a 50 ms poll does it every time), so this poll outlasts any join.
    let source = config(&topic, &random("group"))
        .create_dead_letter_topics(true)
        .poll_timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("source");
    let store = MemoryStore::<i64>::new();
    let run = Consumer::new("sum", source, store.clone(), Sum).run_until_idle();
    let stats = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the consumer finishes")
        .expect("the consumer runs");
    let dead = read_all(&dlq).await;
    println!(
        "created dead-letter topic: {stats:?}, {} dead letters",
        dead.len()
    );
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(dead.len(), 1);
    let reason = String::from_utf8_lossy(header(&dead[0], REASON).expect("reason"));
    assert!(reason.contains("event_id"), "{reason}");
    assert_eq!(store.state().await, 5, "the good record was applied");
}
