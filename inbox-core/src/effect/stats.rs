//! Counters of an [`EffectConsumer`](super::EffectConsumer), kept for callers and tests and sent
//! to the `metrics` facade, and its duration histograms.

use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Histogram, Unit};

/// Histogram: seconds one lease statement ([`LeaseStore::acquire`](super::LeaseStore::acquire))
/// took.
pub const ACQUIRE_DURATION: &str = "inbox_effects_acquire_duration_seconds";
/// Histogram: seconds one provider call ([`EffectHandler::call`](super::EffectHandler::call))
/// took, failed calls included (a call dropped at the end of its lease counts the time until
/// then).
pub const CALL_DURATION: &str = "inbox_effects_call_duration_seconds";
/// Histogram: seconds one done transaction took (the done mark,
/// [`EffectHandler::record`](super::EffectHandler::record), the commit), fenced and failed ones
/// included.
pub const DONE_DURATION: &str = "inbox_effects_done_duration_seconds";
/// Histogram: seconds one broker ack took.
pub const ACK_DURATION: &str = "inbox_effects_ack_duration_seconds";

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

    fn help(self) -> &'static str {
        match self {
            Counter::Received => "Deliveries the effect consumer took from the broker.",
            Counter::Applied => "Messages called and marked done.",
            Counter::Confirmed => "Messages marked done without a call: an earlier call landed.",
            Counter::SkippedUnknown => {
                "Messages marked done without a call after an unknown outcome: maybe lost."
            }
            Counter::SkippedDuplicate => "Copies of messages already done, skipped.",
            Counter::Busy => "Copies handed back while another lease on their message was live.",
            Counter::Fenced => "Done marks refused because a newer lease had taken over.",
            Counter::Retried => "Attempts handed back or repeated for a retry.",
            Counter::DeadLettered => "Messages parked in the dead-letter destination.",
            Counter::AckFailure => "Acks that failed after the done mark.",
            Counter::Error => "Broker or store errors the effect consumer recovered from.",
        }
    }

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

/// Registers the unit and help text of every effect consumer metric: the counters
/// `inbox_effects_<counter>_total` and the histograms above. An effect consumer calls it when it
/// starts; calling it again does no harm.
pub fn describe_effect_metrics() {
    for counter in Counter::ALL {
        metrics::describe_counter!(counter.metric_name(), Unit::Count, counter.help());
    }
    let durations = [
        (ACQUIRE_DURATION, "Seconds one lease statement took."),
        (
            CALL_DURATION,
            "Seconds one provider call took, failed and timed-out calls included.",
        ),
        (
            DONE_DURATION,
            "Seconds one done transaction (done mark, record, commit) took.",
        ),
        (ACK_DURATION, "Seconds one broker ack took."),
    ];
    for (name, help) in durations {
        metrics::describe_histogram!(name, Unit::Seconds, help);
    }
}

/// One running effect consumer's histogram handles, registered when it starts (a recorder
/// installed later would not see handles taken earlier).
#[derive(Debug, Clone)]
pub(crate) struct EffectMetrics {
    pub(crate) acquire: Histogram,
    pub(crate) call: Histogram,
    pub(crate) done: Histogram,
    pub(crate) ack: Histogram,
}

impl Default for EffectMetrics {
    fn default() -> Self {
        Self {
            acquire: Histogram::noop(),
            call: Histogram::noop(),
            done: Histogram::noop(),
            ack: Histogram::noop(),
        }
    }
}

impl EffectMetrics {
    /// Describes every effect metric and registers the handles of `consumer`.
    pub(crate) fn register(consumer: &str) -> Self {
        describe_effect_metrics();
        let histogram =
            |name: &'static str| metrics::histogram!(name, "consumer" => consumer.to_owned());
        Self {
            acquire: histogram(ACQUIRE_DURATION),
            call: histogram(CALL_DURATION),
            done: histogram(DONE_DURATION),
            ack: histogram(ACK_DURATION),
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

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a poisoned lock should fail the test loudly
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use metrics::{
        Counter as MetricCounter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata,
        Recorder, SharedString, Unit,
    };

    use super::*;
    use crate::effect::{
        Acquired, Attempt, Effect, EffectConsumer, EffectHandler, Lease, LeaseStore, OnUnknown,
        Release,
    };
    use crate::{
        async_trait, Ack, Delivery, HandlerError, Message, MessageId, MessageSource, SourceError,
        StoreError,
    };

    /// Samples per series (`name{consumer=…}`), and the unit of each described metric.
    #[derive(Default)]
    struct Capture {
        series: Mutex<HashMap<String, Arc<Samples>>>,
        described: Mutex<HashMap<String, Option<Unit>>>,
    }

    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl CounterFn for Samples {
        fn increment(&self, value: u64) {
            self.0.lock().unwrap().push(value as f64);
        }
        fn absolute(&self, value: u64) {
            self.0.lock().unwrap().push(value as f64);
        }
    }

    impl HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.lock().unwrap().push(value);
        }
    }

