//! SIGTERM, as Kubernetes or ECS sends it before a SIGKILL: the consumer process stops
//! receiving, finishes (or, past its shutdown timeout, hands back) the batch in flight, and exits
//! by itself in time; a second signal cuts the wait short. Afterwards a drain shows every event
//! applied exactly once.

use crate::common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::{child, TestDb};
use inbox_core::{Consumer, MessageId, Publish};

const EVENTS: i64 = 200;
const ACCOUNTS: i64 = 5;
const WORK: Duration = Duration::from_millis(10);
const CLAIM_IDLE: Duration = Duration::from_millis(1500);
/// A stalled event's first handling: a hung call.
const HUNG: Duration = Duration::from_secs(3600);

/// The consumer process: `Consumer::run`, which listens for SIGINT and SIGTERM.
#[tokio::test]
#[ignore = "the consumer process of the shutdown tests; runs only as their child"]
async fn shutdown_child() {
    if !child::is_child() {
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let db = TestDb::attach(&var("INBOX_SCHEMA")).await;
    let timeout = Duration::from_millis(var("INBOX_SHUTDOWN_MS").parse().expect("a number"));
    let source = builder(&var("INBOX_STREAM"), "child")
        .claim_idle(CLAIM_IDLE)
        .connect()
        .await
        .expect("connect");
    let handler = Credit::new(db.clone()).work(WORK).stall(HUNG);
    Consumer::new("wallet", source, db.inbox(), handler)
        .batch_size(10)
        .shutdown_timeout(timeout)
        .run()
        .await
        .expect("the consumer returns without an error");
}

/// Publishes the events, one of them (`stalled`) stalling on its first handling.
async fn publish(stream: &str, stalled: Option<i64>) -> i64 {
    let producer = producer().await;
    let mut total = 0;
    for i in 0..EVENTS {
        let mut event = CreditEvent::new(1 + i % ACCOUNTS, i + 1);
        event.stall = Some(i) == stalled;
        total += event.amount;
        producer
            .send_with_id(stream, &MessageId::generate(), event.to_json().as_slice())
            .await
            .expect("send");
    }
    // The group exists before the child starts.
    drop(source(stream, "setup").await);
    total
}

fn start(db: &TestDb, stream: &str, shutdown: Duration) -> Child {
    child::spawn(
        "shutdown_child",
        &[
            ("INBOX_SCHEMA", db.schema.clone()),
            ("INBOX_STREAM", stream.to_owned()),
            ("INBOX_SHUTDOWN_MS", shutdown.as_millis().to_string()),
        ],
    )
}

fn sigterm(process: &Child) {
    let sent = Command::new("kill")
        .args(["-TERM", &process.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(sent.success());
}

/// Waits until `ready` says so, failing after 60 s or if the child exits first.
async fn wait_for(process: &mut Child, what: &str, mut ready: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        if let Ok(Some(status)) = process.try_wait() {
            panic!("the consumer exited before {what}: {status}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for the child to exit; its exit status and how long it took after `since`.
async fn exit(process: &mut Child, since: Instant) -> (std::process::ExitStatus, Duration) {
    loop {
        if let Some(status) = process.try_wait().expect("wait") {
            return (status, since.elapsed());
        }
        if since.elapsed() > Duration::from_secs(60) {
            process.kill().expect("SIGKILL");
            panic!("the consumer did not exit within 60 s of SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn stalls(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM wallet_stalls")
        .fetch_one(&db.pool)
        .await
        .expect("count")
}

/// Applies what is left (taking the child's pending entries over after `CLAIM_IDLE`) and checks
/// that every event is in the ledger exactly once.
async fn drain_and_check(db: &TestDb, stream: &str, total: i64) {
    let source = builder(stream, "drain")
        .claim_idle(CLAIM_IDLE)
        .connect()
        .await
        .expect("connect");
    let pool = db.clone();
    let watched = stream.to_owned();
    let done = async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let summary = wallet::summary(&pool).await.expect("summary");
            if summary.distinct_events >= EVENTS && pending(&watched).await == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(50)
        .run_until(done)
        .await
        .expect("drain");
    let summary = wallet::summary(db).await.expect("summary");
    assert_eq!(summary.distinct_events, EVENTS, "lost: {summary:?}");
    assert_eq!(summary.ledger_rows, EVENTS, "applied twice: {summary:?}");
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(pending(stream).await, 0);
}

#[tokio::test]
async fn sigterm_mid_stream_finishes_the_batch_in_flight_and_exits() {
    if child::is_child() {
        return;
    }
    let db = TestDb::new().await;
    let stream = stream_key("sigterm");
    let total = publish(&stream, None).await;
    let mut process = start(&db, &stream, Duration::from_secs(10));
    let pool = db.clone();
    wait_for(&mut process, "some progress", async || {
        wallet::summary(&pool)
            .await
            .expect("summary")
            .distinct_events
            >= 30
    })
    .await;
    let signalled = Instant::now();
    sigterm(&process);
    let (status, took) = exit(&mut process, signalled).await;
    let applied = wallet::summary(&db).await.expect("summary");
    println!("SIGTERM: exited {status} after {took:?}, {applied:?}");
    assert!(status.success(), "{status}");
    // The batch in flight is 10 messages of 10 ms.
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(applied.distinct_events < EVENTS, "stopped mid-stream");
    drain_and_check(&db, &stream, total).await;
    cleanup(&stream).await;
    db.drop().await;
}

#[tokio::test]
async fn sigterm_with_a_hung_handler_hands_its_batch_back_at_the_shutdown_timeout() {
    if child::is_child() {
        return;
    }
    let db = TestDb::new().await;
    let stream = stream_key("sigterm-hung");
    let total = publish(&stream, Some(25)).await;
    let timeout = Duration::from_secs(2);
    let mut process = start(&db, &stream, timeout);
    wait_for(&mut process, "the handler to hang", async || {
        stalls(&db).await == 1
    })
    .await;
    let signalled = Instant::now();
    sigterm(&process);
    let (status, took) = exit(&mut process, signalled).await;
    println!("SIGTERM with a hung handler: exited {status} after {took:?} (timeout {timeout:?})");
    assert!(status.success(), "{status}");
    assert!(took >= timeout, "waited for the timeout: {took:?}");
    assert!(took < timeout + Duration::from_secs(3), "{took:?}");
    drain_and_check(&db, &stream, total).await;
    cleanup(&stream).await;
    db.drop().await;
}

#[tokio::test]
async fn a_second_sigterm_cuts_the_wait_short() {
    if child::is_child() {
        return;
    }
    let db = TestDb::new().await;
    let stream = stream_key("sigterm-twice");
    let total = publish(&stream, Some(25)).await;
    let mut process = start(&db, &stream, Duration::from_secs(60));
    wait_for(&mut process, "the handler to hang", async || {
        stalls(&db).await == 1
    })
    .await;
    let signalled = Instant::now();
    sigterm(&process);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sigterm(&process);
    let (status, took) = exit(&mut process, signalled).await;
    println!("two SIGTERMs: exited {status} after {took:?}");
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    drain_and_check(&db, &stream, total).await;
    cleanup(&stream).await;
    db.drop().await;
}
