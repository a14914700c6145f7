//! [`NatsAck`], the handle that settles one JetStream delivery; the deliveries a source holds,
//! told "in progress" while they are; and the redelivery counts the source keeps.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use async_nats::jetstream::kv::Store;
use async_nats::jetstream::message::{AckKind, Acker};
use async_nats::jetstream::Context;
use async_nats::{Client, HeaderMap, Subject};
use inbox_core::{dead_letter, Ack, Message, OperationError, Recovery, SourceError};
use tracing::debug;

use crate::source::is_jetstream_header;

/// What a source and its acks share.
pub(crate) struct Shared {
    pub(crate) client: Client,
    pub(crate) js: Context,
    pub(crate) stream: String,
    pub(crate) dead_letter_subject: String,
    /// The reply subjects of the deliveries not settled yet, by a token of their own.
    pub(crate) in_flight: Mutex<HashMap<u64, Option<Subject>>>,
    /// Held while "in progress" goes out for the deliveries held, and while a delivery leaves
    /// them to be handed back (`-NAK`): the server takes an "in progress" that arrives after a
    /// `-NAK` with a delay as a restart of the delivery's `ack_wait`, which would bring it back
    /// after `ack_wait` instead of the delay.
    pub(crate) handing_back: tokio::sync::Mutex<()>,
    /// Per stream sequence, the redelivery count handed back and the delivery count then.
    pub(crate) marks: Mutex<HashMap<u64, Mark>>,
    /// The same marks in a KV bucket, under `<stream>.<consumer>.<sequence>` (what a key cannot
    /// hold written `=XX`, [`key_token`](crate::key_token)), where the source keeps them there
    /// ([`NatsSourceBuilder::redelivery_bucket`](crate::NatsSourceBuilder)).
    pub(crate) bucket: Option<(Store, String)>,
    pub(crate) next: AtomicU64,
    /// The connection's operation timeout, which bounds an ack's attempts.
    pub(crate) timeout: Duration,
    /// Acks that failed (reply subject, sequence, delivery count, attempts), sent again at the
    /// next receive, "in progress" tick, and after the source is dropped: an applied message
    /// whose ack stays lost would come back only after `ack_wait`.
    pub(crate) failed_acks: Mutex<Vec<(Subject, u64, u64, u8)>>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    redeliveries: u32,
    delivered: u64,
}

impl Shared {
    /// The redelivery count of a delivery: the one handed back, once the server delivered the
    /// message again after the hand-back. Of this process's mark and the bucket's, where there
    /// is one, the later hand-back's: another member may have handed the message back since
    /// this one did (or this one before a restart).
    pub(crate) async fn redeliveries(&self, sequence: u64, delivered: u64) -> u32 {
        let known = {
            let marks = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
            marks.get(&sequence).copied()
        };
        let stored = match &self.bucket {
            Some((store, prefix)) if delivered > 1 => {
                match within(self.timeout, store.get(format!("{prefix}.{sequence}"))).await {
                    Ok(value) => value.and_then(|v| Mark::parse(&v)),
                    Err(e) => {
                        debug!(error = %e, sequence, "could not read a redelivery count");
                        None
                    }
                }
            }
            _ => None,
        };
        known
            .into_iter()
            .chain(stored)
            .max_by_key(|mark| mark.delivered)
            .filter(|mark| delivered > mark.delivered)
            .map_or(0, |mark| mark.redeliveries)
    }

    async fn forget(&self, sequence: u64, delivered: u64) {
        let had = {
            let mut marks = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
            marks.remove(&sequence).is_some()
        };
        if let Some((store, prefix)) = &self.bucket {
            if had || delivered > 1 {
                // Left behind, the bucket's max_age removes it.
                let _ = within(self.timeout, store.purge(format!("{prefix}.{sequence}"))).await;
            }
        }
    }

    /// Sends the failed acks again, each for up to the operation timeout; those that fail
    /// again wait for the next time, up to 20 attempts.
    pub(crate) async fn flush_acks(&self) {
        let pending = {
            let mut failed = self
                .failed_acks
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            std::mem::take(&mut *failed)
        };
        let mut again = Vec::new();
        for (reply, sequence, delivered, attempts) in pending {
            let ack = self.client.request(reply.clone(), AckKind::Ack.into());
            match within(self.timeout, ack).await {
                Ok(_) => self.forget(sequence, delivered).await,
                Err(_) if attempts < 20 => again.push((reply, sequence, delivered, attempts + 1)),
                Err(e) => {
                    debug!(error = %e, sequence, "an ack failed 20 times; ack_wait brings it back")
                }
            }
        }
        let mut failed = self
            .failed_acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        failed.extend(again);
    }

