//! `effects-test`: side effects outside the database, counted at the provider.
//!
//! Per broker and provider mode: publish N events, run an effect consumer child (an
//! `Consumer::effects` on `PgLeases`) that calls a `TestProvider` running in this process over
//! HTTP, SIGKILL the child every 1–4 s and start another, then let a last child drain. The
//! provider counts effects per idempotency key: duplicates are effects beyond one per event,
//! losses events without one. The first call of each key is slow (it applies after `--work-ms`,
//! whether or not the caller is still there), so kills land inside calls.
//!
//! With `--e2e true`, the outbox chain instead (see `outbox_chain.rs`).

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_admin::progress;
use inbox_conformance::provider::{Behaviour, ProviderMode, TestProvider};
use inbox_conformance::{TestBroker, TestDb};
use inbox_core::BoxError;
use inbox_postgres::PgLeases;
use sqlx::AssertSqlSafe;

use crate::brokers::{self, with_broker, Broker};
use crate::cli::{millis, millis_range, BrokerKind};
use crate::effects_child::{ChildSpec, Mode, Role, EFFECT_CONSUMER, PROVIDER_ENV};
use crate::kill;
use crate::report::spread;
use crate::settings::Brokers;
use serde_json::Value;

/// The flags of `effects-test`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct EffectsSettings {
    #[command(flatten)]
    pub(crate) brokers: Brokers,
    /// What the provider offers and what the handler does after an unknown outcome.
    #[arg(
        long,
        alias = "mode",
        value_delimiter = ',',
        value_name = "MODE,…",
        default_value = "keys,lookup,neither+retry,neither+skip"
    )]
    pub(crate) modes: Vec<Mode>,
    /// Events per run.
    #[arg(long, value_name = "N", default_value = "500")]
    pub(crate) events: u32,
    /// Events per run on SQS (moto is slow).
    #[arg(long, value_name = "N", default_value = "200")]
    pub(crate) sqs_events: u32,
    /// SIGKILLs per run.
    #[arg(long, value_name = "N", default_value = "10")]
    pub(crate) kills: u32,
    /// Runs per broker and mode.
    #[arg(long, value_name = "N", default_value = "5", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) runs: u32,
    /// A child's work before its kill, drawn from MIN..MAX: milliseconds, or durations such as
    /// 1s..4s.
    #[arg(long, value_name = "MIN..MAX", default_value = "1000..4000", value_parser = millis_range)]
    pub(crate) kill_after_ms: (u64, u64),
    /// How long the provider takes over each key's first call (effects); the handlers' sleep
    /// (the outbox chain): milliseconds, or a duration such as 40ms.
    #[arg(long, value_name = "MS", default_value = "40", value_parser = millis)]
    pub(crate) work_ms: u64,
    /// Seed of the events and the kill schedule.
    #[arg(long, value_name = "N", default_value = "42")]
    pub(crate) seed: u64,
    /// The outbox chain instead of the effect consumer.
    #[arg(long, value_name = "BOOL", default_value = "false", action = clap::ArgAction::Set)]
    pub(crate) e2e: bool,
}

impl EffectsSettings {
    pub(crate) fn events_on(&self, kind: BrokerKind) -> u32 {
        if kind == BrokerKind::Sqs {
            self.sqs_events.min(self.events)
        } else {
            self.events
        }
    }
}

/// One run's figures: effects count at the provider (`calls`), the outbox chain in B's ledger
/// and the outbox (the rest).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Run {
    pub(crate) kills: u32,
    pub(crate) duplicates: i64,
    pub(crate) lost: i64,
    /// Provider calls.
    pub(crate) calls: i64,
    pub(crate) balances_exact: bool,
    /// Outbox rows A wrote: one per event when A is effectively-once.
    pub(crate) outbox_rows: i64,
    pub(crate) unsent: i64,
}

