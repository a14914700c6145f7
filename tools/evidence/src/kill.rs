//! `kill-test`: publish N credit events, SIGKILL the consumer process K times on a seeded
//! schedule, let a final consumer drain, and count duplicates and losses from the ledger.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use inbox_admin::progress;
use inbox_conformance::kill::{self, KillAt, KillHarness, KillPlan, KillReport, KillTick};
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::{TestBroker, TestDb, TestStore};
use inbox_core::{BoxError, OutgoingMessage};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::brokers::{self, with_broker, Broker};
use crate::chart;
use crate::cli::{
    BrokerKind, ConsumerSpec, KafkaImpl, StoreKind, Variant, KAFKA_IMPL_HELP, KAFKA_IMPL_LONG_HELP,
};
use crate::consume;
use crate::report::{self, VariantResult};
use crate::settings::KillSettings;
use crate::shards::ShardedDb;

/// Seeded credit events, IDs `evt-<i>` from 0, each crediting 1–100 to one of `accounts`, and
/// the balances those made so far add up to: the same sequence for a seed, taken at once or a
/// chunk at a time.
pub(crate) struct Credits {
    rng: StdRng,
    accounts: i64,
    next: u32,
    pub(crate) expected: HashMap<i64, i64>,
}

impl Credits {
    pub(crate) fn new(seed: u64, accounts: i64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            accounts,
            next: 0,
            expected: HashMap::new(),
        }
    }
}

impl Iterator for Credits {
    type Item = OutgoingMessage;

    fn next(&mut self) -> Option<OutgoingMessage> {
        let event = CreditEvent::new(
            self.rng.random_range(1..=self.accounts),
            self.rng.random_range(1..=100),
        );
        *self.expected.entry(event.account_id).or_insert(0) += event.amount;
        self.next += 1;
        Some(brokers::credit(self.next - 1, &event))
    }
}

/// The first `count` [`Credits`] of `seed`, and the balances they add up to.
pub(crate) fn events(
    seed: u64,
    accounts: i64,
    count: u32,
) -> (Vec<OutgoingMessage>, HashMap<i64, i64>) {
    let mut credits = Credits::new(seed, accounts);
    let events = credits.by_ref().take(count as usize).collect();
    (events, credits.expected)
}

/// `count` waits of `min..=max` ms, drawn by a generator seeded with `seed`.
pub(crate) fn waits(
    seed: u64,
    count: u32,
    (min, max): (u64, u64),
) -> impl Iterator<Item = Duration> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count).map(move |_| Duration::from_millis(rng.random_range(min..=max)))
}

/// Work after the child's first write before each kill of run `run`: the same for every variant
/// and broker.
fn schedule(s: &KillSettings, run: u32) -> Vec<KillAt> {
    let seed = s.seed ^ (0x6b11 + u64::from(run));
    let waits = waits(seed, s.kills(), s.kill_after_ms());
    waits.map(KillAt::AfterFirstWrite).collect()
}

/// Runs the kill test on one broker for every variant of `s`, a fresh wallet on `D` per run.
async fn on_broker<B: TestBroker, D: TestStore>(
    broker: &Broker<B>,
    s: &KillSettings,
) -> Result<Vec<VariantResult>, BoxError> {
    let (kind, runs_per_variant) = (broker.kind(), s.runs());
    let mut results = Vec::new();
    for variant in s.variants() {
        let mut runs = Vec::new();
        for run in 0..runs_per_variant {
            let label = format!(
                "{kind} {} run {}/{runs_per_variant}",
                variant.name(),
                run + 1
            );
            let kills = schedule(s, run);
            let r = run_once::<B, D>(
                broker,
                s,
                variant,
                &run.to_string(),
                &label,
                s.events(),
                kills,
            )
            .await?;
            // Kept in the output as it happens, so a long session cut short still shows it.
            println!(
                "run done: {label}: {} duplicates, {} lost, {} kills, {} self-crashes",
                r.duplicates, r.lost, r.kills, r.self_crashes
            );
            runs.push(r);
        }
        let throughput = if s.throughput {
            // A run with no kills: events per second from the consumer's start to its last write.
            let label = format!("{kind} {} no-kill throughput", variant.name());
            let events = s.throughput_events();
            let r =
                run_once::<B, D>(broker, s, variant, "rate", &label, events, Vec::new()).await?;
            let rows = i64::from(events) - r.lost + r.duplicates;
            Some(rows as f64 / r.drained_in.as_secs_f64().max(1e-3))
        } else {
            None
        };
        let result = VariantResult::new(kind, variant, s.events(), &runs, throughput, s.work_ms);
        println!("{}{}", report::VARIANT_DONE, result.json_line()?);
        results.push(result);
    }
    Ok(results)
}

