//! Shared by the integration tests: an SQS client for the local endpoint (or real AWS when the
//! environment says so), per-test queues with random names, and wallet events.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use inbox_sqs::aws_sdk_sqs::config::timeout::TimeoutConfig;
use inbox_sqs::aws_sdk_sqs::config::{Credentials, Region};
use inbox_testkit::FaultProxy;

use inbox_sqs::aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_testkit::wallet::CreditEvent;

/// The local SQS endpoint (moto's standalone server) used when the environment names none.
pub const LOCAL_ENDPOINT: &str = "http://127.0.0.1:4566";

/// A client for `AWS_ENDPOINT_URL_SQS` (default the local endpoint), with region us-east-1 and
/// dummy credentials only where none are configured, so the same tests run against AWS.
pub async fn client() -> Client {
    inbox_sqs::connect_or_local(LOCAL_ENDPOINT).await
}

fn random_name(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("inbox-{prefix}-{}", &id[..12])
}

/// Creates a standard queue with a random name and the given visibility timeout.
pub async fn queue(client: &Client, prefix: &str, visibility_secs: u32) -> String {
    create(client, &random_name(prefix), visibility_secs, None).await
}

/// Creates a FIFO queue (no content-based deduplication) with a random name.
pub async fn fifo_queue(client: &Client, prefix: &str, visibility_secs: u32) -> String {
    let out = client
        .create_queue()
        .queue_name(format!("{}.fifo", random_name(prefix)))
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
    let url = create(client, &random_name(prefix), visibility_secs, Some(policy)).await;
    (url, dlq)
}

async fn create(
    client: &Client,
    name: &str,
    visibility_secs: u32,
    redrive: Option<String>,
) -> String {
    let mut request = client.create_queue().queue_name(name).attributes(
        QueueAttributeName::VisibilityTimeout,
        visibility_secs.to_string(),
    );
    if let Some(policy) = redrive {
        request = request.attributes(QueueAttributeName::RedrivePolicy, policy);
    }
    let out = request
        .send()
        .await
        .expect("create the test queue (is the SQS endpoint up?)");
    out.queue_url().expect("queue URL").to_owned()
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

/// Receives (and deletes) everything visible on `url`, waiting up to `wait` for the first.
pub async fn drain(client: &Client, url: &str, wait: Duration) -> Vec<Message> {
    let mut all = Vec::new();
    let mut wait_secs = i32::try_from(wait.as_secs()).unwrap_or(20);
    loop {
        let out = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(wait_secs)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .expect("receive");
        let messages = out.messages().to_vec();
        if messages.is_empty() {
            return all;
        }
        for m in &messages {
            client
                .delete_message()
                .queue_url(url)
                .receipt_handle(m.receipt_handle().unwrap_or_default())
                .send()
                .await
                .expect("delete");
        }
        all.extend(messages);
        wait_secs = 1;
    }
}

/// The string value of a message attribute.
pub fn attr(message: &Message, name: &str) -> Option<String> {
    message
        .message_attributes()
        .and_then(|a: &HashMap<_, _>| a.get(name))
        .and_then(|v| v.string_value())
        .map(str::to_owned)
}

/// Deletes a test queue; errors are ignored (the endpoint may be gone at the end).
pub async fn delete_queue(client: &Client, url: &str) {
    let _ = client.delete_queue().queue_url(url).send().await;
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

/// The SQS endpoint's socket address, when it is plain HTTP (a local endpoint such as moto): the
/// proxy forwards bytes, so it cannot stand between a client and an HTTPS endpoint such as AWS.
pub async fn plain_http_endpoint() -> Option<SocketAddr> {
    let url = ["AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|v| !v.is_empty())
        .unwrap_or_else(|| LOCAL_ENDPOINT.to_owned());
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let mut addrs = tokio::net::lookup_host(&authority)
        .await
        .unwrap_or_else(|e| panic!("resolve the SQS endpoint {authority}: {e}"));
    addrs.next()
}

/// The timeout per attempt of [`proxied_client`]: a black-holed call fails after this.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The timeout per call of [`proxied_client`], its retries included.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// A client for the endpoint behind `proxy`, with short timeouts so a black-holed call fails
/// in seconds rather than the default 30.
pub async fn proxied_client(proxy: &FaultProxy) -> Client {
    let config = inbox_sqs::config_loader()
        .endpoint_url(format!("http://{}", proxy.addr()))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(1))
                .operation_attempt_timeout(ATTEMPT_TIMEOUT)
                .operation_timeout(OPERATION_TIMEOUT)
                .build(),
        )
        .load()
        .await;
    Client::new(&config)
}
