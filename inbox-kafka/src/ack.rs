//! What an ack is on Kafka: marking the message finished after the database commit, so that its
//! partition's finished prefix is committed (by the commit task, or right away with a zero commit
//! interval). A dead letter is produced to the dead-letter topic first, then acked the same way.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{Ack, Message, Recovery, SourceError};
use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};
use tracing::{debug, warn};

use crate::commit::commit_sync;
use crate::dead_letter::DeadLetterProducer;
use crate::error::{partition_moved, Error};
use crate::redelivery;
use crate::shared_consumer::SharedConsumer;
use crate::tracker::Commit;

/// The acknowledgement handle of a Kafka delivery. See the crate docs, "Ack semantics".
///
/// [`Ack::dead_letter`] produces the record to the dead-letter topic (`<topic>.dlq` unless
/// [`KafkaSourceBuilder::dead_letter_topic`](crate::KafkaSourceBuilder::dead_letter_topic) names
/// one), waits for the delivery report, then acks. When the produce fails it hands the record
/// back as [`Ack::nack`] does (its partition is sought back to it).
pub struct KafkaAck {
    pub(crate) consumer: SharedConsumer,
    pub(crate) topic: Arc<str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) generation: u64,
    pub(crate) timeout: Duration,
    pub(crate) dead_letters: Arc<DeadLetterProducer>,
}

impl fmt::Debug for KafkaAck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaAck")
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish()
    }
}

impl Ack for KafkaAck {
    async fn ack(self) -> Result<(), SourceError> {
        Self::ack_all(vec![self]).await
    }

    /// Kafka cannot hand out one record again: the partition is sought back to this offset, so
    /// this message and every later one of its partition are read again (the later ones that
    /// were applied are then skipped by the inbox). `retry_after` is not honoured: the core's
    /// own backoff already applies. Nothing past this offset is committed until it is acked.
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        let rewind = self.consumer.context().tracker().rewind(
            &self.topic,
            self.partition,
            self.generation,
            self.offset,
        );
        if !rewind {
            return Ok(());
        }
        let (topic, partition, offset) = (self.topic.clone(), self.partition, self.offset);
        // A seek with a timeout waits until no message fetched before it can reach the
        // application; it blocks, so it runs off the async workers.
        let result = tokio::task::spawn_blocking(move || {
            self.consumer.seek(
                &self.topic,
                self.partition,
                Offset::Offset(self.offset),
                self.timeout,
            )
        })
        .await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if partition_moved(&e) => {
                warn!(%topic, partition, offset, error = %e, "seek back failed: the partition moved; its new owner reads it from the last commit");
                Ok(())
            }
            Ok(Err(e)) => Err(Error::kafka(
                format!("seeking {topic}[{partition}] back to offset {offset}"),
                e,
            )
            .into_source()),
            Err(join) => Err(SourceError::new(Recovery::Retry, "seek task failed", join)),
        }
    }

    /// Pauses the partition, commits the record's new redelivery count with the partition's
    /// offset, seeks it back to this offset as a nack does, and resumes it once `delay` has
    /// passed: see the crate docs, "Ack semantics". A delivery received before its partition
    /// was revoked ([`Ack::is_stale`]) leaves the partition alone: whoever holds it now reads
    /// the record again from the last commit.
    async fn redeliver(
        self,
        _message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        let commit = {
            // Decided and paused under the tracker's lock, so a revoke (which takes it too)
            // cannot come between the check of the generation and the pause.
            let mut tracker = self.consumer.context().tracker();
            let Some(commit) = tracker.delay(
                &self.topic,
                self.partition,
                self.generation,
                self.offset,
                redelivery + 1,
                delay,
                std::time::Instant::now(),
                std::time::SystemTime::now(),
            ) else {
                debug!(topic = %self.topic, partition = self.partition, offset = self.offset, "redelivery of a delivery from a revoked assignment: the partition's owner reads it again from the last commit");
                return Ok(());
            };
            let mut list = TopicPartitionList::new();
            list.add_partition(&self.topic, self.partition);
            // Paused before the seek, so nothing of the partition is fetched again in between.
            if let Err(e) = self.consumer.pause(&list) {
                warn!(topic = %self.topic, partition = self.partition, error = %e, "pausing a partition for a delayed redelivery failed; the record comes back without the delay");
            }
            commit
        };
        redelivery::resume_at(
            &tokio::runtime::Handle::current(),
            self.consumer.downgrade(),
            Arc::clone(&self.topic),
            self.partition,
            std::time::Instant::now() + delay,
        );
        // The count goes with the offset before the record can be read again, so the next
        // owner after a rebalance or a restart goes on with the schedule. A commit that fails
        // leaves the partition dirty: the commit task, the revoke or the close retries it.
        if let Err(e) = commit_sync(self.consumer.clone(), vec![commit]).await {
            warn!(topic = %self.topic, partition = self.partition, error = %e, "committing a redelivery count failed; the next commit carries it");
        }
        self.nack(Duration::ZERO).await
    }

    /// Received before its partition was revoked: the partition is read again from its last
    /// commit, by whichever member holds it now.
    fn is_stale(&self) -> bool {
        !self
            .consumer
            .context()
            .tracker()
            .is_current(&self.topic, self.partition, self.generation)
    }

    /// Produces the dead letter, then acks; on a failed produce, seeks back as a nack does.
    /// See the type's docs.
    async fn dead_letter(self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let dead_letters = Arc::clone(&self.dead_letters);
        match dead_letters.publish(message, reason).await {
            Ok(()) => self.ack().await,
            Err(e) => {
                if let Err(nack) = self.nack(Duration::ZERO).await {
                    warn!(error = %nack, "seek back after a failed dead letter failed; the record comes back from the last committed offset");
                }
                Err(e)
            }
        }
    }

    /// Marks every delivery finished. With a commit interval that is all: the commit task
    /// commits the new finished prefixes. With a zero interval, the new finished prefix of each
    /// partition they touched is committed here, in one synchronous request; a partition with an
    /// earlier message still unfinished is not committed yet.
    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let mut consumer = None;
        let mut commits: HashMap<(Arc<str>, i32), (u64, i64)> = HashMap::new();
        for ack in acks {
            let next = ack.consumer.context().tracker().finish(
                &ack.topic,
                ack.partition,
                ack.generation,
                ack.offset,
            );
            if let Some(next) = next {
                let slot = commits
                    .entry((Arc::clone(&ack.topic), ack.partition))
                    .or_insert((ack.generation, next));
                slot.1 = slot.1.max(next);
            }
            consumer.get_or_insert(ack.consumer);
        }
        let Some(consumer) = consumer else {
            return Ok(());
        };
        if !consumer.context().commit_interval.is_zero() {
            return Ok(());
        }
        if commits.is_empty() {
            debug!("acked messages wait behind unfinished earlier offsets; nothing to commit yet");
            return Ok(());
        }
        let commits: Vec<Commit> = {
            let mut tracker = consumer.context().tracker();
            commits
                .into_iter()
                .filter_map(|((topic, partition), (generation, offset))| {
                    tracker.sending(&topic, partition, generation, offset)
                })
                .collect()
        };
        if commits.is_empty() {
            debug!("the acked partitions were revoked meanwhile; their new owners re-read them");
            return Ok(());
        }
        commit_sync(consumer, commits).await
    }
}
