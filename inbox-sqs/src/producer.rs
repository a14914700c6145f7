//! [`SqsProducer`]: sends with the message ID where [`SqsSource`](crate::SqsSource) reads it,
//! to any queue, named per call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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

/// One message to send: its ID, its body and, for a FIFO queue, its message group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// The ID the consumers deduplicate on. Keep it when resending the same event.
    pub id: MessageId,
    /// The message body (SQS bodies are text; JSON is usual).
    pub body: String,
    /// The `MessageGroupId` on a FIFO queue (made to fit SQS's rules, hashed where it does not);
    /// `None` takes the producer's [`message_group_id`](SqsProducerBuilder::message_group_id).
    /// Standard queues ignore it.
    pub group: Option<String>,
}

impl Outgoing {
    /// A message with a fresh UUIDv7 ID.
    pub fn new(body: impl Into<String>) -> Self {
        Self::with_id(MessageId::generate(), body)
    }

    /// A message with the given ID (a resend of an event keeps its ID).
    pub fn with_id(id: MessageId, body: impl Into<String>) -> Self {
        Self {
            id,
            body: body.into(),
            group: None,
        }
    }

    /// Sets the FIFO message group.
    #[must_use]
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }
}

/// Configures an [`SqsProducer`]; made by [`SqsProducer::builder`], finished by
/// [`connect`](Self::connect).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct SqsProducerBuilder {
    client: Option<Client>,
    id_attribute: String,
    message_group_id: Option<String>,
}

impl SqsProducerBuilder {
    /// The SQS client to use. Without one, [`connect`](Self::connect) builds one from the
    /// environment as [`crate::connect`] does (endpoint from `AWS_ENDPOINT_URL_SQS`).
    pub fn client(mut self, client: Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The message attribute for the ID (default `event_id`); match the consumer's
    /// [`id_attribute`](crate::SqsSourceBuilder::id_attribute).
    pub fn id_attribute(mut self, name: impl Into<String>) -> Self {
        self.id_attribute = name.into();
        self
    }

    /// The message group for FIFO queues, for messages that name none (an [`Outgoing`] without
    /// [`group`](Outgoing::group), an [`OutgoingMessage`] without a key). On a FIFO queue the
    /// message ID is also sent as the `MessageDeduplicationId`, so SQS drops a resend within its
    /// 5-minute window and the inbox any later one.
    pub fn message_group_id(mut self, group: impl Into<String>) -> Self {
        self.message_group_id = Some(group.into());
        self
    }

    /// Builds the client unless one was given, checks the settings and returns the producer. It
    /// makes no SQS call: an unreachable endpoint or a missing queue shows in the first send.
    pub async fn connect(self) -> Result<SqsProducer> {
        if self.id_attribute.is_empty() {
            return Err(Error::Config("the ID attribute name is empty".into()));
        }
        let client = match self.client {
            Some(client) => client,
            None => crate::connect().await,
        };
        Ok(SqsProducer {
            client,
            id_attribute: self.id_attribute,
            message_group_id: self.message_group_id,
            urls: Arc::new(Mutex::new(HashMap::new())),
        })
    }
}

/// Sends messages with their ID in a message attribute (default `event_id`), to any queue.
///
/// Send through [`Publish`]: `send(queue, payload)` (a fresh UUIDv7 ID, returned),
/// `send_with_id(queue, &id, payload)`, `send_batch(queue, &messages)`; or
/// [`send_message`](Self::send_message) for a message with its own FIFO group. The queue is a
/// queue URL, used as given, or a queue name, resolved with `GetQueueUrl` on first use and
/// remembered (in the producer and its clones).
///
/// Resending is always safe: a message sent twice with the same ID is applied once by an
/// inbox consumer, so on any doubt (a timeout, a partial batch failure) send again with the
/// same ID.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_core::Publish;
/// use inbox_sqs::SqsProducer;
///
/// let producer = SqsProducer::builder().connect().await?;
/// let id = producer.send("payments", b"100").await?; // by name: GetQueueUrl once
/// producer.send_with_id("payments", &id, b"100").await?; // sent twice: applied once
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SqsProducer {
    client: Client,
    id_attribute: String,
    message_group_id: Option<String>,
    /// Queue names already resolved to URLs.
    urls: Arc<Mutex<HashMap<String, String>>>,
}

/// A queue to send to: its URL and whether it is FIFO.
struct Queue {
    url: String,
    fifo: bool,
}

impl SqsProducer {
    /// Starts configuring a producer; finish with [`SqsProducerBuilder::connect`].
    pub fn builder() -> SqsProducerBuilder {
        SqsProducerBuilder {
            client: None,
            id_attribute: DEFAULT_ID_ATTRIBUTE.to_owned(),
            message_group_id: None,
        }
    }

