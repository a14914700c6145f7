//! `effects-test --e2e true`: the outbox end to end under kills. Consumer A (inbox + outbox)
//! reads X and, in its inbox transaction, writes each event into the outbox; an `OutboxRelay`
//! publishes the outbox to Y through the broker's producer (`Publish`); consumer B (the wallet
//! credit, inbox) reads Y. A, the relay and B are child processes, SIGKILLed in turn every
//! 1–4 s and restarted, then all three drain. B must have applied every event exactly once.

use std::collections::HashMap;
use std::time::Duration;

use inbox_admin::progress;
use inbox_conformance::wallet;
use inbox_conformance::{TestBroker, TestDb, TestStore};
use inbox_core::BoxError;
use inbox_postgres::Outbox;

use crate::brokers::Broker;
use crate::effects::{kill_in_turn, schedule, Drain, EffectsSettings, Run, ACCOUNTS};
use crate::effects_child::{ChildSpec, Mode, Role};
use crate::kill::events;

/// One run of the chain on `broker`, `label` naming it.
pub(crate) async fn run_once<B: TestBroker>(
    broker: &Broker<B>,
    s: &EffectsSettings,
    run: u32,
    label: &str,
) -> Result<Run, BoxError> {
    let kind = broker.kind();
    let count = s.events_on(kind);
    let bar = progress::Progress::bar(label, u64::from(count), "events", "credited");
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
        restarts: broker.drain_restarts(),
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
    let result = Run {
        kills,
        duplicates: summary.duplicates(),
        lost: summary.lost(i64::from(count)),
        balances_exact: summary.balances_exact && balances == expected,
        outbox_rows,
        unsent,
        calls: 0,
    };
    db.drop().await;
    broker.remove(&x).await;
    broker.remove(&y).await;
    Ok(result)
}
