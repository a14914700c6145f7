//! Acknowledging SQS deliveries: delete on ack, change visibility on nack.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use aws_sdk_sqs::Client;
use inbox_core::{async_trait, Ack, SourceError};
use tracing::debug;

use crate::config::{AckMode, MAX_VISIBILITY};
use crate::heartbeat::Heartbeat;
use crate::Error;

/// The acknowledgement handle of one SQS delivery: its queue and the receipt handle of the
/// receive that returned it.
///
/// - [`Ack::ack`] deletes the message (`DeleteMessage`); [`Ack::ack_all`] deletes many with
///   `DeleteMessageBatch`, 10 per call.
/// - [`Ack::nack`] makes the message visible again after the delay (`ChangeMessageVisibility`).
/// - Dropping it without either (the consumer crashed) stops its visibility heartbeat; the
///   message becomes visible again when its visibility timeout runs out.
#[derive(Debug)]
pub struct SqsAck {
    client: Client,
    queue_url: Arc<str>,
    receipt_handle: Arc<str>,
    mode: AckMode,
    min_retry_delay: Duration,
    heartbeat: Option<Heartbeat>,
}

impl SqsAck {
    pub(crate) fn new(
        client: Client,
        queue_url: Arc<str>,
        receipt_handle: Arc<str>,
        mode: AckMode,
        min_retry_delay: Duration,
        heartbeat: Option<Heartbeat>,
    ) -> Self {
        Self {
            client,
            queue_url,
            receipt_handle,
            mode,
            min_retry_delay,
            heartbeat,
        }
    }

    /// The receipt handle this ack deletes with.
    pub fn receipt_handle(&self) -> &str {
        &self.receipt_handle
    }

    async fn stop_heartbeat(&mut self) {
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.stop().await;
        }
    }
}

#[async_trait]
impl Ack for SqsAck {
    async fn ack(mut self) -> Result<(), SourceError> {
        self.stop_heartbeat().await;
        if self.mode == AckMode::DeleteOnReceive {
            return Ok(());
        }
        self.client
            .delete_message()
            .queue_url(&*self.queue_url)
            .receipt_handle(&*self.receipt_handle)
            .send()
            .await
            .map_err(|e| Error::sdk("DeleteMessage", &self.queue_url, e))?;
        Ok(())
    }

    async fn nack(mut self, retry_after: Duration) -> Result<(), SourceError> {
        self.stop_heartbeat().await;
        if self.mode == AckMode::DeleteOnReceive {
            // Already deleted: there is nothing left to hand back (the anti-pattern's loss).
            return Ok(());
        }
        let delay = retry_after.max(self.min_retry_delay).min(MAX_VISIBILITY);
        let seconds = i32::try_from(delay.as_secs()).unwrap_or(i32::MAX);
        let result = self
            .client
            .change_message_visibility()
            .queue_url(&*self.queue_url)
            .receipt_handle(&*self.receipt_handle)
            .visibility_timeout(seconds)
            .send()
            .await
            .map_err(|e| Error::sdk("ChangeMessageVisibility (nack)", &self.queue_url, e));
        match result {
            Ok(_) => Ok(()),
            // The copy is no longer ours (its visibility ran out and another receive took it):
            // that receive owns it now, which is what a nack wanted anyway.
            Err(e) if e.is_stale_receipt() => {
                debug!(error = %e, "nack on a stale receipt handle; the message is already back");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let mut pending: Vec<SqsAck> = Vec::with_capacity(acks.len());
        for mut ack in acks {
            ack.stop_heartbeat().await;
            if ack.mode == AckMode::AfterCommit {
                pending.push(ack);
            }
        }
        // One batch call per queue and per 10 messages; normally all share one queue.
        pending.sort_by(|a, b| a.queue_url.cmp(&b.queue_url));
        let mut first_error: Option<Error> = None;
        let mut failed = 0;
        let total = pending.len();
        for group in pending.chunk_by(|a, b| a.queue_url == b.queue_url) {
            for chunk in group.chunks(10) {
                if let Err((n, e)) = delete_batch(chunk).await {
                    failed += n;
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            None => Ok(()),
            Some(Error::Batch {
                operation,
                queue_url,
                first,
                ..
            }) => Err(Error::Batch {
                operation,
                queue_url,
                failed,
                total,
                first,
            }
            .into()),
            Some(e) => Err(e.into()),
        }
    }
}

/// Deletes up to 10 messages of one queue; on failure, how many were not deleted and why.
async fn delete_batch(chunk: &[SqsAck]) -> Result<(), (usize, Error)> {
    let Some(first) = chunk.first() else {
        return Ok(());
    };
    let queue_url = &*first.queue_url;
    if let [only] = chunk {
        // One message: the plain call is as cheap and its error is simpler.
        return only
            .client
            .delete_message()
            .queue_url(queue_url)
            .receipt_handle(&*only.receipt_handle)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| (1, Error::sdk("DeleteMessage", queue_url, e)));
    }
    let mut request = first.client.delete_message_batch().queue_url(queue_url);
    for (i, ack) in chunk.iter().enumerate() {
        let entry = DeleteMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .receipt_handle(&*ack.receipt_handle)
            .build()
            .map_err(|e| {
                (
                    chunk.len(),
                    Error::Config(format!("cannot build a delete entry: {e}")),
                )
            })?;
        request = request.entries(entry);
    }
    let out = request
        .send()
        .await
        .map_err(|e| (chunk.len(), Error::sdk("DeleteMessageBatch", queue_url, e)))?;
    match out.failed().first() {
        None => Ok(()),
        Some(entry) => Err((
            out.failed().len(),
            Error::Batch {
                operation: "DeleteMessageBatch",
                queue_url: queue_url.to_owned(),
                failed: out.failed().len(),
                total: chunk.len(),
                first: format!("{}: {}", entry.code(), entry.message().unwrap_or("")),
            },
        )),
    }
}
