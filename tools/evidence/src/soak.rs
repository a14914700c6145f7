//! `soak`: a long run per broker. Credit events are published in chunks while one consumer child
//! at a time works through them, SIGKILLed every few seconds and restarted at once, with a
//! network fault injected into its connections every minute through fault proxies in this
//! process; then a clean drain, the ledger counted, and the children's memory (VmRSS) over the run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt, TryStreamExt};
use inbox_admin::progress;
use inbox_conformance::kill::{KillPlan, KillReport};
use inbox_conformance::{TestBroker, TestDb};
use inbox_core::BoxError;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::process::Child;

use crate::bench;
use crate::brokers::{self, with_broker, Broker};
use crate::cli::{
    millis, minutes, positive, seconds, seconds_range, BrokerKind, ConsumerSpec, HandlerKind,
    KafkaImpl, Variant, KAFKA_IMPL_HELP, KAFKA_IMPL_LONG_HELP,
};
use crate::faults::{Fault, Proxies, BROKER_BLACKHOLED_FOR, DB_REFUSED_FOR};
use crate::kill::{self, Credits};

/// Events generated and handed to the broker at a time, and chunks in flight at once.
const CHUNK: u32 = 10_000;
const CHUNKS_IN_FLIGHT: usize = 4;
const PUBLISH_ATTEMPTS: u32 = 10;
/// A child's RSS is reported at this age.
const RSS_AGE: Duration = Duration::from_secs(10);

/// The flags of `soak`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SoakSettings {
    /// Brokers to soak, one after the other.
    #[arg(
        long,
        alias = "broker",
        value_delimiter = ',',
        value_name = "BROKER,…",
        default_value = "redis,rabbitmq,kafka"
    )]
    brokers: Vec<BrokerKind>,
    /// Credit events per broker.
    #[arg(long, value_name = "N", default_value = "1000000", value_parser = clap::value_parser!(u32).range(1..))]
    events: u32,
    /// Accounts the events credit.
    #[arg(long, value_name = "N", default_value = "1000", value_parser = clap::value_parser!(i64).range(1..))]
    accounts: i64,
    /// Messages per transaction.
    #[arg(long, value_name = "N", default_value = "1000", value_parser = positive)]
    batch: usize,
    /// Lanes applied side by side.
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    lanes: usize,
    /// The set-based batch handler or the per-message one.
    #[arg(long, value_name = "batch|message", default_value = "batch")]
    handler: HandlerKind,
    /// The handler's work per message: milliseconds, or a duration such as 1ms.
    #[arg(long, value_name = "MS", default_value = "0", value_parser = millis)]
    work_ms: u64,
    /// A child's life before its kill, drawn from MIN..MAX: seconds, or durations such as 5s..1m.
    #[arg(long, value_name = "MIN..MAX", default_value = "5..30", value_parser = seconds_range)]
    kill_every: (u64, u64),
    /// Time between network faults: seconds, or a duration such as 1m; 0: none.
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = seconds)]
    fault_every: u64,
    /// Seed of the events, the kill schedule and the faults.
    #[arg(long, value_name = "N", default_value = "42")]
    seed: u64,
    /// After this the kills and faults stop and the drain does the rest: minutes, or a duration
    /// such as 1h30m.
    #[arg(long, value_name = "MINUTES", default_value = "60", value_parser = minutes)]
    max_minutes: u64,
    #[arg(long, value_name = "tansu|mock", default_value = "tansu", help = KAFKA_IMPL_HELP, long_help = KAFKA_IMPL_LONG_HELP)]
    kafka_impl: KafkaImpl,
}

/// Events handed to the broker, and chunks published again after a failure.
#[derive(Debug, Default)]
struct Published {
    events: AtomicU32,
    republished_chunks: AtomicU32,
}

