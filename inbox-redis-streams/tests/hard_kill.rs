//! The consumer process is SIGKILLed mid-stream, again and again, and restarted under a new
//! consumer name each time, so the dead processes' pending entries come back only through
//! `XAUTOCLAIM`. In the end every event is in the ledger exactly once.

mod common;

use std::time::{Duration, Instant};

use common::*;
use inbox_core::{Consumer, MessageId};
use inbox_postgres::testkit::wallet::{self, Credit, CreditEvent};
use inbox_postgres::testkit::{child, TestDb};

const EVENTS: i64 = 400;
const KILLS: i64 = 5;
const ACCOUNTS: i64 = 7;
const CLAIM_IDLE: Duration = Duration::from_millis(1500);
const WORK: Duration = Duration::from_millis(5);

fn consumer_source(stream: &str, name: &str) -> inbox_redis_streams::RedisStreamBuilder {
    builder(stream, name).claim_idle(CLAIM_IDLE)
}

/// The consumer process. Not a test of its own: `hard_kill` starts it with `INBOX_CHILD=1`.
#[tokio::test]
#[ignore = "the consumer process of hard_kill; runs only as its child"]
async fn hard_kill_child() {
    if !child::is_child() {
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let (schema, stream, name) = (
        var("INBOX_SCHEMA"),
        var("INBOX_STREAM"),
        var("INBOX_CONSUMER"),
    );
    let db = TestDb::attach(&schema).await;
    let source = consumer_source(&stream, &name)
        .connect(&redis_url())
        .await
        .expect("connect");
    let handler = Credit::new(db.pool.clone()).work(WORK);
    // Runs until the parent kills it.
    Consumer::new("wallet", source, db.inbox(), handler)
        .batch_size(5)
        .run()
        .await
        .expect("consumer");
}

#[tokio::test]
async fn hard_kill() {
    if child::is_child() {
        return;
    }
    let db = TestDb::new().await;
    let stream = stream_key("hard-kill");
    let producer = producer(&stream).await;
    let mut expected_total = 0;
    for i in 0..EVENTS {
        let amount = i + 1;
        expected_total += amount;
        let event = CreditEvent::new(1 + i % ACCOUNTS, amount);
        producer
            .send_with_id(&MessageId::generate(), event.to_json())
            .await
            .expect("send");
    }
    // Create the group before any child, so `lag` is readable from the start.
    drop(source(&stream, "setup").await);

    let deadline = Instant::now() + Duration::from_secs(90);
    for kill in 1..=KILLS {
        let name = format!("killed-{kill}");
        let mut process = child::spawn(
            "hard_kill_child",
            &[
                ("INBOX_SCHEMA", db.schema.clone()),
                ("INBOX_STREAM", stream.clone()),
                ("INBOX_CONSUMER", name.clone()),
            ],
        );
        // Kill once this process has made some progress of its own, so each kill lands mid-stream.
        let target = kill * EVENTS / (KILLS + 2);
        loop {
            let done = wallet::summary(&db.pool)
                .await
                .expect("summary")
                .distinct_events;
            if done >= target {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no progress: {done} of {target} applied"
            );
            if let Ok(Some(status)) = process.try_wait() {
                panic!("consumer {name} exited by itself: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A random extra moment, so kills also land between a commit and its XACK.
        let jitter = (uuid::Uuid::new_v4().as_u128() % 40) as u64;
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        process.kill().expect("SIGKILL");
        process.wait().expect("reap");
        let summary = wallet::summary(&db.pool).await.expect("summary");
        println!(
            "kill {kill} ({name}): {} of {EVENTS} events applied, {} ledger rows, {} entries pending",
            summary.distinct_events,
            summary.ledger_rows,
            pending(&stream).await
        );
    }

    // The last restart, in this process, again under a new name: whatever the killed ones left
    // pending it can only get through XAUTOCLAIM.
    let source = consumer_source(&stream, "survivor")
        .connect(&redis_url())
        .await
        .expect("connect");
    let consumer = Consumer::new(
        "wallet",
        source,
        db.inbox(),
        Credit::new(db.pool.clone()).work(WORK),
    )
    .batch_size(5);
    let stats = consumer.stats();
    let pool = db.pool.clone();
    let watched = stream.clone();
    let done = async move {
        loop {
            let summary = wallet::summary(&pool).await.expect("summary");
            if summary.distinct_events >= EVENTS
                && pending(&watched).await == 0
                && lag(&watched).await == 0
            {
                return;
            }
            if Instant::now() > deadline {
                println!("timed out: {summary:?}");
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    consumer.run_until(done).await.expect("survivor");
    let survivor = stats.snapshot();

    let summary = wallet::summary(&db.pool).await.expect("summary");
    let left = pending(&stream).await;
    println!(
        "hard kill: {EVENTS} events, {KILLS} kills; survivor received {}, applied {}, skipped {} duplicates; {summary:?}; expected total {expected_total}; pending {left}",
        survivor.received, survivor.applied, survivor.skipped_duplicates
    );
    assert_eq!(summary.distinct_events, EVENTS, "every event applied");
    assert_eq!(summary.ledger_rows, EVENTS, "none twice");
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, expected_total);
    assert_eq!(left, 0);
    cleanup(&stream).await;
    db.drop().await;
}