    /// The client it sends with.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The URL of `queue`: `queue` itself when it is a URL (has `://`), else the URL of the queue
    /// of that name (`GetQueueUrl`, remembered after the first call).
    pub async fn queue_url(&self, queue: &str) -> Result<String> {
        Ok(self.resolve(queue).await?.url)
    }

    async fn resolve(&self, queue: &str) -> Result<Queue> {
        if queue.is_empty() {
            return Err(Error::Config(
                "the destination queue is empty; name a queue URL or a queue name".into(),
            ));
        }
        let url = if queue.contains("://") {
            queue.to_owned()
        } else {
            let known = self
                .urls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(queue)
                .cloned();
            match known {
                Some(url) => url,
                None => {
                    let out = self
                        .client
                        .get_queue_url()
                        .queue_name(queue)
                        .send()
                        .await
                        .map_err(|e| Error::sdk("GetQueueUrl", queue, e))?;
                    let url = out.queue_url().unwrap_or_default().to_owned();
                    if url.is_empty() {
                        return Err(Error::Config(format!(
                            "GetQueueUrl for queue `{queue}` returned no URL"
                        )));
                    }
                    self.urls
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(queue.to_owned(), url.clone());
                    url
                }
            }
        };
        let fifo = url.trim_end_matches('/').ends_with(".fifo");
        Ok(Queue { url, fifo })
    }

    /// The message group of `message` on a FIFO queue: its own, else the producer's.
    fn group(&self, queue: &Queue, message: &Outgoing) -> Result<Option<String>> {
        if !queue.fifo {
            return Ok(None);
        }
        match message
            .group
            .as_deref()
            .or(self.message_group_id.as_deref())
        {
            Some(group) => Ok(Some(fifo::fifo_id(group))),
            None => Err(Error::Config(format!(
                "message {} has no group, and FIFO queue {} needs a message group: set \
                 Outgoing::group, a key on the OutgoingMessage, or \
                 SqsProducerBuilder::message_group_id",
                message.id, queue.url
            ))),
        }
    }

    /// Sends one message with its ID to `queue` (a URL or a name), with its FIFO group.
    pub async fn send_message(&self, queue: &str, message: &Outgoing) -> Result<()> {
        let queue = self.resolve(queue).await?;
        let mut request = self
            .client
            .send_message()
            .queue_url(&queue.url)
            .message_body(&message.body)
            .message_attributes(&self.id_attribute, id_attribute(&message.id)?);
        if let Some(traceparent) = traceparent_attribute()? {
            request = request.message_attributes(TRACEPARENT_HEADER, traceparent);
        }
        if let Some(group) = self.group(&queue, message)? {
            request = request
                .message_group_id(group)
                .message_deduplication_id(dedup_id(&message.id));
        }
        request
            .send()
            .await
            .map_err(|e| Error::sdk("SendMessage", &queue.url, e))?;
        Ok(())
    }

    /// Sends many messages to `queue` (a URL or a name) with `SendMessageBatch`, 10 per call,
    /// one call after the other, in order. Entries SQS refuses are sent again (up to 3 attempts
    /// in all); what still fails is reported as [`Error::Batch`], and sending all again is safe.
    pub async fn send_messages(&self, queue: &str, messages: &[Outgoing]) -> Result<()> {
        let queue = self.resolve(queue).await?;
        for chunk in messages.chunks(10) {
            self.send_chunk(&queue, chunk).await?;
        }
        Ok(())
    }

