//! Offset commits: the commit task that coalesces acks, the synchronous commit of one request,
//! and the counters that show how many requests there were.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use inbox_core::{Recovery, SourceError};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{debug, warn};

use crate::context::InboxContext;
use crate::error::{partition_moved, Error};
use crate::shared_consumer::{Client, SharedConsumer};
use crate::tracker::Commit;

/// Counters of a source's offset commit requests, readable while its consumer runs (from
/// [`KafkaSource::offset_commits`](crate::KafkaSource::offset_commits)).
#[derive(Clone, Default)]
pub struct OffsetCommits(Arc<Counters>);

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    failed: AtomicU64,
}

impl OffsetCommits {
    /// Offset commit requests made so far: by the commit task, by acks (with a zero commit
    /// interval), on revokes and on close. One request covers every partition it names.
    pub fn requests(&self) -> u64 {
        self.0.requests.load(Ordering::Relaxed)
    }

    /// Requests that failed, as far as the adapter learns it (a commit made on a revoke or a
    /// close is waited for by librdkafka, which logs a failure itself).
    pub fn failed(&self) -> u64 {
        self.0.failed.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for OffsetCommits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffsetCommits")
            .field("requests", &self.requests())
            .field("failed", &self.failed())
            .finish()
    }
}

pub(crate) fn offset_list(commits: &[Commit]) -> KafkaResult<TopicPartitionList> {
    let mut list = TopicPartitionList::with_capacity(commits.len());
    for c in commits {
        list.add_partition_offset(&c.topic, c.partition, Offset::Offset(c.offset))?;
        if !c.metadata.is_empty() {
            // The redelivery marks of the partition's unfinished records: every commit carries
            // them, or it would erase them.
            if let Some(mut element) = list.find_partition(&c.topic, c.partition) {
                element.set_metadata(c.metadata.as_str());
            }
        }
    }
    Ok(list)
}

/// Commits `commits` in one request, counted in the consumer's [`OffsetCommits`].
fn commit(
    consumer: &impl Consumer<InboxContext>,
    commits: &[Commit],
    mode: CommitMode,
) -> KafkaResult<()> {
    let counters = &consumer.context().commits.0;
    counters.requests.fetch_add(1, Ordering::Relaxed);
    let result = offset_list(commits).and_then(|list| consumer.commit(&list, mode));
    if result.is_err() {
        counters.failed.fetch_add(1, Ordering::Relaxed);
    }
    result
}

/// Commits `commits` in one synchronous request on the blocking pool: `Ok` means the broker has
/// the offsets, or refused them because the partitions moved to another member (logged: it
/// re-reads them and the inbox skips what was applied). After a failure the partitions are
/// dirty again, so the next commit retries them.
pub(crate) async fn commit_sync(
    consumer: SharedConsumer,
    commits: Vec<Commit>,
) -> Result<(), SourceError> {
    let (group, partitions) = (consumer.context().group.clone(), commits.len());
    let result = tokio::task::spawn_blocking(move || {
        let result = commit(&*consumer, &commits, CommitMode::Sync);
        if result.is_err() {
            // A partition that moved is gone from the tracker, so this retries only partitions
            // still assigned (a commit refused during a rebalance that kept them here).
            let mut tracker = consumer.context().tracker();
            for c in &commits {
                tracker.commit_failed(&c.topic, c.partition, c.offset);
            }
        }
        result
    })
    .await
    .map_err(|join| SourceError::new(Recovery::Retry, "commit task failed", join))?;
    match result {
        Ok(()) => debug!(%group, partitions, "offsets committed"),
        Err(e) if partition_moved(&e) => {
            warn!(%group, error = %e, partitions, "offset commit refused: the partitions moved to another member; it re-reads them and the inbox skips what was applied")
        }
        Err(e) => return Err(Error::kafka("committing offsets", e).into_source()),
    }
    Ok(())
}

/// Commits `commits` without waiting, from a rebalance callback, which runs on the thread that
/// polls the consumer (a tokio worker inside `recv`, or the thread closing the consumer).
/// librdkafka finishes the unassign, and a close, only once its outstanding commits are done, so
/// the partitions' next owner starts after these offsets all the same.
pub(crate) fn commit_on_revoke(consumer: &BaseConsumer<InboxContext>, commits: &[Commit]) {
    if let Err(e) = commit(consumer, commits, CommitMode::Async) {
        warn!(group = %consumer.context().group, error = %e, partitions = commits.len(), "the last commit of revoked partitions failed; their new owner re-reads the rest and the inbox skips it");
    }
}

/// The commit task: every `every`, one synchronous request for the finished prefixes acked since
/// the last one. Holds the consumer only while committing, and ends when the consumer is gone
/// (the source aborts it when dropped).
pub(crate) async fn commit_task(consumer: Weak<Client>, every: Duration) {
    let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
    // A commit slower than the interval (a broker away) delays the next one, no burst after it.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(consumer) = SharedConsumer::upgrade(&consumer) else {
            return;
        };
        let dirty = consumer.context().tracker().take_dirty();
        if dirty.is_empty() {
            continue;
        }
        let group = consumer.context().group.clone();
        if let Err(e) = commit_sync(consumer, dirty).await {
            warn!(%group, error = %e, "offset commit failed; retried at the next interval");
        }
    }
}
