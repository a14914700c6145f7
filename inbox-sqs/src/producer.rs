//! [`SqsProducer`]: sends with the message ID where [`SqsSource`](crate::SqsSource) reads it,
//! to any queue, named per call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use aws_sdk_sqs::Client;
use inbox_core::{OutgoingMessage, Publish, PublishError, Recovery};
use tokio::task::JoinSet;

use crate::config::DEFAULT_ID_ATTRIBUTE;
use crate::copy::attribute;
use crate::delivery::{send_dedup_id, DEDUPLICATION_ID_HEADER};
use crate::{dead_letter, fifo};
use crate::{Error, Result, SqsConnection};

/// How often a batch entry SQS refused (throttling, say) is sent again before giving up.
const BATCH_ATTEMPTS: u32 = 3;

/// Configures an [`SqsProducer`]; made by [`SqsConnection::producer`] (or
/// [`SqsProducer::builder`], through the environment's SQS), finished by
/// [`connect`](Self::connect).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct SqsProducerBuilder {
    connection: SqsConnection,
    id_attribute: String,
    message_group_id: Option<String>,
}

impl SqsProducerBuilder {
    pub(crate) fn new(connection: SqsConnection) -> Self {
        Self {
            connection,
            id_attribute: DEFAULT_ID_ATTRIBUTE.to_owned(),
            message_group_id: None,
        }
    }

    /// The message attribute for the ID (default `event_id`); match the consumer's
    /// [`id_attribute`](crate::SqsSourceBuilder::id_attribute).
    pub fn id_attribute(mut self, name: impl Into<String>) -> Self {
        self.id_attribute = name.into();
        self
    }

    /// The message group for FIFO queues, for messages that name none (an [`OutgoingMessage`]
    /// without a key). On a FIFO queue the
    /// message ID is also sent as the `MessageDeduplicationId`, so SQS drops a resend within its
    /// 5-minute window and the inbox any later one.
    pub fn message_group_id(mut self, group: impl Into<String>) -> Self {
        self.message_group_id = Some(group.into());
        self
    }

    /// Builds the client unless the connection has one, checks the settings and returns the producer. It
    /// makes no SQS call: an unreachable endpoint or a missing queue shows in the first send.
    pub async fn connect(self) -> Result<SqsProducer> {
        dead_letter::check_id_attribute(&self.id_attribute, "SqsProducerBuilder::id_attribute")?;
        Ok(SqsProducer {
            client: self.connection.client().await,
            id_attribute: self.id_attribute,
            message_group_id: self.message_group_id,
            urls: Arc::new(Mutex::new(HashMap::new())),
        })
    }
}

/// Sends messages with their ID in a message attribute (default `event_id`) and their headers
/// as further message attributes, to any queue.
///
/// Send through [`Publish`]: `send(queue, payload)` (a fresh UUIDv7 ID, returned),
/// `send_with_id(queue, &id, payload)`, `send_batch(queue, &messages)` (each message's key its
/// FIFO group). The queue is a
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
pub(crate) struct Queue {
    pub(crate) url: String,
    pub(crate) fifo: bool,
}

impl SqsProducer {
    /// Starts configuring a producer through the environment's SQS
    /// ([`SqsConnection::from_env`]); finish with [`SqsProducerBuilder::connect`].
    pub fn builder() -> SqsProducerBuilder {
        SqsConnection::from_env().producer()
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
        let urls = || self.urls.lock().unwrap_or_else(PoisonError::into_inner);
        let known = if queue.contains("://") {
            Some(queue.to_owned())
        } else {
            urls().get(queue).cloned()
        };
        let url = if let Some(url) = known {
            url
        } else {
            let out = self
                .client
                .get_queue_url()
                .queue_name(queue)
                .send()
                .await
                .map_err(|e| Error::sdk("GetQueueUrl", queue, e))?;
            let url = out.queue_url.unwrap_or_default();
            if url.is_empty() {
                return Err(Error::Config(format!(
                    "GetQueueUrl for queue `{queue}` returned no URL"
                )));
            }
            urls().insert(queue.to_owned(), url.clone());
            url
        };
        let fifo = fifo::is_fifo_queue(&url);
        Ok(Queue { url, fifo })
    }

    /// The message group of `message` on a FIFO queue: its key, else the producer's.
    fn group(&self, queue: &Queue, message: &OutgoingMessage) -> Result<Option<String>> {
        if !queue.fifo {
            return Ok(None);
        }
        match message.key.as_deref().or(self.message_group_id.as_deref()) {
            Some(group) => Ok(Some(fifo::fifo_id(group))),
            None => Err(Error::Config(format!(
                "message {} has no key, and FIFO queue {} needs a message group: set a key on \
                 the OutgoingMessage, or SqsProducerBuilder::message_group_id",
                message.id, queue.url
            ))),
        }
    }

