//! Acknowledging SQS deliveries: delete on ack, change visibility on nack, send to the
//! dead-letter queue then delete on dead-letter.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, MessageAttributeValue};
use aws_sdk_sqs::Client;
use inbox_core::{Ack, Message, SourceError};
use tracing::{debug, warn};

use crate::config::MAX_VISIBILITY;
use crate::dead_letter::{self, DeadLetterTarget};
use crate::delivery::{
    DedupId, Ownership, RedeliveryCopy, REDELIVERY_COUNT, REDELIVER_AT, SCHEDULE_ATTRIBUTES,
};
use crate::heartbeat::Heartbeat;
use crate::Error;

/// What every ack of one source shares: its client, queue, settings and dead-letter queue.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) client: Client,
    pub(crate) queue_url: Arc<str>,
    /// The message attribute the source reads the ID from: a dead letter carries the ID in it.
    pub(crate) id_attribute: Arc<str>,
    pub(crate) min_retry_delay: Duration,
    pub(crate) dead_letter: DeadLetterTarget,
    /// A FIFO queue: a redelivered copy keeps the message group and is delayed by
    /// [`REDELIVER_AT`](crate::delivery::REDELIVER_AT), FIFO queues taking no per-message delay.
    pub(crate) fifo: bool,
}

/// The acknowledgement handle of one SQS delivery: its queue and the receipt handle of the
/// receive that returned it.
///
/// - [`Ack::ack`] deletes the message (`DeleteMessage`); [`Ack::ack_all`] deletes many with
///   `DeleteMessageBatch`, 10 per call.
/// - [`Ack::nack`] makes the message visible again after the delay (`ChangeMessageVisibility`).
/// - [`Ack::redeliver`] sends a copy of the message to its queue, due after the schedule's
///   delay and carrying the redelivery's number ([`inbox_core::REDELIVERY_COUNT`]), which the
///   copy reports as [`Metadata::redeliveries`](inbox_core::Metadata), then deletes the
///   message; a copy that cannot be sent leaves the message in place, visible again after the
///   delay (see the crate docs, "Ack semantics").
/// - [`Ack::is_stale`] is `true` once the visibility heartbeat found the receipt handle refused:
///   the message was handed out again, or deleted by its other copy.
/// - [`Ack::dead_letter`] sends the message to the dead-letter queue (see the crate docs, "Dead
///   letters"), with the attributes it was received with and its ID in the ID attribute, then
///   deletes it. When the send fails
///   it is nacked for [`inbox_core::dead_letter::RETRY_AFTER`] (at least the source's
///   `retry_backoff`); a source with no dead-letter queue fails with
///   [`Recovery::Fatal`](inbox_core::Recovery::Fatal) naming the setting.
/// - Dropping it without either (the consumer crashed) stops its visibility heartbeat; the
///   message becomes visible again when its visibility timeout runs out.
#[derive(Debug)]
pub struct SqsAck {
    shared: Arc<Shared>,
    receipt_handle: Arc<str>,
    /// The message attributes as received, with their data types, for a dead letter or a
    /// redelivered copy.
    attributes: Option<HashMap<String, MessageAttributeValue>>,
    heartbeat: Option<Heartbeat>,
    /// Lost when the heartbeat finds the receipt handle stale.
    ownership: Arc<Ownership>,
}

impl SqsAck {
    pub(crate) fn new(
        shared: Arc<Shared>,
        receipt_handle: Arc<str>,
        attributes: Option<HashMap<String, MessageAttributeValue>>,
        heartbeat: Option<Heartbeat>,
        ownership: Arc<Ownership>,
    ) -> Self {
        Self {
            shared,
            receipt_handle,
            attributes,
            heartbeat,
            ownership,
        }
    }

    /// The receipt handle this ack deletes with.
    pub fn receipt_handle(&self) -> &str {
        &self.receipt_handle
    }