    pub(crate) fn acks_failed(&self) -> bool {
        let failed = self
            .failed_acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        !failed.is_empty()
    }

    /// Keeps `mark` in this process, then in the bucket (an error says the bucket refused).
    async fn mark(&self, sequence: u64, mark: Mark) -> Result<(), SourceError> {
        {
            let mut marks = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
            marks.insert(sequence, mark);
        }
        if let Some((store, prefix)) = &self.bucket {
            let value = format!("{}:{}", mark.redeliveries, mark.delivered);
            within(
                self.timeout,
                store.put(format!("{prefix}.{sequence}"), value.into()),
            )
            .await
            .map_err(|e| {
                OperationError::new(
                    Recovery::Retry,
                    format!("keeping the redelivery count of sequence {sequence}"),
                    e,
                )
            })?;
        }
        Ok(())
    }
}

impl Mark {
    fn parse(value: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(value).ok()?;
        let (redeliveries, delivered) = text.split_once(':')?;
        Some(Self {
            redeliveries: redeliveries.parse().ok()?,
            delivered: delivered.parse().ok()?,
        })
    }
}

/// A delivery's place among those the source holds; leaves it when dropped.
pub(crate) struct InFlight {
    shared: Weak<Shared>,
    token: u64,
}

impl InFlight {
    pub(crate) fn register(shared: &Arc<Shared>, reply: Option<Subject>) -> Self {
        let token = shared.next.fetch_add(1, Ordering::Relaxed);
        let mut held = shared
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        held.insert(token, reply);
        Self {
            shared: Arc::downgrade(shared),
            token,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            let mut held = shared
                .in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            held.remove(&self.token);
        }
    }
}

/// Every `every`, tells the server that each delivery the source holds is still being worked
/// on (`+WPI`), which restarts its `ack_wait`. Ends when the source is dropped.
pub(crate) fn spawn_progress(shared: &Arc<Shared>, every: Duration) -> tokio::task::JoinHandle<()> {
    let shared = Arc::downgrade(shared);
    let every = every.max(Duration::from_millis(100));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            if shared.acks_failed() {
                shared.flush_acks().await;
            }
            let _order = shared.handing_back.lock().await;
            let replies: Vec<Subject> = {
                let held = shared
                    .in_flight
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                held.values().flatten().cloned().collect()
            };
            // Bounded: while the client connects again its queue fills, and a send then waits
            // for the server, holding up every hand-back behind `handing_back`.
            let told = tokio::time::timeout(shared.timeout, async {
                for reply in replies {
                    // At most once: a lost one costs a redelivery the inbox skips.
                    if let Err(e) = shared.client.publish(reply, AckKind::Progress.into()).await {
                        debug!(error = %e, "could not tell NATS a delivery is in progress");
                    }
                }
            });
            if told.await.is_err() {
                debug!("could not tell NATS the deliveries held are in progress in time");
            }
        }
    })
}

/// Settles one JetStream delivery: ack (`+ACK`, confirmed by the server), nack (`-NAK` with a
/// delay), dead letter (published to the dead-letter subject and confirmed, then acked) or a
/// delayed redelivery (`-NAK` with the delay).
pub struct NatsAck {
    acker: Acker,
    reply: Option<Subject>,
    sequence: u64,
    delivered: u64,
    shared: Arc<Shared>,
    /// Among the deliveries "in progress" is sent for until it is settled or handed back.
    in_flight: Option<InFlight>,
}

impl std::fmt::Debug for NatsAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAck")
            .field("stream", &self.shared.stream)
            .field("sequence", &self.sequence)
            .field("delivered", &self.delivered)
            .finish_non_exhaustive()
    }
}

impl NatsAck {
    pub(crate) fn new(
        acker: Acker,
        reply: Option<Subject>,
        sequence: u64,
        delivered: u64,
        shared: Arc<Shared>,
        in_flight: InFlight,
    ) -> Self {
        Self {
            acker,
            reply,
            sequence,
            delivered,
            shared,
            in_flight: Some(in_flight),
        }
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display) -> SourceError {
        OperationError::new(
            Recovery::Retry,
            format!(
                "{what} stream `{}` sequence {}",
                self.shared.stream, self.sequence
            ),
            e.to_string(),
        )
    }