    async fn send_chunk(&self, queue: &Queue, chunk: &[Outgoing]) -> Result<()> {
        let mut pending: Vec<usize> = (0..chunk.len()).collect();
        let mut attempt = 1;
        let traceparent = traceparent_attribute()?;
        loop {
            let mut request = self.client.send_message_batch().queue_url(&queue.url);
            for &i in &pending {
                let message = &chunk[i];
                let mut entry = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&message.body)
                    .message_attributes(&self.id_attribute, id_attribute(&message.id)?);
                if let Some(traceparent) = &traceparent {
                    entry = entry.message_attributes(TRACEPARENT_HEADER, traceparent.clone());
                }
                if let Some(group) = self.group(queue, message)? {
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
                .map_err(|e| Error::sdk("SendMessageBatch", &queue.url, e))?;
            let failed = out.failed();
            let Some(first) = failed.first() else {
                return Ok(());
            };
            // A sender fault (a malformed entry) fails again however often it is sent.
            if attempt >= BATCH_ATTEMPTS || failed.iter().any(|f| f.sender_fault()) {
                return Err(Error::Batch {
                    operation: "SendMessageBatch",
                    queue_url: queue.url.clone(),
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

/// `destination` is a queue URL or a queue name (resolved once, as by
/// [`SqsProducer::queue_url`]). Payloads must be UTF-8 (SQS bodies are text); any other payload
/// is refused, fatally, before anything is sent.
///
/// A standard queue gets `SendMessageBatch` calls of 10, up to 10 calls at a time, and ignores
/// keys (it keeps no order). A FIFO queue (URL ending in `.fifo`) gets each message's key as its
/// `MessageGroupId` (made to fit SQS's rules as the consumer's IDs are), or the producer's
/// [`message_group_id`](SqsProducerBuilder::message_group_id) for messages without one, and the
/// calls go one after the other in slice order, so each group keeps its order.
#[async_trait]
impl Publish for SqsProducer {
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
        let mut outgoing = Vec::with_capacity(messages.len());
        for message in messages {
            let body = String::from_utf8(message.payload.clone()).map_err(|_| {
                failed(Error::Config(format!(
                    "message {} has a payload that is not UTF-8, and SQS bodies are text; \
                     encode it (base64, JSON) before writing it",
                    message.id
                )))
            })?;
            let mut one = Outgoing::with_id(message.id.clone(), body);
            one.group.clone_from(&message.key);
            outgoing.push(one);
        }
        if outgoing.is_empty() {
            return Ok(());
        }
        let queue = self.resolve(destination).await.map_err(failed)?;

        if queue.fifo {
            // Runs of messages with one group, in order, one call after the other.
            for message in &outgoing {
                // Checked before anything is sent, so a batch goes out whole or not at all.
                self.group(&queue, message).map_err(failed)?;
            }
            let mut start = 0;
            while start < outgoing.len() {
                let group = &outgoing[start].group;
                let end = outgoing[start..]
                    .iter()
                    .position(|m| m.group != *group)
                    .map_or(outgoing.len(), |n| start + n);
                for chunk in outgoing[start..end].chunks(10) {
                    self.send_chunk(&queue, chunk).await.map_err(failed)?;
                }
                start = end;
            }
            return Ok(());
        }

        let queue = Arc::new(queue);
        let mut rest = outgoing.into_iter();
        let mut calls = JoinSet::new();
        loop {
            while calls.len() < CALLS_AT_ONCE {
                let chunk: Vec<Outgoing> = rest.by_ref().take(10).collect();
                if chunk.is_empty() {
                    break;
                }
                let producer = self.clone();
                let queue = Arc::clone(&queue);
                calls.spawn(async move { producer.send_chunk(&queue, &chunk).await });
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
