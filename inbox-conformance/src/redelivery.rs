//! The redelivery schedule on a real broker: a handler whose downstream is down for a while
//! dead-letters nothing, applies everything once after it is back, and each message comes back
//! within its schedule.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_core::{Consumer, HandlerError, Message, MessageId, RetryPolicy};
use inbox_testkit::{eventually, lock};

use crate::scenarios::{finish, ledger_has, left, setup, source, Guarded};
use crate::wallet::{self, CreditEvent};
use crate::{TestBroker, TestQueue, TestStore};

/// How long the downstream is down: `INBOX_TEST_OUTAGE_SECS` (the issue's own test is 60),
/// 12 s by default to keep the suite short.
fn outage() -> Duration {
    let secs = std::env::var("INBOX_TEST_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    Duration::from_secs(secs)
}

/// The jitter of the scenario's schedule.
const JITTER: f64 = 0.2;

/// How late a redelivery may come beyond its delay and jitter: the broker's poll and sweep
/// (a receive's wait, the Redis claim sweep, whole seconds of SQS visibility).
const SLACK: Duration = Duration::from_secs(3);

/// Per message ID, when each attempt started and under which redelivery.
type Attempts = BTreeMap<String, Vec<(Instant, u32)>>;

/// The test: the downstream is down from the first attempt for
/// `INBOX_TEST_OUTAGE_SECS` (12 s by default); the schedule is 1/12, 1/4, 1/2 and all of the
/// outage (5, 15, 30, 60 s for a minute), jitter 0.2, so a message comes back up to three times
/// while it is down and is applied on the next. Nothing is dead-lettered, everything is applied
/// once, nothing is left on the broker, and each redelivery comes no sooner than its delay less
/// the jitter and no later than its delay, the jitter and 3 s of poll slack. On a Kafka
/// partition, paused behind its first failing record, the records after it may be tried only
/// once the downstream is back; each record that failed came back.
pub async fn a_downstream_outage_is_ridden_out_by_delayed_redeliveries<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "redeliver").await;
    let first = source(&queue, "c1").await;
    let claims = first.claims();
    if !claims.delayed_redelivery() {
        println!("delayed redelivery: skipped: the source cannot delay a redelivery ({claims:?})");
        drop(first);
        finish(db, queue).await;
        return;
    }
    let outage = outage();
    let schedule: Vec<Duration> = [12, 4, 2, 1].iter().map(|d| outage / *d).collect();
    let n = 5;
    for i in 0..n {
        let id = MessageId::generate();
        queue
            .send(
                Some(id.as_str()),
                &CreditEvent::new(1 + i % 2, 10 + i).to_json(),
            )
            .await;
    }
    // The wallet's credit behind a downstream that is down from the first attempt until
    // `up_at`, noting each attempt's time per message and redelivery.
    let (up_at, attempts) = (
        Arc::new(Mutex::new(None)),
        Arc::new(Mutex::new(Attempts::new())),
    );
    let handler = Guarded(db.credit(), {
        let (up_at, attempts) = (Arc::clone(&up_at), Arc::clone(&attempts));
        move |id: &MessageId, m: &Message| {
            let now = Instant::now();
            let mut attempts = lock(&attempts);
            attempts
                .entry(id.to_string())
                .or_default()
                .push((now, m.meta.redeliveries));
            if now < *lock(&up_at).get_or_insert(now + outage) {
                return Err(HandlerError::transient("the downstream is down"));
            }
            Ok(())
        }
    });
    let consumer = Consumer::new("wallet", first, db.inbox(), handler.clone()).retry(
        RetryPolicy::default()
            .max_attempts(2)
            .backoff(Duration::from_millis(10), Duration::from_millis(50))
            .redeliver_after(schedule.clone())
            .jitter(JITTER),
    );
    let started = Instant::now();
    let limit = outage * 3 + Duration::from_secs(30);
    let all_applied = async {
        eventually(limit, || ledger_has(&db, n)).await;
    };
    let snapshot = consumer
        .run_until(all_applied)
        .await
        .unwrap_or_else(|e| panic!("consumer: {e}"));
    let took = started.elapsed();

    let dead = queue.dead_letters().await;
    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    let up_at = lock(&up_at).unwrap_or_else(Instant::now);
    let attempts = lock(&attempts).clone();
    println!(
        "delayed redelivery: outage {outage:?}, schedule {schedule:?}, took {took:?}, \
         {snapshot:?}, {summary:?}, left {left}, dead letters {dead:?}"
    );
    assert!(dead.is_empty(), "nothing dead-lettered: {dead:?}");
    assert_eq!(snapshot.dead_lettered, 0);
    assert_eq!(
        (summary.ledger_rows, summary.distinct_events),
        (n, n),
        "everything applied once, after {took:?}"
    );
    assert!(summary.balances_exact);
    assert_eq!(left, 0, "everything acked");
    // On a queue every message fails and comes back on its own; on a Kafka partition, paused
    // behind its first failing message, the ones after it may first be tried once it is back.
    assert!(
        snapshot.redelivered >= 2,
        "messages came back at least twice while the downstream was down"
    );
    for (id, tries) in &attempts {
        let mut gaps = Vec::new();
        for (step, delay) in schedule.iter().enumerate() {
            let step = u32::try_from(step).unwrap_or(u32::MAX);
            let last = tries.iter().rev().find(|(_, r)| *r == step);
            let next = tries.iter().find(|(_, r)| *r == step + 1);
            let (Some((last, _)), Some((next, _))) = (last, next) else {
                continue;
            };
            let gap = *next - *last;
            gaps.push(gap);
            let low = delay
                .mul_f64(1.0 - JITTER)
                .saturating_sub(Duration::from_millis(200));
            let high = delay.mul_f64(1.0 + JITTER) + SLACK;
            assert!(
                gap >= low && gap <= high,
                "{id}: redelivery {} came {gap:?} after the last attempt, outside \
                 {low:?}..={high:?} (attempts {tries:?})",
                step + 1
            );
        }
        println!("{id}: gaps between deliveries {gaps:?}");
        let failed = tries.len() > 1 || tries.iter().any(|(t, _)| *t < up_at);
        assert!(
            !failed || !gaps.is_empty(),
            "{id}: failed, but never came back: {tries:?}"
        );
    }
    finish(db, queue).await;
}