    /// `-NAK`, with the delay unless zero. Once it is sent no "in progress" follows it: the
    /// delivery leaves those held before the `-NAK` goes out, both under
    /// [`Shared::handing_back`], on the connection that sends the "in progress" too.
    async fn nak(&mut self, delay: Duration) -> Result<(), SourceError> {
        let kind = AckKind::Nak((!delay.is_zero()).then_some(delay));
        let _order = self.shared.handing_back.lock().await;
        self.in_flight = None;
        let sent = async {
            self.acker.ack_with(kind).await?;
            // On the wire before the hand-back returns: a source dropped right after (a
            // consumer that stops hands back what it holds) took a -NAK still queued in the
            // client with it, and the message waited out ack_wait.
            self.shared.client.flush().await?;
            Ok::<_, async_nats::Error>(())
        };
        within(self.shared.timeout, sent)
            .await
            .map_err(|e| self.failed("handing back", e))
    }
}

impl Ack for NatsAck {
    /// `+ACK`, confirmed; a failed one (a connection cut, a confirm lost) is sent again, 100 ms
    /// apart, for up to the operation timeout: the client reconnects meanwhile, and an ack left
    /// failed would bring the message back after `ack_wait`.
    async fn ack(self) -> Result<(), SourceError> {
        let start = tokio::time::Instant::now();
        loop {
            match within(self.shared.timeout, self.acker.double_ack()).await {
                Ok(()) => break,
                Err(_) if start.elapsed() < self.shared.timeout => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    if let Some(reply) = self.reply.clone() {
                        let mut failed = self
                            .shared
                            .failed_acks
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner);
                        failed.push((reply, self.sequence, self.delivered, 0));
                    }
                    return Err(self.failed("acking", e));
                }
            }
        }
        self.shared.forget(self.sequence, self.delivered).await;
        Ok(())
    }

    async fn nack(mut self, retry_after: Duration) -> Result<(), SourceError> {
        self.nak(retry_after).await
    }

    /// Acks concurrently, each confirmed by the server (JetStream has no batch ack).
    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let results = futures_util::future::join_all(acks.into_iter().map(Ack::ack)).await;
        results.into_iter().collect()
    }

    async fn dead_letter(mut self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &message.headers {
            let skipped = [
                dead_letter::REASON,
                dead_letter::ORIGINAL_SOURCE,
                dead_letter::ORIGINAL_POSITION,
            ];
            if !skipped.contains(&name.as_str()) && !is_jetstream_header(name) {
                headers.append(name.as_str(), String::from_utf8_lossy(value).as_ref());
            }
        }
        headers.insert(dead_letter::REASON, one_line(reason).as_str());
        headers.insert(dead_letter::ORIGINAL_SOURCE, message.meta.source.as_str());
        headers.insert(
            dead_letter::ORIGINAL_POSITION,
            message.meta.position.as_str(),
        );
        let subject = self.shared.dead_letter_subject.clone();
        let parked = async {
            let confirm = self
                .shared
                .js
                .publish_with_headers(subject.clone(), headers, message.payload.clone().into())
                .await?;
            confirm.await.map(drop)
        };
        let parked = within(self.shared.timeout, parked).await;
        if let Err(e) = parked {
            // Back after a pause, not in a tight loop against a refusing destination.
            let _ = self.nak(dead_letter::RETRY_AFTER).await;
            return Err(OperationError::new(
                Recovery::Retry,
                format!(
                    "dead-lettering stream `{}` sequence {} to `{subject}`",
                    self.shared.stream, self.sequence
                ),
                e,
            ));
        }
        self.ack().await
    }

    /// A `-NAK` with the delay: the server hands the message out again once it has passed. The
    /// count is kept by this source, and in its redelivery bucket where it has one (see the
    /// crate docs).
    async fn redeliver(
        mut self,
        _message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        let mark = Mark {
            redeliveries: redelivery.saturating_add(1),
            delivered: self.delivered,
        };
        if let Err(e) = self.shared.mark(self.sequence, mark).await {
            // Kept in this process only: back after the delay all the same.
            tracing::warn!(error = %e, "the redelivery count is kept in this process only");
        }
        self.nak(delay).await
    }
}

/// `operation`, given up after `timeout`. While the client connects again it queues what is
/// sent, and once its queue is full a send waits for the server, for good if it never answers
/// (a request's own timeout starts only once it is sent).
async fn within<T, E: Into<async_nats::Error>>(
    timeout: Duration,
    operation: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, async_nats::Error> {
    match tokio::time::timeout(timeout, operation).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => Err(format!("no answer within {timeout:?}; the connection may be lost").into()),
    }
}

/// Header values are one line.
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}