/// Publishes every event, [`CHUNKS_IN_FLIGHT`] chunks at a time; returns the expected balances.
///
/// A chunk whose publishing fails (the shared broker restarted by another test, say) is published
/// again whole: the copies of its first messages carry the same IDs, so the inbox skips them.
async fn publish<B: TestBroker>(
    broker: &Broker<B>,
    name: &str,
    s: &SoakSettings,
    published: &Published,
) -> Result<HashMap<i64, i64>, BoxError> {
    let mut events = Credits::new(s.seed, s.accounts);
    let chunks = s.events.div_ceil(CHUNK);
    stream::iter(0..chunks)
        .map(|i| {
            let chunk: Vec<_> = events
                .by_ref()
                .take(CHUNK.min(s.events - i * CHUNK) as usize)
                .collect();
            async move {
                let mut attempts = 1;
                loop {
                    match broker.publish(name, &chunk).await {
                        Ok(()) => return Ok::<_, BoxError>(chunk.len() as u32),
                        Err(e) if attempts < PUBLISH_ATTEMPTS => {
                            eprintln!("publishing a chunk to {name} failed ({e}); again in 2 s");
                            published.republished_chunks.fetch_add(1, Ordering::Relaxed);
                            attempts += 1;
                            tokio::time::sleep(Duration::from_secs(2)).await;
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        })
        .buffer_unordered(CHUNKS_IN_FLIGHT)
        .try_for_each(|n| {
            published.events.fetch_add(n, Ordering::Relaxed);
            async { Ok(()) }
        })
        .await?;
    Ok(events.expected)
}

/// The child running now.
struct Running {
    child: Child,
    pid: u32,
    started: Instant,
    /// Which child of the run this is, from 0.
    index: u32,
    /// Its first VmRSS sample at [`RSS_AGE`] or later (kB).
    rss_at_age: Option<u64>,
    rss_max: u64,
}

/// A fault whose effect is being watched: did the same child apply anything after it ended?
struct Watched {
    child: u32,
    ended: Instant,
    /// The ledger's highest row ID at the first look after the fault ended.
    mark: Option<i64>,
}

/// What the kill phase saw.
#[derive(Debug, Default)]
struct Phase {
    children: u32,
    kills: u32,
    /// Children that ended by themselves (a fatal error, a panic), with how.
    exits: Vec<String>,
    /// Starts that died or stayed silent before saying they were connected.
    failed_starts: u32,
    /// Faults injected, by their place in [`Fault::ALL`].
    faults: [u32; Fault::ALL.len()],
    /// Seconds from a fault's end to the same child's next ledger write.
    recovered_in_place: Vec<f64>,
    /// Faults after which the child was killed (or ended) before it wrote again.
    ended_by_kill: u32,
    /// Faults near the end, after which there was nothing left to write.
    unresolved: u32,
    /// RSS at [`RSS_AGE`] of the first and of the last child that reached it, and the highest.
    rss_first: Option<u64>,
    rss_last: Option<u64>,
    rss_max: u64,
    /// The kill phase hit `--max-minutes`.
    timed_out: bool,
    /// How long the kills and faults went on.
    lasted: Duration,
}

impl Phase {
    /// The faults injected so far, each with its count, in the order they rotate.
    fn faults(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        Fault::ALL
            .iter()
            .zip(self.faults)
            .filter(|(_, n)| *n > 0)
            .map(|(f, n)| (f.name(), n))
    }

    fn retire(&mut self, running: &Running) {
        if let Some(kb) = running.rss_at_age {
            self.rss_first.get_or_insert(kb);
            self.rss_last = Some(kb);
        }
        self.rss_max = self.rss_max.max(running.rss_max);
    }
}

/// Starts a child (see [`kill::spawn_ready`]).
async fn start(
    spec: &ConsumerSpec,
    proxies: &Proxies,
    phase: &mut Phase,
) -> Result<Running, BoxError> {
    let failed = &mut phase.failed_starts;
    let child = kill::spawn_ready(&spec.to_args(), &proxies.env, failed).await?;
    phase.children += 1;
    Ok(Running {
        pid: child.id().ok_or("a started child has no pid")?,
        child,
        started: Instant::now(),
        index: phase.children - 1,
        rss_at_age: None,
        rss_max: 0,
    })
}

/// Kills and restarts children, injects faults and samples RSS until every event is published
/// and in the ledger (or `--max-minutes`); the last child is killed too.
async fn kill_phase(
    spec: &ConsumerSpec,
    db: &TestDb,
    s: &SoakSettings,
    proxies: &Proxies,
    published: &Published,
    bar: &progress::Progress,
) -> Result<Phase, BoxError> {
    let mut phase = Phase::default();
    let mut rng = StdRng::seed_from_u64(s.seed ^ 0x50a4);
    let mut life = || Duration::from_secs(rng.random_range(s.kill_every.0..=s.kill_every.1));
    let faults = proxies.faults();
    let fault_every = Duration::from_secs(s.fault_every);
    let start_time = Instant::now();
    let deadline = start_time + Duration::from_secs(s.max_minutes * 60);
    let mut next_fault = start_time + fault_every;
    let mut running = start(spec, proxies, &mut phase).await?;
    let mut kill_at = Instant::now() + life();
    let mut watched: Vec<Watched> = Vec::new();
    let mut applied = 0i64;
    let mut tick = 0u64;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tick += 1;
        let pid = running.pid.to_string();
        let rss = tokio::task::spawn_blocking(move || bench::status_kb(&pid, "VmRSS")).await;
        if let Ok(Some(kb)) = rss {
            running.rss_max = running.rss_max.max(kb);
            if running.rss_at_age.is_none() && running.started.elapsed() >= RSS_AGE {
                running.rss_at_age = Some(kb);
            }
        }
        let top: Option<i64> = sqlx::query_scalar("SELECT max(id) FROM ledger")
            .fetch_one(&db.pool)
            .await?;
        let top = top.unwrap_or(0);
        watched.retain_mut(|w| {
            if w.ended > Instant::now() {
                return true;
            }
            if w.child != running.index {
                phase.ended_by_kill += 1;
                return false;
            }
            match w.mark {
                None => {
                    w.mark = Some(top);
                    true
                }
                Some(mark) if top > mark => {
                    phase
                        .recovered_in_place
                        .push(w.ended.elapsed().as_secs_f64());
                    false
                }
                Some(_) => true,
            }
        });
        if tick.is_multiple_of(5) {
            applied = sqlx::query_scalar("SELECT count(*) FROM ledger")
                .fetch_one(&db.pool)
                .await?;
        }
        let all_published = published.events.load(Ordering::Relaxed) >= s.events;
        let done = all_published && applied >= i64::from(s.events);
        phase.timed_out = Instant::now() >= deadline;
        let ended = running.child.try_wait()?;
        if done || phase.timed_out || ended.is_some() || Instant::now() >= kill_at {
            match ended {
                Some(status) => phase.exits.push(status.to_string()),
                None => {
                    running.child.start_kill()?; // SIGKILL
                    running.child.wait().await?;
                    phase.kills += 1;
                }
            }
            phase.retire(&running);
            if done || phase.timed_out {
                break;
            }
            running = start(spec, proxies, &mut phase).await?;
            kill_at = Instant::now() + life();
        }
        if !faults.is_empty() && s.fault_every > 0 && Instant::now() >= next_fault {
            let fault = faults[phase.faults.iter().sum::<u32>() as usize % faults.len()];
            proxies.inject(fault);
            phase.faults[fault as usize] += 1;
            watched.push(Watched {
                child: running.index,
                ended: Instant::now() + fault.lasts(),
                mark: None,
            });
            next_fault += fault_every;
        }
        bar.set_message(format!(
            "{}/{} published, {} kills, {} faults, child {} at {} MB",
            published.events.load(Ordering::Relaxed),
            s.events,
            phase.kills,
            phase.faults.iter().sum::<u32>(),
            running.index + 1,
            running.rss_max / 1024,
        ));
        bar.set_position(applied);
    }
    // A fault still watched when the work ran out could show no recovery either way.
    phase.unresolved = watched.len() as u32;
    phase.lasted = start_time.elapsed();
    Ok(phase)
}

/// Runs the soak on every broker of `s`; fails when any shows a duplicate or a loss.
pub(crate) async fn run(s: &SoakSettings) -> Result<(), BoxError> {
    println!(
        "The wallet soak: {} credit events per broker, one consumer (`--batch {} --lanes {} \
         --handler {}`) SIGKILLed every {}–{} s and restarted at once, a network fault every {} s \
         (database cut, database refused {} s, broker cut, broker black-holed {} s), then a drain.",
        s.events,
        s.batch,
        s.lanes,
        s.handler.name(),
        s.kill_every.0,
        s.kill_every.1,
        s.fault_every,
        DB_REFUSED_FOR.as_secs(),
        BROKER_BLACKHOLED_FOR.as_secs(),
    );
    let mut failures = Vec::new();
    for &kind in &s.brokers {
        if brokers::left_out(kind, true)? {
            continue;
        }
        brokers::kafka_note(kind, s.kafka_impl);
        if kind == BrokerKind::Kafka {
            println!(
                "kafka: database faults only. A proxy in front of the broker covers only \
                 bootstrap: the clients then connect to the address the broker advertises."
            );
        }
        let (line, failed) =
            with_broker!(kind, s.kafka_impl, |broker| on_broker(broker, s).await?);
        println!("{line}");
        if let Some(f) = failed {
            failures.push(f);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; ").into())
    }
}

async fn on_broker<B: TestBroker>(
    broker: &Broker<B>,
    s: &SoakSettings,
) -> Result<(String, Option<String>), BoxError> {
    let kind = broker.kind();
    let began = Instant::now();
    let db = TestDb::new().await;
    let name = broker.create(&format!("{kind}-soak")).await?;
    let spec = ConsumerSpec {
        work: Duration::from_millis(s.work_ms),
        batch: Some(s.batch),
        lanes: s.lanes,
        handler: s.handler,
        ..ConsumerSpec::new(kind, Variant::C, &name, &db.schema)
    };
    let proxies = Proxies::start(kind).await?;
    let published = Published::default();
    let bar = progress::Progress::bar(format!("{kind} soak"), s.events.into(), "events", "applied");
    let publishing = async {
        let start = Instant::now();
        let expected = publish(broker, &name, s, &published).await?;
        Ok::<_, BoxError>((expected, start.elapsed()))
    };
    let ((expected, publish_time), phase) = tokio::try_join!(
        publishing,
        kill_phase(&spec, &db, s, &proxies, &published, &bar)
    )?;
    drop(proxies);
    let drain_start = Instant::now();
    let h = kill::harness(broker, &spec, &spec, &db, &bar).await?;
    let plan = KillPlan {
        events: i64::from(s.events),
        expected,
        kills: Vec::new(),
    };
    inbox_conformance::kill::drain(&h, plan.events).await?;
    let drain_time = drain_start.elapsed();
    let report = KillReport {
        kills: phase.kills,
        ..KillReport::default()
    };
    let result = inbox_conformance::kill::tally(&h, &plan, report).await?;
    drop(h);
    bar.finish();
    let minutes = began.elapsed().as_secs_f64() / 60.0;
    db.drop().await;
    broker.remove(&name).await;

    let mb = |kb: Option<u64>| kb.map_or("-".to_owned(), |kb| format!("{:.1}", kb as f64 / 1024.0));
    let faults: Vec<String> = phase.faults().map(|(f, n)| format!("{f} {n}")).collect();
    let recovery_max = phase.recovered_in_place.iter().copied().fold(0.0, f64::max);
    let balances = if result.balances_exact {
        "exact"
    } else {
        "WRONG"
    };
    let mut line = format!(
        "{kind}: {} events, {} kills, {} children ({} failed starts, {} exits by themselves), \
         faults [{}] ({} recovered in place within {recovery_max:.0} s, {} cut short by a \
         kill, {} at the end), {} duplicates, {} lost, balances {}, {minutes:.1} min (publishing {:.1} min at \
         {:.0}/s, kills and faults {:.1} min, drain {:.0} s), child RSS MB: {} at 10 s (first), \
         {} at 10 s (last before the drain), {} max",
        s.events,
        phase.kills,
        phase.children,
        phase.failed_starts,
        phase.exits.len(),
        faults.join(", "),
        phase.recovered_in_place.len(),
        phase.ended_by_kill,
        phase.unresolved,
        result.duplicates,
        result.lost,
        balances,
        publish_time.as_secs_f64() / 60.0,
        f64::from(s.events) / publish_time.as_secs_f64().max(1e-3),
        phase.lasted.as_secs_f64() / 60.0,
        drain_time.as_secs_f64(),
        mb(phase.rss_first),
        mb(phase.rss_last),
        mb(Some(phase.rss_max)),
    );
    if phase.timed_out {
        line.push_str(&format!(
            "; the kills and faults stopped at --max-minutes {}, the drain applied the rest",
            s.max_minutes
        ));
    }
    let republished = published.republished_chunks.load(Ordering::Relaxed);
    if republished > 0 {
        line.push_str(&format!(
            "; {republished} chunks of {CHUNK} published again after a publishing error"
        ));
    }
    if !phase.exits.is_empty() {
        line.push_str(&format!("; exits: {}", phase.exits.join(", ")));
    }
    let json = serde_json::json!({
        "soak": kind.name(),
        "events": s.events,
        "batch": s.batch,
        "lanes": s.lanes,
        "handler": s.handler.name(),
        "kill_every_s": [s.kill_every.0, s.kill_every.1],
        "fault_every_s": s.fault_every,
        "seed": s.seed,
        "kills": phase.kills,
        "children": phase.children,
        "failed_starts": phase.failed_starts,
        "exits": phase.exits,
        "faults": phase.faults().collect::<HashMap<_, _>>(),
        "faults_recovered_in_place": phase.recovered_in_place.len(),
        "fault_recovery_max_s": recovery_max,
        "faults_cut_short_by_kill": phase.ended_by_kill,
        "faults_at_the_end": phase.unresolved,
        "broker_faults": kind != BrokerKind::Kafka,
        "duplicates": result.duplicates,
        "lost": result.lost,
        "balances_exact": result.balances_exact,
        "minutes": minutes,
        "publish_per_s": f64::from(s.events) / publish_time.as_secs_f64().max(1e-3),
        "drain_s": drain_time.as_secs_f64(),
        "republished_chunks": republished,
        "timed_out": phase.timed_out,
        "rss_kb_first_at_10s": phase.rss_first,
        "rss_kb_last_at_10s": phase.rss_last,
        "rss_kb_max": phase.rss_max,
    });
    let line = format!("{line}\n{json}");
    let (duplicates, lost) = (result.duplicates, result.lost);
    let failed = (duplicates != 0 || lost != 0 || !result.balances_exact).then(|| {
        let balances = balances.to_lowercase();
        format!("{kind}: {duplicates} duplicates, {lost} lost, balances {balances}")
    });
    Ok((line, failed))
}
