//! What the Kafka source tells the consumer's telemetry about a record: the broker, the record's
//! timestamp (for the end-to-end lag) and the producer's `traceparent` header.

use crate::common;

use std::time::{Duration, SystemTime};

use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{Ack, MessageSource, OutgoingMessage, Publish};
use inbox_testkit::metadata::{assert_sent_since, assert_traced, TRACEPARENT};
use inbox_testkit::receive;

#[tokio::test]
async fn a_record_carries_its_timestamp_and_trace_parent() {
    let topic = common::topic(1).await;
    let before = SystemTime::now() - Duration::from_secs(5);
    common::producer()
        .await
        .send_batch(
            &topic,
            &[OutgoingMessage::generate("{}").header(TRACEPARENT_HEADER, TRACEPARENT)],
        )
        .await
        .expect("produced");
    let mut source = common::source(&topic, &common::random("g")).await;
    assert_eq!(source.system(), "kafka");
    let delivery = receive(&mut source, 1, Duration::from_secs(60))
        .await
        .remove(0);
    assert_sent_since(&delivery.message, before);
    assert_traced(&delivery.message);
    delivery.ack.ack().await.expect("acked");
}
