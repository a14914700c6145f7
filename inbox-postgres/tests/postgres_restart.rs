//! PostgreSQL itself restarted mid-stream (`pg_ctlcluster … restart --mode fast`: every session
//! is terminated, in-flight transactions are rolled back, the server refuses connections while
//! it shuts down and starts). The consumer must recover by itself with every message applied
//! once.
//!
//! The shared test server is not restarted (other tests run beside this one): the test runs on
//! a cluster of its own, `inbox_restart` on port `INBOX_RESTART_PG_PORT` (default 5439), which
//! it creates with Debian's `pg_createcluster` when missing, starts when stopped, and stops
//! again if it started it. Without `pg_ctlcluster` and root (a managed database, another OS)
//! the test says so and skips.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_conformance::wallet::{self, publish_credit, Credit};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, Stage, StageHook};
use inbox_postgres::{PgInbox, TableName};
use inbox_testkit::MemoryBroker;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const CLUSTER: &str = "inbox_restart";

/// The test's own PostgreSQL cluster, stopped on drop when this test started it.
struct Cluster {
    version: String,
    port: u16,
    started_here: bool,
}

impl Cluster {
    /// The cluster, created and started as needed; `None` (and why) where that cannot be done.
    fn up() -> Result<Self, String> {
        let port: u16 = std::env::var("INBOX_RESTART_PG_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(5439);
        let uid = output("id", &["-u"])?;
        if uid.trim() != "0" {
            return Err("needs root to run pg_createcluster and pg_ctlcluster".into());
        }
        let listing = output("pg_lsclusters", &["--no-header"])?;
        let clusters: Vec<Vec<&str>> = listing
            .lines()
            .map(|l| l.split_whitespace().collect())
            .filter(|f: &Vec<&str>| f.len() > 3)
            .collect();
        let version = clusters
            .first()
            .map(|f| f[0].to_owned())
            .ok_or("pg_lsclusters lists no cluster to take the version from")?;
        let mut started_here = false;
        match clusters.iter().find(|f| f[1] == CLUSTER) {
            Some(f) if f[2] != port.to_string() => {
                return Err(format!(
                    "cluster {CLUSTER} listens on {}, not INBOX_RESTART_PG_PORT={port}",
                    f[2]
                ))
            }
            Some(f) if f[3] == "online" => {}
            Some(_) => {
                run("pg_ctlcluster", &[&version, CLUSTER, "start"])?;
                started_here = true;
            }
            None => {
                run(
                    "pg_createcluster",
                    &[&version, CLUSTER, "--port", &port.to_string(), "--start"],
                )?;
                started_here = true;
                let sql = "ALTER USER postgres PASSWORD 'postgres'; CREATE DATABASE inbox";
                for statement in sql.split("; ") {
                    run(
                        "su",
                        &[
                            "postgres",
                            "-c",
                            &format!("psql -p {port} -qc \"{statement}\""),
                        ],
                    )?;
                }
            }
        }
        Ok(Self {
            version,
            port,
            started_here,
        })
    }

    fn url(&self) -> String {
        format!("postgres://postgres:postgres@127.0.0.1:{}/inbox", self.port)
    }

    /// Restarts the server: fast shutdown (sessions terminated, transactions rolled back), start.
    fn restart(&self) {
        run(
            "pg_ctlcluster",
            &["--mode", "fast", &self.version, CLUSTER, "restart"],
        )
        .unwrap();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.started_here {
            let _ = run("pg_ctlcluster", &[&self.version, CLUSTER, "stop"]);
        }
    }
}

fn output(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    output(program, args).map(drop)
}

#[tokio::test]
async fn a_postgresql_restart_mid_stream_loses_nothing_and_applies_nothing_twice() {
    let cluster = match Cluster::up() {
        Ok(cluster) => cluster,
        Err(why) => {
            println!("skipped: no PostgreSQL cluster of its own to restart: {why}");
            return;
        }
    };
    // This file holds one test, so its process talks to the restarted cluster only.
    std::env::set_var("DATABASE_URL", cluster.url());
    let db = TestDb::new().await;
    let options: PgConnectOptions = cluster.url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .test_before_acquire(false)
        .connect_lazy_with(options.options([("search_path", db.schema.as_str())]));
    let inbox =
        PgInbox::new(pool.clone()).with_table(TableName::qualified(&db.schema, "inbox").unwrap());

    let events = 300;
    let broker = MemoryBroker::new();
    for i in 0..events {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 1);
    }
    // After a third of the events, restart the server once, from a thread of its own while
    // the consumer goes on (10 ms of work per message keeps it going for a few seconds).
    let cluster = Arc::new(cluster);
    let applied = Arc::new(AtomicU64::new(0));
    let restarted = Arc::new(AtomicBool::new(false));
    let restart_done: Arc<Mutex<Option<Instant>>> = Arc::default();
    let first_after: Arc<Mutex<Option<Instant>>> = Arc::default();
    let restarter: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::default();
    let hook = {
        let (cluster, applied, restarted) = (cluster.clone(), applied.clone(), restarted.clone());
        let (restart_done, first_after) = (restart_done.clone(), first_after.clone());
        let restarter = restarter.clone();
        StageHook::new(move |stage, _id| {
            if stage == Stage::Committed {
                let n = applied.fetch_add(1, Ordering::SeqCst) + 1;
                let done = *restart_done.lock().unwrap();
                if done.is_some() && first_after.lock().unwrap().is_none() {
                    *first_after.lock().unwrap() = Some(Instant::now());
                }
                if n == events as u64 / 3 && !restarted.swap(true, Ordering::SeqCst) {
                    let (cluster, restart_done) = (cluster.clone(), restart_done.clone());
                    *restarter.lock().unwrap() = Some(std::thread::spawn(move || {
                        cluster.restart();
                        *restart_done.lock().unwrap() = Some(Instant::now());
                    }));
                }
            }
        })
    };

    let credit = Credit::new(pool.clone()).work(Duration::from_millis(10));
    let run = Consumer::new("wallet", broker.source(), inbox, credit)
        .batch_size(10)
        .error_backoff(Duration::from_millis(100))
        .on_stage(hook)
        .run_until_idle();
    let stats = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("the consumer did not get through the queue after the restart")
        .unwrap();
    let restarter = restarter.lock().unwrap().take();
    restarter.expect("the restart began").join().unwrap();

    let restart_done = restart_done
        .lock()
        .unwrap()
        .expect("the server was restarted");
    let recovered = first_after
        .lock()
        .unwrap()
        .map(|t| t.saturating_duration_since(restart_done));
    println!("restart: {stats:?}; first commit {recovered:?} after the server was back");
    // A fresh pool: the test pool's sessions were terminated by the restart.
    let check = TestDb::attach(&db.schema).await;
    let summary = wallet::summary(&check.pool).await.unwrap();
    assert_eq!(summary.duplicates(), 0, "{stats:?}");
    assert_eq!(summary.lost(events), 0, "{stats:?}");
    assert!(summary.balances_exact);
    assert!(stats.errors > 0, "the restart was seen: {stats:?}");
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending(), 0);
    check.drop().await;
}
