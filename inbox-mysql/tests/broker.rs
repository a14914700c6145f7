//! The MySQL store behind a real broker (Redis Streams, through the conformance suite's
//! `TestBroker`): duplicates, a crash at each stage of the algorithm, racing consumers, and the
//! consumer process SIGKILLed again and again. Each scenario is generic over the broker, so
//! another adapter runs them by instantiating them with its `TestBroker`.
//!
//! The kill scenario's size comes from `INBOX_KILLS` (default 4) and `INBOX_KILL_EVENTS`
//! (default 300), for longer runs by hand:
//! `INBOX_KILLS=50 INBOX_KILL_EVENTS=3000 cargo test -p inbox-mysql --test broker -- --nocapture killed`.

mod common;

use std::time::{Duration, Instant};

use inbox_conformance::redis::Redis;
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::{child, TestBroker, TestQueue};
use inbox_core::{Consumer, MessageId, Stage};
use inbox_testkit::Crash;

use common::{drain, inbox, left, summary, wallet_db, Credit, ACCOUNTS};

const LIMIT: Duration = Duration::from_secs(120);

/// Each message twice under the same ID: applied once, the copy skipped, nothing left.
async fn the_same_id_twice_is_applied_once<B: TestBroker>(broker: &B) {
    let db = wallet_db().await;
    let queue = broker.queue("mysql-twice").await;
    for i in 0..20 {
        let id = MessageId::generate();
        let event = CreditEvent::new(1 + i % ACCOUNTS, i + 1).to_json();
        queue.send(Some(id.as_str()), &event).await;
        queue.send(Some(id.as_str()), &event).await;
    }
    let runs = drain(&queue, &db, "c1", 20, LIMIT, |source| {
        Consumer::new("wallet", source, inbox(&db), Credit::default()).run_until_idle()
    })
    .await;
    // The copies may still be on their way after the ledger is complete.
    let mut skipped: u64 = runs.iter().map(|s| s.skipped_duplicates).sum();
    let start = Instant::now();
    while skipped < 20 && start.elapsed() < LIMIT {
        let source = queue.source("c1").await;
        let stats = Consumer::new("wallet", source, inbox(&db), Credit::default())
            .run_until_idle()
            .await
            .expect("consumer");
        skipped += stats.skipped_duplicates;
    }
    let s = summary(&db.pool).await;
    println!("the same ID twice: {s:?}, skipped {skipped}");
    assert_eq!((s.ledger_rows, s.distinct_events), (20, 20));
    assert_eq!(skipped, 20, "every copy skipped");
    assert_eq!(s.total_balance, (1..=20).sum::<i64>());
    assert!(s.balances_exact);
    assert_eq!(left(&queue).await, 0);
    queue.cleanup().await;
    db.drop().await;
}

/// The consumer dies after the claim, after the handler, after the commit (before the ack) and
/// after the ack; its restarts lose nothing and apply nothing twice.
async fn a_crash_at_each_stage_loses_nothing_and_applies_nothing_twice<B: TestBroker>(broker: &B) {
    for stage in [
        Stage::Claimed,
        Stage::Applied,
        Stage::Committed,
        Stage::Acked,
    ] {
        let db = wallet_db().await;
        let queue = broker
            .queue(&format!("mysql-crash-{stage:?}").to_lowercase())
            .await;
        for amount in [10, 20, 30, 40, 50] {
            let id = MessageId::generate();
            queue
                .send(Some(id.as_str()), &CreditEvent::new(1, amount).to_json())
                .await;
        }
        let crash = Crash::at(stage);
        let consumer = Consumer::new(
            "wallet",
            crash.source(queue.source("c1").await),
            crash.store(inbox(&db)),
            crash.handler(Credit::default()),
        );
        let crashed = crash.run(consumer.run_until_idle()).await;
        assert!(
            matches!(&crashed, Err(c) if c.stage == stage),
            "{stage:?}: {crashed:?}"
        );
        let runs = drain(&queue, &db, "c1", 5, LIMIT, |source| {
            Consumer::new("wallet", source, inbox(&db), Credit::default()).run_until_idle()
        })
        .await;
        let s = summary(&db.pool).await;
        let left = left(&queue).await;
        println!("crash at {stage:?}: {s:?}, left {left}, runs {runs:?}");
        assert_eq!((s.ledger_rows, s.distinct_events), (5, 5), "{stage:?}");
        assert_eq!(s.total_balance, 150, "{stage:?}");
        assert_eq!(left, 0, "{stage:?}");
        queue.cleanup().await;
        db.drop().await;
    }
}