/// `evidence effects-test`: per broker and mode (the outbox chain: per broker) the runs, then a
/// table and a JSON line per row.
pub(crate) async fn main(s: &EffectsSettings) -> Result<(), BoxError> {
    // The outbox chain has no modes.
    let modes: Vec<Option<Mode>> = if s.e2e {
        vec![None]
    } else {
        s.modes.iter().copied().map(Some).collect()
    };
    let mut rows = Vec::new();
    for &kind in &s.brokers.list {
        if brokers::left_out(kind, s.brokers.required)? {
            continue;
        }
        with_broker!(kind, s.brokers.kafka_impl, |broker| for &mode in &modes {
            let mut runs = Vec::new();
            for run in 0..s.runs {
                let what = mode.map_or("outbox chain", Mode::name);
                let label = format!("{kind} {what} run {}/{}", run + 1, s.runs);
                let r = match mode {
                    Some(mode) => run_once(broker, s, mode, run, &label).await?,
                    None => crate::outbox_chain::run_once(broker, s, run, &label).await?,
                };
                let (duplicates, lost, kills) = (r.duplicates, r.lost, r.kills);
                let figures = if mode.is_some() {
                    format!("{duplicates} duplicate effects, {lost} lost, {kills} kills, {} provider calls", r.calls)
                } else {
                    let balances = if r.balances_exact { "exact" } else { "WRONG" };
                    format!(
                        "{duplicates} duplicates, {lost} lost, balances {balances}, {kills} kills, \
                         {} outbox rows ({} unsent)",
                        r.outbox_rows, r.unsent
                    )
                };
                println!("run done: {label}: {figures}");
                runs.push(r);
            }
            rows.push((kind, mode, s.events_on(kind), runs));
        });
    }
    println!();
    if s.e2e {
        println!(
            "| broker | events | runs | kills/run (A, relay, B in turn) | duplicates/run | lost/run | balances exact | outbox rows/run |"
        );
    } else {
        println!(
            "| broker | mode | events | runs | kills/run | duplicate effects/run | lost/run | provider calls/run |"
        );
    }
    println!("|---|---|---|---|---|---|---|---|");
    let show = |runs: &[Run], figure: fn(&Run) -> i64| spread(runs.iter().map(figure)).show();
    for (kind, mode, events, runs) in &rows {
        let last = match mode {
            Some(_) => show(runs, |r| r.calls),
            None => format!(
                "{}/{} | {}",
                runs.iter().filter(|r| r.balances_exact).count(),
                runs.len(),
                show(runs, |r| r.outbox_rows)
            ),
        };
        let mode = mode.map_or(String::new(), |m| format!(" {} |", m.name()));
        println!(
            "| {kind} |{mode} {events} | {} | {} | {} | {} | {last} |",
            runs.len(),
            show(runs, |r| r.kills.into()),
            show(runs, |r| r.duplicates),
            show(runs, |r| r.lost),
        );
    }
    println!();
    for (kind, mode, events, runs) in &rows {
        let list = |figure: fn(&Run) -> Value| runs.iter().map(figure).collect::<Value>();
        let mut line = serde_json::json!({
            "test": if s.e2e { "outbox_chain" } else { "effects" },
            "broker": kind.name(),
            "events": events,
            "runs": runs.len(),
            "kills": list(|r| r.kills.into()),
            "duplicates": list(|r| r.duplicates.into()),
            "lost": list(|r| r.lost.into()),
            "work_ms": s.work_ms,
            "kill_after_ms": [s.kill_after_ms.0, s.kill_after_ms.1],
        });
        if let Some(mode) = mode {
            line["mode"] = mode.name().into();
            line["provider_calls"] = list(|r| r.calls.into());
        } else {
            line["balances_exact"] = list(|r| r.balances_exact.into());
            line["outbox_rows"] = list(|r| r.outbox_rows.into());
            line["unsent"] = list(|r| r.unsent.into());
        }
        println!("{line}");
    }
    // What each mode promises: keys and lookup neither duplicate nor lose; retry never loses;
    // skip never duplicates. The outbox chain: each event credited once, one outbox row each.
    let broken: Vec<String> = rows
        .iter()
        .filter(|(_, mode, events, runs)| {
            runs.iter().any(|r| {
                let (duplicated, lost) = (r.duplicates > 0, r.lost > 0);
                match mode {
                    Some(Mode::Keys | Mode::Lookup) => duplicated || lost,
                    Some(Mode::NeitherRetry) => lost,
                    Some(Mode::NeitherSkip) => duplicated,
                    None => {
                        duplicated
                            || lost
                            || !r.balances_exact
                            || r.outbox_rows != i64::from(*events)
                    }
                }
            })
        })
        .map(|(kind, mode, _, _)| mode.map_or(kind.to_string(), |m| format!("{kind} {}", m.name())))
        .collect();
    if broken.is_empty() {
        return Ok(());
    }
    let what = if s.e2e {
        "the outbox chain was not exactly-once on"
    } else {
        "outside what the mode promises"
    };
    Err(format!("{what}: {}", broken.join(", ")).into())
}

