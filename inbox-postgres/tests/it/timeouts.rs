//! A hung handler or a hung peer no longer stalls a consumer: the handler timeout fails the
//! stuck call (and ends a statement it left waiting in PostgreSQL) and the lock timeout ends a
//! claim's wait on a peer's uncommitted row; the rest of the batch goes on and the stuck message
//! is retried.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_core::Transaction as _;
use std::time::{Duration, Instant};

use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::{database_url, TestDb};
use inbox_core::{Consumer, ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::PgInbox;
use inbox_testkit::eventually;
use inbox_testkit::fast_retry;
use inbox_testkit::MemoryBroker;
use sqlx::postgres::PgPoolOptions;

/// Longer than any test: a stalled handler is a hung one.
const HUNG: Duration = Duration::from_secs(3600);
/// How long a stalled consumer is given before the test calls it stalled.
const PATIENCE: Duration = Duration::from_secs(3);

/// Publishes `events` credits with IDs `<prefix>-<i>`; the one at index `stalled` (if any)
/// stalls on its first handling. Each run of a test uses its own prefix: a run given up on may
/// leave a statement waiting on a lock, holding the rows it inserted before it.
fn publish(broker: &MemoryBroker, prefix: &str, events: i64, stalled: Option<i64>) {
    for i in 0..events {
        let mut event = CreditEvent::new(1 + i % 3, i + 1);
        event.stall = Some(i) == stalled;
        broker.publish(Some(&format!("{prefix}-{i}")), event.to_json());
    }
}

#[tokio::test]
async fn a_hung_handler_is_cut_off_by_the_handler_timeout_and_its_message_retried() {
    let db = TestDb::new().await;

    // Without a handler timeout the consumer waits on the hung handler for ever.
    let broker = MemoryBroker::new();
    publish(&broker, "a", 10, Some(3));
    let stalled = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()).stall(HUNG),
    )
    .batch_size(10)
    .run_until_idle();
    assert!(
        tokio::time::timeout(PATIENCE, stalled).await.is_err(),
        "without a handler timeout the run should hang"
    );
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!(summary.ledger_rows, 0, "nothing committed while it hung");

    // Now with a timeout.
    let broker = MemoryBroker::new();
    publish(&broker, "b", 11, Some(3));
    let started = Instant::now();
    let stats = tokio::time::timeout(
        Duration::from_secs(30),
        Consumer::new(
            "wallet",
            broker.source(),
            db.inbox(),
            Credit::new(db.clone()).stall(HUNG),
        )
        .batch_size(11)
        .handler_timeout(Duration::from_millis(300))
        .retry(fast_retry(3))
        .run_until_idle(),
    )
    .await
    .expect("the handler timeout ends the hang")
    .unwrap();

    // The batch failed on its timeout, was split, and the hung message failed alone; its retry
    // (no longer its first handling) applied it.
    assert_eq!(stats.applied, 11, "{stats:?}");
    assert!(stats.commits >= 2, "the batch was split: {stats:?}");
    assert!(broker.dead_letters().is_empty());
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!((summary.ledger_rows, summary.distinct_events), (11, 11));
    assert!(summary.balances_exact);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_claim_behind_a_hung_peer_gives_up_after_the_lock_timeout() {
    let db = TestDb::new().await;
    // A peer that claimed a-1 and b-1 and hangs with its transaction open. Its pool is fresh:
    // it registers the consumer name before its transaction opens, so no other process
    // registering the name waits for the peer.
    let peer_pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url())
        .await
        .unwrap();
    let peer_store = PgInbox::new(peer_pool)
        .with_table(db.inbox().table().clone())
        .bind(&ConsumerBinding::new("wallet"));
    let mut peer = peer_store.begin().await.unwrap();
    let ids = [
        MessageId::new("a-1").unwrap(),
        MessageId::new("b-1").unwrap(),
    ];
    assert_eq!(
        peer_store.claim(&mut peer, &ids).await.unwrap(),
        [true, true]
    );

    // Without a lock timeout the claim of a-1 waits on the peer, and the batch with it.
    let broker = MemoryBroker::new();
    publish(&broker, "a", 5, None);
    let stalled = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(5)
    .run_until_idle();
    assert!(
        tokio::time::timeout(PATIENCE, stalled).await.is_err(),
        "without a lock timeout the run should wait on the peer"
    );
    assert_eq!(wallet::summary(&db).await.unwrap().ledger_rows, 0);

    let broker = MemoryBroker::new();
    publish(&broker, "b", 5, None);
    let stats = tokio::time::timeout(
        Duration::from_secs(30),
        Consumer::new(
            "wallet",
            broker.source(),
            db.inbox().lock_timeout(Duration::from_millis(200)),
            Credit::new(db.clone()),
        )
        .batch_size(5)
        .retry(fast_retry(2))
        .run_until_idle(),
    )
    .await
    .expect("the lock timeout ends the wait")
    .unwrap();

    // Everything but the peer's message applied; that one failed on the lock each time and was
    // dead-lettered with the reason, not applied behind the peer's back.
    let dead = broker.dead_letters();
    assert_eq!(stats.applied, 4, "{stats:?} {dead:?}");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0.id.as_ref().unwrap().as_str(), "b-1");
    assert!(dead[0].1.contains("lock timeout"), "{}", dead[0].1);
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!((summary.ledger_rows, summary.distinct_events), (4, 4));
    peer.rollback().await.unwrap();
}

