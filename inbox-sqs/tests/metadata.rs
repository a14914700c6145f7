//! What the SQS source tells the consumer's telemetry about a message: the broker, its
//! `SentTimestamp` (for the end-to-end lag) and the producer's `traceparent` attribute.

mod common;

use std::time::{Duration, SystemTime};

use common::text;
use inbox_core::{Ack, MessageSource};
use inbox_sqs::SqsSource;
use inbox_testkit::metadata::{assert_sent_since, assert_traced, TRACEPARENT};
use inbox_testkit::receive;

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
    let delivery = receive(&mut source, 1, Duration::from_secs(30))
        .await
        .remove(0);
    assert_sent_since(&delivery.message, before);
    assert_traced(&delivery.message);
    delivery.ack.ack().await.expect("deleted");
}
