//! Test queues: creating them with random names, taking everything off one, deleting them.

use std::collections::HashMap;
use std::time::Duration;

use inbox_sqs::aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use inbox_sqs::aws_sdk_sqs::Client;

/// A queue name no other test uses: `inbox-<prefix>-` and 12 random hex digits.
pub fn queue_name(prefix: &str) -> String {
    crate::unique_name(&format!("inbox-{prefix}"))
}

/// Creates a standard queue with a random name and the given visibility timeout; returns its
/// URL.
pub async fn queue(client: &Client, prefix: &str, visibility_secs: u32) -> String {
    create_queue(client, &queue_name(prefix), visibility_secs, &[]).await
}

/// Creates the queue `name` with the given visibility timeout and other `attributes` (a redrive
/// policy, FIFO); returns its URL.
pub async fn create_queue(
    client: &Client,
    name: &str,
    visibility_secs: u32,
    attributes: &[(QueueAttributeName, &str)],
) -> String {
    let mut request = client.create_queue().queue_name(name).attributes(
        QueueAttributeName::VisibilityTimeout,
        visibility_secs.to_string(),
    );
    for (attribute, value) in attributes {
        request = request.attributes(attribute.clone(), *value);
    }
    let out = request
        .send()
        .await
        .expect("create the test queue (is the SQS endpoint up?)");
    out.queue_url().expect("queue URL").to_owned()
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
