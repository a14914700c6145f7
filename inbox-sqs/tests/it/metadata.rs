//! What the SQS source tells the consumer's telemetry about a message: the broker, its
//! `SentTimestamp` (for the end-to-end lag) and the producer's `traceparent` attribute, and the
//! producer's headers as message attributes, text or not.

use crate::common;

use std::time::{Duration, SystemTime};

use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{Ack, MessageSource, OutgoingMessage, Publish};
use inbox_sqs::SqsConnection;
use inbox_testkit::metadata::{assert_sent_since, assert_traced, TRACEPARENT};
use inbox_testkit::receive;

#[tokio::test]
async fn a_message_carries_its_sent_timestamp_trace_parent_and_headers() {
    let client = common::client().await;
    let queue = common::queue(&client, "metadata", 30).await;
    let before = SystemTime::now() - Duration::from_secs(5);
    let message = OutgoingMessage::generate("{}")
        .header(TRACEPARENT_HEADER, TRACEPARENT)
        .header("digest", [0xde, 0xad, 0xff]);
    common::producer(&client)
        .await
        .send_batch(&queue, std::slice::from_ref(&message))
        .await
        .expect("sent");
    let mut source = SqsConnection::new(client)
        .source(&queue)
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
    assert_eq!(
        delivery.message.header("digest"),
        Some(&[0xde, 0xad, 0xff][..])
    );
    assert_eq!(delivery.message.id.as_ref(), Ok(&message.id));
    delivery.ack.ack().await.expect("deleted");
}
