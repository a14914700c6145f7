//! `basic.ack` after the commit, batched with `multiple` where that is safe; delayed requeues;
//! dead letters published and confirmed, then acked.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use inbox_core::{Ack, Message, SourceError};
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{BasicProperties, Channel, Connection};

use crate::dead_letter::DeadLetters;
use crate::unsettled::{AckPlan, Unsettled};
use crate::Error;

/// One connection and its consuming channel. Deliveries keep it alive until they are settled:
/// an ack must go to the channel its delivery came on, never to a newer one.
pub(crate) struct Link {
    pub(crate) generation: u64,
    /// Held so the connection closes only when the source and every delivery from it are gone.
    pub(crate) connection: Connection,
    pub(crate) channel: Channel,
    /// Delivery tags handed to the consumer and not yet acked or nacked, so `ack_all` knows when
    /// one `multiple` ack covers exactly the tags it was given and nothing else.
    pub(crate) unsettled: Mutex<Unsettled>,
    /// Test-only: stops a nack just before its frame is queued.
    #[cfg(test)]
    pub(crate) before_nack_frame: tests::Pause,
    /// Test-only: the next ack or nack fails as a lost socket does, its frame not sent.
    #[cfg(test)]
    pub(crate) fail_next_frame: std::sync::atomic::AtomicBool,
}

