//! The I/O half of delayed redelivery (the decisions are the [`Tracker`](crate::tracker::Tracker)'s):
//! resuming a paused partition once its delay has passed, and reading the redelivery marks of
//! newly assigned partitions back from their committed offsets.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tracing::{debug, warn};

use crate::shared_consumer::{Client, SharedConsumer};
use crate::tracker::Resume;

/// Resumes the partition at `until`, unless a later delay of it reaches further by then (that
/// delay resumes it).
pub(crate) fn resume_at(
    runtime: &Handle,
    consumer: Weak<Client>,
    topic: Arc<str>,
    partition: i32,
    until: Instant,
) {
    runtime.spawn(async move {
        tokio::time::sleep_until(until.into()).await;
        // A consumer closed meanwhile has nothing to resume.
        let Some(consumer) = SharedConsumer::upgrade(&consumer) else {
            return;
        };
        if !consumer
            .context()
            .tracker()
            .pause_over(&topic, partition, Instant::now())
        {
            return;
        }
        let mut list = TopicPartitionList::new();
        list.add_partition(&topic, partition);
        if let Err(e) = consumer.resume(&list) {
            warn!(%topic, partition, error = %e, "resuming a paused partition failed");
        }
    });
}

/// Reads the committed offsets of `partitions` (assigned, none of their records handed out yet)
/// for their redelivery marks and hands them to the tracker; a partition whose latest mark is
/// not due yet is paused until it is.
/// Blocks on a broker round trip: call it on the blocking pool. A partition whose committed
/// offset could not be read stays awaited, and the next receive tries again.
///
/// The pause comes after the tracker knows the marks; the pause's barrier drops whatever was
/// fetched of the partition meanwhile, and no record of it was handed out before the marks.
pub(crate) fn restore(
    consumer: &SharedConsumer,
    partitions: &[(String, i32)],
    timeout: Duration,
    runtime: &Handle,
) {
    let mut list = TopicPartitionList::with_capacity(partitions.len());
    for (topic, partition) in partitions {
        list.add_partition(topic, *partition);
    }
    let group = &consumer.context().group;
    let committed = match consumer.committed_offsets(list, timeout) {
        Ok(committed) => committed,
        Err(e) => {
            warn!(%group, error = %e, "reading the committed offsets of assigned partitions failed; they stay paused and the next receive tries again");
            return;
        }
    };
    let (now, wall) = (Instant::now(), SystemTime::now());
    let mut pause = TopicPartitionList::new();
    // Partitions that may be read at once are resumed: librdkafka keeps a pause across a revoke
    // and a re-assignment, and the resume task that was to lift it may have come while the
    // marks were still to be read (then `pause_over` said no, and nothing else resumes it).
    let mut resume = TopicPartitionList::new();
    {
        let mut tracker = consumer.context().tracker();
        for element in committed.elements() {
            let (topic, partition) = (element.topic(), element.partition());
            if let Err(e) = element.error() {
                warn!(%group, topic, partition, error = %e, "reading a committed offset failed; the partition stays paused and the next receive tries again");
                continue;
            }
            let committed = match element.offset() {
                Offset::Offset(offset) => Some(offset),
                _ => None,
            };
            match tracker.restore(topic, partition, committed, element.metadata(), now, wall) {
                Some(Resume::Now) => {
                    resume.add_partition(topic, partition);
                }
                None => {}
                Some(Resume::At(until)) => {
                    pause.add_partition(topic, partition);
                    debug!(%group, topic, partition, wait = ?until.saturating_duration_since(now), "a record of the assigned partition waits for its delayed redelivery");
                    resume_at(
                        runtime,
                        consumer.downgrade(),
                        topic.into(),
                        partition,
                        until,
                    );
                }
            }
        }
    }
    debug!(%group, partitions = partitions.len(), paused = pause.count(), "redelivery counts of assigned partitions read");
    if resume.count() > 0 {
        if let Err(e) = consumer.resume(&resume) {
            warn!(%group, error = %e, "resuming assigned partitions failed; a pause left from their last assignment may hold them");
        }
    }
    if pause.count() > 0 {
        if let Err(e) = consumer.pause(&pause) {
            warn!(%group, error = %e, "pausing assigned partitions until their delayed redelivery failed; the record comes back sooner");
        }
    }
}
