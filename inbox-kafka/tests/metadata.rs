//! What the Kafka source tells the consumer's telemetry about a record: the broker, the record's
//! timestamp (for the end-to-end lag) and the producer's `traceparent` header.

mod common;

use std::time::{Duration, SystemTime};

use inbox_core::{Ack, MessageSource, TraceParent};
use inbox_kafka::Record;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn a_record_carries_its_timestamp_and_trace_parent() {
    let topic = common::topic(1).await;
    let before = SystemTime::now() - Duration::from_secs(5);
    common::producer()
        .await
        .send_record(&topic, Record::new("{}").header("traceparent", TRACEPARENT))
        .await
        .expect("produced");
    let mut source = common::source(&topic, &common::random("g")).await;
    assert_eq!(source.system(), "kafka");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut batch = Vec::new();
    while batch.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "nothing received");
        batch = source.receive(10).await.expect("receives");
    }
    let delivery = batch.remove(0);
    let sent = delivery.message.meta.timestamp.expect("a record timestamp");
    assert!(sent >= before, "{sent:?} is before the send");
    assert!(
        sent <= SystemTime::now() + Duration::from_secs(5),
        "{sent:?} is in the future"
    );
    assert_eq!(
        TraceParent::from_message(&delivery.message).map(|p| p.to_string()),
        Some(TRACEPARENT.to_owned())
    );
    delivery.ack.ack().await.expect("acked");
}
