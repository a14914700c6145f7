//! A primary crashes mid-stream and its streaming standby is promoted: what the guarantee
//! becomes. Two clusters of the test's own (`inbox_primary` on `INBOX_PRIMARY_PG_PORT`, default
//! 5441, and `inbox_standby` on `INBOX_STANDBY_PG_PORT`, 5442), made fresh for each run with
//! `pg_createcluster` and `pg_basebackup`. The consumer reaches the primary through a proxy that
//! moves to the standby once it is promoted (as a virtual IP or a pooler would). After a third
//! of the messages the replication link (through a second proxy) carries nothing for 500 ms, as
//! a slow or congested one, then the primary is stopped in `immediate` mode (no checkpoint, as
//! a crash) and what was on the link is gone.
//!
//! With asynchronous replication a commit the primary acknowledged may not have reached the
//! standby: the consumer acked that message to the broker, and the promoted standby has neither
//! its claim nor its effect, so it is lost. With synchronous replication
//! (`synchronous_standby_names`, `synchronous_commit = on`) a commit is acknowledged only once
//! the standby has it: nothing is lost. Neither applies anything twice. Each run prints its
//! figures; `INBOX_FAILOVER_RUNS` repeats them. Without root and Debian's cluster tools the
//! test says so and skips.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_conformance::pg_cluster::{ClusterSettings, PgCluster};
use inbox_conformance::wallet::{self, publish_credit, Credit};
use inbox_conformance::{partitioned_layout, FaultProxy, ProxyMode, TestDb};
use inbox_core::{Consumer, Stage, StageHook};
use inbox_postgres::{Partitions, PgInbox, TableName};
use inbox_testkit::{eventually, MemoryBroker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

const EVENTS: i64 = 1500;
/// How long the standby receives nothing before the primary crashes.
const LAG: Duration = Duration::from_millis(500);

/// What one failover came to.
#[derive(Debug)]
#[allow(dead_code)] // printed
struct Failover {
    /// Messages applied (committed on the primary) before it crashed.
    applied_at_crash: u64,
    /// From the crash to the first commit on the promoted standby.
    back_after: Duration,
    /// Acked to the broker, but neither claim nor effect on the promoted standby.
    lost: i64,
    /// Applied twice.
    duplicates: i64,
    /// Errors the consumer saw and retried.
    errors: u64,
}

async fn one_query(pool: &PgPool, sql: String) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs the stream through a crash of the primary, with `synchronous` replication or not.
async fn failover(synchronous: bool) -> Result<Failover, String> {
    let mut settings = ClusterSettings::default();
    if synchronous {
        settings.conf = vec![
            "synchronous_standby_names = 'inbox_standby'".into(),
            "synchronous_commit = on".into(),
        ];
    }
    let primary = PgCluster::fresh("inbox_primary", "INBOX_PRIMARY_PG_PORT", 5441, &settings)?;
    // The replication link goes through a proxy, to lose what is on it when the primary dies.
    let link = FaultProxy::start(([127, 0, 0, 1], primary.port()).into())
        .await
        .unwrap();
    let standby = PgCluster::standby_of(
        &primary,
        link.addr().port(),
        "inbox_standby",
        "INBOX_STANDBY_PG_PORT",
        5442,
    )?;
    let primary_url = primary.url("127.0.0.1", "");
    let admin = PgPool::connect(&primary_url).await.unwrap();
    let wanted = if synchronous { "sync" } else { "async" };
    let streaming = eventually(Duration::from_secs(20), || async {
        let sql = format!(
            "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'inbox_standby' \
             AND state = 'streaming' AND sync_state = '{wanted}'"
        );
        one_query(&admin, sql).await == 1
    })
    .await;
    assert!(streaming, "the standby streams ({wanted})");
    admin.close().await;

    let db = TestDb::at(&primary_url).await;
    let upstream = ([127, 0, 0, 1], primary.port()).into();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let options: PgConnectOptions = primary_url.parse().unwrap();
    let options = options
        .port(proxy.addr().port())
        .options([("search_path", db.schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .test_before_acquire(false)
        .connect_lazy_with(options);
    let table = TableName::qualified(&db.schema, "inbox").unwrap();
    let mut inbox = PgInbox::new(pool.clone()).with_table(table);
    if partitioned_layout() {
        inbox = inbox.partitioned(Partitions::default());
    }
    let broker = MemoryBroker::new();
    for i in 0..EVENTS {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 1);
    }

    // After a third, from a thread of its own: crash, promote, move the proxy.
    let clusters = Arc::new((primary, standby));
    let committed = Arc::new(AtomicU64::new(0));
    let crashed_at: Arc<Mutex<Option<(Instant, u64)>>> = Arc::default();
    let first_after: Arc<Mutex<Option<Instant>>> = Arc::default();
    let failing_over: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::default();
    let hook = {
        let (clusters, committed, proxy) = (clusters.clone(), committed.clone(), proxy.clone());
        let link = link.clone();
        let (crashed_at, first_after) = (crashed_at.clone(), first_after.clone());
        let failing_over = failing_over.clone();
        StageHook::new(move |stage, _id| {
            if stage != Stage::Committed {
                return;
            }
            let n = committed.fetch_add(1, Ordering::SeqCst) + 1;
            let crashed = *crashed_at.lock().unwrap();
            if crashed.is_some_and(|(_, at)| n > at) && first_after.lock().unwrap().is_none() {
                *first_after.lock().unwrap() = Some(Instant::now());
            }
            if n == EVENTS as u64 / 3 {
                let (clusters, proxy, crashed_at, link) = (
                    clusters.clone(),
                    proxy.clone(),
                    crashed_at.clone(),
                    link.clone(),
                );
                let committed_then = committed.clone();
                *failing_over.lock().unwrap() = Some(std::thread::spawn(move || {
                    let (primary, standby) = &*clusters;
                    // The link to the standby carries nothing for a moment, as a slow or
                    // congested one, then the primary dies; what was on the link is gone.
                    link.set_mode(ProxyMode::Blackhole);
                    std::thread::sleep(LAG);
                    primary.crash();
                    let at = committed_then.load(Ordering::SeqCst);
                    *crashed_at.lock().unwrap() = Some((Instant::now(), at));
                    link.set_mode(ProxyMode::Refuse);
                    standby.promote();
                    proxy.redirect(([127, 0, 0, 1], standby.port()).into());
                }));
            }
        })
    };
    let run = Consumer::new("wallet", broker.source(), inbox, Credit::new(db.clone()))
        .error_backoff(Duration::from_millis(100))
        .on_stage(hook)
        .run_until_idle();
    let stats = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("the consumer got through the queue after the failover")
        .unwrap();
    let thread = failing_over.lock().unwrap().take();
    thread.expect("the failover ran").join().unwrap();

    let (crashed, applied_at_crash) = crashed_at.lock().unwrap().expect("crashed");
    let back = first_after
        .lock()
        .unwrap()
        .expect("a commit after the failover");
    let standby_url = clusters.1.url("127.0.0.1", "");
    let promoted = TestDb::attach_at(&standby_url, &db.schema).await;
    let summary = wallet::summary(&promoted).await.unwrap();
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending(), 0, "everything acked");
    promoted.drop().await;
    Ok(Failover {
        applied_at_crash,
        back_after: back.saturating_duration_since(crashed),
        lost: summary.lost(EVENTS),
        duplicates: summary.duplicates(),
        errors: stats.errors,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_loses_acked_messages_only_without_synchronous_replication() {
    let runs: usize = std::env::var("INBOX_FAILOVER_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    for run in 1..=runs {
        for synchronous in [false, true] {
            let mode = if synchronous {
                "synchronous"
            } else {
                "asynchronous"
            };
            let failover = match failover(synchronous).await {
                Ok(failover) => failover,
                Err(why) => {
                    println!("skipped: no PostgreSQL clusters of its own: {why}");
                    return;
                }
            };
            println!("failover {run}, {mode} replication, {EVENTS} messages: {failover:?}");
            assert_eq!(failover.duplicates, 0, "{mode}: {failover:?}");
            if synchronous {
                assert_eq!(failover.lost, 0, "{mode}: {failover:?}");
            }
        }
    }
}
