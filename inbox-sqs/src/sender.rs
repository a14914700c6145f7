//! A producer helper that puts the message ID where [`SqsSource`](crate::SqsSource) reads it.

use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use aws_sdk_sqs::Client;
use inbox_core::MessageId;

use crate::config::DEFAULT_ID_ATTRIBUTE;
use crate::fifo;
use crate::{Error, Result};

/// How often a batch entry SQS refused (throttling, say) is sent again before giving up.
const BATCH_ATTEMPTS: u32 = 3;

/// One message to send: its ID and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// The ID the consumers deduplicate on. Keep it when resending the same event.
    pub id: MessageId,
    /// The message body (SQS bodies are text; JSON is usual).
    pub body: String,
}

impl Outgoing {
    /// A message with a fresh UUIDv7 ID.
    pub fn new(body: impl Into<String>) -> Self {
        Self {
            id: MessageId::generate(),
            body: body.into(),
        }
    }

    /// A message with the given ID (a resend of an event keeps its ID).
    pub fn with_id(id: MessageId, body: impl Into<String>) -> Self {
        Self {
            id,
            body: body.into(),
        }
    }
}

/// Sends messages with their ID in a message attribute (default `event_id`).
///
/// Resending is always safe: a message sent twice with the same ID is applied once by an
/// inbox consumer, so on any doubt (a timeout, a partial batch failure) send again with the
/// same ID.
#[derive(Debug, Clone)]
pub struct SqsSender {
    client: Client,
    queue_url: String,
    id_attribute: String,
    message_group_id: Option<String>,
}

impl SqsSender {
    /// A sender to the queue at `queue_url`.
    pub fn new(client: Client, queue_url: impl Into<String>) -> Self {
        Self {
            client,
            queue_url: queue_url.into(),
            id_attribute: DEFAULT_ID_ATTRIBUTE.to_owned(),
            message_group_id: None,
        }
    }

    /// The message attribute for the ID; match the consumer's
    /// [`id_attribute`](crate::SqsSourceBuilder::id_attribute).
    pub fn id_attribute(mut self, name: impl Into<String>) -> Self {
        self.id_attribute = name.into();
        self
    }

    /// For a FIFO queue: the message group (required there). The message ID is also sent as
    /// the `MessageDeduplicationId`, so SQS drops a resend within its 5-minute window and the
    /// inbox any later one.
    pub fn message_group_id(mut self, group: impl Into<String>) -> Self {
        self.message_group_id = Some(group.into());
        self
    }

    /// The queue this sender sends to.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// Sends `body` with a fresh UUIDv7 ID and returns that ID.
    pub async fn send(&self, body: impl Into<String>) -> Result<MessageId> {
        let message = Outgoing::new(body);
        self.send_message(&message).await?;
        Ok(message.id)
    }

    /// Sends one message with its ID.
    pub async fn send_message(&self, message: &Outgoing) -> Result<()> {
        let mut request = self
            .client
            .send_message()
            .queue_url(&self.queue_url)
            .message_body(&message.body)
            .message_attributes(&self.id_attribute, id_attribute(&message.id)?);
        if let Some(group) = &self.message_group_id {
            request = request
                .message_group_id(group)
                .message_deduplication_id(dedup_id(&message.id));
        }
        request
            .send()
            .await
            .map_err(|e| Error::sdk("SendMessage", &self.queue_url, e))?;
        Ok(())
    }

    /// Sends many messages with `SendMessageBatch`, 10 per call, in order. Entries SQS refuses
    /// are sent again (up to 3 attempts in all); what still fails is reported as
    /// [`Error::Batch`], and sending all again is safe.
    pub async fn send_batch(&self, messages: &[Outgoing]) -> Result<()> {
        for chunk in messages.chunks(10) {
            self.send_chunk(chunk).await?;
        }
        Ok(())
    }

    async fn send_chunk(&self, chunk: &[Outgoing]) -> Result<()> {
        let mut pending: Vec<usize> = (0..chunk.len()).collect();
        let mut attempt = 1;
        loop {
            let mut request = self.client.send_message_batch().queue_url(&self.queue_url);
            for &i in &pending {
                let message = &chunk[i];
                let mut entry = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&message.body)
                    .message_attributes(&self.id_attribute, id_attribute(&message.id)?);
                if let Some(group) = &self.message_group_id {
                    entry = entry
                        .message_group_id(group)
                        .message_deduplication_id(dedup_id(&message.id));
                }
                let entry = entry
                    .build()
                    .map_err(|e| Error::Config(format!("cannot build a batch entry: {e}")))?;
                request = request.entries(entry);
            }
            let out = request
                .send()
                .await
                .map_err(|e| Error::sdk("SendMessageBatch", &self.queue_url, e))?;
            let failed = out.failed();
            let Some(first) = failed.first() else {
                return Ok(());
            };
            // A sender fault (a malformed entry) fails again however often it is sent.
            if attempt >= BATCH_ATTEMPTS || failed.iter().any(|f| f.sender_fault()) {
                return Err(Error::Batch {
                    operation: "SendMessageBatch",
                    queue_url: self.queue_url.clone(),
                    failed: failed.len(),
                    total: pending.len(),
                    first: format!(
                        "entry {}: {}: {}",
                        first.id(),
                        first.code(),
                        first.message().unwrap_or("")
                    ),
                });
            }
            pending = failed.iter().filter_map(|f| f.id().parse().ok()).collect();
            tokio::time::sleep(Duration::from_millis(100) * 2u32.pow(attempt)).await;
            attempt += 1;
        }
    }
}

fn id_attribute(id: &MessageId) -> Result<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(id.as_str())
        .build()
        .map_err(|e| Error::Config(format!("cannot build the ID attribute: {e}")))
}

/// SQS deduplication IDs are at most 128 characters of a limited alphabet; a UUID fits, and a
/// longer or odd ID is hashed down to one that does.
fn dedup_id(id: &MessageId) -> String {
    fifo::fifo_id(id.as_str())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn dedup_ids_fit_sqs_rules() {
        let uuid = MessageId::generate();
        assert_eq!(dedup_id(&uuid), uuid.as_str());
        let odd = MessageId::new("évènement 1").unwrap();
        let hashed = dedup_id(&odd);
        assert_eq!(hashed.len(), 32);
        assert_eq!(hashed, dedup_id(&odd), "stable");
        assert_ne!(hashed, dedup_id(&MessageId::new("évènement 2").unwrap()));
        assert_eq!(
            dedup_id(&MessageId::new("x".repeat(129)).unwrap()).len(),
            32
        );
    }
}
