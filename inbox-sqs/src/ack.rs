//! Acknowledging SQS deliveries: delete on ack, change visibility on nack, send to the
//! dead-letter queue then delete on dead-letter.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_sdk_sqs::types::{
    BatchResultErrorEntry, DeleteMessageBatchRequestEntry, MessageAttributeValue,
};
use aws_sdk_sqs::Client;
use inbox_core::{Ack, Message, Recovery, SourceError};
use tracing::{debug, warn};

use crate::copy::Copy;
use crate::dead_letter::{self, DeadLetterTarget};
use crate::delivery::{
    DedupId, Ownership, RedeliveryCopy, MAX_HIDE, REDELIVERY_COUNT, REDELIVER_AT,
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
/// receive that returned it. What each method does on SQS is in the crate docs, "Ack
/// semantics" and "Dead letters":
///
/// - [`Ack::ack`] is `DeleteMessage`; [`Ack::ack_all`] is `DeleteMessageBatch`, 10 per call.
/// - [`Ack::nack`] is `ChangeMessageVisibility` to the delay.
/// - [`Ack::redeliver`] sends a copy carrying the redelivery's number, then deletes the
///   message; a copy that cannot be sent leaves the message in place, visible again after the
///   delay.
/// - [`Ack::is_stale`] is `true` once the visibility heartbeat found the receipt handle refused.
/// - [`Ack::dead_letter`] sends the message to the dead-letter queue, then deletes it; when the
///   send fails it is nacked for [`inbox_core::dead_letter::RETRY_AFTER`] (at least the
///   source's `retry_backoff`).
/// - Dropping it without either (the consumer crashed) stops its visibility heartbeat; the
///   message becomes visible again when its visibility timeout runs out.
#[derive(Debug)]
pub struct SqsAck {
    pub(crate) shared: Arc<Shared>,
    pub(crate) receipt_handle: Arc<str>,
    /// The message attributes as received, with their data types, for a dead letter or a
    /// redelivered copy.
    pub(crate) attributes: Option<HashMap<String, MessageAttributeValue>>,
    /// Dropping it stops the heartbeat at once, an extension in flight included.
    pub(crate) heartbeat: Option<Heartbeat>,
    /// Lost when the heartbeat finds the receipt handle stale.
    pub(crate) ownership: Arc<Ownership>,
}

impl SqsAck {
    /// The receipt handle this ack deletes with.
    pub fn receipt_handle(&self) -> &str {
        &self.receipt_handle
    }

    /// Sends `copy` of `message` with the attributes it was received with.
    async fn send(&mut self, message: &Message, copy: Copy<'_>) -> Result<(), Error> {
        let attributes = self.attributes.take();
        let s = &self.shared;
        copy.send(&s.client, &s.id_attribute, message, attributes.as_ref())
            .await
    }

    /// Deletes the message once its copy was `sent`; otherwise leaves it in place, visible
    /// again after `nack_after`, and returns why the `what` failed.
    async fn delete_if_sent(
        self,
        sent: Result<(), SourceError>,
        nack_after: Duration,
        what: &str,
    ) -> Result<(), SourceError> {
        match sent {
            Ok(()) => self.ack().await,
            Err(e) => {
                if let Err(nack) = self.nack(nack_after).await {
                    warn!(error = %nack, "nack after a failed {what} failed; the message is visible again when its visibility timeout runs out");
                }
                Err(e)
            }
        }
    }
}

impl Ack for SqsAck {
    async fn ack(mut self) -> Result<(), SourceError> {
        self.heartbeat = None;
        delete_batch(std::slice::from_ref(&self))
            .await
            .map_err(|(_, e)| e.into())
    }

    async fn nack(mut self, retry_after: Duration) -> Result<(), SourceError> {
        self.heartbeat = None;
        let s = &self.shared;
        let seconds = visibility_seconds(retry_after.max(s.min_retry_delay));
        let operation = "ChangeMessageVisibility (nack)";
        match s
            .change_visibility(&self.receipt_handle, seconds, operation)
            .await
        {
            Ok(()) => Ok(()),
            // The copy is no longer ours (its visibility ran out and another receive took it):
            // that receive owns it now, which is what a nack wanted anyway.
            Err(e) if e.is_stale_receipt() => {
                debug!(error = %e, "nack on a stale receipt handle; the message is already back");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Sends a copy carrying redelivery `redelivery + 1`, due after `delay`, to the source
    /// queue: the attributes as received and the copy's [`REDELIVERY_COUNT`] and
    /// [`REDELIVER_AT`]; on a FIFO queue, the message group and a deduplication ID of its own.
    /// Then deletes the message; see the type's docs.
    async fn redeliver(
        mut self,
        message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        self.heartbeat = None;
        let shared = Arc::clone(&self.shared);
        let plan = RedeliveryCopy::plan(redelivery, delay, SystemTime::now(), shared.fifo);
        let mut added = vec![(REDELIVERY_COUNT, plan.count.to_string())];
        added.extend(plan.due_attribute().map(|due| (REDELIVER_AT, due)));
        let copy = Copy {
            queue_url: &shared.queue_url,
            operation: "SendMessage (delayed redelivery)",
            why: "count the redelivery",
            added,
            fifo_dedup_id: shared
                .fifo
                .then(|| DedupId::Redelivery(&self.receipt_handle).value()),
            delay_seconds: plan.delay_seconds,
        };
        let sent = self.send(message, copy).await.map_err(|e| {
            if e.recovery() == Recovery::Fatal {
                Error::Config(format!(
                    "{e}; a delayed redelivery sends a copy of the message to its own queue: \
                     allow sqs:SendMessage on {} to the consumer, or remove the redelivery \
                     schedule",
                    shared.queue_url
                ))
            } else {
                e
            }
        });
        // In place instead, when it fails: back after the delay, its count unchanged.
        self.delete_if_sent(sent.map_err(SourceError::from), delay, "redelivery copy")
            .await
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
            DeadLetterTarget::Queue(dlq_url) => {
                let handle = Arc::clone(&self.receipt_handle);
                let letter = dead_letter::letter(dlq_url, message, &handle, reason);
                self.send(message, letter).await.map_err(SourceError::from)
            }
            target => Err(target.refusal(&shared.queue_url, reason)),
        };
        let retry_after = inbox_core::dead_letter::RETRY_AFTER;
        self.delete_if_sent(sent, retry_after, "dead letter").await
    }

    async fn ack_all(mut pending: Vec<Self>) -> Result<(), SourceError> {
        for ack in &mut pending {
            ack.heartbeat = None;
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
        // A batch error counts the failures of every call.
        if let Some(Error::Batch {
            failed: f,
            total: t,
            ..
        }) = &mut first_error
        {
            (*f, *t) = (failed, total);
        }
        first_error.map_or(Ok(()), |e| Err(e.into()))
    }
}

/// A nack delay as the whole seconds `ChangeMessageVisibility` takes, rounded up: rounding
/// down would make a delay under 1 s no delay at all (visible again at once).
pub(crate) fn visibility_seconds(delay: Duration) -> i32 {
    crate::delivery::whole_seconds(delay.min(MAX_HIDE))
}

impl Shared {
    /// `ChangeMessageVisibility` of the message received with `receipt_handle` to `seconds`.
    pub(crate) async fn change_visibility(
        &self,
        receipt_handle: &str,
        seconds: i32,
        operation: &'static str,
    ) -> Result<(), Error> {
        self.client
            .change_message_visibility()
            .queue_url(&*self.queue_url)
            .receipt_handle(receipt_handle)
            .visibility_timeout(seconds)
            .send()
            .await
            .map_err(|e| Error::sdk(operation, &self.queue_url, e))?;
        Ok(())
    }
}

/// Deletes the messages received with `handles` (10 at most) with one `DeleteMessageBatch`:
/// the entries SQS did not delete, whose IDs are their indexes in `handles`.
pub(crate) async fn delete_message_batch<'h>(
    client: &Client,
    queue_url: &str,
    handles: impl IntoIterator<Item = &'h str>,
    operation: &'static str,
) -> Result<Vec<BatchResultErrorEntry>, Error> {
    let entries = handles.into_iter().enumerate().map(|(i, handle)| {
        DeleteMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .receipt_handle(handle)
            .build()
            .map_err(|e| Error::Config(format!("cannot build a delete entry: {e}")))
    });
    let out = client
        .delete_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries.collect::<Result<_, _>>()?))
        .send()
        .await
        .map_err(|e| Error::sdk(operation, queue_url, e))?;
    Ok(out.failed)
}

/// Deletes up to 10 messages of one queue; on failure, how many were not deleted and why.
async fn delete_batch(chunk: &[SqsAck]) -> Result<(), (usize, Error)> {
    let Some(first) = chunk.first() else {
        return Ok(());
    };
    let (client, queue_url) = (&first.shared.client, &*first.shared.queue_url);
    if let [only] = chunk {
        // One message: the plain call is as cheap and its error is simpler.
        return client
            .delete_message()
            .queue_url(queue_url)
            .receipt_handle(&*only.receipt_handle)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| (1, Error::sdk("DeleteMessage", queue_url, e)));
    }
    let handles = chunk.iter().map(|ack| &*ack.receipt_handle);
    let failed = delete_message_batch(client, queue_url, handles, "DeleteMessageBatch")
        .await
        .map_err(|e| (chunk.len(), e))?;
    match failed.first() {
        None => Ok(()),
        Some(entry) => Err((
            failed.len(),
            Error::Batch {
                operation: "DeleteMessageBatch",
                queue_url: queue_url.to_owned(),
                failed: failed.len(),
                total: chunk.len(),
                first: format!("{}: {}", entry.code(), entry.message().unwrap_or("")),
            },
        )),
    }
}
#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use aws_sdk_sqs::config::retry::RetryConfig;

    use super::*;

    #[test]
    fn nack_delays_round_up_to_whole_seconds() {
        // No delay stays none; 24 h is capped at SQS's longest visibility timeout.
        let rounded = [(0, 0), (1, 1), (300, 1), (1000, 1), (1500, 2), (7000, 7)];
        let capped = (86_400_000, 43_200);
        for (millis, seconds) in rounded.into_iter().chain([capped]) {
            let delay = Duration::from_millis(millis);
            assert_eq!(visibility_seconds(delay), seconds, "{delay:?}");
        }
    }

    /// What the acks of a queue at `addr` share, with a client that does not retry.
    async fn shared_at(addr: SocketAddr) -> Arc<Shared> {
        let config = crate::connection::test_loader(&format!("http://{addr}"))
            .retry_config(RetryConfig::disabled())
            .load()
            .await;
        Arc::new(Shared {
            client: Client::new(&config),
            queue_url: Arc::from("http://localhost/123456789012/q"),
            id_attribute: Arc::from(crate::DEFAULT_ID_ATTRIBUTE),
            min_retry_delay: Duration::ZERO,
            dead_letter: DeadLetterTarget::None,
            fifo: false,
        })
    }

    #[tokio::test]
    async fn an_ack_does_not_wait_for_a_hung_heartbeat_extension() {
        // An endpoint that accepts connections and never answers: a hung SQS call.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let black_hole = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        // An endpoint where nothing listens: the ack's own delete fails at once, so only the
        // heartbeat's stop can hold it up.
        // (The listener is dropped at once.)
        let refusing = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let handle: Arc<str> = Arc::from("receipt");
        // Visibility 1 s: the first extension goes out after a third of it and never returns.
        let heartbeat = Heartbeat::start(
            shared_at(black_hole).await,
            Arc::clone(&handle),
            Duration::from_secs(1),
            Arc::default(),
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
        let ack = SqsAck {
            shared: shared_at(refusing).await,
            receipt_handle: handle,
            attributes: None,
            heartbeat: Some(heartbeat),
            ownership: Arc::default(),
        };
        let acked = tokio::time::timeout(Duration::from_secs(3), ack.ack()).await;
        server.abort();
        assert!(
            acked.is_ok(),
            "the ack waited for the heartbeat's hung ChangeMessageVisibility"
        );
    }
}
