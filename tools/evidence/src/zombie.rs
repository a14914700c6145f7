//! `zombie-test`: three consumers; one event in 500 stalls on its first handling long enough
//! for its consumer to lose ownership, and the stalled handler still writes.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use inbox_admin::progress;
use inbox_conformance::wallet::{self, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{BoxError, OutgoingMessage, StatsSnapshot};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use crate::brokers::{self, Broker};
use crate::cli::{BrokerKind, ConsumerSpec, Variant};
use crate::consume::Watch;
use crate::settings::ZombieSettings;

const CONSUMERS: usize = 3;

/// How long a stalled handler sleeps: past each broker's ownership limit.
fn stall(kind: BrokerKind) -> Duration {
    Duration::from_secs(match kind {
        BrokerKind::Kafka => 12,   // max.poll.interval.ms = 10 s
        BrokerKind::Sqs => 8,      // visibility timeout 5 s, heartbeat off
        BrokerKind::Redis => 6,    // XAUTOCLAIM after 3 s idle
        BrokerKind::Rabbitmq => 4, // the broker closes the stalled consumer's connection
    })
}

/// One run's counts.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct ZombieCounts {
    pub(crate) stalls: i64,
    /// Stalled messages handed to another consumer: handled again, or skipped by the inbox.
    pub(crate) ownership_losses: u64,
    pub(crate) duplicates: i64,
    pub(crate) skipped_duplicates: u64,
    pub(crate) lost: i64,
}

pub(crate) async fn on_broker(broker: &dyn Broker, s: &ZombieSettings) -> Result<(), BoxError> {
    let kind = broker.kind();
    println!(
        "\n{kind}: zombie test, {CONSUMERS} consumers, {} events, one in {} stalls {:?} on its first handling, {} run(s)",
        s.events, s.stall_every, stall(kind), s.runs
    );
    println!(
        "{:<32} {:>7} {:>17} {:>18} {:>18} {:>5}",
        "variant", "stalls", "ownership losses", "duplicate credits", "skipped by inbox", "lost"
    );
    let mut lines = Vec::new();
    for &variant in &s.variants {
        let mut total = ZombieCounts::default();
        for run in 0..s.runs {
            let c = run_once(broker, s, variant, run).await?;
            total.stalls += c.stalls;
            total.ownership_losses += c.ownership_losses;
            total.duplicates += c.duplicates;
            total.skipped_duplicates += c.skipped_duplicates;
            total.lost += c.lost;
        }
        println!(
            "{:<32} {:>7} {:>17} {:>18} {:>18} {:>5}",
            variant.label(),
            total.stalls,
            total.ownership_losses,
            total.duplicates,
            total.skipped_duplicates,
            total.lost
        );
        lines.push(serde_json::json!({
            "test": "zombie", "broker": kind.name(), "variant": variant.name(), "runs": s.runs,
            "events": u64::from(s.events) * u64::from(s.runs), "stalls": total.stalls,
            "ownership_losses": total.ownership_losses, "duplicates": total.duplicates,
            "skipped_duplicates": total.skipped_duplicates, "lost": total.lost,
        }));
    }
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

async fn run_once(
    broker: &dyn Broker,
    s: &ZombieSettings,
    variant: Variant,
    run: u32,
) -> Result<ZombieCounts, BoxError> {
    let kind = broker.kind();
    let db = TestDb::new().await;
    let name = broker
        .create(&format!("{kind}-zombie-{}-{run}", variant.name()))
        .await?;
    let events: Vec<OutgoingMessage> = (0..s.events)
        .map(|i| {
            let event = CreditEvent {
                stall: i % s.stall_every == s.stall_every / 2,
                ..CreditEvent::new(1 + i64::from(i % 100), 1 + i64::from(i % 37))
            };
            brokers::credit(i, &event)
        })
        .collect();
    broker.publish(&name, &events).await?;
    let redelivery = broker.redelivery_delay(&name).await?;

    let (stalled_tx, mut stalled_rx) = mpsc::unbounded_channel();
    let watch = Watch {
        stalled: Some(stalled_tx),
        ..Watch::default()
    };
    let (stop, stopping) = watch::channel(false);
    let specs: Vec<ConsumerSpec> = (0..CONSUMERS)
        .map(|member| ConsumerSpec {
            work: Duration::from_millis(s.work_ms),
            member,
            zombie: true,
            stall: stall(kind),
            ..ConsumerSpec::new(kind, variant, &name, &db.schema)
        })
        .collect();
    let stats: Vec<Result<StatsSnapshot, BoxError>> = {
        let consumers = join_all(specs.iter().map(|spec| {
            let mut stopping = stopping.clone();
            broker.consume(
                spec,
                &db,
                watch.clone(),
                Box::pin(async move {
                    let _ = stopping.wait_for(|stop| *stop).await;
                }),
            )
        }));
        tokio::pin!(consumers);
        let published = i64::from(s.events);
        let expected_stalls = i64::from(s.events.div_ceil(s.stall_every));
        let (mut rows, mut last_change) = (-1, Instant::now());
        let label = format!(
            "{kind} zombie {} run {}/{}",
            variant.name(),
            run + 1,
            s.runs
        );
        let bar = progress::Progress::bar(label, u64::from(s.events), "events", "applied");
        loop {
            tokio::select! {
                finished = &mut consumers => break finished,
                Some(member) = stalled_rx.recv() => {
                    // Give the stalled handler a moment to be inside its sleep, then take its
                    // messages away where the broker needs a push.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if let Err(e) = broker.take_away(&specs[member]).await {
                        bar.println(&format!("cannot take the stalled consumer's messages away: {e}"));
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(250)) => {
                    let summary = wallet::summary(&db.pool).await?;
                    if summary.ledger_rows != rows {
                        rows = summary.ledger_rows;
                        last_change = Instant::now();
                    }
                    let quiet = last_change.elapsed();
                    let stalls = stall_rows(&db).await?;
                    bar.set_message(format!("{stalls}/{expected_stalls} stalls"));
                    bar.set_position(summary.distinct_events);
                    let done = summary.distinct_events >= published && stalls >= expected_stalls
                        && quiet >= stall(kind) + redelivery;
                    if done || quiet >= Duration::from_secs(120) {
                        let _ = stop.send(true);
                    }
                }
            }
        }
    };
    let mut skipped = 0;
    for result in stats {
        skipped += result?.skipped_duplicates;
    }
    let summary = wallet::summary(&db.pool).await?;
    let counts = ZombieCounts {
        stalls: stall_rows(&db).await?,
        ownership_losses: watch.second_handlings.load(Ordering::Relaxed) + skipped,
        duplicates: summary.duplicates(),
        skipped_duplicates: skipped,
        lost: summary.lost(i64::from(s.events)),
    };
    db.drop().await;
    broker.remove(&name).await;
    Ok(counts)
}

async fn stall_rows(db: &TestDb) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM wallet_stalls")
        .fetch_one(&db.pool)
        .await
}

/// `evidence zombie-test`: the zombie test on every broker asked for that answers.
pub(crate) async fn run(s: &ZombieSettings) -> Result<(), BoxError> {
    for &kind in &s.brokers {
        let Some(broker) = brokers::connect_or_skip(kind, s.kafka_impl, s.require_brokers).await?
        else {
            continue;
        };
        brokers::kafka_note(kind, s.kafka_impl);
        on_broker(broker.as_ref(), s).await?;
    }
    Ok(())
}
