//! The consumer process is SIGKILLed mid-stream, repeatedly, and restarted: no destructor, no
//! delete, no last commit. Every event must still be in the ledger exactly once.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{client, counts, credit};
use inbox_core::Consumer;
use inbox_postgres::testkit::child::{is_child, spawn};
use inbox_postgres::testkit::wallet::{summary, Credit};
use inbox_postgres::testkit::TestDb;
use inbox_sqs::{Outgoing, SqsSender, SqsSource};

const EVENTS: i64 = 300;
const KILLS: usize = 4;

/// The consumer process: runs until killed. Only does anything when started by the test below.
#[tokio::test]
#[ignore = "the child process of hard_kill_mid_stream_applies_every_event_exactly_once"]
async fn hard_kill_child() {
    if !is_child() {
        return;
    }
    let url = std::env::var("SQS_QUEUE_URL").expect("SQS_QUEUE_URL");
    let schema = std::env::var("TEST_SCHEMA").expect("TEST_SCHEMA");
    let db = TestDb::attach(&schema).await;
    let sqs = client().await;
    let source = SqsSource::builder(sqs, &url)
        .wait_time(Duration::from_secs(1))
        .build()
        .await
        .expect("source");
    Consumer::new(
        "wallet",
        source,
        db.inbox(),
        Credit::new(db.pool.clone()).work(Duration::from_millis(5)),
    )
    .batch_size(5)
    .run_until(std::future::pending())
    .await
    .expect("consumer");
}

#[tokio::test]
async fn hard_kill_mid_stream_applies_every_event_exactly_once() {
    if is_child() {
        return;
    }
    let sqs = client().await;
    // A short visibility timeout so what a killed process had in flight comes back quickly.
    let url = common::queue(&sqs, "kill", 2).await;
    let db = TestDb::new().await;
    let outgoing: Vec<_> = (0..EVENTS)
        .map(|n| Outgoing::new(credit(n % 10, n + 1)))
        .collect();
    SqsSender::new(sqs.clone(), &url)
        .send_batch(&outgoing)
        .await
        .unwrap();
    let envs = [
        ("SQS_QUEUE_URL", url.clone()),
        ("TEST_SCHEMA", db.schema.clone()),
    ];

    let started = Instant::now();
    let mut kills = Vec::new();
    for kill in 0..KILLS {
        let before = summary(&db.pool).await.unwrap().distinct_events;
        let mut child = spawn("hard_kill_child", &envs);
        // Kill once this process has applied some events: mid-stream, not before it started.
        let target = before + 25 + (kill as i64 * 7) % 20;
        let progressed = common::eventually(Duration::from_secs(30), || async {
            summary(&db.pool).await.unwrap().distinct_events >= target.min(EVENTS - 1)
        })
        .await;
        child.kill().expect("SIGKILL the child");
        child.wait().expect("reap the child");
        let at = summary(&db.pool).await.unwrap();
        kills.push(at.distinct_events);
        assert!(progressed, "the child made no progress before kill {kill}");
    }

    let mut child = spawn("hard_kill_child", &envs);
    let finished = common::eventually(Duration::from_secs(90), || async {
        summary(&db.pool).await.unwrap().distinct_events >= EVENTS
            && counts(&sqs, &url).await == (0, 0)
    })
    .await;
    child.kill().expect("stop the last child");
    child.wait().expect("reap the last child");

    let ledger = summary(&db.pool).await.unwrap();
    let expected: i64 = (0..EVENTS).map(|n| n + 1).sum();
    let left = counts(&sqs, &url).await;
    println!(
        "hard kill: {KILLS} kills at {kills:?} applied events; after {:?}: {ledger:?}, inbox rows {}, queue {left:?}",
        started.elapsed(),
        db.inbox_rows().await,
    );
    assert!(
        finished,
        "not every event was applied in time: {ledger:?}, queue {left:?}"
    );
    assert_eq!(ledger.distinct_events, EVENTS, "nothing lost");
    assert_eq!(ledger.ledger_rows, EVENTS, "nothing applied twice");
    assert!(ledger.balances_exact);
    assert_eq!(ledger.total_balance, expected);
    assert_eq!(left, (0, 0));
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
}
