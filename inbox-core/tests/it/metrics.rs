//! What the consumer reports through the `metrics` facade, captured by a recorder of this test:
//! every metric described with a unit, counters and histograms labelled by consumer, the
//! in-flight gauge back at 0 and the state gauges following the consumer, for the inbox step and
//! the effect step alike.
// A poisoned lock should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use inbox_core::effect::{Acquired, Attempt, Effect, EffectHandler, Lease, OnUnknown};
use inbox_core::telemetry::{self as t};
use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId};
use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx, ScriptedLeases};
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// Every value each series took, in order (counters: their running total).
#[derive(Default)]
struct Series(Mutex<Vec<f64>>);

impl Series {
    fn push(&self, f: impl FnOnce(Option<f64>) -> f64) {
        let mut values = self.0.lock().unwrap();
        let next = f(values.last().copied());
        values.push(next);
    }
}

impl CounterFn for Series {
    fn increment(&self, value: u64) {
        self.push(|last| last.unwrap_or(0.0) + value as f64);
    }
    fn absolute(&self, value: u64) {
        self.push(|_| value as f64);
    }
}

impl GaugeFn for Series {
    fn increment(&self, value: f64) {
        self.push(|last| last.unwrap_or(0.0) + value);
    }
    fn decrement(&self, value: f64) {
        self.push(|last| last.unwrap_or(0.0) - value);
    }
    fn set(&self, value: f64) {
        self.push(|_| value);
    }
}

impl HistogramFn for Series {
    fn record(&self, value: f64) {
        self.push(|_| value);
    }
}

#[derive(Default)]
struct Capture {
    /// By name and sorted labels (`name{a=b,c=d}`).
    series: Mutex<HashMap<String, Arc<Series>>>,
    described: Mutex<HashMap<String, Option<Unit>>>,
}

impl Capture {
    fn series(&self, key: &Key) -> Arc<Series> {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let id = format!("{}{{{}}}", key.name(), labels.join(","));
        Arc::clone(self.series.lock().unwrap().entry(id).or_default())
    }

    fn values(&self, id: &str) -> Vec<f64> {
        self.series
            .lock()
            .unwrap()
            .get(id)
            .map(|s| s.0.lock().unwrap().clone())
            .unwrap_or_default()
    }

    fn describe(&self, key: KeyName, unit: Option<Unit>) {
        self.described
            .lock()
            .unwrap()
            .insert(key.as_str().to_owned(), unit);
    }
}

impl Recorder for Capture {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        self.describe(key, unit);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        self.describe(key, unit);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        self.describe(key, unit);
    }
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.series(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.series(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.series(key))
    }
}

struct Add;

impl Handler<MemoryTx<i64>> for Add {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}

