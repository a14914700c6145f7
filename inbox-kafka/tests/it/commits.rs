//! Offset commits coalesced by the commit task: far fewer commit requests than acked batches,
//! nothing committed before the interval, and what was acked committed anyway when the
//! partitions are revoked or the source closes.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::wallet::Credit;
use inbox_conformance::TestDb;
use inbox_kafka::OffsetCommits;

/// Longer than any test: the commit task never fires, so whatever is committed was committed
/// by a revoke or a close.
const NEVER: Duration = Duration::from_secs(3600);

/// What one consumer run over `events` single-message batches came to.
#[derive(Debug)]
struct BatchRun {
    batches: u64,
    requests: u64,
    elapsed: Duration,
}

/// Applies `events` credits on one partition in batches of one (a transaction and an ack each)
/// with `commit_interval`, and counts the commit requests.
async fn one_message_batches(events: usize, commit_interval: Option<Duration>) -> BatchRun {
    let topic = topic(1).await;
    let group = random("group");
    let db = TestDb::new().await;
    let total = produce_credits(&topic, events, 1).await;
    let mut config = config(&topic, &group);
    if let Some(every) = commit_interval {
        config = config.commit_interval(every);
    }
    let source = config.connect().await.expect("source");
    let commits: OffsetCommits = source.offset_commits();
    let started = Instant::now();
    let consumer = Running::start("wallet", source, db.inbox(), Credit::new(db.clone()), 1);
    assert!(
        wait_for_events(&db, events as i64).await,
        "not every event applied"
    );
    let stats = consumer.stop().await.expect("consumer");
    let elapsed = started.elapsed();
    let lag = wait_for_no_lag(&topic, &group, 1).await;
    let summary = summary(&db).await;
    let run = BatchRun {
        batches: stats.commits,
        requests: commits.requests(),
        elapsed,
    };
    println!(
        "commit interval {commit_interval:?}: {run:?}, lag {lag}, {commits:?}, {stats:?}, {summary:?}"
    );
    assert_eq!(
        summary.ledger_rows, events as i64,
        "each event exactly once"
    );
    assert_eq!(summary.distinct_events, events as i64);
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(lag, 0, "everything committed in the end");
    assert_eq!(commits.failed(), 0);
    db.drop().await;
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_are_committed_in_far_fewer_requests_than_batches() {
    const EVENTS: usize = 150;
    // The default interval.
    let coalesced = one_message_batches(EVENTS, None).await;
    // One synchronous commit per ack, as the counter must then show.
    let per_ack = one_message_batches(EVENTS, Some(Duration::ZERO)).await;
    println!("coalesced {coalesced:?}\nper ack {per_ack:?}");
    assert!(
        per_ack.requests >= per_ack.batches && per_ack.batches >= EVENTS as u64,
        "with a zero interval every acked batch is a commit request: {per_ack:?}"
    );
    // At most one request per interval from the commit task, plus the close's.
    let ticks = coalesced.elapsed.as_millis() / 250 + 1;
    assert!(
        u128::from(coalesced.requests) <= ticks + 1,
        "more than one commit request per interval: {coalesced:?}"
    );
    assert!(
        coalesced.requests < coalesced.batches,
        "not coalesced: {coalesced:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_commits_what_was_acked() {
    const EVENTS: usize = 30;
    let topic = topic(3).await;
    let group = random("group");
    let db = TestDb::new().await;
    produce_credits(&topic, EVENTS, 3).await;
    let source = config(&topic, &group)
        .commit_interval(NEVER)
        .connect()
        .await
        .expect("source");
    let commits = source.offset_commits();
    let consumer = Running::start("wallet", source, db.inbox(), Credit::new(db.clone()), 5);
    assert!(wait_for_events(&db, EVENTS as i64).await);
    let lag_running = tokio::task::spawn_blocking({
        let (t, g) = (topic.clone(), group.clone());
        move || lag(&t, &g, 3)
    })
    .await
    .expect("lag task");
    let stats = consumer.stop().await.expect("consumer");
    let lag_stopped = wait_for_no_lag(&topic, &group, 3).await;
    println!(
        "graceful stop: lag {lag_running} while running, {lag_stopped} after the stop; {commits:?} {stats:?}"
    );
    assert_eq!(
        lag_running, EVENTS as i64,
        "nothing is committed before the interval"
    );
    assert_eq!(lag_stopped, 0, "the close committed what was acked");
    assert!(commits.requests() >= 1);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_commits_what_was_acked_before_the_partitions_move() {
    if skip_on_mock(
        "the mock refuses an offset commit while the group prepares a rebalance \
         (REBALANCE_IN_PROGRESS in its JOINING state), so the commit on revoke never lands; \
         Kafka's group coordinator accepts a commit of the current generation then and refuses \
         one only while completing the rebalance",
    ) {
        return;
    }
    const EVENTS: usize = 80;
    const PARTITIONS: i32 = 4;
    let topic = topic(PARTITIONS).await;
    let group = random("group");
    let db = TestDb::new().await;
    produce_credits(&topic, EVENTS, PARTITIONS).await;
    let member = || async {
        let source = config(&topic, &group)
            .commit_interval(NEVER)
            .connect()
            .await
            .expect("source");
        let commits = source.offset_commits();
        let running = Running::start("wallet", source, db.inbox(), Credit::new(db.clone()), 10);
        (running, commits)
    };
    let (first, first_commits) = member().await;
    assert!(wait_for_events(&db, EVENTS as i64).await);
    let lag_now = || {
        let (t, g) = (topic.clone(), group.clone());
        async move {
            tokio::task::spawn_blocking(move || lag(&t, &g, PARTITIONS))
                .await
                .expect("lag task")
        }
    };
    let lag_alone = lag_now().await;
    // The second member makes the group rebalance: the first's partitions are revoked.
    let (second, _) = member().await;
    let committed = eventually(|| async { lag_now().await == 0 }).await;
    let lag_rebalanced = lag_now().await;
    let (s1, s2) = (
        first.stop().await.expect("first"),
        second.stop().await.expect("second"),
    );
    let summary = summary(&db).await;
    println!(
        "revoke: lag {lag_alone} alone, {lag_rebalanced} after the second member joined; first {s1:?} {first_commits:?}, second {s2:?}; {summary:?}"
    );
    assert_eq!(
        lag_alone, EVENTS as i64,
        "nothing is committed before the interval"
    );
    assert!(
        committed,
        "the revoke did not commit what the first member acked"
    );
    assert_eq!(
        s2.applied + s2.skipped_duplicates,
        0,
        "the second member started behind the first one's commits"
    );
    assert_eq!(summary.ledger_rows, EVENTS as i64);
    assert!(summary.balances_exact);
    db.drop().await;
}
