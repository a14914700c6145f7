//! Counters: kept per consumer for callers and tests, and sent to the `metrics` facade.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a consumer has done so far. Cheap to read at any time through
/// [`Consumer::stats`](crate::Consumer::stats).
#[derive(Debug, Default)]
pub struct Stats {
    received: AtomicU64,
    applied: AtomicU64,
    skipped_duplicates: AtomicU64,
    retried: AtomicU64,
    redelivered: AtomicU64,
    dead_lettered: AtomicU64,
    ack_failures: AtomicU64,
    commits: AtomicU64,
    errors: AtomicU64,
    confirmed: AtomicU64,
    skipped_unknown: AtomicU64,
    busy: AtomicU64,
    fenced: AtomicU64,
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

#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Received,
    Applied,
    SkippedDuplicate,
    Retried,
    Redelivered,
    DeadLettered,
    AckFailure,
    Commit,
    Error,
    Confirmed,
    SkippedUnknown,
    Busy,
    Fenced,
}

impl Counter {
    /// Every counter.
    const ALL: [Counter; 13] = [
        Counter::Received,
        Counter::Applied,
        Counter::SkippedDuplicate,
        Counter::Retried,
        Counter::Redelivered,
        Counter::DeadLettered,
        Counter::AckFailure,
        Counter::Commit,
        Counter::Error,
        Counter::Confirmed,
        Counter::SkippedUnknown,
        Counter::Busy,
        Counter::Fenced,
    ];

    /// Registers every counter of `consumer` at 0, so a series exists before its first event
    /// and a rate or an increase over it sees that event.
    pub(crate) fn register_all(consumer: &str) {
        for counter in Self::ALL {
            metrics::counter!(counter.metric_name(), "consumer" => consumer.to_owned())
                .increment(0);
        }
    }

    fn metric_name(self) -> &'static str {
        use crate::telemetry as t;
        match self {
            Counter::Received => t::MESSAGES_RECEIVED,
            Counter::Applied => t::MESSAGES_APPLIED,
            Counter::SkippedDuplicate => t::DUPLICATES_SKIPPED,
            Counter::Retried => t::RETRIES,
            Counter::Redelivered => t::REDELIVERED,
            Counter::DeadLettered => t::DEAD_LETTERED,
            Counter::AckFailure => t::ACK_FAILURES,
            Counter::Commit => t::COMMITS,
            Counter::Error => t::ERRORS,
            Counter::Confirmed => t::EFFECTS_CONFIRMED,
            Counter::SkippedUnknown => t::EFFECTS_SKIPPED_UNKNOWN,
            Counter::Busy => t::EFFECTS_BUSY,
            Counter::Fenced => t::EFFECTS_FENCED,
        }
    }
}

impl Stats {
    pub(crate) fn add(&self, consumer: &str, counter: Counter, n: u64) {
        if n == 0 {
            return;
        }
        let cell = match counter {
            Counter::Received => &self.received,
            Counter::Applied => &self.applied,
            Counter::SkippedDuplicate => &self.skipped_duplicates,
            Counter::Retried => &self.retried,
            Counter::Redelivered => &self.redelivered,
            Counter::DeadLettered => &self.dead_lettered,
            Counter::AckFailure => &self.ack_failures,
            Counter::Commit => &self.commits,
            Counter::Error => &self.errors,
            Counter::Confirmed => &self.confirmed,
            Counter::SkippedUnknown => &self.skipped_unknown,
            Counter::Busy => &self.busy,
            Counter::Fenced => &self.fenced,
        };
        cell.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(counter.metric_name(), "consumer" => consumer.to_owned()).increment(n);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            received: get(&self.received),
            applied: get(&self.applied),
            skipped_duplicates: get(&self.skipped_duplicates),
            retried: get(&self.retried),
            redelivered: get(&self.redelivered),
            dead_lettered: get(&self.dead_lettered),
            ack_failures: get(&self.ack_failures),
            commits: get(&self.commits),
            errors: get(&self.errors),
            confirmed: get(&self.confirmed),
            skipped_unknown: get(&self.skipped_unknown),
            busy: get(&self.busy),
            fenced: get(&self.fenced),
        }
    }
}
