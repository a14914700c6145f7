//! `kill-test`: publish N credit events, SIGKILL the consumer process K times on a seeded
//! schedule, let a final consumer drain, and count duplicates and losses from the ledger.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use inbox_admin::progress;
use inbox_conformance::wallet::CreditEvent;
use inbox_core::{BoxError, OutgoingMessage};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::brokers::{self, Broker};
use crate::chart;
use crate::cli::{
    BrokerKind, ConsumerSpec, KafkaImpl, StoreKind, Variant, KAFKA_IMPL_HELP, KAFKA_IMPL_LONG_HELP,
};
use crate::report::{self, RunResult, VariantResult};
use crate::settings::{KillArgs, KillSettings};
use crate::wallet_db::{self, WalletDb};

/// The seeded events of every run: IDs `evt-<i>`, accounts and amounts from `seed`.
pub(crate) fn events(s: &KillSettings, count: u32) -> (Vec<OutgoingMessage>, HashMap<i64, i64>) {
    let mut rng = StdRng::seed_from_u64(s.seed);
    let mut expected = HashMap::new();
    let events = (0..count)
        .map(|i| {
            let event =
                CreditEvent::new(rng.random_range(1..=s.accounts), rng.random_range(1..=100));
            *expected.entry(event.account_id).or_insert(0) += event.amount;
            brokers::credit(i, &event)
        })
        .collect();
    (events, expected)
}

/// Seconds of work before each kill of run `run`: the same for every variant and broker.
fn schedule(s: &KillSettings, run: u32) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(s.seed ^ (0x6b11 + u64::from(run)));
    (0..s.kills)
        .map(|_| Duration::from_millis(rng.random_range(s.kill_after_ms.0..=s.kill_after_ms.1)))
        .collect()
}

/// Runs the kill test on one broker for every variant of `s`.
pub(crate) async fn on_broker(
    broker: &dyn Broker,
    s: &KillSettings,
) -> Result<Vec<VariantResult>, BoxError> {
    let mut results = Vec::new();
    for &variant in &s.variants {
        let mut runs = Vec::new();
        for run in 0..s.runs {
            let r = run_once(broker, s, variant, run).await?;
            // Kept in the output as it happens, so a long session cut short still shows it.
            println!(
                "run done: {} {} run {}/{}: {} duplicates, {} lost, {} kills, {} self-crashes",
                broker.kind(),
                variant.name(),
                run + 1,
                s.runs,
                r.duplicates,
                r.lost,
                r.kills,
                r.self_crashes
            );
            runs.push(r);
        }
        let throughput = if s.throughput {
            Some(throughput(broker, s, variant).await?)
        } else {
            None
        };
        let result = VariantResult {
            broker: broker.kind(),
            variant,
            events: s.events,
            kills_per_run: s.kills,
            runs,
            throughput,
            work_ms: s.work_ms,
        };
        println!("{}{}", report::VARIANT_DONE, result.json_line()?);
        results.push(result);
    }
    Ok(results)
}

fn spec(
    broker: BrokerKind,
    variant: Variant,
    name: &str,
    db: &dyn WalletDb,
    s: &KillSettings,
) -> ConsumerSpec {
    ConsumerSpec {
        work: Duration::from_millis(s.work_ms),
        lanes: s.lanes,
        crash_between_commit_and_ack: s.crash_between_commit_and_ack,
        store: db.store(),
        ..ConsumerSpec::new(broker, variant, name, db.name())
    }
}