// One thread: the recorder is the thread's default while the consumer runs.
#[tokio::test(flavor = "current_thread")]
async fn the_consumer_records_its_metrics_labelled_and_described() {
    let capture = Capture::default();
    let _recorder = metrics::set_default_local_recorder(&capture);

    let broker = MemoryBroker::new();
    for (id, amount) in [
        ("a", "1"),
        ("b", "2"),
        ("a", "1"),
        ("c", "3"),
        ("d", "oops"),
    ] {
        broker.publish(Some(id), amount);
    }
    let store = MemoryStore::<i64>::new();
    let consumer = Consumer::new("metered", broker.source(), store.clone(), Add)
        .batch_size(10)
        .retry(inbox_core::RetryPolicy::default().max_attempts(1));
    let health = consumer.health();
    let stats = consumer.run_until_idle().await.expect("runs");
    assert_eq!(store.state().await, 6);
    assert_eq!(health.consumer(), Some("metered"));

    let label = "{consumer=metered}";
    let last = |name: &str| capture.values(&format!("{name}{label}")).last().copied();
    assert_eq!(last(t::MESSAGES_RECEIVED), Some(5.0));
    assert_eq!(last(t::MESSAGES_APPLIED), Some(stats.applied as f64));
    assert_eq!(last(t::MESSAGES_APPLIED), Some(3.0));
    assert_eq!(last(t::DUPLICATES_SKIPPED), Some(1.0));
    // "oops" is no JSON: dead-lettered at once.
    assert_eq!(last(t::DEAD_LETTERED), Some(1.0));
    // Every counter is there from the start, at 0 until its first event, so an alert on its
    // increase sees the first one.
    assert_eq!(
        capture.values(&format!("{}{label}", t::DEAD_LETTERED))[0],
        0.0
    );
    assert_eq!(
        capture.values(&format!("{}{label}", t::ACK_FAILURES)),
        vec![0.0]
    );
    assert_eq!(
        capture.values(&format!("{}{label}", t::EFFECTS_FENCED)),
        vec![0.0]
    );

    // One batch: a, b, a (a duplicate within the batch never reaches the claim), c.
    let sizes = capture.values(&format!("{}{label}", t::BATCH_SIZE));
    assert_eq!(sizes, vec![3.0], "messages per transaction");
    for name in [
        t::CLAIM_DURATION,
        t::HANDLER_DURATION,
        t::COMMIT_DURATION,
        t::ACK_DURATION,
    ] {
        let samples = capture.values(&format!("{name}{label}"));
        assert!(!samples.is_empty(), "{name} recorded nothing");
        assert!(samples.iter().all(|s| *s >= 0.0), "{name}: {samples:?}");
    }

    let in_flight = capture.values(&format!("{}{label}", t::IN_FLIGHT));
    assert_eq!(in_flight.iter().copied().fold(0.0, f64::max), 5.0);
    assert_eq!(in_flight.last(), Some(&0.0), "{in_flight:?}");

    let ready = capture.values(&format!("{}{label}", t::CONSUMER_READY));
    assert!(ready.contains(&1.0), "ready while running: {ready:?}");
    assert_eq!(ready.last(), Some(&0.0), "not ready once stopped");
    let state = |s: &str| {
        capture
            .values(&format!(
                "{}{{consumer=metered,state={s}}}",
                t::CONSUMER_STATE
            ))
            .last()
            .copied()
    };
    assert_eq!(state("stopped"), Some(1.0));
    assert_eq!(state("running"), Some(0.0));

    let described = capture.described.lock().unwrap().clone();
    for (name, unit) in [
        (t::MESSAGES_APPLIED, Unit::Count),
        (t::BATCH_SIZE, Unit::Count),
        (t::HANDLER_DURATION, Unit::Seconds),
        (t::END_TO_END_LAG, Unit::Seconds),
        (t::IN_FLIGHT, Unit::Count),
        (t::CONSUMER_READY, Unit::Count),
        (t::OLDEST_REMEMBERED_AGE, Unit::Seconds),
    ] {
        assert_eq!(described.get(name), Some(&Some(unit)), "{name}");
    }
}

struct Call;

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
async fn the_effect_step_records_the_same_metrics_plus_its_own_counters() {
    let capture = Capture::default();
    let _recorder = metrics::set_default_local_recorder(&capture);

    let broker = MemoryBroker::new();
    for id in ["a", "b", "a"] {
        broker.publish(Some(id), "{}");
    }
    let first = Acquired::Leased(Lease {
        token: 1,
        attempt: Attempt::First,
        attempts: 1,
        since_first: Duration::ZERO,
    });
    let leases = ScriptedLeases::default();
    leases.then_acquire([
        first,
        first,
        Acquired::Done,
        Acquired::Busy {
            retry_after: Duration::from_millis(1),
        },
    ]);
    let consumer = Consumer::effects("mailer", broker.source(), leases, Call);
    let health = consumer.health();
    let stats = consumer.run_until_idle().await.expect("runs");
    assert_eq!((stats.applied, stats.skipped_duplicates), (2, 1));
    assert_eq!(
        health.consumer(),
        Some("mailer"),
        "the effect step has health too"
    );
    assert!(
        health.last_batch().is_some(),
        "a done mark counts as a batch"
    );

    let label = "{consumer=mailer}";
    let count = |name: &str| capture.values(&format!("{name}{label}")).len();
    assert_eq!(
        count(t::CLAIM_DURATION),
        3,
        "one lease statement per delivery"
    );
    assert_eq!(count(t::HANDLER_DURATION), 2, "one call per new message");
    assert_eq!(
        count(t::COMMIT_DURATION),
        2,
        "one done transaction per call"
    );
    assert_eq!(count(t::ACK_DURATION), 3, "the duplicate is acked too");
    let last = |name: &str| capture.values(&format!("{name}{label}")).last().copied();
    assert_eq!(last(t::MESSAGES_APPLIED), Some(2.0));
    assert_eq!(last(t::COMMITS), Some(2.0));
    let in_flight = capture.values(&format!("{}{label}", t::IN_FLIGHT));
    assert_eq!(in_flight.last(), Some(&0.0), "{in_flight:?}");

    let described = capture.described.lock().unwrap().clone();
    for name in [
        t::EFFECTS_CONFIRMED,
        t::EFFECTS_SKIPPED_UNKNOWN,
        t::EFFECTS_BUSY,
        t::EFFECTS_FENCED,
    ] {
        assert_eq!(described.get(name), Some(&Some(Unit::Count)), "{name}");
    }
}
