//! librdkafka callbacks: its log lines go to `tracing`, connection failures are kept for the
//! source to report, OAUTHBEARER tokens come from the token provider, and rebalances reach the
//! offset tracker (assigned partitions wait until their redelivery marks are read).

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::client::{ClientContext, OAuthToken};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::commit::{commit_on_revoke, OffsetCommits};
use crate::failure::Failures;
use crate::token::TokenRefresh;
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

/// What a client without a token provider answers librdkafka's token refresh with.
const NO_PROVIDER: &str = "sasl.mechanism=OAUTHBEARER needs a token: set one with \
                           `.token_provider(..)` on the KafkaConnection (librdkafka's own \
                           sasl.oauthbearer.method=oidc needs a libcurl build this crate does \
                           not enable)";

/// The callbacks every client context answers the same way: log lines to `tracing` under the
/// client's name (`$name`, an expression on `$self`), failures kept for the source, tokens from
/// the token provider.
macro_rules! client_context {
    ($context:ty, |$self:ident| $name:expr) => {
        impl ClientContext for $context {
            const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

            fn log(&$self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
                $self.failures.log(fac, log_message);
                log($name, level, fac, log_message);
            }
            fn error(&$self, error: KafkaError, reason: &str) {
                $self.failures.error(&error, reason);
                warn!(client = $name, %error, "librdkafka: {reason}");
            }
            fn generate_oauth_token(
                &$self,
                _config: Option<&str>,
            ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
                match &$self.token {
                    Some(refresh) => refresh.fetch(),
                    None => Err(NO_PROVIDER.into()),
                }
            }
        }
    };
}

/// The context of producers, admin clients and the dead-letter reader: logging, connection
/// failures, tokens.
#[derive(Clone, Default)]
pub(crate) struct ProducerContext {
    pub(crate) failures: Failures,
    pub(crate) token: Option<TokenRefresh>,
}

client_context!(ProducerContext, |self| "producer");

/// The dead-letter reader assigns its partitions itself: no rebalance to hook.
impl ConsumerContext for ProducerContext {}

/// The consumer's context: logging, the offset tracker and commit counters, and the rebalance
/// hook that commits what was acked of the revoked partitions and forgets the rest.
#[derive(Default)]
pub(crate) struct InboxContext {
    pub(crate) group: String,
    /// `Duration::ZERO`: every ack commits; otherwise the commit task does, this often.
    pub(crate) commit_interval: Duration,
    pub(crate) commits: OffsetCommits,
    /// Shared with the source's dead-letter producer.
    pub(crate) failures: Failures,
    pub(crate) token: Option<TokenRefresh>,
    /// Locked through [`tracker`](Self::tracker).
    pub(crate) tracker: Mutex<Tracker>,
    /// Told when partitions were assigned and their redelivery marks are to be read: the
    /// receive waiting on the consumer stops waiting and reads them.
    pub(crate) assigned: Notify,
}

impl InboxContext {
    /// The tracker, even if a thread panicked while holding it: its maps stay consistent at
    /// every step, so the data is still good.
    pub(crate) fn tracker(&self) -> MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }
}

client_context!(InboxContext, |self| &self.group);

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

    /// Marks newly assigned partitions for the source to read their redelivery marks from the
    /// committed offsets (a broker round trip, which this callback on the polling thread must
    /// not wait for); until then the source hands out none of their records.
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(partitions) = rebalance else {
            return;
        };
        if partitions.count() == 0 {
            return;
        }
        let mut tracker = self.tracker();
        for p in partitions.elements() {
            tracker.assigned(p.topic(), p.partition());
        }
        drop(tracker);
        self.assigned.notify_one();
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
