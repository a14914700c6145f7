//! What the RabbitMQ source tells the consumer's telemetry about a delivery: the broker, the
//! publisher's `timestamp` property (for the end-to-end lag) and its `traceparent` header.

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_core::{Ack, MessageSource, Publish};
use inbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use inbox_rabbitmq::lapin::BasicProperties;
use inbox_testkit::metadata::{assert_traced, TRACEPARENT};

#[tokio::test]
async fn a_delivery_carries_its_timestamp_and_trace_parent() {
    let config = common::fresh_config("metadata");
    let publisher = common::publisher(&config).await;
    let sent_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let mut headers = FieldTable::default();
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(TRACEPARENT.into()),
    );
    publisher
        .publish_with_properties(
            config.queue(),
            b"{}",
            BasicProperties::default()
                .with_message_id("m-1".into())
                .with_timestamp(sent_at)
                .with_headers(headers),
        )
        .await
        .expect("published");
    // Without a timestamp: no lag to report.
    publisher
        .send(config.queue(), b"{}")
        .await
        .expect("published");

    let mut source = config.clone().connect().await.expect("connects");
    assert_eq!(source.system(), "rabbitmq");
    let mut batch = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while batch.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "got {}",
            batch.len()
        );
        batch.extend(source.receive(10).await.expect("receives"));
    }
    let stamped = &batch[0].message;
    assert_eq!(
        stamped.meta.timestamp,
        Some(UNIX_EPOCH + Duration::from_secs(sent_at))
    );
    assert_traced(stamped);
    assert_eq!(batch[1].message.meta.timestamp, None);
    for delivery in batch {
        delivery.ack.ack().await.expect("acked");
    }
    common::cleanup(&config).await;
}
