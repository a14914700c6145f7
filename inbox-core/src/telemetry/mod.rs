//! Metrics and traces: the name, unit and meaning of every metric the consumer records, and
//! W3C trace context (`traceparent`) propagation through the brokers.
//!
//! # Metrics
//!
//! Everything goes through the [`metrics`] facade, labelled `consumer` (the consumer's name);
//! install any recorder (`metrics-exporter-prometheus`, say) before the consumer starts. The
//! consumer describes its metrics (unit and help text) when it starts; call
//! [`describe_metrics`] yourself to have them described before that.
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `inbox_messages_received_total` | counter | deliveries taken from the broker |
//! | `inbox_messages_applied_total` | counter | messages whose side effect committed |
//! | `inbox_duplicates_skipped_total` | counter | deliveries skipped: their ID was applied before |
//! | `inbox_retries_total` | counter | handler attempts repeated after a transient failure |
//! | `inbox_dead_lettered_total` | counter | messages parked in the dead-letter destination |
//! | `inbox_ack_failures_total` | counter | acks that failed after their commit (the redelivery is skipped) |
//! | `inbox_commits_total` | counter | store transactions committed |
//! | `inbox_errors_total` | counter | broker and store errors the consumer recovered from |
//! | `inbox_batch_size` | histogram | messages per store transaction, duplicates included |
//! | `inbox_claim_duration_seconds` | histogram | the claim statement of one transaction |
//! | `inbox_handler_duration_seconds` | histogram | one handler call: a batch for a `BatchHandler`, a transaction's messages in turn for a `Handler` |
//! | `inbox_commit_duration_seconds` | histogram | one `COMMIT` |
//! | `inbox_ack_duration_seconds` | histogram | one broker ack round-trip for the messages of a transaction |
//! | `inbox_end_to_end_lag_seconds` | histogram | from the broker's timestamp of a message to its commit (or its skip) |
//! | `inbox_in_flight_messages` | gauge | received, not yet acked, dead-lettered or handed back |
//! | `inbox_consumer_ready` | gauge | 1 while running with broker and store answering, else 0 |
//! | `inbox_consumer_state` | gauge | 1 for the current `state` label (`starting`, `running`, `backoff`, `stopping`, `stopped`), 0 for the others |
//! | `inbox_retention_seconds` | gauge | the inbox retention given to [`Consumer::inbox_retention`](crate::Consumer::inbox_retention) |
//! | `inbox_redelivery_window_seconds` | gauge | how long the broker can redeliver, where the source knows ([`MessageSource::redelivery_window`](crate::MessageSource::redelivery_window)) |
//! | `inbox_oldest_remembered_age_seconds` | gauge | set by stores that track it (`inbox-postgres`): how far back the inbox remembers IDs |
//!
//! The lag needs a timestamp from the broker ([`Metadata::timestamp`](crate::Metadata::timestamp)):
//! Kafka's record timestamp, SQS `SentTimestamp`, the RabbitMQ `timestamp` property (set by the
//! publisher; whole seconds) or a `timestamp_in_ms` header, a Redis stream entry ID. Clocks of
//! other hosts are compared with this one's, so skew shows up in it.
//!
//! # Traces
//!
//! Spans follow the OpenTelemetry messaging conventions: `inbox.process` per store transaction
//! (`messaging.operation.type = process`, a CONSUMER span), `inbox.settle` per ack, nack,
//! delayed redelivery or dead letter (`settle`, a CLIENT span) and `inbox.send` per publish of
//! an adapter's producer ([`send_span`]: `send`, a PRODUCER span). They carry
//! `messaging.system`, `messaging.destination.name`, `messaging.destination.partition.id`
//! (where the broker partitions: Kafka), `messaging.consumer.group.name` (the broker's group
//! where it has one, [`MessageSource::consumer_group`](crate::MessageSource::consumer_group),
//! else the consumer's name; `inbox.consumer` is the consumer's name), `messaging.message.id`
//! (for one message) or `messaging.batch.message_count`, `error.type` on a failure (`handler`,
//! `handler_permanent`, `retry`, `reconnect`, `fatal`, `dead_letter_failed`), plus `otel.name`
//! and `otel.kind` for `tracing-opentelemetry`.
//!
//! Producers put a W3C `traceparent` header ([`TraceParent`]) on each message; the process span
//! of a transaction of one message records it in its `traceparent` field. With the crate feature
//! `opentelemetry`, the producer helpers take the header from the current span's OpenTelemetry
//! context ([`TraceParent::current`]), and the consumer makes it the parent of the process span
//! (one message) or a link of it (a batch: one link per message), as the conventions say.

mod trace;

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use metrics::{Gauge, Histogram, Unit};

use crate::Message;

