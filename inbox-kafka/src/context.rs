//! librdkafka callbacks: its log lines go to `tracing`, and rebalances reach the offset tracker.

use std::sync::{Arc, Mutex, MutexGuard};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use tracing::{debug, error, info, warn};

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

/// The consumer's context: logging, and the rebalance hooks that keep the tracker honest.
#[derive(Debug)]
pub(crate) struct InboxContext {
    pub(crate) group: String,
    tracker: Arc<Mutex<Tracker>>,
}

impl InboxContext {
    pub(crate) fn new(group: String) -> Self {
        Self {
            group,
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
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(partitions) => {
                let mut tracker = self.tracker();
                for p in partitions.elements() {
                    tracker.revoke(p.topic(), p.partition());
                }
                info!(
                    group = %self.group,
                    partitions = %describe(partitions),
                    unfinished_elsewhere = tracker.unfinished(),
                    "partitions revoked; their in-flight messages will not be committed here, \
                     the new owner re-reads them and the inbox skips what was applied"
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
