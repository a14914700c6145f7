//! Counters of an [`EffectConsumer`](super::EffectConsumer), kept for callers and tests and sent
//! to the `metrics` facade.

use std::sync::atomic::{AtomicU64, Ordering};

/// What an effect consumer has done so far. Cheap to read at any time through
/// [`EffectConsumer::stats`](super::EffectConsumer::stats).
#[derive(Debug, Default)]
pub struct EffectStats {
    cells: [AtomicU64; Counter::ALL.len()],
}

/// A copy of [`EffectStats`] at one moment. Each field is also the metric
/// `inbox_effects_<field>_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EffectStatsSnapshot {
    /// Deliveries taken from the broker.
    pub received: u64,
    /// Messages called and marked done.
    pub applied: u64,
    /// Messages marked done without a call because the status lookup said an earlier call
    /// landed.
    pub confirmed: u64,
    /// Messages marked done without a call after an unknown outcome, as
    /// [`OnUnknown::Skip`](super::OnUnknown::Skip) says: each may be a lost effect.
    pub skipped_unknown: u64,
    /// Copies of messages already done, skipped.
    pub skipped_duplicates: u64,
    /// Copies handed back because another lease on their message was live.
    pub busy: u64,
    /// Done marks refused because a newer lease had taken over (this attempt was a zombie).
    pub fenced: u64,
    /// Attempts handed back for a retry: a failed call, a pending provider, a failed done
    /// transaction.
    pub retried: u64,
    /// Messages parked in the dead-letter destination.
    pub dead_lettered: u64,
    /// Acks that failed after the done mark (the redelivered copy will be skipped).
    pub ack_failures: u64,
    /// Broker or store errors the consumer recovered from.
    pub errors: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Received,
    Applied,
    Confirmed,
    SkippedUnknown,
    SkippedDuplicate,
    Busy,
    Fenced,
    Retried,
    DeadLettered,
    AckFailure,
    Error,
}

impl Counter {
    const ALL: [Counter; 11] = [
        Counter::Received,
        Counter::Applied,
        Counter::Confirmed,
        Counter::SkippedUnknown,
        Counter::SkippedDuplicate,
        Counter::Busy,
        Counter::Fenced,
        Counter::Retried,
        Counter::DeadLettered,
        Counter::AckFailure,
        Counter::Error,
    ];

    fn metric_name(self) -> &'static str {
        match self {
            Counter::Received => "inbox_effects_received_total",
            Counter::Applied => "inbox_effects_applied_total",
            Counter::Confirmed => "inbox_effects_confirmed_total",
            Counter::SkippedUnknown => "inbox_effects_skipped_unknown_total",
            Counter::SkippedDuplicate => "inbox_effects_skipped_duplicates_total",
            Counter::Busy => "inbox_effects_busy_total",
            Counter::Fenced => "inbox_effects_fenced_total",
            Counter::Retried => "inbox_effects_retried_total",
            Counter::DeadLettered => "inbox_effects_dead_lettered_total",
            Counter::AckFailure => "inbox_effects_ack_failures_total",
            Counter::Error => "inbox_effects_errors_total",
        }
    }
}

impl EffectStats {
    pub(crate) fn add(&self, consumer: &str, counter: Counter) {
        self.cells[counter as usize].fetch_add(1, Ordering::Relaxed);
        metrics::counter!(counter.metric_name(), "consumer" => consumer.to_owned()).increment(1);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> EffectStatsSnapshot {
        let get = |c: Counter| self.cells[c as usize].load(Ordering::Relaxed);
        EffectStatsSnapshot {
            received: get(Counter::Received),
            applied: get(Counter::Applied),
            confirmed: get(Counter::Confirmed),
            skipped_unknown: get(Counter::SkippedUnknown),
            skipped_duplicates: get(Counter::SkippedDuplicate),
            busy: get(Counter::Busy),
            fenced: get(Counter::Fenced),
            retried: get(Counter::Retried),
            dead_lettered: get(Counter::DeadLettered),
            ack_failures: get(Counter::AckFailure),
            errors: get(Counter::Error),
        }
    }
}