pub(crate) use trace::{dead_letter_span, process_span, settle_span, SpanNames};
pub use trace::{record_error, send_span, traced_send};
pub use trace::{InvalidTraceParent, TraceParent, TRACEPARENT_HEADER};

/// Declares each metric once: its name constant (with its docs), and its kind, unit and help
/// text for [`describe_metrics`].
macro_rules! declare_metrics {
    (@describe counter $($args:tt)+) => { metrics::describe_counter!($($args)+) };
    (@describe histogram $($args:tt)+) => { metrics::describe_histogram!($($args)+) };
    (@describe gauge $($args:tt)+) => { metrics::describe_gauge!($($args)+) };
    ($($(#[$doc:meta])* $kind:ident $unit:ident $name:ident = $metric:literal, $help:literal;)+) => {
        $($(#[$doc])* pub const $name: &str = $metric;)+

        /// Registers the unit and help text of every metric above with the installed
        /// recorder. The consumer calls it when it starts; call it yourself after installing
        /// the recorder to have the descriptions before that. Calling it again does no harm.
        pub fn describe_metrics() {
            $(declare_metrics!(@describe $kind $name, Unit::$unit, $help);)+
        }
    };
}

declare_metrics! {
    /// Counter: deliveries taken from the broker.
    counter Count MESSAGES_RECEIVED = "inbox_messages_received_total",
        "Deliveries taken from the broker.";
    /// Counter: messages whose side effect committed.
    counter Count MESSAGES_APPLIED = "inbox_messages_applied_total",
        "Messages whose side effect committed.";
    /// Counter: deliveries skipped because their ID was already applied.
    counter Count DUPLICATES_SKIPPED = "inbox_duplicates_skipped_total",
        "Deliveries skipped because their ID was already applied.";
    /// Counter: handler attempts repeated after a transient failure.
    counter Count RETRIES = "inbox_retries_total",
        "Handler attempts repeated after a transient failure.";
    /// Counter: messages handed back to the broker under the redelivery schedule, to come back
    /// after a delay.
    counter Count REDELIVERED = "inbox_redelivered_total",
        "Messages handed back to the broker to come back after a delay.";
    /// Counter: messages parked in the dead-letter destination.
    counter Count DEAD_LETTERED = "inbox_dead_lettered_total",
        "Messages parked in the dead-letter destination.";
    /// Counter: acks that failed after their transaction committed.
    counter Count ACK_FAILURES = "inbox_ack_failures_total",
        "Acks that failed after their transaction committed; the redelivered copies are skipped.";
    /// Counter: store transactions committed.
    counter Count COMMITS = "inbox_commits_total",
        "Store transactions committed.";
    /// Counter: broker or store errors the consumer recovered from.
    counter Count ERRORS = "inbox_errors_total",
        "Broker or store errors the consumer recovered from.";
    /// Counter ([`Consumer::effects`](crate::Consumer::effects)): messages marked done without a
    /// call because the status lookup said an earlier call landed.
    counter Count EFFECTS_CONFIRMED = "inbox_effects_confirmed_total",
        "Effects marked done without a call: an earlier call landed.";
    /// Counter ([`Consumer::effects`](crate::Consumer::effects)): messages marked done without a
    /// call after an unknown outcome, as `OnUnknown::Skip` says: each may be a lost effect.
    counter Count EFFECTS_SKIPPED_UNKNOWN = "inbox_effects_skipped_unknown_total",
        "Effects marked done without a call after an unknown outcome: maybe lost.";
    /// Counter ([`Consumer::effects`](crate::Consumer::effects)): copies handed back because
    /// another lease on their message was live.
    counter Count EFFECTS_BUSY = "inbox_effects_busy_total",
        "Copies handed back while another lease on their message was live.";
    /// Counter ([`Consumer::effects`](crate::Consumer::effects)): done marks refused because a
    /// newer lease had taken over.
    counter Count EFFECTS_FENCED = "inbox_effects_fenced_total",
        "Done marks refused because a newer lease had taken over.";
    /// Histogram: messages per store transaction.
    histogram Count BATCH_SIZE = "inbox_batch_size",
        "Messages per store transaction, duplicates included.";
    /// Histogram: seconds the claim statement of one transaction took (for
    /// [`Consumer::effects`](crate::Consumer::effects): one lease statement).
    histogram Seconds CLAIM_DURATION = "inbox_claim_duration_seconds",
        "Seconds the claim of a transaction's message IDs took.";
    /// Histogram: seconds one handler call took (for
    /// [`Consumer::effects`](crate::Consumer::effects): one provider call, failed calls and calls
    /// cut at the end of their lease included).
    histogram Seconds HANDLER_DURATION = "inbox_handler_duration_seconds",
        "Seconds one handler call took (a batch, or a transaction's messages in turn).";
    /// Histogram: seconds one commit took (for [`Consumer::effects`](crate::Consumer::effects):
    /// one done transaction, with the done mark and `EffectHandler::record`).
    histogram Seconds COMMIT_DURATION = "inbox_commit_duration_seconds",
        "Seconds one store commit took.";
    /// Histogram: seconds one broker ack round-trip took.
    histogram Seconds ACK_DURATION = "inbox_ack_duration_seconds",
        "Seconds one broker ack round-trip took, for the messages of a transaction.";
    /// Histogram: seconds from a message's broker timestamp to its commit.
    histogram Seconds END_TO_END_LAG = "inbox_end_to_end_lag_seconds",
        "Seconds from a message's broker timestamp to its commit or skip.";
    /// Gauge: messages received and not yet settled.
    gauge Count IN_FLIGHT = "inbox_in_flight_messages",
        "Messages received and not yet acked, dead-lettered or handed back.";
    /// Gauge: 1 while the consumer is ready, else 0.
    gauge Count CONSUMER_READY = "inbox_consumer_ready",
        "1 while the consumer runs with its broker and store answering, else 0.";
    /// Gauge: 1 for the consumer's current `state` label, 0 for the others.
    gauge Count CONSUMER_STATE = "inbox_consumer_state",
        "1 for the consumer's current state label, 0 for the other states.";
    /// Gauge: the inbox retention the consumer was given, in seconds.
    gauge Seconds RETENTION = "inbox_retention_seconds",
        "How long the inbox is configured to remember IDs.";
    /// Gauge: how long the broker can redeliver a message, in seconds, where the source knows.
    gauge Seconds REDELIVERY_WINDOW = "inbox_redelivery_window_seconds",
        "How long the broker can still redeliver a message, where the source knows.";
    /// Gauge (set by stores that track it): seconds since the oldest remembered ID was processed.
    gauge Seconds OLDEST_REMEMBERED_AGE = "inbox_oldest_remembered_age_seconds",
        "Seconds since the oldest ID the inbox remembers was processed.";
}

/// One running consumer's histogram and gauge handles, registered once when it starts (a
/// recorder installed later would not see handles taken earlier).
#[derive(Debug, Clone)]
pub(crate) struct ConsumerMetrics {
    pub(crate) batch_size: Histogram,
    pub(crate) claim: Histogram,
    pub(crate) handler: Histogram,
    pub(crate) commit: Histogram,
    pub(crate) ack: Histogram,
    pub(crate) lag: Histogram,
    pub(crate) in_flight: Gauge,
}

impl Default for ConsumerMetrics {
    fn default() -> Self {
        Self::new(|_| Histogram::noop(), Gauge::noop())
    }
}

impl ConsumerMetrics {
    fn new(histogram: impl Fn(&'static str) -> Histogram, in_flight: Gauge) -> Self {
        Self {
            batch_size: histogram(BATCH_SIZE),
            claim: histogram(CLAIM_DURATION),
            handler: histogram(HANDLER_DURATION),
            commit: histogram(COMMIT_DURATION),
            ack: histogram(ACK_DURATION),
            lag: histogram(END_TO_END_LAG),
            in_flight,
        }
    }

    /// Describes every metric and registers this consumer's handles.
    pub(crate) fn register(consumer: &str) -> Self {
        describe_metrics();
        crate::stats::Counter::register_all(consumer);
        Self::new(
            |name| metrics::histogram!(name, "consumer" => consumer.to_owned()),
            metrics::gauge!(IN_FLIGHT, "consumer" => consumer.to_owned()),
        )
    }

    /// Records, per message with a broker timestamp, how long ago it was sent.
    pub(crate) fn lag<'a>(&self, messages: impl Iterator<Item = &'a Message>) {
        let now = SystemTime::now();
        for message in messages {
            if let Some(sent) = message.meta.timestamp {
                // A timestamp ahead of this clock (skew) counts as no lag.
                let lag = now.duration_since(sent).unwrap_or(Duration::ZERO);
                self.lag.record(lag.as_secs_f64());
            }
        }
    }
}

/// Runs `work`, recording in `histogram` the seconds it took.
pub(crate) async fn timed<T>(histogram: &Histogram, work: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let done = work.await;
    histogram.record(started.elapsed().as_secs_f64());
    done
}

/// Sets the configured retention and the broker's redelivery window gauges of `consumer`.
pub(crate) fn windows(consumer: &str, retention: Option<Duration>, broker: Option<Duration>) {
    if let Some(retention) = retention {
        metrics::gauge!(RETENTION, "consumer" => consumer.to_owned()).set(retention.as_secs_f64());
    }
    if let Some(window) = broker {
        metrics::gauge!(REDELIVERY_WINDOW, "consumer" => consumer.to_owned())
            .set(window.as_secs_f64());
    }
}
