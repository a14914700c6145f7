//! librdkafka callbacks: its log lines go to `tracing`, and rebalances reach the offset tracker.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use tracing::{debug, error, info, warn};

use crate::commit::{commit_on_revoke, OffsetCommits};
use crate::tracker::Tracker;

/// Sends librdkafka's log lines (`MAXPOLL`, `REQTMOUT`, `FAIL`, ...) to `tracing`.
fn log(client: &str, level: RDKafkaLogLevel, facility: &str, line: &str) {
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => error!(client, facility, "librdkafka: {line}"),
        RDKafkaLogLevel::Warning => warn!(client, facility, "librdkafka: {line}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            info!(client, facility, "librdkafka: {line}")
        }
        RDKafkaLogLevel::Debug => debug!(client, facility, "librdkafka: {line}"),
    }
}

/// The context of producers: logging only.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProducerContext;

impl ClientContext for ProducerContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log("producer", level, fac, log_message);
    }
    fn error(&self, error: KafkaError, reason: &str) {
        warn!(client = "producer", %error, "librdkafka: {reason}");
    }
}

/// The consumer's context: logging, the offset tracker and commit counters, and the rebalance
/// hook that commits what was acked of the revoked partitions and forgets the rest.
#[derive(Debug)]
pub(crate) struct InboxContext {
    pub(crate) group: String,
    /// `Duration::ZERO`: every ack commits; otherwise the commit task does, this often.
    pub(crate) commit_interval: Duration,
    pub(crate) commits: OffsetCommits,
    tracker: Arc<Mutex<Tracker>>,
}

impl InboxContext {
    pub(crate) fn new(group: String, commit_interval: Duration) -> Self {
        Self {
            group,
            commit_interval,
            commits: OffsetCommits::default(),
            tracker: Arc::default(),
        }
    }

    /// The tracker, even if a thread panicked while holding it: its maps stay consistent at
    /// every step, so the data is still good.
    pub(crate) fn tracker(&self) -> MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ClientContext for InboxContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log(&self.group, level, fac, log_message);
    }
    fn error(&self, error: KafkaError, reason: &str) {
        warn!(group = %self.group, %error, "librdkafka: {reason}");
    }
}

impl ConsumerContext for InboxContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(partitions) => {
                let mut tracker = self.tracker();
                let last: Vec<_> = partitions
                    .elements()
                    .iter()
                    .filter_map(|p| tracker.revoke(p.topic(), p.partition()))
                    .collect();
                let unfinished = tracker.unfinished();
                drop(tracker);
                // A lost assignment (this member was evicted) can no longer commit.
                let lost = consumer.assignment_lost();
                if !last.is_empty() && !lost {
                    commit_on_revoke(consumer, &last);
                }
                info!(
                    group = %self.group,
                    partitions = %describe(partitions),
                    last_commits = if lost { 0 } else { last.len() },
                    assignment_lost = lost,
                    unfinished_elsewhere = unfinished,
                    "partitions revoked; what was acked is committed, messages in flight are \
                     not: the new owner re-reads them and the inbox skips what was applied"
                );
            }
            Rebalance::Assign(partitions) => {
                info!(group = %self.group, partitions = %describe(partitions), "partitions assigned");
            }
            Rebalance::Error(e) => warn!(group = %self.group, error = %e, "rebalance failed"),
        }
    }
}

fn describe(partitions: &rdkafka::TopicPartitionList) -> String {
    let parts: Vec<String> = partitions
        .elements()
        .iter()
        .map(|p| format!("{}[{}]", p.topic(), p.partition()))
        .collect();
    parts.join(",")
}
