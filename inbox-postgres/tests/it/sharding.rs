//! A sharded inbox over two PostgreSQL clusters of the test's own, `inbox_shard_a` on
//! `INBOX_SHARD_A_PG_PORT` (default 5443) and `inbox_shard_b` on `INBOX_SHARD_B_PG_PORT`
//! (default 5444), made with Debian's `pg_createcluster` when missing: each credit is applied
//! once, in the database of its account's shard, and a restart of one shard mid-stream loses
//! and repeats nothing in either. Without `pg_ctlcluster` and root the test says so and skips.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_conformance::pg_cluster::{ClusterSettings, PgCluster};
use inbox_conformance::wallet::{self, publish_credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, Message, MessageId, Sharded, Stage, StageHook};
use inbox_testkit::MemoryBroker;

/// Even accounts live in shard 0, odd ones in shard 1.
fn by_account(_: &MessageId, m: &Message) -> usize {
    m.json::<CreditEvent>()
        .map_or(0, |e| usize::from(e.account_id % 2 != 0))
}

fn clusters() -> Result<(PgCluster, PgCluster), String> {
    let settings = ClusterSettings::default();
    Ok((
        PgCluster::up("inbox_shard_a", "INBOX_SHARD_A_PG_PORT", 5443, &settings)?,
        PgCluster::up("inbox_shard_b", "INBOX_SHARD_B_PG_PORT", 5444, &settings)?,
    ))
}

/// Accounts in `shard`'s ledger that belong to the other shard.
async fn strangers(db: &TestDb, shard: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE account_id % 2 <> $1")
        .bind(shard)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn each_credit_is_applied_once_in_its_shard_across_a_restart_of_one_shard() {
    let (a, b) = match clusters() {
        Ok(clusters) => clusters,
        Err(why) => {
            println!("skipped: no PostgreSQL clusters of its own: {why}");
            return;
        }
    };
    let (url_a, url_b) = (a.url("127.0.0.1", ""), b.url("127.0.0.1", ""));
    let (db_a, db_b) = (TestDb::at(&url_a).await, TestDb::at(&url_b).await);
    let store = Sharded::new(vec![db_a.inbox(), db_b.inbox()], by_account);

    let events: i64 = 300;
    let broker = MemoryBroker::new();
    for i in 0..events {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 1);
    }
    // Each published twice: the copy must be skipped in the shard that holds the claim.
    for i in (0..events).step_by(10) {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 1);
    }
    let shard_of = |i: i64| (i % 7) % 2;
    let in_b = (0..events).filter(|i| shard_of(*i) == 1).count() as i64;

    // After a third of the credits, shard 1's server restarts (every session terminated, the
    // transactions in flight rolled back) while shard 0 goes on.
    let b = Arc::new(b);
    let committed = Arc::new(AtomicU64::new(0));
    let restarted = Arc::new(AtomicBool::new(false));
    let restarter: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::default();
    let hook = {
        let (b, committed, restarted, restarter) = (
            b.clone(),
            committed.clone(),
            restarted.clone(),
            restarter.clone(),
        );
        StageHook::new(move |stage, _| {
            if stage == Stage::Committed
                && committed.fetch_add(1, Ordering::SeqCst) + 1 == events as u64 / 3
                && !restarted.swap(true, Ordering::SeqCst)
            {
                let b = b.clone();
                *restarter.lock().unwrap() = Some(std::thread::spawn(move || b.restart()));
            }
        })
    };
    let credit = wallet::Credit::new(db_a.clone()).work(Duration::from_millis(5));
    let run = Consumer::new("wallet", broker.source(), store, credit)
        .batch_size(10)
        .parallel_lanes(4)
        .error_backoff(Duration::from_millis(100))
        .on_stage(hook)
        .run_until_idle();
    let stats = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the consumer did not get through the queue")
        .unwrap();
    restarter
        .lock()
        .unwrap()
        .take()
        .expect("shard 1 was restarted")
        .join()
        .unwrap();

    // Fresh pools: shard 1's sessions were terminated by the restart.
    let check_a = TestDb::attach_at(&url_a, &db_a.schema).await;
    let check_b = TestDb::attach_at(&url_b, &db_b.schema).await;
    let (sum_a, sum_b) = (
        wallet::summary(&check_a).await.unwrap(),
        wallet::summary(&check_b).await.unwrap(),
    );
    println!("{stats:?}\nshard 0: {sum_a:?}\nshard 1: {sum_b:?}");
    assert_eq!(sum_a.duplicates() + sum_b.duplicates(), 0);
    assert_eq!(sum_a.lost(events - in_b), 0, "shard 0");
    assert_eq!(sum_b.lost(in_b), 0, "shard 1");
    assert!(sum_a.balances_exact && sum_b.balances_exact);
    assert_eq!(
        strangers(&check_a, 0).await,
        0,
        "shard 0 holds shard 1's credits"
    );
    assert_eq!(
        strangers(&check_b, 1).await,
        0,
        "shard 1 holds shard 0's credits"
    );
    assert!(
        stats.skipped_duplicates >= (events / 10) as u64,
        "{stats:?}"
    );
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending() + broker.in_flight(), 0);
    check_a.drop().await;
    check_b.drop().await;
}
