//! A producer helper that puts the message ID where [`SqsSource`](crate::SqsSource) reads it.

use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use aws_sdk_sqs::Client;
use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{async_trait, MessageId, OutgoingMessage, Publish, PublishError, Recovery};
use tokio::task::JoinSet;

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
        if let Some(traceparent) = traceparent_attribute()? {
            request = request.message_attributes(TRACEPARENT_HEADER, traceparent);
        }
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
        let traceparent = traceparent_attribute()?;
        loop {
            let mut request = self.client.send_message_batch().queue_url(&self.queue_url);
            for &i in &pending {
                let message = &chunk[i];
                let mut entry = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&message.body)
                    .message_attributes(&self.id_attribute, id_attribute(&message.id)?);
                if let Some(traceparent) = &traceparent {
                    entry = entry.message_attributes(TRACEPARENT_HEADER, traceparent.clone());
                }
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

/// The current span's trace context (feature `opentelemetry` of inbox-core) as a `traceparent`
/// message attribute.
fn traceparent_attribute() -> Result<Option<MessageAttributeValue>> {
    let Some(parent) = inbox_core::TraceParent::current() else {
        return Ok(None);
    };
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(parent.to_string())
        .build()
        .map(Some)
        .map_err(|e| Error::Config(format!("cannot build the traceparent attribute: {e}")))
}

/// SQS deduplication IDs are at most 128 characters of a limited alphabet; a UUID fits, and a
/// longer or odd ID is hashed down to one that does.
fn dedup_id(id: &MessageId) -> String {
    fifo::fifo_id(id.as_str())
}

/// `destination` must be this sender's queue, by URL or by name (the URL's last segment): a
/// sender refuses any other with a [`Recovery::Fatal`] error ([`Error::Config`]); make one per
/// queue and route them with [`Destinations`](inbox_core::Destinations). Payloads must be UTF-8
/// (SQS bodies are text); any other payload is refused, fatally, before anything is sent.
///
/// A standard queue gets `SendMessageBatch` calls of 10, up to 10 calls at a time, and ignores
/// keys (it keeps no order). A FIFO queue (URL ending in `.fifo`) gets each message's key as its
/// `MessageGroupId` (made to fit SQS's rules as the consumer's IDs are), or the sender's
/// [`message_group_id`](SqsSender::message_group_id) for messages without one, and the calls go
/// one after the other in slice order, so each group keeps its order.
#[async_trait]
impl Publish for SqsSender {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        const CALLS_AT_ONCE: usize = 10;
        let failed = |e: Error| {
            PublishError::new(
                e.recovery(),
                format!("sending to SQS queue `{destination}`"),
                e,
            )
        };
        let queue_name = self.queue_url.rsplit('/').next().unwrap_or_default();
        if destination != self.queue_url && destination != queue_name {
            return Err(failed(Error::Config(format!(
                "this SqsSender sends to queue `{}`, not `{destination}`; make one sender per \
                 queue and route them with inbox_core::Destinations",
                self.queue_url
            ))));
        }
        let mut outgoing = Vec::with_capacity(messages.len());
        for message in messages {
            let body = String::from_utf8(message.payload.clone()).map_err(|_| {
                failed(Error::Config(format!(
                    "message {} has a payload that is not UTF-8, and SQS bodies are text; \
                     encode it (base64, JSON) before writing it",
                    message.id
                )))
            })?;
            outgoing.push((
                message.key.as_deref(),
                Outgoing::with_id(message.id.clone(), body),
            ));
        }

        if queue_name.ends_with(".fifo") {
            // Runs of messages with one group, in order, one call after the other.
            let mut start = 0;
            while start < outgoing.len() {
                let key = outgoing[start].0;
                let end = outgoing[start..]
                    .iter()
                    .position(|(k, _)| *k != key)
                    .map_or(outgoing.len(), |n| start + n);
                let sender = match key {
                    Some(key) => self.clone().message_group_id(fifo::fifo_id(key)),
                    None if self.message_group_id.is_some() => self.clone(),
                    None => {
                        return Err(failed(Error::Config(format!(
                            "message {} has no key, and FIFO queue {} needs a message group: \
                             give it a key, or set SqsSender::message_group_id",
                            outgoing[start].1.id, self.queue_url
                        ))))
                    }
                };
                let run: Vec<Outgoing> = outgoing[start..end]
                    .iter()
                    .map(|(_, m)| m.clone())
                    .collect();
                sender.send_batch(&run).await.map_err(failed)?;
                start = end;
            }
            return Ok(());
        }

        let mut rest = outgoing.into_iter().map(|(_, message)| message);
        let mut calls = JoinSet::new();
        loop {
            while calls.len() < CALLS_AT_ONCE {
                let chunk: Vec<Outgoing> = rest.by_ref().take(10).collect();
                if chunk.is_empty() {
                    break;
                }
                let sender = self.clone();
                calls.spawn(async move { sender.send_batch(&chunk).await });
            }
            // Dropping `calls` on an error aborts the calls still running.
            match calls.join_next().await {
                None => return Ok(()),
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => return Err(failed(e)),
                Some(Err(e)) => {
                    return Err(PublishError::new(
                        Recovery::Retry,
                        format!("sending to SQS queue `{destination}`"),
                        e,
                    ))
                }
            }
        }
    }
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