    /// Sends the copy of a delayed redelivery to the source queue: the body, the attributes as
    /// received (the ID attribute kept whatever is cut) and the copy's [`REDELIVERY_COUNT`] and
    /// [`REDELIVER_AT`](crate::delivery::REDELIVER_AT); on a FIFO queue, the message group and a
    /// deduplication ID of its own.
    async fn send_copy(&mut self, message: &Message, copy: &RedeliveryCopy) -> Result<(), Error> {
        let s = &self.shared;
        let mut attributes = dead_letter::original_attributes(self.attributes.as_ref(), message);
        let id = dead_letter::id_attribute_of(&mut attributes, &s.id_attribute, message)?;
        attributes.retain(|(name, _)| !SCHEDULE_ATTRIBUTES.contains(&name.as_str()));
        let due = copy.due_attribute();
        let added = 1 + usize::from(due.is_some()) + usize::from(id.is_some());
        dead_letter::make_room(&mut attributes, added, &s.queue_url, "count the redelivery");
        attributes.extend(id);
        attributes.push((
            REDELIVERY_COUNT.to_owned(),
            dead_letter::text_attribute(REDELIVERY_COUNT, &copy.count.to_string())?,
        ));
        if let Some(due) = due {
            attributes.push((
                REDELIVER_AT.to_owned(),
                dead_letter::text_attribute(REDELIVER_AT, &due)?,
            ));
        }
        let mut request = s
            .client
            .send_message()
            .queue_url(&*s.queue_url)
            .message_body(String::from_utf8_lossy(&message.payload))
            .set_message_attributes(Some(attributes.into_iter().collect()))
            .set_delay_seconds(copy.delay_seconds);
        if s.fifo {
            request = request
                .message_group_id(dead_letter::fifo_group(message))
                .message_deduplication_id(DedupId::Redelivery(&self.receipt_handle).value());
        }
        request.send().await.map_err(|e| {
            let e = Error::sdk("SendMessage (delayed redelivery)", &s.queue_url, e);
            if e.recovery() == inbox_core::Recovery::Fatal {
                Error::Config(format!(
                    "{e}; a delayed redelivery sends a copy of the message to its own queue: \
                     allow sqs:SendMessage on {} to the consumer, or remove the redelivery \
                     schedule",
                    s.queue_url
                ))
            } else {
                e
            }
        })?;
        Ok(())
    }

    fn stop_heartbeat(&mut self) {
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.stop();
        }
    }
}

impl Ack for SqsAck {
    async fn ack(mut self) -> Result<(), SourceError> {
        self.stop_heartbeat();
        let s = &self.shared;
        s.client
            .delete_message()
            .queue_url(&*s.queue_url)
            .receipt_handle(&*self.receipt_handle)
            .send()
            .await
            .map_err(|e| Error::sdk("DeleteMessage", &s.queue_url, e))?;
        Ok(())
    }