    /// The `SendMessageBatch` entry `index` for `message`: its body, its ID and headers as
    /// message attributes, and on a FIFO queue its group and deduplication ID.
    pub(crate) fn entry(
        &self,
        index: usize,
        queue: &Queue,
        message: &OutgoingMessage,
    ) -> Result<SendMessageBatchRequestEntry> {
        let body = std::str::from_utf8(&message.payload).map_err(|_| {
            Error::Config(format!(
                "message {} has a payload that is not UTF-8, and SQS bodies are text; encode it \
                 (base64, JSON) before writing it",
                message.id
            ))
        })?;
        let id = attribute(&self.id_attribute, message.id.as_str())?;
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(index.to_string())
            .message_body(body)
            .message_attributes(&self.id_attribute, id);
        // Sent as the FIFO deduplication ID, never as an attribute.
        for (name, value) in message.traced_headers() {
            if name == DEDUPLICATION_ID_HEADER {
                continue;
            }
            if name == self.id_attribute {
                return Err(Error::Config(format!(
                    "header `{name}` would shadow the ID attribute; rename it"
                )));
            }
            entry = entry.message_attributes(name, attribute(name, value)?);
        }
        if let Some(group) = self.group(queue, message)? {
            entry = entry
                .message_group_id(group)
                .message_deduplication_id(send_dedup_id(message));
        }
        entry
            .build()
            .map_err(|e| Error::Config(format!("cannot build a batch entry: {e}")))
    }

    /// Sends up to 10 entries with one `SendMessageBatch`. Entries SQS refuses are sent again
    /// (up to 3 attempts in all); what still fails is reported as [`Error::Batch`].
    async fn send_chunk(
        &self,
        queue: &Queue,
        chunk: &[SendMessageBatchRequestEntry],
    ) -> Result<()> {
        let mut pending = chunk.to_vec();
        let mut attempt = 1;
        loop {
            let out = self
                .client
                .send_message_batch()
                .queue_url(&queue.url)
                .set_entries(Some(pending.clone()))
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
            pending.retain(|entry| failed.iter().any(|f| f.id() == entry.id()));
            tokio::time::sleep(Duration::from_millis(100) * 2u32.pow(attempt)).await;
            attempt += 1;
        }
    }
}

/// `destination` is a queue URL or a queue name (resolved once, as by
/// [`SqsProducer::queue_url`]). Payloads must be UTF-8 (SQS bodies are text); any other payload
/// is refused, fatally, before anything is sent. Headers go as message attributes beside the ID
/// (SQS takes 10 attributes per message, the ID and `traceparent` among them).
///
/// A standard queue gets `SendMessageBatch` calls of 10, up to 10 calls at a time, and ignores
/// keys (it keeps no order). A FIFO queue (URL ending in `.fifo`) gets each message's key as its
/// `MessageGroupId` (made to fit SQS's rules as the consumer's IDs are), or the producer's
/// [`message_group_id`](SqsProducerBuilder::message_group_id) for messages without one, and the
/// calls go one after the other in slice order, so each group keeps its order.
impl Publish for SqsProducer {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let traced =
            inbox_core::telemetry::traced_send("aws_sqs", destination, messages.len(), async {
                const CALLS_AT_ONCE: usize = 10;
                let context = || format!("sending to SQS queue `{destination}`");
                let failed = |e: Error| PublishError::new(e.recovery(), context(), e);
                if messages.is_empty() {
                    return Ok(());
                }
                let queue = self.resolve(destination).await.map_err(failed)?;
                // Built before anything is sent, so a batch that cannot be sent goes out not at all.
                let entries = messages
                    .iter()
                    .enumerate()
                    .map(|(i, message)| self.entry(i, &queue, message))
                    .collect::<Result<Vec<_>>>()
                    .map_err(failed)?;

                if queue.fifo {
                    // Runs of messages with one group, in order, one call after the other.
                    for run in entries.chunk_by(|a, b| a.message_group_id() == b.message_group_id())
                    {
                        for chunk in run.chunks(10) {
                            self.send_chunk(&queue, chunk).await.map_err(failed)?;
                        }
                    }
                    return Ok(());
                }

                let queue = Arc::new(queue);
                let mut rest = entries.into_iter();
                let mut calls = JoinSet::new();
                loop {
                    while calls.len() < CALLS_AT_ONCE {
                        let chunk: Vec<SendMessageBatchRequestEntry> =
                            rest.by_ref().take(10).collect();
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
                            return Err(PublishError::new(Recovery::Retry, context(), e))
                        }
                    }
                }
            });
        traced.await
    }
}
