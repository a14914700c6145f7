//! The redelivery schedule on the in-memory broker: a message still failing after its
//! in-process attempts is handed back for each delay of the schedule, and dead-lettered only
//! once the schedule is used up.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_core::{Consumer, Error, Handler, HandlerError, Message, MessageId, RetryPolicy};
use inbox_testkit::{eventually, AckOnReceive, MemoryBroker, MemoryStore, MemoryTx};

/// Adds each payload to the sum, failing while its downstream is down (until `up_at`), and
/// notes when each attempt started and under which redelivery.
#[derive(Clone)]
struct Downstream {
    up_at: Instant,
    attempts: Arc<Mutex<Vec<(Instant, u32)>>>,
}

impl Handler<MemoryTx<i64>> for Downstream {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        m: &Message,
    ) -> Result<(), HandlerError> {
        self.attempts
            .lock()
            .unwrap()
            .push((Instant::now(), m.meta.redeliveries));
        if Instant::now() < self.up_at {
            return Err(HandlerError::transient("downstream is down"));
        }
        *tx.state_mut() += std::str::from_utf8(&m.payload)
            .unwrap()
            .parse::<i64>()
            .unwrap();
        Ok(())
    }
}

fn schedule(ms: &[u64]) -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .redeliver_after(ms.iter().map(|ms| Duration::from_millis(*ms)))
}

#[tokio::test]
async fn an_outage_within_the_schedule_dead_letters_nothing_and_applies_once() {
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "100");
    let store = MemoryStore::<i64>::new();
    let handler = Downstream {
        up_at: Instant::now() + Duration::from_millis(250),
        attempts: Arc::default(),
    };
    let consumer = Consumer::new("sum", broker.source(), store.clone(), handler.clone())
        .retry(schedule(&[100, 200, 400]));
    let stats = consumer.stats();
    let done = {
        let store = store.clone();
        async move {
            eventually(Duration::from_secs(5), || async {
                store.state().await == 100
            })
            .await;
        }
    };
    consumer.run_until(done).await.unwrap();
    assert_eq!(store.state().await, 100);
    assert!(broker.dead_letters().is_empty());
    let snapshot = stats.snapshot();
    assert_eq!((snapshot.applied, snapshot.dead_lettered), (1, 0));
    assert_eq!(
        snapshot.redelivered, 2,
        "down for 250 ms: back after 100, then 200 ms"
    );
    // Each delivery's first attempt comes at least its delay after the previous one's last.
    let attempts = handler.attempts.lock().unwrap().clone();
    for (delay, n) in [(100, 1), (200, 2)] {
        let last_before = attempts.iter().rev().find(|(_, r)| *r == n - 1).unwrap().0;
        let first = attempts.iter().find(|(_, r)| *r == n).unwrap().0;
        assert!(
            first - last_before >= Duration::from_millis(delay),
            "redelivery {n} came {:?} after the previous attempt, sooner than {delay} ms",
            first - last_before
        );
    }
}

#[tokio::test]
async fn a_schedule_used_up_dead_letters_after_its_last_delay() {
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "100");
    let store = MemoryStore::<i64>::new();
    let handler = Downstream {
        up_at: Instant::now() + Duration::from_secs(3600),
        attempts: Arc::default(),
    };
    let consumer = Consumer::new("sum", broker.source(), store.clone(), handler.clone())
        .retry(schedule(&[20, 40]).jitter(0.5));
    let stats = consumer.stats();
    let parked = {
        let broker = broker.clone();
        async move {
            eventually(Duration::from_secs(5), || async {
                !broker.dead_letters().is_empty()
            })
            .await;
        }
    };
    consumer.run_until(parked).await.unwrap();
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].1.contains("after 2 delayed redeliveries"),
        "{}",
        dead[0].1
    );
    assert_eq!(dead[0].0.meta.redeliveries, 2);
    assert_eq!(stats.snapshot().redelivered, 2);
    // Two attempts on each of three deliveries.
    assert_eq!(handler.attempts.lock().unwrap().len(), 6);
    assert_eq!(store.state().await, 0);
}

#[tokio::test]
async fn a_permanent_failure_is_dead_lettered_at_once_whatever_the_schedule() {
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "not a number");
    let store = MemoryStore::<i64>::new();
    struct Refuse;
    impl Handler<MemoryTx<i64>> for Refuse {
        async fn handle(
            &self,
            _: &mut MemoryTx<i64>,
            _: &MessageId,
            _: &Message,
        ) -> Result<(), HandlerError> {
            Err(HandlerError::permanent("malformed"))
        }
    }
    let consumer = Consumer::new("sum", broker.source(), store, Refuse).retry(schedule(&[10_000]));
    let stats = consumer.run_until_idle().await.unwrap();
    assert_eq!((stats.dead_lettered, stats.redelivered), (1, 0));
}

#[tokio::test]
async fn a_schedule_on_a_source_that_cannot_delay_is_refused() {
    let broker = MemoryBroker::new();
    let consumer = Consumer::new(
        "sum",
        AckOnReceive::new(broker.source()),
        MemoryStore::<i64>::new(),
        inbox_testkit::Sum,
    )
    .retry(schedule(&[10]));
    let err = consumer.run_until_idle().await.unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("cannot delay a redelivery")),
        "{err}"
    );
}

#[test]
fn jitter_stays_within_its_fraction() {
    let policy = RetryPolicy::default()
        .redeliver_after([Duration::from_secs(10)])
        .jitter(0.2);
    for _ in 0..1000 {
        let d = policy.redelivery_delay(0).unwrap();
        assert!(
            d >= Duration::from_secs(8) && d <= Duration::from_secs(12),
            "{d:?}"
        );
    }
    assert_eq!(policy.redelivery_delay(1), None);
    assert_eq!(
        RetryPolicy::default().redelivery_delay(0),
        None,
        "no schedule: dead-lettered after the in-process attempts"
    );
}