    async fn nack(mut self, retry_after: Duration) -> Result<(), SourceError> {
        self.stop_heartbeat();
        let s = &self.shared;
        let seconds = visibility_seconds(retry_after.max(s.min_retry_delay));
        let result = s
            .client
            .change_message_visibility()
            .queue_url(&*s.queue_url)
            .receipt_handle(&*self.receipt_handle)
            .visibility_timeout(seconds)
            .send()
            .await
            .map_err(|e| Error::sdk("ChangeMessageVisibility (nack)", &s.queue_url, e));
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

    /// A copy carrying redelivery `redelivery + 1` is sent, due after `delay`, then the message
    /// is deleted; see the type's docs.
    async fn redeliver(
        mut self,
        message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        self.stop_heartbeat();
        let copy = RedeliveryCopy::plan(redelivery, delay, SystemTime::now(), self.shared.fifo);
        match self.send_copy(message, &copy).await {
            Ok(()) => self.ack().await,
            Err(e) => {
                // In place instead: back after the delay, its count unchanged.
                if let Err(nack) = self.nack(delay).await {
                    warn!(error = %nack, "nack after a failed redelivery copy failed; the message is visible again when its visibility timeout runs out");
                }
                Err(e.into())
            }
        }
    }

    /// Whether the heartbeat found this delivery's receipt handle stale: the message was handed
    /// out again (or deleted by its other copy) while this delivery waited.
    fn is_stale(&self) -> bool {
        self.ownership.is_lost()
    }

    /// Sends the dead letter, then deletes the message; see the type's docs.
    async fn dead_letter(mut self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let shared = Arc::clone(&self.shared);
        let sent = match &shared.dead_letter {
            DeadLetterTarget::Queue(dlq_url) => dead_letter::send(
                &shared.client,
                dlq_url,
                &shared.id_attribute,
                message,
                self.attributes.take().as_ref(),
                Some(&self.receipt_handle),
                reason,
            )
            .await
            .map_err(SourceError::from),
            DeadLetterTarget::Redrive {
                arn,
                max_receive_count,
            } => Err(dead_letter::handed_to_redrive(
                &shared.queue_url,
                arn,
                max_receive_count,
                reason,
            )),
            DeadLetterTarget::None => Err(dead_letter::nowhere(&shared.queue_url, reason)),
        };
        match sent {
            Ok(()) => self.ack().await,
            Err(e) => {
                if let Err(nack) = self.nack(inbox_core::dead_letter::RETRY_AFTER).await {
                    warn!(error = %nack, "nack after a failed dead letter failed; the message is visible again when its visibility timeout runs out");
                }
                Err(e)
            }
        }
    }

    async fn ack_all(mut pending: Vec<Self>) -> Result<(), SourceError> {
        for ack in &mut pending {
            ack.stop_heartbeat();
        }
        // One batch call per queue and per 10 messages; normally all share one queue.
        pending.sort_by(|a, b| a.shared.queue_url.cmp(&b.shared.queue_url));
        let mut first_error: Option<Error> = None;
        let mut failed = 0;
        let total = pending.len();
        for group in pending.chunk_by(|a, b| a.shared.queue_url == b.shared.queue_url) {
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

/// A nack delay as the whole seconds `ChangeMessageVisibility` takes, rounded up: rounding
/// down would make a delay under 1 s no delay at all (visible again at once).
pub(crate) fn visibility_seconds(delay: Duration) -> i32 {
    crate::delivery::whole_seconds(delay.min(MAX_VISIBILITY))
}

/// Deletes up to 10 messages of one queue; on failure, how many were not deleted and why.
async fn delete_batch(chunk: &[SqsAck]) -> Result<(), (usize, Error)> {
    let Some(first) = chunk.first() else {
        return Ok(());
    };
    let queue_url = &*first.shared.queue_url;
    if let [only] = chunk {
        // One message: the plain call is as cheap and its error is simpler.
        return only
            .shared
            .client
            .delete_message()
            .queue_url(queue_url)
            .receipt_handle(&*only.receipt_handle)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| (1, Error::sdk("DeleteMessage", queue_url, e)));
    }
    let mut request = first
        .shared
        .client
        .delete_message_batch()
        .queue_url(queue_url);
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::SocketAddr;

    use aws_sdk_sqs::config::retry::RetryConfig;
    use aws_sdk_sqs::config::{Credentials, Region};

    use super::*;

    #[test]
    fn nack_delays_round_up_to_whole_seconds() {
        assert_eq!(visibility_seconds(Duration::ZERO), 0, "no delay stays none");
        assert_eq!(visibility_seconds(Duration::from_millis(1)), 1);
        assert_eq!(visibility_seconds(Duration::from_millis(300)), 1);
        assert_eq!(visibility_seconds(Duration::from_secs(1)), 1);
        assert_eq!(visibility_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(visibility_seconds(Duration::from_secs(7)), 7);
        assert_eq!(
            visibility_seconds(Duration::from_secs(24 * 60 * 60)),
            12 * 60 * 60,
            "capped at SQS's longest visibility timeout"
        );
    }

    /// A client of the endpoint at `addr` that does not retry.
    async fn client_at(addr: SocketAddr) -> Client {
        let config = crate::config_loader()
            .endpoint_url(format!("http://{addr}"))
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "test"))
            .retry_config(RetryConfig::disabled())
            .load()
            .await;
        Client::new(&config)
    }

    /// An endpoint that accepts connections and never answers: a hung SQS call.
    async fn black_hole() -> (Client, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        (client_at(addr).await, server)
    }

    /// An endpoint where nothing listens: every call fails at once.
    async fn refusing() -> Client {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        client_at(addr).await
    }

    #[tokio::test]
    async fn an_ack_does_not_wait_for_a_hung_heartbeat_extension() {
        let (client, server) = black_hole().await;
        let queue_url: Arc<str> = Arc::from("http://localhost/123456789012/q");
        let handle: Arc<str> = Arc::from("receipt");
        // Visibility 1 s: the first extension goes out after a third of it and never returns.
        let heartbeat = Heartbeat::start(
            client,
            Arc::clone(&queue_url),
            Arc::clone(&handle),
            Duration::from_secs(1),
            Arc::default(),
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
        // The ack's own delete fails at once: only the heartbeat's stop can hold it up.
        let shared = Shared {
            client: refusing().await,
            queue_url,
            id_attribute: Arc::from(crate::DEFAULT_ID_ATTRIBUTE),
            min_retry_delay: Duration::ZERO,
            dead_letter: DeadLetterTarget::None,
            fifo: false,
        };
        let ack = SqsAck::new(
            Arc::new(shared),
            handle,
            None,
            Some(heartbeat),
            Arc::default(),
        );
        let acked = tokio::time::timeout(Duration::from_secs(3), ack.ack()).await;
        server.abort();
        assert!(
            acked.is_ok(),
            "the ack waited for the heartbeat's hung ChangeMessageVisibility"
        );
    }
}
