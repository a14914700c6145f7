//! `memory-demo`: the wallet on the in-memory broker from `inbox_testkit`, crashing at
//! random points of claim, apply, commit and ack while the producer sends some events twice.
//! No broker needed, only PostgreSQL.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, InboxStore};
use inbox_postgres::PgTx;
use inbox_testkit::{Crash, MemoryBroker, WithoutInbox};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::cli::{positive, probability};

/// The flags of `memory-demo`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Settings {
    /// Credit events.
    #[arg(long, value_name = "N", default_value = "2000")]
    events: u32,
    /// Accounts the events credit.
    #[arg(long, value_name = "N", default_value = "50", value_parser = clap::value_parser!(i64).range(1..))]
    accounts: i64,
    /// Share of the events the producer sends twice.
    #[arg(long, value_name = "F", default_value = "0.1", value_parser = probability)]
    resend_share: f64,
    /// Probability of a crash at each step of each message, below 1.
    #[arg(long, value_name = "P", default_value = "0.01", value_parser = below_1)]
    crash_probability: f64,
    /// Messages per transaction.
    #[arg(long, value_name = "N", default_value = "10", value_parser = positive)]
    batch: usize,
    /// Seed of the events and the crashes.
    #[arg(long, value_name = "N", default_value = "7")]
    seed: u64,
}

fn below_1(value: &str) -> Result<f64, String> {
    match probability(value)? {
        p if p < 1.0 => Ok(p),
        _ => Err("must be below 1: a consumer that always crashes never finishes".into()),
    }
}

pub(crate) async fn main(settings: &Settings) -> ExitCode {
    println!(
        "wallet demo: {} credit events over {} accounts, {:.0}% sent twice by the producer, \
         the consumer crashing with probability {} at each step of each message, batches of {}",
        settings.events,
        settings.accounts,
        settings.resend_share * 100.0,
        settings.crash_probability,
        settings.batch
    );
    println!(
        "{:<34} {:>8} {:>8} {:>11} {:>5} {:>15} {:>8}",
        "variant", "crashes", "applied", "duplicates", "lost", "balances exact", "msgs/s"
    );
    let mut ok = true;
    for with_inbox in [false, true] {
        let row = run(settings, with_inbox).await;
        ok &= !with_inbox || (row.duplicates == 0 && row.lost == 0 && row.balances_exact);
        println!(
            "{:<34} {:>8} {:>8} {:>11} {:>5} {:>15} {:>8.0}",
            if with_inbox {
                "c: inbox + ack after commit"
            } else {
                "b: ack after commit, no inbox"
            },
            row.crashes,
            row.applied,
            row.duplicates,
            row.lost,
            row.balances_exact,
            row.rate
        );
    }
    if ok {
        println!("with the inbox: every event applied exactly once, every balance exact");
        ExitCode::SUCCESS
    } else {
        println!("the inbox variant showed duplicates or losses");
        ExitCode::FAILURE
    }
}

struct Row {
    crashes: u32,
    applied: i64,
    duplicates: i64,
    lost: i64,
    balances_exact: bool,
    rate: f64,
}

async fn run(s: &Settings, with_inbox: bool) -> Row {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    let mut rng = StdRng::seed_from_u64(s.seed);
    for i in 0..s.events {
        let event = CreditEvent::new(rng.random_range(1..=s.accounts), rng.random_range(1..=100));
        let id = format!("evt-{i}");
        broker.publish(Some(&id), event.to_json());
        if rng.random_bool(s.resend_share) {
            broker.publish(Some(&id), event.to_json()); // a relay publishing twice
        }
    }
    let crash = Crash::anywhere(s.crash_probability, s.seed ^ 0x5eed);
    let started = Instant::now();
    let crashes = if with_inbox {
        drain(&broker, db.inbox(), &db, &crash, s.batch).await
    } else {
        drain(&broker, WithoutInbox(db.inbox()), &db, &crash, s.batch).await
    };
    let elapsed = started.elapsed();
    let summary = wallet::summary(&db)
        .await
        .unwrap_or_else(|e| panic!("cannot read the ledger: {e}"));
    db.drop().await;
    Row {
        crashes,
        applied: summary.ledger_rows,
        duplicates: summary.duplicates(),
        lost: summary.lost(i64::from(s.events)),
        balances_exact: summary.balances_exact,
        rate: summary.ledger_rows as f64 / elapsed.as_secs_f64().max(1e-9),
    }
}

/// Runs consumers until the queue is empty, starting a new one after each crash.
async fn drain<St: InboxStore<Tx = PgTx> + Clone>(
    broker: &MemoryBroker,
    store: St,
    db: &TestDb,
    crash: &Crash,
    batch: usize,
) -> u32 {
    let mut crashes = 0;
    while broker.pending() > 0 {
        let consumer = Consumer::new(
            "wallet",
            crash.source(broker.source()),
            crash.store(store.clone()),
            crash.handler(Credit::new(db.clone())),
        )
        .batch_size(batch)
        .error_backoff(Duration::from_millis(10));
        match crash.run(consumer.run_until_idle()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("consumer failed: {e}"),
            Err(_) => crashes += 1,
        }
    }
    crashes
}