/// Accounts the events of the effects and outbox-chain tests credit.
pub(crate) const ACCOUNTS: i64 = 100;

/// The waits before each kill of run `run`.
pub(crate) fn schedule(s: &EffectsSettings, run: u32) -> Vec<Duration> {
    kill::waits(s.seed ^ (0xeffe + u64::from(run)), s.kills, s.kill_after_ms).collect()
}

async fn run_once<B: TestBroker>(
    broker: &Broker<B>,
    s: &EffectsSettings,
    mode: Mode,
    run: u32,
    label: &str,
) -> Result<Run, BoxError> {
    let kind = broker.kind();
    let count = s.events_on(kind);
    let bar = progress::Progress::bar(label, u64::from(count), "effects", "done");
    let db = TestDb::new().await;
    let leases = PgLeases::new(db.inbox())?;
    leases.migrate().await?;
    let provider = TestProvider::start(match mode {
        Mode::Keys => ProviderMode::Keys,
        Mode::Lookup => ProviderMode::StatusLookup,
        Mode::NeitherRetry | Mode::NeitherSkip => ProviderMode::Neither,
    })
    .await?;
    let (events, _) = kill::events(s.seed, ACCOUNTS, count);
    let keys: Vec<String> = events
        .iter()
        .map(|e| e.id.idempotency_key(EFFECT_CONSUMER))
        .collect();
    for key in &keys {
        provider.next_call(key, Behaviour::Slow(Duration::from_millis(s.work_ms)));
    }
    let name = broker.create(&format!("{kind}-fx-{run}")).await?;
    broker.publish(&name, &events).await?;
    let spec = ChildSpec {
        role: Role::Effect,
        broker: kind,
        name: name.clone(),
        destination: String::new(),
        schema: db.schema.clone(),
        mode,
        work_ms: s.work_ms,
    };
    let env = [(PROVIDER_ENV, provider.addr().to_string())];
    let done_query = format!(
        "SELECT count(*) FROM {} WHERE done_at IS NOT NULL",
        leases.table()
    );
    let (done_query, pool) = (done_query.as_str(), &db.pool);
    let drain = Drain {
        events: count,
        unit: "done",
        quiet: Duration::ZERO,
        delay: broker.redelivery_delay(&name).await?,
        restarts: broker.drain_restarts(),
    };
    let kills = kill_in_turn(
        (&[spec], &env),
        schedule(s, run),
        drain,
        &bar,
        || async move {
            let done = sqlx::query_scalar::<_, i64>(AssertSqlSafe(done_query))
                .fetch_one(pool)
                .await?;
            Ok((done, done))
        },
    )
    .await?;
    provider.wait_settled(Duration::from_secs(10)).await;
    let effects: Vec<i64> = keys.iter().map(|k| provider.effects(k) as i64).collect();
    let duplicates = effects.iter().map(|n| (n - 1).max(0)).sum();
    let lost = effects.iter().filter(|&&n| n == 0).count() as i64;
    let calls = keys.iter().map(|k| provider.calls(k).len() as i64).sum();
    db.drop().await;
    broker.remove(&name).await;
    Ok(Run {
        kills,
        duplicates,
        lost,
        calls,
        ..Run::default()
    })
}