/// One run of `variant` on a fresh queue (`tag` part of its name) and wallet: `events`
/// published, the consumer process killed as `kills` say, then a drain; `label` names it.
async fn run_once<B: TestBroker, D: TestStore>(
    broker: &Broker<B>,
    s: &KillSettings,
    variant: Variant,
    tag: &str,
    label: &str,
    events: u32,
    kills: Vec<KillAt>,
) -> Result<KillReport, BoxError> {
    let kind = broker.kind();
    let db = D::create().await;
    let name = broker
        .create(&format!("{kind}-{}-{tag}", variant.name()))
        .await?;
    let (outgoing, expected) = self::events(s.seed, s.accounts, events);
    broker.publish(&name, &outgoing).await?;
    let spec = ConsumerSpec {
        work: Duration::from_millis(s.work_ms),
        lanes: s.lanes,
        crash_between_commit_and_ack: s.crash_between_commit_and_ack(),
        store: s.store,
        ..ConsumerSpec::new(kind, variant, &name, db.name())
    };
    let drain_spec = ConsumerSpec {
        crash_between_commit_and_ack: 0.0,
        ..spec.clone()
    };
    let bar = progress::Progress::bar(label, u64::from(events), "events", "applied");
    let plan = KillPlan {
        events: i64::from(events),
        expected,
        kills,
    };
    let mut h = harness(broker, &spec, &drain_spec, &db, &bar).await?;
    let result = kill::run(&mut h, &plan)
        .await
        .map_err(|e| format!("{label}: {e}"))?;
    drop(h);
    bar.finish();
    db.remove().await;
    broker.remove(&name).await;
    Ok(result)
}

/// How the kill run reaches `spec`'s consumers: `evidence consume` children of `spec`, and a
/// draining consumer of `drain` in this process, on `broker` and `db`; `bar` shows the way.
pub(crate) async fn harness<'a, B: TestBroker, D: TestStore>(
    broker: &'a Broker<B>,
    spec: &'a ConsumerSpec,
    drain: &'a ConsumerSpec,
    db: &'a D,
    bar: &progress::Progress,
) -> Result<KillHarness<'a>, BoxError> {
    let bar = bar.counter();
    Ok(KillHarness {
        spawn: Box::new(move |_| {
            Box::pin(async move { spawn_ready(&spec.to_args(), &[], &mut 0).await })
        }),
        summary: Box::new(move || Box::pin(async move { Ok(db.summary().await?) })),
        balances: Box::new(move || Box::pin(async move { Ok(db.balances().await?) })),
        waiting: Box::new(move || Box::pin(async move { broker.waiting(&spec.name).await })),
        consume: Box::new(move |shutdown| Box::pin(consume::attached(broker, drain, shutdown))),
        redelivery_delay: broker.redelivery_delay(&spec.name).await?,
        drain_restarts: broker.drain_restarts(),
        tick: Box::new(move |tick| match tick {
            KillTick::Applied(n) => bar.set_position(n),
            KillTick::Killing(kill, of) => bar.set_message(format!("kill {kill}/{of}")),
            KillTick::Draining => bar.set_message("draining"),
            KillTick::Note(note) => bar.println(&format!("{}: {note}", bar.label())),
        }),
    })
}

/// How long a starting child may take to say it is connected before it is replaced, and how
/// long [`spawn_ready`] keeps replacing it (a child can die on the way up: one started into a
/// refused database, say).
const START_PATIENCE: Duration = Duration::from_secs(30);
const START_GIVE_UP: Duration = Duration::from_secs(180);