impl Link {
    pub(crate) fn new(generation: u64, connection: Connection, channel: Channel) -> Self {
        Self {
            generation,
            connection,
            channel,
            unsettled: Mutex::new(Unsettled::new()),
            #[cfg(test)]
            before_nack_frame: tests::Pause::default(),
            #[cfg(test)]
            fail_next_frame: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn unsettled(&self) -> MutexGuard<'_, Unsettled> {
        self.unsettled.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn track(&self, tag: u64) {
        self.unsettled().track(tag);
    }

    pub(crate) fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    /// The delivery's [`Metadata::position`](inbox_core::Metadata::position).
    pub(crate) fn position(&self, tag: u64) -> String {
        format!(
            "connection {} channel {} tag {tag}",
            self.generation,
            self.channel.id()
        )
    }

    /// Sends `basic.ack` of `tag` (and, with `multiple`, of every unsettled tag below it).
    async fn ack(&self, tag: u64, multiple: bool) -> Result<(), Error> {
        let frame = self.channel.basic_ack(tag, BasicAckOptions { multiple });
        self.send("ack", tag, frame).await?;
        let mut unsettled = self.unsettled();
        if multiple {
            unsettled.settled_up_to(tag);
        } else {
            unsettled.settled([tag]);
        }
        Ok(())
    }

    /// `basic.nack` with `requeue`, never `basic.reject`: from RabbitMQ 4.3 on a nack does not
    /// count against the quorum queue's `x-delivery-limit` (a reject does), and the hand-backs
    /// that reach this point are the store's or the broker's trouble, not the message's.
    async fn nack(&self, tag: u64) -> Result<(), Error> {
        #[cfg(test)]
        self.before_nack_frame.point().await;
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        self.send("nack", tag, self.channel.basic_nack(tag, options))
            .await?;
        self.unsettled().settled([tag]);
        Ok(())
    }

    /// Queues an ack's or nack's `frame` (lapin queues it when the future is first polled).
    ///
    /// Only once it is queued may the caller mark its tags settled, and never after a failure
    /// (see [`Unsettled::settled`]): lapin sends a channel's frames in the order they were
    /// queued, so a `multiple` ack planned after that point reaches the broker after this frame,
    /// and one planned before it still sees the tags as unsettled and does not pass over them.
    async fn send(
        &self,
        action: &'static str,
        tag: u64,
        frame: impl Future<Output = lapin::Result<()>>,
    ) -> Result<(), Error> {
        // lapin accepts an ack on a channel the broker already closed and then drops it; the
        // delivery is redelivered, so the caller must hear about it.
        if !self.is_open() {
            return Err(self.closed(action, tag));
        }
        #[cfg(test)]
        if self
            .fail_next_frame
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            let lost = std::io::Error::other("test: the frame was not sent");
            return Err(self.failed(action, tag, lost.into()));
        }
        frame.await.map_err(|e| self.failed(action, tag, e))
    }

    fn closed(&self, action: &'static str, tag: u64) -> Error {
        Error::ChannelClosed {
            action,
            position: self.position(tag),
        }
    }

    fn failed(&self, action: &'static str, tag: u64, e: lapin::Error) -> Error {
        match e.kind() {
            lapin::ErrorKind::InvalidChannelState(..)
            | lapin::ErrorKind::InvalidConnectionState(_)
            | lapin::ErrorKind::InvalidChannel(_) => self.closed(action, tag),
            _ => Error::amqp(format!("{action} of {}", self.position(tag)), e),
        }
    }
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("generation", &self.generation)
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

/// Acknowledges one RabbitMQ delivery: `basic.ack` on the channel it arrived on. The crate
/// docs, "Ack semantics", say what each step means for redelivery and `x-delivery-limit`.
///
/// - [`Ack::ack`]: `basic.ack`. After its channel closed it fails with
///   [`Recovery::Reconnect`](inbox_core::Recovery::Reconnect), and the broker redelivers the
///   message (flagged `redelivered`), which the inbox skips.
/// - [`Ack::ack_all`]: one `basic.ack` with `multiple = true` for the longest run of the batch
///   that starts at the channel's oldest unsettled delivery (so it cannot settle a delivery the
///   batch does not own, such as one waiting for a delayed requeue); the rest one by one.
/// - [`Ack::nack`]: a **delayed requeue**: a spawned task sleeps `retry_after`, then sends
///   `basic.nack` with `requeue = true`; until then the delivery stays unsettled and keeps its
///   prefetch slot, while the others keep flowing. If the channel closes while it waits, the
///   broker requeues the delivery and the nack is not sent.
/// - [`Ack::redeliver`]: publishes a copy to the delay queue `<queue>.delay.<n>` (`n`: the
///   redelivery, from 0) with the delay as its `expiration` and the count in the
///   [`inbox_core::REDELIVERY_COUNT`] header, waits for the publisher confirm, then acks. The
///   copy keeps the message ID, so the inbox applies it once even if the ack is lost and both
///   copies come back.
/// - [`Ack::dead_letter`]: publishes the message to `<queue>.dlq` as the crate docs,
///   "Topology", describe, waits for the publisher confirm (at most
///   [`RabbitConnection::operation_timeout`](crate::RabbitConnection::operation_timeout)),
///   then acks.
///
/// An ack or nack that fails on a channel that stays open leaves its deliveries unsettled: no
/// later `multiple` ack covers them, and the broker hands them out again when the channel
/// closes. A redelivery or dead letter whose publish fails is nacked as above, after
/// [`inbox_core::dead_letter::RETRY_AFTER`].
pub struct RabbitAck {
    pub(crate) link: Arc<Link>,
    pub(crate) tag: u64,
    /// The source's dead-letter publisher.
    pub(crate) dead_letters: Arc<DeadLetters>,
    /// The delivery's own properties, so a dead letter keeps its typed headers and properties.
    pub(crate) properties: BasicProperties,
}

impl fmt::Debug for RabbitAck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitAck")
            .field("link", &self.link)
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl RabbitAck {
    /// Acks once the dead letter or delayed copy is `published`; else hands the delivery back,
    /// to be tried again after [`RETRY_AFTER`](inbox_core::dead_letter::RETRY_AFTER).
    async fn ack_once(self, published: Result<(), Error>, what: &str) -> Result<(), SourceError> {
        let Err(e) = published else {
            return self.ack().await;
        };
        if let Err(nack) = self.nack(inbox_core::dead_letter::RETRY_AFTER).await {
            tracing::warn!(error = %nack, "requeue after a failed {what} failed; the broker redelivers the message when the channel closes");
        }
        Err(e.into())
    }
}

impl Ack for RabbitAck {
    async fn ack(self) -> Result<(), SourceError> {
        Ok(self.link.ack(self.tag, false).await?)
    }

    async fn nack(self, retry_after: Duration) -> Result<(), SourceError> {
        let link = self.link;
        if retry_after.is_zero() {
            return Ok(link.nack(self.tag).await?);
        }
        let tag = self.tag;
        tokio::spawn(async move {
            tokio::time::sleep(retry_after).await;
            if let Err(e) = link.nack(tag).await {
                tracing::warn!(error = %e, "delayed requeue failed; the broker redelivers the message when the channel closes");
            }
        });
        Ok(())
    }

    /// Publishes the dead letter, waits for its confirm, then acks; see the type's docs.
    async fn dead_letter(self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let published = self
            .dead_letters
            .park(message, &self.properties, reason)
            .await;
        self.ack_once(published, "dead letter").await
    }

    /// Publishes a copy to the delay queue and waits for its confirm, then acks; see the
    /// type's docs.
    async fn redeliver(
        self,
        message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        let published = (self.dead_letters)
            .delay(message, &self.properties, delay, redelivery)
            .await;
        self.ack_once(published, "delayed redelivery").await
    }

    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        // Group by link: deliveries of a closed connection cannot be acked with the live ones.
        let mut groups: HashMap<u64, (Arc<Link>, BTreeSet<u64>)> = HashMap::new();
        for ack in acks {
            groups
                .entry(ack.link.generation)
                .or_insert_with(|| (ack.link, BTreeSet::new()))
                .1
                .insert(ack.tag);
        }
        let mut first_error = None;
        for (link, tags) in groups.into_values() {
            let AckPlan {
                multiple_up_to,
                singles,
            } = link.unsettled().plan(&tags);
            let acked = async {
                if let Some(last) = multiple_up_to {
                    link.ack(last, true).await?;
                }
                for tag in singles {
                    link.ack(tag, false).await?;
                }
                Ok::<_, Error>(())
            };
            // Settled as each frame was queued. After a failure the rest stay unsettled: the
            // broker never got their ack, so no later `multiple` ack may cover them.
            if let Err(e) = acked.await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), |e| Err(e.into()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use lapin::options::QueueDeleteOptions;
    use tokio::sync::Notify;
    use tokio::time::Instant;

    use super::*;
    use crate::RabbitSource;
    use inbox_core::MessageSource;
    use inbox_core::Publish;

    /// A point where a test stops a task and runs something else before letting it go on.
    #[derive(Debug, Default)]
    pub(crate) struct Pause {
        armed: AtomicBool,
        reached: Notify,
        release: Notify,
    }

    impl Pause {
        fn arm(&self) {
            self.armed.store(true, Ordering::SeqCst);
        }

        pub(crate) async fn point(&self) {
            if self.armed.swap(false, Ordering::SeqCst) {
                self.reached.notify_one();
                self.release.notified().await;
            }
        }
    }

    /// The delayed requeue has decided to nack tag 1, but its frame is not queued yet, when the
    /// batch of tags 2 and 3 is acked. A `multiple` ack of 3 would settle tag 1 too: the message
    /// would be gone without ever being applied.
    #[tokio::test]
    async fn a_batch_ack_never_settles_a_delivery_whose_nack_is_not_yet_sent() {
        let (config, mut source, deliveries) = received("nackrace", 3).await;
        let mut deliveries = deliveries.into_iter();
        let first = deliveries.next().unwrap();
        let nacked = first.message.id.clone().unwrap();
        let link = Arc::clone(&first.ack.link);
        assert_eq!(first.ack.tag, 1);

        link.before_nack_frame.arm();
        first.ack.nack(Duration::from_millis(1)).await.unwrap();
        link.before_nack_frame.reached.notified().await;
        let batch = deliveries.map(|d| d.ack).collect();
        RabbitAck::ack_all(batch).await.unwrap();
        link.before_nack_frame.release.notify_one();

        // The nacked message comes back (as tag 4).
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut back = None;
        while back.is_none() && Instant::now() < deadline {
            match source.receive(1).await {
                Ok(batch) => back = batch.into_iter().next(),
                Err(e) => println!("receive: {e}"),
            }
        }
        let back_id = back.as_ref().map(|d| d.message.id.clone().unwrap());
        println!("nacked {nacked}, came back: {back_id:?}");
        if let Some(d) = back {
            d.ack.ack().await.unwrap();
        }
        source.close().await;
        delete_queues(&config).await;
        assert_eq!(
            back_id,
            Some(nacked),
            "the nacked message was settled by the batch's multiple ack and is lost"
        );
    }

    /// A fresh queue holding `n` messages, and a source that has received them all (tags 1 to
    /// `n`, in order).
    async fn received(
        prefix: &str,
        n: usize,
    ) -> (
        crate::RabbitSourceBuilder,
        RabbitSource,
        Vec<inbox_core::Delivery<RabbitAck>>,
    ) {
        let queue = format!("inbox-test-{prefix}-{}", uuid::Uuid::new_v4().simple());
        let config = RabbitSource::builder(queue)
            .prefetch(10)
            .poll_timeout(Duration::from_millis(500));
        config.declare_topology().await.unwrap();
        let producer = config.connection().producer().connect().await.unwrap();
        for i in 0..n {
            let payload = format!("m{i}");
            producer
                .send(config.queue(), payload.as_bytes())
                .await
                .unwrap();
        }
        producer.close().await;
        let mut source = config.clone().connect().await.unwrap();
        let mut deliveries = Vec::new();
        while deliveries.len() < n {
            deliveries.extend(source.receive(n).await.unwrap());
        }
        let tags: Vec<u64> = deliveries.iter().map(|d| d.ack.tag).collect();
        assert_eq!(tags, (1..=n as u64).collect::<Vec<_>>());
        (config, source, deliveries)
    }

    /// Deletes the test's queue and its dead-letter queue.
    async fn delete_queues(config: &crate::RabbitSourceBuilder) {
        let cleanup = config.connection().open("inbox-test cleanup", "cleanup");
        let (connection, channel) = cleanup.await.unwrap();
        for q in [config.queue().to_owned(), config.dead_letter_queue()] {
            let _ = channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = connection.close(200, "cleanup".into()).await;
    }

    /// Receives `n` messages, makes the frame of `fail` on the first `failing` deliveries fail
    /// on a channel that stays open, and acks the rest as a batch. Then closes the source (the
    /// broker requeues whatever it did not get an ack or nack for), takes everything left on
    /// the queue with a new source, and deletes the queues: the payloads that came back, sorted.
    async fn after_a_failed_frame<F>(
        prefix: &str,
        n: usize,
        failing: usize,
        fail: impl FnOnce(Vec<RabbitAck>) -> F,
    ) -> Vec<String>
    where
        F: Future<Output = Result<(), SourceError>>,
    {
        let (config, source, deliveries) = received(prefix, n).await;
        let mut acks: Vec<RabbitAck> = deliveries.into_iter().map(|d| d.ack).collect();
        let link = Arc::clone(&acks[0].link);
        let rest = acks.split_off(failing);
        link.fail_next_frame.store(true, Ordering::SeqCst);
        let e = fail(acks).await.expect_err("the frame failed");
        println!("failed: {e}");
        assert!(link.is_open(), "the channel is still open");
        RabbitAck::ack_all(rest).await.unwrap();

        source.close().await;
        let mut source = config.clone().connect().await.unwrap();
        let mut back = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            for d in source.receive(10).await.unwrap() {
                back.push(String::from_utf8(d.message.payload.clone()).unwrap());
                d.ack.ack().await.unwrap();
            }
        }
        source.close().await;
        delete_queues(&config).await;
        back.sort();
        println!("came back after the channel closed: {back:?}");
        back
    }

    /// The batch ack of tags 1 and 2 fails on a live channel, nothing sent. The next batch (3
    /// and 4) must ack only its own deliveries: a `multiple` ack of 4 would ack 1 and 2 as well,
    /// though no ack of theirs reached the broker. They come back when the channel closes.
    #[tokio::test]
    async fn a_failed_batch_ack_leaves_its_deliveries_to_come_back() {
        let back = after_a_failed_frame("ackfail", 4, 2, RabbitAck::ack_all).await;
        assert_eq!(
            back,
            ["m0", "m1"],
            "the later batch acked deliveries whose own ack never reached the broker"
        );
    }

    /// The hand-back (nack) of tag 1 fails on a live channel, nothing sent, so the broker still
    /// holds it unacked. The batch of 2 and 3 must not cover it with a `multiple` ack: message 1
    /// was never applied, and would be gone.
    #[tokio::test]
    async fn a_failed_nack_leaves_its_delivery_to_come_back() {
        let nack = |mut acks: Vec<RabbitAck>| acks.remove(0).nack(Duration::ZERO);
        let back = after_a_failed_frame("nackfail", 3, 1, nack).await;
        assert_eq!(
            back,
            ["m0"],
            "the message whose nack failed was acked by the batch: lost"
        );
    }
}
