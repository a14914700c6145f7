//! What an ack is on Kafka: committing the partition's finished prefix after the database commit.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{async_trait, Ack, Recovery, SourceError};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};
use tracing::{debug, warn};

use crate::context::InboxContext;
use crate::error::{partition_moved, Error};

/// The acknowledgement handle of a Kafka delivery. See the crate docs, "Ack semantics".
pub struct KafkaAck(Inner);

enum Inner {
    Tracked(AckTarget),
    /// [`AckMode::AutoCommit`](crate::AckMode::AutoCommit): the client commits on its timer.
    AutoCommit,
}

pub(crate) struct AckTarget {
    pub(crate) consumer: Arc<StreamConsumer<InboxContext>>,
    pub(crate) topic: Arc<str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) generation: u64,
    pub(crate) timeout: Duration,
}

impl fmt::Debug for KafkaAck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Inner::Tracked(t) => f
                .debug_struct("KafkaAck")
                .field("topic", &t.topic)
                .field("partition", &t.partition)
                .field("offset", &t.offset)
                .finish(),
            Inner::AutoCommit => f.write_str("KafkaAck(auto-commit)"),
        }
    }
}

impl KafkaAck {
    pub(crate) fn tracked(target: AckTarget) -> Self {
        Self(Inner::Tracked(target))
    }

    pub(crate) fn auto_commit() -> Self {
        Self(Inner::AutoCommit)
    }
}

#[async_trait]
impl Ack for KafkaAck {
    async fn ack(self) -> Result<(), SourceError> {
        Self::ack_all(vec![self]).await
    }

    /// Kafka cannot hand out one record again: the partition is sought back to this offset, so
    /// this message and every later one of its partition are read again (the later ones that
    /// were applied are then skipped by the inbox). `retry_after` is not honoured: the core's
    /// own backoff already applies. Nothing past this offset is committed until it is acked.
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        let Inner::Tracked(t) = self.0 else {
            return Ok(());
        };
        let rewind =
            t.consumer
                .context()
                .tracker()
                .rewind(&t.topic, t.partition, t.generation, t.offset);
        if !rewind {
            return Ok(());
        }
        let (topic, partition, offset) = (t.topic.clone(), t.partition, t.offset);
        // A seek with a timeout waits until no message fetched before it can reach the
        // application; it blocks, so it runs off the async workers.
        let result = tokio::task::spawn_blocking(move || {
            t.consumer
                .seek(&t.topic, t.partition, Offset::Offset(t.offset), t.timeout)
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

    /// Marks every delivery finished and commits, in one request, the new finished prefix of
    /// each partition they touched; a partition with an earlier message still unfinished is not
    /// committed yet.
    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let mut consumer = None;
        let mut commits: HashMap<(Arc<str>, i32), i64> = HashMap::new();
        for ack in acks {
            let Inner::Tracked(t) = ack.0 else { continue };
            let next = t.consumer.context().tracker().finish(
                &t.topic,
                t.partition,
                t.generation,
                t.offset,
            );
            if let Some(next) = next {
                let slot = commits
                    .entry((Arc::clone(&t.topic), t.partition))
                    .or_insert(next);
                *slot = (*slot).max(next);
            }
            consumer.get_or_insert((t.consumer, t.timeout));
        }
        let Some((consumer, _timeout)) = consumer else {
            return Ok(());
        };
        if commits.is_empty() {
            debug!("acked messages wait behind unfinished earlier offsets; nothing to commit yet");
            return Ok(());
        }
        let mut list = TopicPartitionList::with_capacity(commits.len());
        for ((topic, partition), next) in &commits {
            list.add_partition_offset(topic, *partition, Offset::Offset(*next))
                .map_err(|e| Error::kafka("building the offset commit", e).into_source())?;
        }
        // A synchronous commit returns only once the coordinator answered, so `Ok` means the
        // offsets are stored; it blocks, so it runs off the async workers.
        let result =
            tokio::task::spawn_blocking(move || consumer.commit(&list, CommitMode::Sync)).await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if partition_moved(&e) => {
                warn!(error = %e, partitions = commits.len(), "offset commit refused: the partitions moved to another member; it re-reads them and the inbox skips what was applied");
                Ok(())
            }
            Ok(Err(e)) => Err(Error::kafka("committing offsets", e).into_source()),
            Err(join) => Err(SourceError::new(
                Recovery::Retry,
                "commit task failed",
                join,
            )),
        }
    }
}
