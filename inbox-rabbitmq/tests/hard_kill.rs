//! The consumer process is SIGKILLed mid-stream, again and again, and restarted: every event
//! lands in the ledger exactly once.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use inbox_core::Consumer;
use inbox_postgres::testkit::wallet::{self, Credit};
use inbox_postgres::testkit::{child, TestDb};
use inbox_rabbitmq::{RabbitConfig, RabbitSource};

const EVENTS: i64 = 400;
const KILLS: usize = 5;
const CHILD: &str = "kill_child_consumer";

/// The consumer process of the kill test: does nothing unless started by it.
#[tokio::test]
#[ignore = "the child process of hard_kill_mid_stream_applies_every_event_once"]
async fn kill_child_consumer() {
    if !child::is_child() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let queue = std::env::var("KILL_QUEUE").expect("KILL_QUEUE");
    let schema = std::env::var("KILL_SCHEMA").expect("KILL_SCHEMA");
    let db = TestDb::attach(&schema).await;
    let config = RabbitConfig::new(amqp_url(), queue).prefetch(20);
    let source = RabbitSource::connect(config).await.expect("child connects");
    let handler = Credit::new(db.pool.clone()).work(Duration::from_millis(5));
    // Runs until killed.
    let _ = Consumer::new("wallet", source, db.inbox(), handler)
        .batch_size(10)
        .run()
        .await;
}

#[tokio::test]
async fn hard_kill_mid_stream_applies_every_event_once() {
    if child::is_child() {
        return;
    }
    let config = fresh_config("kill");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    let mut expected_total = 0;
    for i in 0..EVENTS {
        let amount = 1 + i % 17;
        publisher
            .publish(&credit(1 + i % 10, amount))
            .await
            .unwrap();
        expected_total += amount;
    }
    publisher.close().await;

    let envs = [
        ("KILL_QUEUE", config.queue().to_owned()),
        ("KILL_SCHEMA", db.schema.clone()),
    ];
    let mut kills = 0;
    for round in 0..KILLS {
        let before = wallet::summary(&db.pool).await.unwrap().distinct_events;
        let mut process = child::spawn(CHILD, &envs);
        // Kill it mid-stream: once it has applied something, a little later.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while wallet::summary(&db.pool).await.unwrap().distinct_events == before
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let wait = Duration::from_millis(250 + 150 * (round as u64 % 4));
        tokio::time::sleep(wait).await;
        process.kill().expect("SIGKILL the child");
        let _ = process.wait();
        kills += 1;
        let summary = wallet::summary(&db.pool).await.unwrap();
        println!(
            "kill {kills}: {wait:?} after its first commit, {} distinct events applied, {} ledger rows",
            summary.distinct_events, summary.ledger_rows
        );
    }

    // A last, clean consumer finishes the queue.
    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let handler = Credit::new(db.pool.clone()).work(Duration::from_millis(5));
    let stats = Consumer::new("wallet", source, db.inbox(), handler)
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();

    let summary = wallet::summary(&db.pool).await.unwrap();
    let left = left_on(config.queue()).await;
    let parked = drain(&config.dead_letter_queue()).await.len();
    println!(
        "hard kill: {kills} kills, final consumer {stats:?}\n  {summary:?}, left on queue {left}, dead-lettered {parked}"
    );
    assert_eq!(kills, KILLS);
    assert_eq!(summary.distinct_events, EVENTS, "no event lost");
    assert_eq!(summary.ledger_rows, EVENTS, "no event applied twice");
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, expected_total);
    assert_eq!(left, 0);
    assert_eq!(parked, 0);
    cleanup(&config).await;
    db.drop().await;
}
