//! Shared by the integration tests: an SQS client for the local endpoint (or real AWS when the
//! environment says so), per-test queues with random names, and wallet events (the conformance
//! suite's, `inbox_conformance::sqs`, where it has them).
#![allow(dead_code, unused_imports, unreachable_pub)]

pub use inbox_conformance::sqs::{
    attr, client, create_queue, delete_queue, drain, queue, queue_name, ATTEMPT_TIMEOUT,
    LOCAL_ENDPOINT, OPERATION_TIMEOUT,
};
use inbox_conformance::wallet::CreditEvent;
use inbox_sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::{SqsConnection, SqsProducer};

/// A producer on `client`.
pub async fn producer(client: &Client) -> SqsProducer {
    SqsConnection::new(client.clone())
        .producer()
        .connect()
        .await
        .expect("producer")
}

/// Creates a FIFO queue (no content-based deduplication) with a random name.
pub async fn fifo_queue(client: &Client, prefix: &str, visibility_secs: u32) -> String {
    let out = client
        .create_queue()
        .queue_name(format!("{}.fifo", queue_name(prefix)))
        .attributes(QueueAttributeName::FifoQueue, "true")
        .attributes(
            QueueAttributeName::VisibilityTimeout,
            visibility_secs.to_string(),
        )
        .send()
        .await
        .expect("create the FIFO test queue");
    out.queue_url().expect("queue URL").to_owned()
}

/// Creates a queue and a dead-letter queue, the first with a redrive policy to the second.
/// Returns (queue URL, dead-letter queue URL).
pub async fn queue_with_redrive(
    client: &Client,
    prefix: &str,
    visibility_secs: u32,
    max_receive_count: u32,
) -> (String, String) {
    let dlq = queue(client, &format!("{prefix}-dlq"), 30).await;
    let arn = queue_arn(client, &dlq).await;
    let policy =
        format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{max_receive_count}"}}"#);
    let redrive = [(QueueAttributeName::RedrivePolicy, policy.as_str())];
    let url = create_queue(client, &queue_name(prefix), visibility_secs, &redrive).await;
    (url, dlq)
}

/// The queue's ARN.
pub async fn queue_arn(client: &Client, url: &str) -> String {
    attribute(client, url, QueueAttributeName::QueueArn)
        .await
        .expect("QueueArn")
}

async fn attribute(client: &Client, url: &str, name: QueueAttributeName) -> Option<String> {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(name.clone())
        .send()
        .await
        .expect("get queue attributes");
    out.attributes().and_then(|a| a.get(&name)).cloned()
}

/// Messages on the queue: (visible, in flight).
pub async fn counts(client: &Client, url: &str) -> (u64, u64) {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .expect("get queue counts");
    let get = |name| {
        out.attributes()
            .and_then(|a| a.get(&name))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (
        get(QueueAttributeName::ApproximateNumberOfMessages),
        get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    )
}

/// A wallet credit event as JSON.
pub fn credit(account_id: i64, amount: i64) -> String {
    json(CreditEvent::new(account_id, amount))
}

/// A wallet credit event whose first handling stalls (see the wallet's `Credit::stall`).
pub fn stalling_credit(account_id: i64, amount: i64) -> String {
    json(CreditEvent {
        stall: true,
        ..CreditEvent::new(account_id, amount)
    })
}

fn json(event: CreditEvent) -> String {
    String::from_utf8(event.to_json()).expect("JSON is UTF-8")
}

/// A String message attribute.
pub fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("a valid attribute")
}