/// Two members consume one queue at once, each in its own transactions on the same inbox:
/// every event applied once.
async fn racing_consumers_apply_each_id_once<B: TestBroker>(broker: &B) {
    let db = wallet_db().await;
    let queue = broker.queue("mysql-race").await;
    const EVENTS: i64 = 200;
    for i in 0..EVENTS {
        let id = MessageId::generate();
        let event = CreditEvent::new(1 + i % ACCOUNTS, i + 1).to_json();
        queue.send(Some(id.as_str()), &event).await;
        // Every fifth event twice: the copies race too.
        if i % 5 == 0 {
            queue.send(Some(id.as_str()), &event).await;
        }
    }
    let work = Credit {
        work: Duration::from_millis(2),
    };
    let (a, b) = (queue.source("c1").await, queue.source("c2").await);
    let (one, two) = tokio::join!(
        Consumer::new("wallet", a, inbox(&db), work.clone())
            .batch_size(10)
            .run_until_idle(),
        Consumer::new("wallet", b, inbox(&db), work.clone())
            .batch_size(10)
            .run_until_idle(),
    );
    println!("racing: {one:?}; {two:?}");
    drain(&queue, &db, "c1", EVENTS, LIMIT, |source| {
        Consumer::new("wallet", source, inbox(&db), work.clone()).run_until_idle()
    })
    .await;
    let s = summary(&db.pool).await;
    println!("racing consumers: {s:?}");
    assert_eq!((s.ledger_rows, s.distinct_events), (EVENTS, EVENTS));
    assert_eq!(s.total_balance, (1..=EVENTS).sum::<i64>());
    assert!(s.balances_exact);
    assert_eq!(left(&queue).await, 0);
    queue.cleanup().await;
    db.drop().await;
}

fn env_number(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|e| panic!("{name}={v}: {e}")))
        .unwrap_or(default)
}

/// Each message's handler sleeps this long, so that kills land mid-stream.
const WORK: Duration = Duration::from_millis(5);

/// The consumer runs as a child process (this test binary again, running only
/// `kill_child`), is SIGKILLed once it applied a share of the events, and again, each restart a
/// new member; then a last consumer drains. Every event is in the ledger exactly once.
async fn a_consumer_process_killed_again_and_again_loses_and_repeats_nothing<B: TestBroker>(
    broker: &B,
) {
    let events = env_number("INBOX_KILL_EVENTS", 300);
    let kills = env_number("INBOX_KILLS", 4);
    let db = wallet_db().await;
    let queue = broker.queue("mysql-kill").await;
    let mut expected_total = 0;
    for i in 0..events {
        expected_total += i + 1;
        let event = CreditEvent::new(1 + i % ACCOUNTS, i + 1);
        queue
            .send(Some(MessageId::generate().as_str()), &event.to_json())
            .await;
    }
    let started = Instant::now();
    for kill in 1..=kills {
        let mut process = child::spawn(
            "kill_child",
            &[
                ("INBOX_MYSQL_DB", db.name.clone()),
                ("INBOX_QUEUE", queue.name()),
                ("INBOX_MEMBER", format!("killed-{kill}")),
            ],
        );
        // Killed once it made progress of its own, so that each kill lands mid-stream.
        let target = kill * events / (kills + 2);
        let deadline = Instant::now() + LIMIT;
        loop {
            let done = summary(&db.pool).await.distinct_events;
            if done >= target {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "kill {kill}: no progress: {done} of {target} applied"
            );
            if let Ok(Some(status)) = process.try_wait() {
                panic!("the consumer process exited by itself: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A random extra moment, so that kills also land between a commit and its ack.
        tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 40)).await;
        process.kill().expect("SIGKILL");
        process.wait().expect("reap");
        let s = summary(&db.pool).await;
        println!(
            "kill {kill}: {} of {events} events applied, {} ledger rows",
            s.distinct_events, s.ledger_rows
        );
    }
    let killing = started.elapsed();
    let runs = drain(&queue, &db, "survivor", events, LIMIT, |source| {
        Consumer::new("wallet", source, inbox(&db), Credit { work: WORK })
            .batch_size(5)
            .run_until_idle()
    })
    .await;
    let s = summary(&db.pool).await;
    let left = left(&queue).await;
    let (duplicates, lost) = (
        s.ledger_rows - s.distinct_events,
        events - s.distinct_events,
    );
    println!(
        "hard kill on MySQL: {events} events, {kills} kills in {killing:?}; {duplicates} duplicates, \
         {lost} lost; {s:?}; expected total {expected_total}; left {left}; the last consumer: {runs:?}"
    );
    assert_eq!((duplicates, lost), (0, 0));
    assert!(s.balances_exact);
    assert_eq!(s.total_balance, expected_total);
    assert_eq!(left, 0);
    queue.cleanup().await;
    db.drop().await;
}

/// The consumer process of the kill scenario: runs until it is killed, and only in a process
/// the scenario started.
async fn consumer_process<B: TestBroker>(broker: &B) {
    if !child::is_child() {
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let db = MySqlDb::attach(&var("INBOX_MYSQL_DB")).await;
    let queue = broker.attach(&var("INBOX_QUEUE")).await;
    Consumer::new(
        "wallet",
        queue.source(&var("INBOX_MEMBER")).await,
        inbox(&db),
        Credit { work: WORK },
    )
    .batch_size(5)
    .run()
    .await
    .expect("consumer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_the_same_id_twice_is_applied_once() {
    the_same_id_twice_is_applied_once(&Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_crash_at_each_stage_loses_nothing_and_applies_nothing_twice() {
    a_crash_at_each_stage_loses_nothing_and_applies_nothing_twice(&Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_racing_consumers_apply_each_id_once() {
    racing_consumers_apply_each_id_once(&Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_consumer_process_killed_again_and_again_loses_and_repeats_nothing() {
    if child::is_child() {
        return;
    }
    a_consumer_process_killed_again_and_again_loses_and_repeats_nothing(&Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the consumer process of the kill scenario; runs only as its child"]
async fn kill_child() {
    consumer_process(&Redis).await;
}
