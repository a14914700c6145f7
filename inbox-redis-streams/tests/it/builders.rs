//! How a source, a producer and a dead-letter reader are built and what they report: Redis is
//! found at `REDIS_URL` unless their connection names it, the capabilities match what deliveries carry, and one producer
//! sends to any stream.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use inbox_core::{Ack, MessageSource, Publish};
use inbox_redis_streams::{RedisConnection, RedisStreamProducer, RedisStreamSource};
use inbox_testkit::publish::{as_sent, send_each_way};

/// Set in the child process of [`builders_without_an_address_use_redis_url`]: the stream it
/// reads.
const CHILD_STREAM: &str = "INBOX_TEST_CHILD_STREAM";
/// The Redis that does run, for the child (whose `REDIS_URL` points nowhere).
const REAL_URL: &str = "INBOX_TEST_REAL_REDIS_URL";

/// The test runs itself again in a child process with `REDIS_URL` set to a port nothing listens
/// on (the environment of a running test cannot be changed safely). There, a source and a
/// producer built without `url` fail to connect naming that address, and with `url` connect.
#[tokio::test]
async fn builders_without_an_address_use_redis_url() {
    if let Ok(stream) = std::env::var(CHILD_STREAM) {
        child(&stream).await;
        return;
    }
    let stream = stream_key("env");
    let ran = inbox_conformance::child::run(
        "builders_without_an_address_use_redis_url",
        &[
            (CHILD_STREAM, stream.clone()),
            (REAL_URL, redis_url()),
            ("REDIS_URL", "redis://127.0.0.1:1".to_owned()),
        ],
    )
    .await;
    assert!(ran.passed, "the child failed:\n{}", ran.printed);
    cleanup(&stream).await;
}

async fn child(stream: &str) {
    let env = RedisConnection::from_env().operation_timeout(Duration::from_secs(2));
    let e = env
        .source(stream, GROUP)
        .connect()
        .await
        .expect_err("nothing listens at REDIS_URL");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    let e = env
        .producer()
        .connect()
        .await
        .expect_err("nothing listens at REDIS_URL");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    let e = env
        .dead_letters(format!("{stream}:dlq"))
        .connect()
        .await
        .expect_err("nothing listens at REDIS_URL");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");

    let real = RedisConnection::new(std::env::var(REAL_URL).expect("the parent sets it"));
    let given = "the given URL answers";
    real.source(stream, GROUP).connect().await.expect(given);
    real.producer().connect().await.expect(given);
    let dead_letters = real.dead_letters(format!("{stream}:dlq"));
    dead_letters.connect().await.expect(given);
}

#[tokio::test]
async fn capabilities_match_what_deliveries_carry() {
    let stream = stream_key("capabilities");
    let producer = producer().await;
    let mut source = builder(&stream, "c1")
        .claim_idle(Duration::from_millis(300))
        .claim_interval(Duration::from_millis(100))
        .connect()
        .await
        .expect("source connects");
    let capabilities = source.capabilities();
    assert!(capabilities.delivery_count());
    assert!(!capabilities.lanes());
    assert!(!capabilities.delayed_nack());

    let id = producer.send(&stream, b"1").await.expect("send");
    let first = inbox_testkit::receive(&mut source, 1, Duration::from_secs(30))
        .await
        .remove(0);
    assert_eq!(first.message.id.as_ref().ok(), Some(&id));
    // Delivery count: a first delivery carries 1.
    assert_eq!(first.message.meta.delivery_count, Some(1));
    // No lanes.
    assert_eq!(first.message.meta.lane, None);

    // No delayed nack: the entry is back after `claim_idle`, long before the minute asked for,
    // counted as a second delivery.
    first.ack.nack(Duration::from_secs(60)).await.expect("nack");
    let again = inbox_testkit::receive(&mut source, 1, Duration::from_secs(30))
        .await
        .remove(0);
    assert_eq!(again.message.id.as_ref().ok(), Some(&id));
    assert_eq!(again.message.meta.delivery_count, Some(2));
    assert!(again.message.meta.redelivered);
    again.ack.ack().await.expect("ack");
    assert_eq!(pending(&stream).await, 0);
    cleanup(&stream).await;
}

#[tokio::test]
async fn one_producer_sends_to_two_streams() {
    let (a, b) = (stream_key("two-a"), stream_key("two-b"));
    let producer = producer().await;
    let sent = send_each_way(&producer, &a, &b).await;

    let mut received = BTreeSet::new();
    for stream in [&a, &b] {
        let mut source = source(stream, "c1").await;
        for delivery in inbox_testkit::receive(&mut source, 3, Duration::from_secs(30)).await {
            received.insert(as_sent(&delivery.message));
            delivery.ack.ack().await.expect("ack");
        }
        cleanup(stream).await;
    }
    assert_eq!(received, sent);
}

/// Without `url` or `client` and with `REDIS_URL` unset or empty, a source and a producer
/// refuse to connect, naming both ways to set the server: no silent Redis on localhost. Run in
/// a child process whose `REDIS_URL` is empty.
#[tokio::test]
async fn without_a_url_anywhere_connect_fails_naming_redis_url() {
    if inbox_conformance::child::is_child() {
        let e = RedisStreamSource::builder("s", "g")
            .connect()
            .await
            .expect_err("no server anywhere");
        assert!(e.to_string().contains("REDIS_URL"), "{e}");
        let e = RedisStreamProducer::builder()
            .connect()
            .await
            .expect_err("no server anywhere");
        assert!(e.to_string().contains("REDIS_URL"), "{e}");
        return;
    }
    let ran = inbox_conformance::child::run(
        "without_a_url_anywhere_connect_fails_naming_redis_url",
        &[("REDIS_URL", String::new())],
    )
    .await;
    assert!(ran.passed, "the child failed:\n{}", ran.printed);
}
