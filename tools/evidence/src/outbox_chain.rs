//! `effects-test --e2e true`: the outbox end to end under kills. Consumer A (inbox + outbox)
//! reads X and, in its inbox transaction, writes each event into the outbox; an `OutboxRelay`
//! publishes the outbox to Y through the broker's producer (`Publish`); consumer B (the wallet
//! credit, inbox) reads Y. A, the relay and B are child processes, SIGKILLed in turn every
//! 1–4 s and restarted, then all three drain. B must have applied every event exactly once.

use std::collections::HashMap;
use std::time::Duration;

use inbox_admin::progress;
use inbox_conformance::wallet;
use inbox_conformance::{TestDb, TestStore};
use inbox_core::BoxError;
use inbox_postgres::Outbox;

use inbox_conformance::TestBroker;

use crate::brokers::{self, with_broker, Broker};
use crate::effects::{kill_in_turn, schedule, Drain, EffectsSettings, ACCOUNTS};
use crate::effects_child::{ChildSpec, Mode, Role};
use crate::kill::events;
use crate::report::spread;

/// One run's figures, counted in B's ledger and the outbox.
#[derive(Debug, Clone, Copy)]
struct ChainRun {
    kills: u32,
    duplicates: i64,
    lost: i64,
    balances_exact: bool,
    /// Outbox rows A wrote: one per event when A is effectively-once.
    outbox_rows: i64,
    unsent: i64,
}

pub(crate) async fn main(s: &EffectsSettings) -> Result<(), BoxError> {
    let mut rows = Vec::new();
    for &kind in &s.brokers {
        if brokers::left_out(kind, false)? {
            continue;
        }
        let mut runs = Vec::new();
        with_broker!(kind, s.kafka_impl, |broker| for run in 0..s.runs {
            let r = run_once(broker, s, run).await?;
            println!(
                "run done: {kind} outbox chain run {}/{}: {} duplicates, {} lost, balances {}, \
                 {} kills, {} outbox rows ({} unsent)",
                run + 1,
                s.runs,
                r.duplicates,
                r.lost,
                if r.balances_exact { "exact" } else { "WRONG" },
                r.kills,
                r.outbox_rows,
                r.unsent
            );
            runs.push(r);
        });
        rows.push((kind, s.events_on(kind), runs));
    }
    println!();
    println!(
        "| broker | events | runs | kills/run (A, relay, B in turn) | duplicates/run | lost/run | balances exact | outbox rows/run |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (kind, events, runs) in &rows {
        println!(
            "| {kind} | {events} | {} | {} | {} | {} | {}/{} | {} |",
            runs.len(),
            spread(runs.iter().map(|r| i64::from(r.kills))).show(),
            spread(runs.iter().map(|r| r.duplicates)).show(),
            spread(runs.iter().map(|r| r.lost)).show(),
            runs.iter().filter(|r| r.balances_exact).count(),
            runs.len(),
            spread(runs.iter().map(|r| r.outbox_rows)).show(),
        );
    }
    println!();
    for (kind, events, runs) in &rows {
        let line = serde_json::json!({
            "test": "outbox_chain",
            "broker": kind.name(),
            "events": events,
            "runs": runs.len(),
            "kills": runs.iter().map(|r| r.kills).collect::<Vec<_>>(),
            "duplicates": runs.iter().map(|r| r.duplicates).collect::<Vec<_>>(),
            "lost": runs.iter().map(|r| r.lost).collect::<Vec<_>>(),
            "balances_exact": runs.iter().map(|r| r.balances_exact).collect::<Vec<_>>(),
            "outbox_rows": runs.iter().map(|r| r.outbox_rows).collect::<Vec<_>>(),
            "unsent": runs.iter().map(|r| r.unsent).collect::<Vec<_>>(),
            "work_ms": s.work_ms,
            "kill_after_ms": [s.kill_after_ms.0, s.kill_after_ms.1],
        });
        println!("{line}");
    }
    let broken: Vec<String> = rows
        .iter()
        .filter(|(_, events, runs)| {
            runs.iter().any(|r| {
                r.duplicates > 0
                    || r.lost > 0
                    || !r.balances_exact
                    || r.outbox_rows != i64::from(*events)
            })
        })
        .map(|(kind, _, _)| kind.to_string())
        .collect();
    if broken.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the outbox chain was not exactly-once on: {}",
            broken.join(", ")
        )
        .into())
    }
}

async fn run_once<B: TestBroker>(
    broker: &Broker<B>,
    s: &EffectsSettings,
    run: u32,
) -> Result<ChainRun, BoxError> {
    let kind = broker.kind();
    let count = s.events_on(kind);
    let label = format!("{kind} outbox chain run {}/{}", run + 1, s.runs);
    let bar = progress::Progress::bar(&label, u64::from(count), "events", "credited");
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await?;
    let (events, expected) = events(s.seed, ACCOUNTS, count);
    let x = broker.create(&format!("{kind}-x-{run}")).await?;
    let y = broker.create(&format!("{kind}-y-{run}")).await?;
    broker.publish(&x, &events).await?;
    let destination = broker.destination(&y).await?;
    let spec = |role: Role, name: &str| ChildSpec {
        role,
        broker: kind,
        name: name.to_owned(),
        destination: destination.clone(),
        schema: db.schema.clone(),
        mode: Mode::Keys,
        work_ms: s.work_ms,
    };
    let specs = [
        spec(Role::Forward, &x),
        spec(Role::Relay, &y),
        spec(Role::Credit, &y),
    ];
    // The drain: all three run unharmed until B has every event and is quiet.
    let drain = Drain {
        events: count,
        unit: "credited",
        quiet: Duration::from_secs(2),
        delay: broker.redelivery_delay(&y).await?,
    };
    let pool = &db;
    let kills = kill_in_turn(
        (&specs, &[]),
        schedule(s, run),
        drain,
        &bar,
        || async move {
            let summary = wallet::summary(pool).await?;
            Ok((summary.distinct_events, summary.ledger_rows))
        },
    )
    .await?;
    let summary = wallet::summary(&db).await?;
    let balances: HashMap<i64, i64> = db.balances().await?.into_iter().collect();
    let (outbox_rows, unsent): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE sent_at IS NULL) FROM outbox")
            .fetch_one(&db.pool)
            .await?;
    let result = ChainRun {
        kills,
        duplicates: summary.duplicates(),
        lost: summary.lost(i64::from(count)),
        balances_exact: summary.balances_exact && balances == expected,
        outbox_rows,
        unsent,
    };
    db.drop().await;
    broker.remove(&x).await;
    broker.remove(&y).await;
    Ok(result)
}