/// Starts this binary with `args` and `env` added (`consume` and a `ConsumerSpec`'s, say) and
/// waits until it says it has connected, replacing it until then; `failed` counts the starts
/// that died or stayed silent.
pub(crate) async fn spawn_ready(
    args: &[String],
    env: &[(&str, String)],
    failed: &mut u32,
) -> Result<Child, BoxError> {
    let begun = Instant::now();
    loop {
        if let Some(child) = start_child(args, env, START_PATIENCE).await? {
            return Ok(child);
        }
        *failed += 1;
        if begun.elapsed() > START_GIVE_UP {
            let (args, secs) = (args.join(" "), START_GIVE_UP.as_secs());
            return Err(
                format!("`evidence {args}` did not start in {secs} s ({failed} attempts)").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One attempt to start this binary with `args`, with `env` added to its environment: the child
/// once it says it is connected, `None` when it dies or stays silent for `patience`. The child
/// is marked as one, its logs off unless `WALLET_CHILD_LOG` says otherwise, and it is killed
/// when dropped.
async fn start_child(
    args: &[String],
    env: &[(&str, String)],
    patience: Duration,
) -> Result<Option<Child>, BoxError> {
    let log = std::env::var("WALLET_CHILD_LOG").unwrap_or_else(|_| "error,lapin=off".into());
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("WALLET_CHILD", "1")
        .env("RUST_LOG", log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().ok_or("the child has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(patience, lines.next_line()).await;
    if let Ok(Ok(Some(line))) = ready {
        if line == "ready" {
            return Ok(Some(child));
        }
    }
    stop(&mut child).await;
    Ok(None)
}

/// SIGKILL, then reap.
pub(crate) async fn stop(child: &mut Child) {
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// The main demo: a short kill test of b and c on every broker that answers; `--full` for
/// the article's settings.
pub(crate) async fn demo(full: bool, mut settings: KillSettings) -> Result<(), BoxError> {
    settings.demo = !full;
    let (min, max) = settings.kill_after_ms();
    println!(
        "The wallet kill test: {} credit events per run, the consumer process SIGKILLed {} times \
         per run after {min}–{max} ms of work, then a last consumer drains. (`cargo xtask demo \
         --full` runs the article's settings.)",
        settings.events(),
        settings.kills(),
    );
    let crash = settings.crash_between_commit_and_ack();
    if crash > 0.0 {
        println!(
            "The consumer also aborts itself right after a DB commit, before its ack, with \
             probability {crash} per message (--crash-between-commit-and-ack)."
        );
    }
    run(&settings).await
}

/// `evidence kill-test`: the kill test on every broker asked for that answers.
pub(crate) async fn run(s: &KillSettings) -> Result<(), BoxError> {
    if s.store != StoreKind::Postgres && s.variants().iter().any(|&v| v != Variant::C) {
        return Err(format!(
            "--store {} runs variant c only (--variants c): the variants a1, a2 and b show what \
             the inbox prevents, on PostgreSQL",
            s.store
        )
        .into());
    }
    match s.store {
        StoreKind::Postgres => {}
        StoreKind::Mysql => println!("The inbox store: MySQL (inbox-mysql, INBOX_MYSQL_URL)."),
        StoreKind::Sharded => println!(
            "The inbox store: inbox-postgres behind Sharded, credits routed by account over {} \
             PostgreSQL cluster(s) of the run's own.",
            s.shards()
        ),
    }
    if s.lanes > 1 {
        println!(
            "Each consumer applies up to {} lanes side by side (--lanes).",
            s.lanes
        );
    }
    let mut all = Vec::new();
    let mut failures = Vec::new();
    for &kind in &s.brokers.list {
        if brokers::left_out(kind, s.brokers.required)? {
            continue;
        }
        brokers::kafka_note(kind, s.brokers.kafka_impl);
        // The broker and the store are picked here, once: the run is generic over both.
        let results = with_broker!(
            kind,
            s.brokers.kafka_impl,
            |broker| match (s.store, s.shards()) {
                (StoreKind::Postgres, _) => on_broker::<_, TestDb>(broker, s).await,
                (StoreKind::Mysql, _) => on_broker::<_, MySqlDb>(broker, s).await,
                (StoreKind::Sharded, 1) => on_broker::<_, ShardedDb<1>>(broker, s).await,
                (StoreKind::Sharded, _) => on_broker::<_, ShardedDb<2>>(broker, s).await,
            }
        );
        match results {
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
    #[arg(long, value_name = "kafka|sqs|rabbitmq|redis|nats")]
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
    // The kill test's 100 accounts.
    let (outgoing, _) = self::events(args.seed, 100, args.events);
    with_broker!(args.broker, args.kafka_impl, |broker| {
        let name = broker.create(&args.name).await?;
        broker.publish(&name, &outgoing).await?;
        let (events, kind) = (args.events, broker.kind());
        println!("published {events} credit events to {kind} `{name}`");
    });
    Ok(())
}
