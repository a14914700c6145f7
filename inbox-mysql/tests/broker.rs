//! The MySQL store behind a real broker (Redis Streams, through the conformance suite's
//! `TestBroker`): duplicates, a crash at each stage of the algorithm, racing consumers, a
//! consumer that lost its message mid-handler, and the consumer process SIGKILLed again and
//! again. Each scenario is generic over the broker, so
//! another adapter runs them by instantiating them with its `TestBroker`.
//!
//! The kill scenario's size comes from `INBOX_KILLS` (default 4) and `INBOX_KILL_EVENTS`
//! (default 300), for longer runs by hand:
//! `INBOX_KILLS=50 INBOX_KILL_EVENTS=3000 cargo test -p inbox-mysql --test broker -- --nocapture killed`.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_conformance::mysql_wallet;
use inbox_conformance::redis::Redis;
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::{child, LosingSource, TestBroker, TestQueue};
use inbox_core::{
    async_trait, Capabilities, Consumer, Delivery, MessageId, MessageSource, SourceError, Stage,
};
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
        Consumer::new("wallet", source, inbox(&db), Credit::new(db.pool.clone())).run_until_idle()
    })
    .await;
    // The copies may still be on their way after the ledger is complete.
    let mut skipped: u64 = runs.iter().map(|s| s.skipped_duplicates).sum();
    let start = Instant::now();
    while skipped < 20 && start.elapsed() < LIMIT {
        let source = queue.source("c1").await;
        let stats = Consumer::new("wallet", source, inbox(&db), Credit::new(db.pool.clone()))
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
            crash.handler(Credit::new(db.pool.clone())),
        );
        let crashed = crash.run(consumer.run_until_idle()).await;
        assert!(
            matches!(&crashed, Err(c) if c.stage == stage),
            "{stage:?}: {crashed:?}"
        );
        let runs = drain(&queue, &db, "c1", 5, LIMIT, |source| {
            Consumer::new("wallet", source, inbox(&db), Credit::new(db.pool.clone()))
                .run_until_idle()
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
    let work = Credit::new(db.pool.clone()).work(Duration::from_millis(2));
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

/// A source that notes the ID of every message it delivers.
struct Noting<S> {
    inner: S,
    seen: Arc<Mutex<HashSet<MessageId>>>,
}

#[async_trait]
impl<S: MessageSource> MessageSource for Noting<S> {
    type Ack = S::Ack;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<S::Ack>>, SourceError> {
        let batch = self.inner.receive(max).await?;
        let mut seen = self.seen.lock().expect("seen IDs");
        seen.extend(batch.iter().filter_map(|d| d.message.id.clone().ok()));
        Ok(batch)
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// Member `zombie` stalls in its handler on a message, its claim uncommitted, while the broker
/// hands the message to member `b`. `b`'s claim waits on the zombie's row lock (the primary
/// key); the zombie commits, and `b` gets the duplicate key and skips its copy. The stalled
/// credit is in the ledger once.
async fn a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice<B: TestBroker>(
    broker: &B,
) {
    const OTHERS: i64 = 5;
    let db = wallet_db().await;
    let queue = broker.queue("mysql-zombie").await;
    let Some(LosingSource { source, stall }) = queue.losing_source("zombie").await else {
        println!("zombie: skipped: this broker cannot take a message away reliably");
        queue.cleanup().await;
        db.drop().await;
        return;
    };
    let stalled = MessageId::generate();
    let event = CreditEvent {
        stall: true,
        ..CreditEvent::new(1, 1000)
    };
    queue.send(Some(stalled.as_str()), &event.to_json()).await;
    for i in 0..OTHERS {
        let id = MessageId::generate();
        queue
            .send(Some(id.as_str()), &CreditEvent::new(2, i + 1).to_json())
            .await;
    }
    let handler = Credit::new(db.pool.clone()).stall(stall);
    let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
    let zombie = Consumer::new("wallet", source, inbox(&db), handler.clone())
        .batch_size(1)
        .run_until(async {
            let _ = stopping.await;
        });
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let mut skipped = 0;
    let others = async {
        let start = Instant::now();
        while mysql_wallet::stalls(&db.pool).await.expect("stalls") == 0 {
            assert!(start.elapsed() < LIMIT, "the zombie never stalled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        queue.take_away("zombie").await;
        loop {
            let source = Noting {
                inner: queue.source("b").await,
                seen: Arc::clone(&seen),
            };
            let stats = Consumer::new("wallet", source, inbox(&db), handler.clone())
                .run_until_idle()
                .await
                .expect("member b");
            skipped += stats.skipped_duplicates;
            let applied = summary(&db.pool).await.distinct_events;
            if seen.lock().expect("seen").contains(&stalled) && applied == OTHERS + 1 {
                break;
            }
            assert!(start.elapsed() < LIMIT, "not drained: {applied}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = stop.send(());
    };
    let (zombie, ()) = tokio::join!(zombie, others);
    let s = summary(&db.pool).await;
    let left = left(&queue).await;
    println!("zombie on MySQL: stalled {stall:?}; the zombie: {zombie:?}; b skipped {skipped}; {s:?}; left {left}");
    assert_eq!(
        mysql_wallet::rows_of(&db.pool, &stalled)
            .await
            .expect("rows"),
        1,
        "the stalled credit applied once"
    );
    assert!(
        seen.lock().expect("seen").contains(&stalled),
        "the broker handed the stalled message to the second member"
    );
    assert!(skipped >= 1, "and the second member skipped it");
    assert_eq!((s.ledger_rows, s.distinct_events), (OTHERS + 1, OTHERS + 1));
    assert!(s.balances_exact);
    assert_eq!(left, 0);
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
        Consumer::new(
            "wallet",
            source,
            inbox(&db),
            Credit::new(db.pool.clone()).work(WORK),
        )
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
        Credit::new(db.pool.clone()).work(WORK),
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
async fn redis_a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice() {
    a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice(&Redis).await;
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