async fn run_once(
    broker: &dyn Broker,
    s: &KillSettings,
    variant: Variant,
    run: u32,
) -> Result<RunResult, BoxError> {
    let kind = broker.kind();
    let db = wallet_db::create(s.store, s.shards).await?;
    let name = broker
        .create(&format!("{kind}-{}-{run}", variant.name()))
        .await?;
    let (events, expected) = events(s, s.events);
    broker.publish(&name, &events).await?;
    let spec = spec(kind, variant, &name, db.as_ref(), s);
    let label = format!("{kind} {} run {}/{}", variant.name(), run + 1, s.runs);
    let bar = progress::Progress::bar(label, u64::from(s.events), "events", "applied");
    let mut self_crashes = 0;
    for (k, work) in schedule(s, run).into_iter().enumerate() {
        let mut child = spawn_ready(&spec).await?;
        // The clock runs from the child's first write: on Kafka a restarted member waits for the
        // group to notice the killed one (the session timeout) before it gets partitions.
        let killed_at = first_write(broker, &name, db.as_ref(), &mut child).await? + work;
        bar.set_message(format!("kill {}/{}", k + 1, s.kills));
        // The crash option makes the child abort itself: restart it, the kill clock runs on.
        while Instant::now() < killed_at {
            if child.try_wait()?.is_some() {
                self_crashes += 1;
                child = spawn_ready(&spec).await?;
            }
            bar.set_position(db.summary().await?.distinct_events);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        child.start_kill()?; // SIGKILL: no destructor, no close, no last commit
        child.wait().await?;
    }
    let mut drain_spec = spec.clone();
    drain_spec.crash_between_commit_and_ack = 0.0;
    drain(broker, &drain_spec, db.as_ref(), i64::from(s.events), &bar).await?;
    let result = count(db.as_ref(), s.events, &expected, s.kills, self_crashes).await?;
    bar.finish();
    db.remove().await;
    broker.remove(&name).await;
    Ok(result)
}

/// When the child first writes to the ledger; now, if it dies first or the broker holds nothing
/// more for it (after an ack on receipt lost the rest, say), or after 30 s at most.
async fn first_write(
    broker: &dyn Broker,
    name: &str,
    db: &dyn WalletDb,
    child: &mut Child,
) -> Result<Instant, BoxError> {
    let count = || async { Ok::<_, BoxError>(db.summary().await?.ledger_rows) };
    let rows = count().await?;
    let start = Instant::now();
    let mut next_look = start;
    while start.elapsed() < Duration::from_secs(30) && child.try_wait()?.is_none() {
        if count().await? != rows {
            break;
        }
        if Instant::now() >= next_look {
            if broker.left(name).await? == Some(0) {
                break;
            }
            next_look = Instant::now() + Duration::from_secs(1);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Instant::now())
}

/// A no-kill run: events per second from the consumer's start to its last write.
async fn throughput(
    broker: &dyn Broker,
    s: &KillSettings,
    variant: Variant,
) -> Result<f64, BoxError> {
    let kind = broker.kind();
    let db = wallet_db::create(s.store, s.shards).await?;
    let name = broker
        .create(&format!("{kind}-{}-rate", variant.name()))
        .await?;
    let (events, _) = events(s, s.throughput_events);
    broker.publish(&name, &events).await?;
    let mut spec = spec(kind, variant, &name, db.as_ref(), s);
    spec.crash_between_commit_and_ack = 0.0;
    let label = format!("{kind} {} no-kill throughput", variant.name());
    let bar = progress::Progress::bar(label, u64::from(s.throughput_events), "events", "applied");
    let elapsed = drain(
        broker,
        &spec,
        db.as_ref(),
        i64::from(s.throughput_events),
        &bar,
    )
    .await?;
    let rows = db.summary().await?.ledger_rows;
    bar.finish();
    db.remove().await;
    broker.remove(&name).await;
    Ok(rows as f64 / elapsed.as_secs_f64().max(1e-3))
}

pub(crate) async fn count(
    db: &dyn WalletDb,
    published: u32,
    expected: &HashMap<i64, i64>,
    kills: u32,
    self_crashes: u32,
) -> Result<RunResult, BoxError> {
    let summary = db.summary().await?;
    let balances = db.balances().await?;
    let matches = balances.len() == expected.len()
        && balances
            .iter()
            .all(|(id, balance)| expected.get(id) == Some(balance));
    Ok(RunResult {
        kills,
        self_crashes,
        duplicates: summary.duplicates(),
        lost: summary.lost(i64::from(published)),
        balances_exact: summary.balances_exact && matches,
    })
}

/// Starts `evidence consume` for `spec` and waits until it has connected.
pub(crate) async fn spawn_ready(spec: &ConsumerSpec) -> Result<Child, BoxError> {
    for _ in 0..5 {
        if let Some(child) = start_child(spec, &[], Duration::from_secs(60)).await? {
            return Ok(child);
        }
        // It died on the way up (a self-crash on the first message, say): try again.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(format!(
        "`evidence consume` for {} did not start five times in a row",
        spec.name
    )
    .into())
}

/// This binary run as a child with `args` and `env` added: marked as a child, its logs
/// off unless `WALLET_CHILD_LOG` says otherwise, stdout piped for its `ready` line, killed when
/// dropped.
pub(crate) fn child_command(args: Vec<String>, env: &[(&str, String)]) -> std::io::Result<Command> {
    let mut command = Command::new(std::env::current_exe()?);
    command
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("WALLET_CHILD", "1")
        .env(
            "RUST_LOG",
            std::env::var("WALLET_CHILD_LOG").unwrap_or_else(|_| "error,lapin=off".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    Ok(command)
}

/// One attempt to start `evidence consume` for `spec`, with `env` added to its environment: the
/// child once it says it is connected, `None` when it dies or stays silent for `patience`.
pub(crate) async fn start_child(
    spec: &ConsumerSpec,
    env: &[(&str, String)],
    patience: Duration,
) -> Result<Option<Child>, BoxError> {
    let mut child = child_command(spec.to_args(), env)?.spawn()?;
    let stdout = child.stdout.take().ok_or("the child has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(patience, lines.next_line()).await;
    if let Ok(Ok(Some(line))) = ready {
        if line == "ready" {
            return Ok(Some(child));
        }
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
    Ok(None)
}

/// How a draining member ended.
enum Drained {
    /// The ledger holds every event (or the broker nothing more), or the drain gave up.
    Done,
    /// It applied nothing while the broker held messages: replace it.
    Replace,
    /// The same, on a broker where that is not worked around: fail the run.
    Stalled(String),
}

/// Runs a clean consumer until the ledger is quiet and the broker holds nothing more; returns
/// the time from its start to its last write.
///
/// A consumer that applies nothing for the redelivery delay and 10 s more while the broker still
/// holds messages is stopped and replaced, at most [`Broker::drain_restarts`] times, each said on
/// stderr: Tansu 0.6 can leave a group whose leader died during a rebalance with an empty
/// assignment for its last member, which then waits forever; a new member makes the group
/// rebalance. Where the broker allows no restarts (librdkafka's mock, `--kafka-impl mock`), such
/// a stall fails the run instead.
pub(crate) async fn drain(
    broker: &dyn Broker,
    spec: &ConsumerSpec,
    db: &dyn WalletDb,
    published: i64,
    bar: &progress::Progress,
) -> Result<Duration, BoxError> {
    let label = bar.label();
    bar.set_message("draining");
    let start = Instant::now();
    let (mut rows, mut last_change) = (-1, start);
    let delay = broker.redelivery_delay(&spec.name).await?;
    let max_restarts = broker.drain_restarts();
    let mut restarts = 0;
    loop {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = db.consume(
            broker,
            spec,
            Box::pin(async {
                let _ = stopped.await;
            }),
        );
        tokio::pin!(consumer);
        let member_start = Instant::now();
        let drained = loop {
            tokio::select! {
                finished = &mut consumer => {
                    finished?;
                    return Err("the draining consumer stopped by itself".into());
                }
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
            let summary = db.summary().await?;
            if summary.ledger_rows != rows {
                rows = summary.ledger_rows;
                last_change = Instant::now();
            }
            bar.set_position(summary.distinct_events);
            let quiet = last_change.elapsed();
            let empty = |left: &Result<Option<u64>, BoxError>| matches!(left, Ok(None | Some(0)));
            if summary.distinct_events >= published && quiet >= Duration::from_secs(1) {
                if empty(&broker.left(&spec.name).await) {
                    break Drained::Done;
                }
            } else if quiet >= delay {
                let left = broker.left(&spec.name).await;
                // Idle since the later of the last write and this member's start.
                let idle = quiet.min(member_start.elapsed());
                if empty(&left) || idle >= delay + Duration::from_secs(60) {
                    break Drained::Done;
                }
                if idle >= delay + Duration::from_secs(10) {
                    let stall = format!(
                        "the draining consumer applied nothing for {} s while the broker holds \
                         {} messages ({}/{published} events applied)",
                        idle.as_secs(),
                        left.ok().flatten().unwrap_or_default(),
                        summary.distinct_events
                    );
                    if max_restarts == 0 {
                        break Drained::Stalled(stall);
                    }
                    if restarts < max_restarts {
                        bar.println(&format!("{label}: {stall}; replacing it"));
                        break Drained::Replace;
                    }
                }
            }
        };
        let _ = stop.send(());
        match tokio::time::timeout(Duration::from_secs(30), consumer).await {
            Ok(result) => {
                result?;
            }
            Err(_) => bar.println(&format!(
                "{label}: the draining consumer did not stop in 30 s"
            )),
        }
        match drained {
            Drained::Done => return Ok(last_change - start),
            Drained::Replace => restarts += 1,
            Drained::Stalled(stall) => return Err(format!("{label}: {stall}").into()),
        }
    }
}

/// The main demo: a short kill test of b and c on every broker that answers; `--full` for
/// the article's settings.
pub(crate) async fn demo(full: bool, args: KillArgs) -> Result<(), BoxError> {
    let settings = args.apply(if full {
        KillSettings::full()
    } else {
        KillSettings::demo()
    });
    println!(
        "The wallet kill test: {} credit events per run, the consumer process SIGKILLed {} times \
         per run after {}–{} ms of work, then a last consumer drains. (`cargo xtask demo --full` \
         runs the article's settings.)",
        settings.events, settings.kills, settings.kill_after_ms.0, settings.kill_after_ms.1
    );
    if settings.crash_between_commit_and_ack > 0.0 {
        println!(
            "The consumer also aborts itself right after a DB commit, before its ack, with \
             probability {} per message (--crash-between-commit-and-ack).",
            settings.crash_between_commit_and_ack
        );
    }
    run(&settings).await
}

/// `evidence kill-test`: the kill test on every broker asked for that answers.
pub(crate) async fn run(s: &KillSettings) -> Result<(), BoxError> {
    if s.store == StoreKind::Mysql {
        if s.variants.iter().any(|&v| v != Variant::C) {
            return Err(
                "--store mysql runs variant c only (--variants c): the variants a1, a2 \
                        and b show what the inbox prevents, on PostgreSQL"
                    .into(),
            );
        }
        println!("The inbox store: MySQL (inbox-mysql, INBOX_MYSQL_URL).");
    }
    if s.store == StoreKind::Sharded {
        if s.variants.iter().any(|&v| v != Variant::C) {
            return Err("--store sharded runs variant c only (--variants c)".into());
        }
        println!(
            "The inbox store: inbox-postgres behind Sharded, credits routed by account over {} \
             PostgreSQL cluster(s) of the run's own.",
            s.shards
        );
    }
    if s.lanes > 1 {
        println!(
            "Each consumer applies up to {} lanes side by side (--lanes).",
            s.lanes
        );
    }
    let mut all = Vec::new();
    let mut failures = Vec::new();
    for &kind in &s.brokers {
        let Some(broker) = brokers::connect_or_skip(kind, s.kafka_impl, s.require_brokers).await?
        else {
            continue;
        };
        brokers::kafka_note(kind, s.kafka_impl);
        match on_broker(broker.as_ref(), s).await {
            Ok(results) => {
                report::table(&results);
                all.extend(results);
            }
            Err(e) => {
                println!("\n{kind}: the kill test failed: {e}");
                failures.push(format!("{kind}: {e}"));
            }
        }
    }
    if !all.is_empty() {
        match chart::write(&s.chart, &all) {
            Ok(()) => println!("\nchart: {}", s.chart.display()),
            Err(e) => eprintln!("cannot write the chart {}: {e}", s.chart.display()),
        }
        println!();
        report::json_lines(&all);
    }
    let inbox_broken = all
        .iter()
        .any(|r| r.variant == Variant::C && (r.duplicates().max > 0 || r.lost().max > 0));
    if inbox_broken {
        failures.push("variant c showed duplicates or losses".into());
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; ").into())
    }
}

/// `evidence publish`.
#[derive(Debug, clap::Args)]
pub(crate) struct PublishArgs {
    #[arg(long, value_name = "kafka|sqs|rabbitmq|redis")]
    broker: BrokerKind,
    /// The queue, topic or stream.
    #[arg(long, value_name = "QUEUE")]
    name: String,
    /// Credit events to publish.
    #[arg(long, value_name = "N", default_value = "1000")]
    events: u32,
    /// Seed of the events.
    #[arg(long, value_name = "N", default_value = "42")]
    seed: u64,
    #[arg(long, value_name = "tansu|mock", default_value = "tansu", help = KAFKA_IMPL_HELP, long_help = KAFKA_IMPL_LONG_HELP)]
    kafka_impl: KafkaImpl,
}

/// Creates the queue, topic or stream and publishes seeded credit events to it.
pub(crate) async fn publish(args: PublishArgs) -> Result<(), BoxError> {
    let PublishArgs {
        broker,
        name,
        events,
        seed,
        kafka_impl,
    } = args;
    let broker = brokers::connect(broker, kafka_impl).await?;
    let settings = KillSettings {
        events,
        seed,
        ..KillSettings::full()
    };
    let (outgoing, _) = self::events(&settings, events);
    let name = broker.create(&name).await?;
    broker.publish(&name, &outgoing).await?;
    println!(
        "published {events} credit events to {} `{name}`",
        broker.kind()
    );
    Ok(())
}
