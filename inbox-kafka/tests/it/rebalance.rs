//! Group membership changing under a running stream: a member joining and another leaving, and a
//! zombie evicted for exceeding `max.poll.interval.ms` that still writes.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::wallet::{Credit, CreditEvent, Summary};
use inbox_conformance::TestDb;
use inbox_core::{InboxStore, OutgoingMessage};
use inbox_postgres::PgTx;
use inbox_testkit::WithoutInbox;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_and_another_leaving_lose_and_duplicate_nothing() {
    const EVENTS: usize = 300;
    const PARTITIONS: i32 = 6;
    let topic = topic(PARTITIONS).await;
    let group = random("group");
    let db = TestDb::new().await;
    let total = produce_credits(&topic, EVENTS, PARTITIONS).await;
    let handler = || Credit::new(db.clone()).work(Duration::from_millis(10));

    let started = Instant::now();
    let first = Running::start(
        "wallet",
        source(&topic, &group).await,
        db.inbox(),
        handler(),
        10,
    );
    assert!(wait_for_events(&db, 60).await);
    let second = Running::start(
        "wallet",
        source(&topic, &group).await,
        db.inbox(),
        handler(),
        10,
    );
    println!(
        "second member joined at {} events ({:?})",
        summary(&db).await.distinct_events,
        started.elapsed()
    );
    // Wait until the second member has applied something: the group rebalanced onto it. Events
    // keep coming meanwhile, one per partition every 200 ms: on Tansu a join has taken longer
    // than the first member needs for the whole backlog, and a member that joins a drained
    // topic has nothing to apply.
    let (producer, mut events, mut total) = (producer().await, EVENTS, total);
    let deadline = Instant::now() + WAIT;
    while second.stats.snapshot().applied == 0 {
        assert!(
            Instant::now() < deadline,
            "the second member never got a partition"
        );
        let more = events..events + PARTITIONS as usize;
        total += produce_credit_range(&producer, &topic, more, PARTITIONS).await;
        events += PARTITIONS as usize;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let first_stats = first.stop().await.expect("first member");
    println!(
        "first member left at {} events ({:?})",
        summary(&db).await.distinct_events,
        started.elapsed()
    );
    assert!(
        wait_for_events(&db, events as i64).await,
        "not every event applied"
    );
    let lag = wait_for_no_lag(&topic, &group, PARTITIONS).await;
    let second_stats = second.stop().await.expect("second member");
    let summary = summary(&db).await;
    println!("rebalance: first={first_stats:?} second={second_stats:?} {summary:?} duplicates={} lost={} lag={lag}", summary.duplicates(), summary.lost(events as i64));
    assert!(
        first_stats.applied > 0 && second_stats.applied > 0,
        "both members worked"
    );
    assert_eq!(summary.ledger_rows, events as i64);
    assert_eq!(summary.distinct_events, events as i64);
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(lag, 0);
    db.drop().await;
}

const ZOMBIE_EVENTS: usize = 60;
const STALLS: usize = 2;

/// Two members; a few events stall their handler past `max.poll.interval.ms` on first handling,
/// so their member is evicted, the other re-reads the partition, and the zombie still commits.
async fn zombie_run<St, F>(db: &TestDb, store: F) -> (Summary, u64)
where
    St: InboxStore<Tx = PgTx>,
    F: Fn() -> St,
{
    const PARTITIONS: i32 = 3;
    let topic = topic(PARTITIONS).await;
    let group = random("group");
    let producer = producer().await;
    for i in 0..ZOMBIE_EVENTS {
        let mut event = CreditEvent::new((i % 5 + 1) as i64, 10);
        event.stall = i % (ZOMBIE_EVENTS / STALLS) == 7;
        let credit = OutgoingMessage::generate(event.to_json());
        let partition = Some(i as i32 % PARTITIONS);
        producer
            .send_to(&topic, partition, &credit)
            .await
            .expect("produce");
    }
    let member = || async {
        let source = config(&topic, &group)
            .set_consumer("max.poll.interval.ms", "6000")
            .connect()
            .await
            .expect("source");
        let handler = Credit::new(db.clone()).stall(Duration::from_secs(10));
        Running::start("wallet", source, store(), handler, 5)
    };
    let (a, b) = (member().await, member().await);
    let stalls_done = eventually(|| async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM wallet_stalls")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
            >= STALLS as i64
    })
    .await;
    assert!(stalls_done, "the stalling events were never handled");
    assert!(
        wait_for_events(db, ZOMBIE_EVENTS as i64).await,
        "not every event applied"
    );
    // The zombies finish their stall (10 s) after the new owners re-read; wait for both writes.
    tokio::time::sleep(Duration::from_secs(14)).await;
    let (sa, sb) = (a.stop().await.expect("a"), b.stop().await.expect("b"));
    let skipped = sa.skipped_duplicates + sb.skipped_duplicates;
    println!("zombie members: a={sa:?} b={sb:?}");
    (summary(db).await, skipped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_write_is_harmless_with_the_inbox() {
    let db = TestDb::new().await;
    let (summary, skipped) = zombie_run(&db, || db.inbox()).await;
    println!(
        "zombie with inbox: {summary:?} duplicates={} skipped={skipped}",
        summary.duplicates()
    );
    assert_eq!(
        summary.ledger_rows, ZOMBIE_EVENTS as i64,
        "one ledger row per event"
    );
    assert_eq!(summary.distinct_events, ZOMBIE_EVENTS as i64);
    assert!(summary.balances_exact);
    assert!(
        skipped >= STALLS as u64,
        "the re-read copies of the stalled events were skipped"
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_write_duplicates_without_the_inbox() {
    let db = TestDb::new().await;
    let (summary, _) = zombie_run(&db, || WithoutInbox(db.inbox())).await;
    println!(
        "zombie without inbox: {summary:?} duplicates={}",
        summary.duplicates()
    );
    assert_eq!(summary.distinct_events, ZOMBIE_EVENTS as i64);
    assert!(
        summary.duplicates() > 0,
        "the zombie's write shows up as a duplicate"
    );
    db.drop().await;
}