    impl Capture {
        fn series(&self, key: &Key) -> Arc<Samples> {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let id = format!("{}{{{}}}", key.name(), labels.join(","));
            Arc::clone(self.series.lock().unwrap().entry(id).or_default())
        }

        fn samples(&self, name: &str) -> Vec<f64> {
            let id = format!("{name}{{consumer=mailer}}");
            self.series
                .lock()
                .unwrap()
                .get(&id)
                .map(|s| s.0.lock().unwrap().clone())
                .unwrap_or_default()
        }
    }

    impl Recorder for Capture {
        fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.described
                .lock()
                .unwrap()
                .insert(key.as_str().into(), unit);
        }
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.described
                .lock()
                .unwrap()
                .insert(key.as_str().into(), unit);
        }
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> MetricCounter {
            MetricCounter::from_arc(self.series(key))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(self.series(key))
        }
    }

    /// Leases every new message with token 1; done rows stay done.
    #[derive(Default)]
    struct Leases(Mutex<HashSet<String>>);

    #[async_trait]
    impl LeaseStore for Leases {
        type Tx = ();

        async fn acquire(
            &self,
            _: &str,
            id: &MessageId,
            _: Duration,
        ) -> Result<Acquired, StoreError> {
            if self.0.lock().unwrap().contains(id.as_str()) {
                return Ok(Acquired::Done);
            }
            Ok(Acquired::Leased(Lease {
                token: 1,
                attempt: Attempt::First,
                attempts: 1,
                since_first: Duration::ZERO,
            }))
        }
        async fn release(
            &self,
            _: &str,
            _: &MessageId,
            _: u64,
            _: Release,
        ) -> Result<bool, StoreError> {
            Ok(true)
        }
        async fn begin(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn complete(
            &self,
            _: &mut (),
            _: &str,
            id: &MessageId,
            _: u64,
        ) -> Result<bool, StoreError> {
            Ok(self.0.lock().unwrap().insert(id.to_string()))
        }
        async fn commit(&self, _: ()) -> Result<(), StoreError> {
            Ok(())
        }
        async fn rollback(&self, _: ()) -> Result<(), StoreError> {
            Ok(())
        }
    }

    /// Hands out its deliveries once, then nothing; acks do nothing.
    struct Deliveries(Vec<Delivery<NoAck>>);

    struct NoAck;

    #[async_trait]
    impl Ack for NoAck {
        async fn ack(self) -> Result<(), SourceError> {
            Ok(())
        }
        async fn nack(self, _: Duration) -> Result<(), SourceError> {
            Ok(())
        }
        async fn dead_letter(self, _: &Message, _: &str) -> Result<(), SourceError> {
            Ok(())
        }
    }

    #[async_trait]
    impl MessageSource for Deliveries {
        type Ack = NoAck;

        async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<NoAck>>, SourceError> {
            let n = max.min(self.0.len());
            Ok(self.0.drain(..n).collect())
        }
    }

    struct Call;

    #[async_trait]
    impl EffectHandler<()> for Call {
        fn on_unknown(&self) -> OnUnknown {
            OnUnknown::Retry
        }
        async fn call(&self, _: &Effect, _: &Message) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    // One thread: the recorder is the thread's default while the consumer runs.
    #[tokio::test(flavor = "current_thread")]
    async fn an_effect_consumer_records_its_durations_labelled_and_described() {
        let capture = Capture::default();
        let _recorder = metrics::set_default_local_recorder(&capture);
        let deliveries = ["a", "b", "a"].map(|id| Delivery {
            message: Message::new(Ok(MessageId::new(id).unwrap()), "{}"),
            ack: NoAck,
        });
        let source = Deliveries(deliveries.into());
        let stats = EffectConsumer::new("mailer", source, Leases::default(), Call)
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!((stats.applied, stats.skipped_duplicates), (2, 1));

        let count = |name: &str| capture.samples(name).len();
        assert_eq!(
            count(ACQUIRE_DURATION),
            3,
            "one lease statement per delivery"
        );
        assert_eq!(count(CALL_DURATION), 2, "one call per new message");
        assert_eq!(count(DONE_DURATION), 2);
        assert_eq!(count(ACK_DURATION), 3, "the duplicate is acked too");
        assert_eq!(count("inbox_effects_applied_total"), 2);
        let described = capture.described.lock().unwrap().clone();
        for name in [ACQUIRE_DURATION, CALL_DURATION, DONE_DURATION, ACK_DURATION] {
            assert_eq!(described.get(name), Some(&Some(Unit::Seconds)), "{name}");
        }
        for counter in Counter::ALL {
            let name = counter.metric_name();
            assert_eq!(described.get(name), Some(&Some(Unit::Count)), "{name}");
        }
    }
}
