//! Feature `zstd`: records a producer compressed with zstd come back to the source as sent.

#![cfg(feature = "zstd")]

use crate::common;

use std::time::Duration;

use inbox_core::{Ack, MessageSource, OutgoingMessage, Publish};
use inbox_kafka::KafkaProducer;

#[tokio::test]
async fn zstd_compressed_records_are_read_back_as_sent() {
    let topic = common::topic(1).await;
    let producer = KafkaProducer::builder()
        .set("compression.type", "zstd")
        .set("linger.ms", "50")
        .connect()
        .await
        .expect("a producer with zstd");
    // Repetitive payloads, several per batch, so the batch is worth compressing.
    let payloads: Vec<String> = (0..20)
        .map(|n| format!("{{\"n\":{n},\"pad\":\"{}\"}}", "x".repeat(500)))
        .collect();
    // One batch: every record in flight at once, so they share record batches.
    let messages: Vec<OutgoingMessage> = payloads
        .iter()
        .map(|p| OutgoingMessage::generate(p.as_bytes()))
        .collect();
    producer
        .send_batch(&topic, &messages)
        .await
        .expect("produced");

    let mut source = common::source(&topic, &common::random("g")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut received = Vec::new();
    while received.len() < payloads.len() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {} received",
            received.len(),
            payloads.len()
        );
        for delivery in source.receive(100).await.expect("receives") {
            received.push(String::from_utf8(delivery.message.payload).expect("UTF-8"));
            delivery.ack.ack().await.expect("acked");
        }
    }
    assert_eq!(received, payloads);
}
