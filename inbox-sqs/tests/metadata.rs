//! What the SQS source tells the consumer's telemetry about a message: the broker, its
//! `SentTimestamp` (for the end-to-end lag) and the producer's `traceparent` attribute.

mod common;

use std::time::{Duration, SystemTime};

use inbox_core::{Ack, MessageSource, TraceParent};
use inbox_sqs::aws_sdk_sqs::types::MessageAttributeValue;
use inbox_sqs::SqsSource;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("a valid attribute")
}

#[tokio::test]
async fn a_message_carries_its_sent_timestamp_and_trace_parent() {
    let client = common::client().await;
    let queue = common::queue(&client, "metadata", 30).await;
    let before = SystemTime::now() - Duration::from_secs(5);
    client
        .send_message()
        .queue_url(&queue)
        .message_body("{}")
        .message_attributes("event_id", text("m-1"))
        .message_attributes("traceparent", text(TRACEPARENT))
        .send()
        .await
        .expect("sent");
    let mut source = SqsSource::builder(&queue)
        .client(client)
        .poll_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect("the source builds");
    assert_eq!(source.system(), "aws_sqs");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut batch = Vec::new();
    while batch.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "nothing received");
        batch = source.receive(10).await.expect("receives");
    }
    let delivery = batch.remove(0);
    let sent = delivery
        .message
        .meta
        .timestamp
        .expect("SentTimestamp was asked for");
    assert!(sent >= before, "{sent:?} is before the send");
    assert!(
        sent <= SystemTime::now() + Duration::from_secs(5),
        "{sent:?} is in the future"
    );
    assert_eq!(
        TraceParent::from_message(&delivery.message).map(|p| p.to_string()),
        Some(TRACEPARENT.to_owned())
    );
    delivery.ack.ack().await.expect("deleted");
}
