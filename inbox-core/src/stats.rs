//! Counters: kept per consumer for callers and tests, and sent to the `metrics` facade.

use std::sync::atomic::{AtomicU64, Ordering};

/// Writes the counter list out once: [`Stats`]' cells, the [`Counter`] that names each, its
/// metric, and the snapshot's field it is read into.
macro_rules! counters {
    ($($counter:ident => $field:ident, $metric:ident;)+) => {
        /// What a consumer has done so far. Cheap to read at any time through
        /// [`Consumer::stats`](crate::Consumer::stats).
        #[derive(Debug, Default)]
        pub struct Stats {
            $($field: AtomicU64,)+
        }

        #[derive(Debug, Clone, Copy)]
        pub(crate) enum Counter {
            $($counter,)+
        }

        impl Counter {
            /// Every counter.
            const ALL: &[Counter] = &[$(Counter::$counter,)+];

            fn metric_name(self) -> &'static str {
                match self {
                    $(Counter::$counter => crate::telemetry::$metric,)+
                }
            }
        }

        impl Stats {
            fn cell(&self, counter: Counter) -> &AtomicU64 {
                match counter {
                    $(Counter::$counter => &self.$field,)+
                }
            }

            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot {
                    $($field: self.$field.load(Ordering::Relaxed),)+
                }
            }
        }
    };
}

counters! {
    Received => received, MESSAGES_RECEIVED;
    Applied => applied, MESSAGES_APPLIED;
    SkippedDuplicate => skipped_duplicates, DUPLICATES_SKIPPED;
    Retried => retried, RETRIES;
    Redelivered => redelivered, REDELIVERED;
    DeadLettered => dead_lettered, DEAD_LETTERED;
    AckFailure => ack_failures, ACK_FAILURES;
    Commit => commits, COMMITS;
    Error => errors, ERRORS;
    Confirmed => confirmed, EFFECTS_CONFIRMED;
    SkippedUnknown => skipped_unknown, EFFECTS_SKIPPED_UNKNOWN;
    Busy => busy, EFFECTS_BUSY;
    Fenced => fenced, EFFECTS_FENCED;
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Deliveries taken from the broker.
    pub received: u64,
    /// Messages whose side effect committed.
    pub applied: u64,
    /// Deliveries skipped because their ID was already applied.
    pub skipped_duplicates: u64,
    /// Handler attempts repeated after a transient failure.
    pub retried: u64,
    /// Messages handed back to the broker under the redelivery schedule
    /// ([`RetryPolicy::redeliver_after`](crate::RetryPolicy::redeliver_after)).
    pub redelivered: u64,
    /// Messages parked in the dead-letter destination.
    pub dead_lettered: u64,
    /// Acks that failed after their transaction committed (the redelivery will be skipped).
    pub ack_failures: u64,
    /// Store transactions committed.
    pub commits: u64,
    /// Broker or store errors the consumer recovered from.
    pub errors: u64,
    /// [`Consumer::effects`](crate::Consumer::effects): messages marked done without a call
    /// because the status lookup said an earlier call landed.
    pub confirmed: u64,
    /// [`Consumer::effects`](crate::Consumer::effects): messages marked done without a call
    /// after an unknown outcome, as [`OnUnknown::Skip`](crate::effect::OnUnknown::Skip) says:
    /// each may be a lost effect.
    pub skipped_unknown: u64,
    /// [`Consumer::effects`](crate::Consumer::effects): copies handed back because another
    /// lease on their message was live.
    pub busy: u64,
    /// [`Consumer::effects`](crate::Consumer::effects): done marks refused because a newer
    /// lease had taken over (that attempt was a zombie).
    pub fenced: u64,
}

impl Counter {
    /// Registers every counter of `consumer` at 0, so a series exists before its first event
    /// and a rate or an increase over it sees that event.
    pub(crate) fn register_all(consumer: &str) {
        for counter in Self::ALL {
            metrics::counter!(counter.metric_name(), "consumer" => consumer.to_owned())
                .increment(0);
        }
    }
}

impl Stats {
    pub(crate) fn add(&self, consumer: &str, counter: Counter, n: u64) {
        if n == 0 {
            return;
        }
        self.cell(counter).fetch_add(n, Ordering::Relaxed);
        metrics::counter!(counter.metric_name(), "consumer" => consumer.to_owned()).increment(n);
    }
}
