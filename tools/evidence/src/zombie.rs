//! `zombie-test`: three consumers; one event in 500 stalls on its first handling long enough
//! for its consumer to lose ownership, and the stalled handler still writes. The scenario is the
//! conformance suite's (`inbox_conformance::scenarios::zombie`); here it runs over variants and
//! runs, with a table and JSON lines.

use std::time::Duration;

use inbox_admin::progress::Progress;
use inbox_conformance::scenarios::{ZombiePlan, ZombieReport};
use inbox_conformance::TestBroker;
use inbox_core::BoxError;

use crate::brokers::{self, with_broker, Broker};
use crate::settings::ZombieSettings;

const CONSUMERS: usize = 3;

async fn on_broker<B: TestBroker>(broker: &Broker<B>, s: &ZombieSettings) -> Result<(), BoxError> {
    let kind = broker.kind();
    println!(
        "\n{kind}: zombie test, {CONSUMERS} consumers, {} events, one in {} stalls past the \
         broker's hold on its first handling, {} run(s)",
        s.events, s.stall_every, s.runs
    );
    println!(
        "{:<32} {:>7} {:>17} {:>18} {:>18} {:>5}",
        "variant", "stalls", "ownership losses", "duplicate credits", "skipped by inbox", "lost"
    );
    let plan = ZombiePlan {
        events: s.events,
        stall_every: s.stall_every,
        members: CONSUMERS,
        work: Duration::from_millis(s.work_ms),
    };
    let expected_stalls = s.events.div_ceil(s.stall_every);
    let mut lines = Vec::new();
    for &variant in &s.variants {
        let mut total = ZombieReport::default();
        for run in 0..s.runs {
            let label = format!(
                "{kind} zombie {} run {}/{}",
                variant.name(),
                run + 1,
                s.runs
            );
            let bar = Progress::bar(&label, u64::from(s.events), "events", "applied");
            let counter = bar.counter();
            let tick = move |applied: i64, stalls: i64| {
                counter.set_message(format!("{stalls}/{expected_stalls} stalls"));
                counter.set_position(applied);
            };
            let name = format!("zombie-{}-{run}", variant.name());
            let Some(c) = broker.zombie(&name, variant, plan, tick).await? else {
                println!("{kind}: skipped, it cannot take a message away from a stalled consumer");
                return Ok(());
            };
            bar.finish();
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

/// `evidence zombie-test`: the zombie test on every broker asked for that answers.
pub(crate) async fn run(s: &ZombieSettings) -> Result<(), BoxError> {
    if s.variants.iter().any(|v| v.auto_ack()) {
        return Err(
            "zombie-test runs the variants b and c (--variants b,c): a consumer that \
                    acks on receipt holds nothing to lose"
                .into(),
        );
    }
    for &kind in &s.brokers.list {
        if brokers::left_out(kind, s.brokers.required)? {
            continue;
        }
        brokers::kafka_note(kind, s.brokers.kafka_impl);
        with_broker!(kind, s.brokers.kafka_impl, |broker| on_broker(broker, s)
            .await?);
    }
    Ok(())
}