/// When the drain of [`kill_in_turn`] ends: once every event is done and nothing has moved for
/// a while.
pub(crate) struct Drain {
    /// The events to be done.
    pub(crate) events: u32,
    /// What the drain's lines call the events done (`done`, `credited`).
    pub(crate) unit: &'static str,
    /// How long nothing may move, once every event is done, before the drain ends.
    pub(crate) quiet: Duration,
    /// The broker's redelivery delay: a drain that moves nothing for longer is stalled.
    pub(crate) delay: Duration,
    /// How often a stalled drain has its children replaced; 0: a stall fails the run
    /// ([`Broker::drain_restarts`]).
    pub(crate) restarts: u32,
}

/// Runs a child of each of `specs` (with `env` added) side by side, SIGKILLs them in turn after
/// each of `waits` and starts each killed one again at once, then lets them run until `drain`
/// says they are done. `progress` reads the events done and a figure that moves while any child
/// works. A stalled drain has its children replaced, up to `drain.restarts` times (Tansu can
/// leave a lone group member without partitions: new members rebalance), and gives up a minute
/// later; with no restarts allowed (librdkafka's mock cluster) a stall fails the run.
/// Returns the kills.
pub(crate) async fn kill_in_turn<F, Fut>(
    (specs, env): (&[ChildSpec], &[(&str, String)]),
    waits: Vec<Duration>,
    drain: Drain,
    bar: &progress::Progress,
    mut progress: F,
) -> Result<u32, BoxError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(i64, i64), BoxError>>,
{
    let (label, count) = (bar.label(), i64::from(drain.events));
    let mut children = Vec::new();
    for spec in specs {
        children.push(kill::spawn_ready(&spec.to_args(), env, &mut 0).await?);
    }
    let mut kills = 0;
    for (i, wait) in waits.into_iter().enumerate() {
        tokio::time::sleep(wait).await;
        let (done, _) = progress().await?;
        if done >= count {
            break;
        }
        let which = i % specs.len();
        kill::stop(&mut children[which]).await;
        kills += 1;
        children[which] = kill::spawn_ready(&specs[which].to_args(), env, &mut 0).await?;
        bar.set_message(match specs.len() {
            1 => format!("{kills} kills"),
            _ => format!("{kills} kills (last: {})", specs[which].role.name()),
        });
        bar.set_position(done);
    }
    let (mut last, mut since, mut restarts) = (-1, Instant::now(), 0);
    bar.set_message(format!("{kills} kills, draining"));
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (done, moving) = progress().await?;
        bar.set_position(done);
        if moving != last {
            (last, since) = (moving, Instant::now());
        }
        if done >= count && since.elapsed() >= drain.quiet {
            break;
        } else if since.elapsed() >= drain.delay + Duration::from_secs(60) {
            bar.println(&format!(
                "{label}: the drain stopped at {done}/{count} {}",
                drain.unit
            ));
            break;
        } else if since.elapsed() >= drain.delay + Duration::from_secs(10)
            && (drain.restarts == 0 || restarts < drain.restarts)
        {
            let stall = format!("{label}: the drain applies nothing at {done}/{count}");
            if drain.restarts == 0 {
                return Err(stall.into());
            }
            let them = if specs.len() == 1 {
                "it"
            } else {
                "the children"
            };
            bar.println(&format!("{stall}; replacing {them}"));
            for (child, spec) in children.iter_mut().zip(specs) {
                kill::stop(child).await;
                *child = kill::spawn_ready(&spec.to_args(), env, &mut 0).await?;
            }
            (restarts, since) = (restarts + 1, Instant::now());
        }
    }
    for child in &mut children {
        kill::stop(child).await;
    }
    Ok(kills)
}
