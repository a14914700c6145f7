//! The headline result: a consumer process SIGKILLed mid-stream, again and again, and restarted;
//! afterwards every event is in the ledger exactly once and the balances are exact. The consumer
//! commits offsets the default way, coalesced every 250 ms, so each kill also leaves applied
//! messages uncommitted: the next process re-reads them and the inbox skips them.

mod common;

use std::time::{Duration, Instant};

use common::*;
use inbox_core::Consumer;
use inbox_postgres::testkit::child;
use inbox_postgres::testkit::wallet::Credit;
use inbox_postgres::testkit::TestDb;

const EVENTS: usize = 400;
const PARTITIONS: i32 = 6;
const KILLS: i64 = 4;

/// The consumer process: runs until killed. Does nothing unless started by `child::spawn`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of hard_kill_mid_stream_applies_every_event_once"]
async fn kill_child_consumer() {
    if !child::is_child() {
        return;
    }
    let topic = std::env::var("TOPIC").expect("TOPIC");
    let group = std::env::var("GROUP").expect("GROUP");
    let db = TestDb::attach(&std::env::var("SCHEMA").expect("SCHEMA")).await;
    let handler = Credit::new(db.pool.clone()).work(Duration::from_millis(5));
    let consumer = Consumer::new("wallet", source(&topic, &group), db.inbox(), handler)
        .batch_size(20)
        .error_backoff(Duration::from_millis(200));
    let _ = consumer.run_until(std::future::pending::<()>()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_kill_mid_stream_applies_every_event_once() {
    let topic = topic(PARTITIONS).await;
    let group = random("group");
    let db = TestDb::new().await;
    let total = produce_credits(&topic, EVENTS, PARTITIONS).await;
    let envs = [
        ("TOPIC", topic.clone()),
        ("GROUP", group.clone()),
        ("SCHEMA", db.schema.clone()),
    ];
    let started = Instant::now();
    let mut kills = Vec::new();
    let mut child = child::spawn("kill_child_consumer", &envs);
    for k in 1..=KILLS {
        // Kill at fixed points of progress, so that every kill lands mid-stream.
        let target = k * EVENTS as i64 / (KILLS + 1);
        assert!(
            wait_for_events(&db.pool, target).await,
            "no progress to {target} events"
        );
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let at = summary(&db.pool).await;
        println!(
            "kill {k}: SIGKILLed at {} ledger rows ({:?})",
            at.ledger_rows,
            started.elapsed()
        );
        kills.push(at.ledger_rows);
        child = child::spawn("kill_child_consumer", &envs);
    }
    let done = wait_for_events(&db.pool, EVENTS as i64).await;
    let lag = wait_for_no_lag(&topic, &group, PARTITIONS).await;
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let summary = summary(&db.pool).await;
    let inbox_rows = db.inbox_rows().await;
    println!(
        "hard kill: {EVENTS} events, {} kills at {kills:?} rows, {:?}: {summary:?}, duplicates={}, lost={}, inbox rows={inbox_rows}, lag={lag}",
        kills.len(),
        started.elapsed(),
        summary.duplicates(),
        summary.lost(EVENTS as i64),
    );
    assert!(done, "not every event was applied: {summary:?}");
    assert_eq!(
        summary.ledger_rows, EVENTS as i64,
        "each event exactly once"
    );
    assert_eq!(summary.distinct_events, EVENTS as i64);
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(lag, 0, "everything committed in the end");
    db.drop().await;
}