#[tokio::test]
async fn a_handler_waiting_on_a_row_lock_is_cut_off_by_the_handler_timeout() {
    let db = TestDb::new().await;
    // Another session holds account 1's row for longer than the test runs.
    sqlx::query("INSERT INTO accounts (id, balance) VALUES (1, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM accounts WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    // The first message's handler waits on that row; the 19 after it credit account 2.
    let broker = MemoryBroker::new();
    wallet::publish_credit(&broker, "blocked", 1, 1);
    for i in 0..19 {
        wallet::publish_credit(&broker, &format!("free-{i}"), 2, 1);
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(1)
    .handler_timeout(Duration::from_millis(300))
    .retry(fast_retry(3));
    let stats = consumer.stats();
    let started = Instant::now();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    // The blocked message fails on its timeout three times and is dead-lettered; the lane goes
    // on while the lock is still held.
    let pool = db.clone();
    let all_applied = eventually(Duration::from_secs(15), || {
        let pool = pool.clone();
        async move { wallet::applied(&pool).await == 19 }
    })
    .await;
    let applied = wallet::applied(&db).await;
    assert!(
        all_applied,
        "{applied} of 19 messages applied in {:?} while a handler waited on a lock: {:?}",
        started.elapsed(),
        stats.snapshot()
    );
    eprintln!(
        "19 messages applied past the lock in {:?}",
        started.elapsed()
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0.id.as_ref().unwrap().as_str(), "blocked");
    assert!(dead[0].1.contains("timeout"), "{}", dead[0].1);

    // Stopping while a handler waits on the lock does not wait for the lock either: the
    // message is handed back, not applied.
    wallet::publish_credit(&broker, "blocked-again", 1, 1);
    let s = stats.clone();
    assert!(
        eventually(Duration::from_secs(10), || {
            let received = s.snapshot().received;
            async move { received == 21 }
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopping = Instant::now();
    stop.send(()).unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(10), run).await;
    assert!(
        stopped.is_ok(),
        "the consumer was still stopping after 10 s: it waits for the lock"
    );
    stopped.unwrap().unwrap().unwrap();
    eprintln!(
        "stopped in {:?} with a handler waiting on the lock",
        stopping.elapsed()
    );
    assert_eq!(broker.pending(), 1, "blocked-again is handed back");
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!((summary.ledger_rows, summary.distinct_events), (19, 19));

    holder.rollback().await.unwrap();
    db.drop().await;
}

/// A claim waiting on a peer's uncommitted row (the broker handed the message out again after a
/// visibility expiry or a rebalance while the peer still works on it) waits as long as the
/// store's own timeouts allow, not the handler timeout: it is not the handler's statement. Cut
/// off by the handler's bound, it would count as the message's failure and dead-letter it while
/// the peer goes on: here "freed" would never be applied, and "taken", which the peer commits,
/// would be both applied and parked.
#[tokio::test]
async fn a_claim_waiting_on_a_peer_is_not_cut_off_by_the_handler_timeout() {
    const HELD: Duration = Duration::from_secs(4);
    let db = TestDb::new().await;
    let peer_store = db.inbox().bind(&ConsumerBinding::new("wallet"));
    let mut freed_by = peer_store.begin().await.unwrap();
    let freed = MessageId::new("freed").unwrap();
    let claimed = peer_store.claim(&mut freed_by, std::slice::from_ref(&freed));
    assert_eq!(claimed.await.unwrap(), [true]);
    let mut taken_by = peer_store.begin().await.unwrap();
    let taken = MessageId::new("taken").unwrap();
    let claimed = peer_store.claim(&mut taken_by, std::slice::from_ref(&taken));
    assert_eq!(claimed.await.unwrap(), [true]);

    let broker = MemoryBroker::new();
    wallet::publish_credit(&broker, "freed", 1, 1);
    wallet::publish_credit(&broker, "taken", 1, 1);
    let run = tokio::spawn(
        Consumer::new(
            "wallet",
            broker.source(),
            db.inbox(),
            Credit::new(db.clone()),
        )
        .handler_timeout(Duration::from_millis(300))
        .run_until_idle(),
    );
    tokio::time::sleep(HELD).await;
    // The one peer gives up its claim, the other commits it.
    freed_by.rollback().await.unwrap();
    taken_by.commit().await.unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the run ends once the rows are free")
        .unwrap()
        .unwrap();

    let dead = broker.dead_letters();
    assert!(
        dead.is_empty(),
        "dead-lettered while a peer held the row: {:?}",
        dead.iter()
            .map(|(m, reason)| (m.id.as_ref().ok().map(MessageId::as_str), reason))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (1, 1),
        "{stats:?}"
    );
    assert_eq!(wallet::applied(&db).await, 1);
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!(
        summary.total_balance, 1,
        "freed applied once, taken by its peer"
    );
    db.drop().await;
}
