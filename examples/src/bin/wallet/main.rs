//! The wallet: credit events `{account_id, amount}` with producer-set IDs, applied to accounts
//! with a ledger row each, on Kafka, SQS, RabbitMQ or Redis Streams; and the evidence that the
//! inbox makes them effectively-once: the article's kill test and zombie test.
//!
//! `wallet --help` lists the commands and their options.
//!
//! Variants: `a1` the broker's automatic ack, one message at a time (Kafka auto-commit, SQS
//! delete on receive, RabbitMQ `no_ack`, Redis `NOACK`); `a2` the same in batches of 100 (10 on
//! SQS, its receive limit); `b` ack after the DB commit, no inbox; `c` the inbox.
//!
//! Services: PostgreSQL at `DATABASE_URL`, and the brokers at `KAFKA_BROKERS`,
//! `AWS_ENDPOINT_URL_SQS`, `AMQP_URL`, `REDIS_URL` (the defaults are what `cargo xtask services`
//! starts). Each run uses a schema and a queue, topic or stream of its own.

mod bench;
mod brokers;
mod chart;
mod cli;
mod consume;
mod effects;
mod effects_child;
mod faults;
mod kill;
mod memory;
mod outbox_chain;
mod report;
mod retention_bench;
mod settings;
mod soak;
mod zombie;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use inbox_core::BoxError;
use inbox_postgres::testkit::TestDb;

use crate::cli::{num, parse_flags, BrokerKind, ConsumerSpec, KafkaImpl, Variant};
use crate::consume::Watch;
use crate::settings::{KillSettings, ZombieSettings};

/// What `wallet --help` prints.
const HELP: &str = r"cargo xtask demo                      # services, then a short kill test of b and c on every broker
cargo xtask demo --full               # the article's settings: 4 variants, 5 runs of 20 kills
wallet kill-test [--brokers kafka,sqs,rabbitmq,redis] [--variants a1,a2,b,c] [--events 10000]
                 [--kills 20] [--runs 5] [--kill-after-ms 1000..8000] [--work-ms 10] [--seed 42]
                 [--crash-between-commit-and-ack P] [--throughput true] [--throughput-events N]
                 [--chart target/wallet-kill-test.svg] [--require-brokers false]
                 [--kafka-impl tansu|mock]
wallet zombie-test [--brokers …] [--variants b,c] [--events 5000] [--stall-every 500] [--runs 1]
                   [--kafka-impl tansu|mock]
wallet bench [--brokers kafka,redis,rabbitmq] [--events 200000] [--events-at-batch-1 5000]
             [--batches 1,100,1000] [--handlers message,batch] [--variants b,c] [--lanes 1,6]
             [--accounts 1000] [--kafka-impl tansu|mock]
                                      # msgs/s of b and c beside the broker alone and the
                                      # database alone, a table and JSON lines
wallet soak [--brokers redis,rabbitmq,kafka] [--events 1000000] [--batch 1000] [--lanes 1]
            [--handler batch|message] [--kill-every 5..30] [--fault-every 60] [--seed 42]
            [--accounts 1000] [--work-ms 0] [--max-minutes 60] [--kafka-impl tansu|mock]
                                      # events published in chunks while one consumer child is
                                      # SIGKILLed every 5–30 s and restarted, a network fault into
                                      # its connections every 60 s (database cut, database refused
                                      # 5 s, broker cut, broker black-holed 10 s; on Kafka the
                                      # database ones only), then a drain: duplicates, losses and
                                      # the children's RSS, a line and a JSON line per broker
wallet effects-test [--brokers kafka,sqs,rabbitmq,redis] [--modes keys,lookup,neither+retry,neither+skip]
                    [--events 500] [--sqs-events 200] [--kills 10] [--runs 5]
                    [--kill-after-ms 1000..4000] [--work-ms 40] [--seed 42] [--e2e false]
                                      # side effects outside the database: an effect consumer
                                      # child calling a test provider (first call per key slow,
                                      # --work-ms) is SIGKILLed and restarted, then drains;
                                      # duplicate and lost effects counted at the provider per
                                      # mode, a table and JSON lines. --e2e true: the outbox
                                      # chain instead, consumer A (inbox + outbox) on X, the
                                      # relay to Y, consumer B (the credit) on Y, each killed in
                                      # turn; B must credit every event once
wallet retention-bench [--rows-per-day 1000000] [--days 3] [--window-days 2] [--claim-seconds 10]
                       [--batch 1000] [--purge-batch 10000] [--layouts plain,partitioned]
                                      # cleanup at ingest speed: claim msgs/s alone and while the
                                      # batched DELETE purge or the partition drop removes the
                                      # oldest simulated day, rows/s, claim latency, bytes/row;
                                      # only PostgreSQL; a table and JSON lines
wallet consume --broker B --variant V --name QUEUE --schema S [--work-ms 10]
               [--crash-between-commit-and-ack P] [--batch N] [--lanes N]
               [--handler message|batch]
wallet publish --broker B --name QUEUE [--events N] [--seed S] [--kafka-impl tansu|mock]
wallet memory-demo                    # the in-memory broker with crash points; only PostgreSQL
wallet report [--chart target/wallet-kill-test.svg] FILE…   # tables and chart from saved runs
variants: a1 the broker's automatic ack, a2 the same in batches, b ack after the DB commit
without the inbox, c the inbox; services at DATABASE_URL, KAFKA_BROKERS, AWS_ENDPOINT_URL_SQS,
AMQP_URL, REDIS_URL (defaults: what `cargo xtask services` starts)
--kafka-impl: what KAFKA_BROKERS is. tansu (default, what `cargo xtask services` starts): one
record per produced batch (Tansu 0.6 serves a fetch from mid-batch from the next batch on) and a
draining consumer that applies nothing is replaced (Tansu can leave the last member with no
partitions). mock (librdkafka's mock cluster, `cargo run -p inbox-examples --bin kafka-mock`):
neither work-around, a stalled drain fails the run; topics get 6 partitions through
`kafka-mock --control ADDR` when KAFKA_MOCK_CONTROL=ADDR, else 4, created on first use
";

const USAGE: &str = "usage: wallet demo [--full] [kill-test options] | kill-test [options] | zombie-test [options] | bench [options] | soak [options] | retention-bench [options] | consume … | publish … | memory-demo [options] | report [--chart SVG] FILE…\n`wallet --help` lists the options";

/// Tells the parent `kill-test` that this `consume` child is connected and consuming.
pub(crate) fn ready() {
    if std::env::var_os("WALLET_CHILD").is_some() {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "ready");
        let _ = out.flush();
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error,lapin=off".into()))
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::FAILURE;
    };
    if args
        .iter()
        .any(|a| matches!(a.as_str(), "--help" | "-h" | "help"))
    {
        print!("{HELP}");
        return ExitCode::SUCCESS;
    }
    let result = match command.as_str() {
        "demo" => demo(rest).await,
        "kill-test" => match KillSettings::full().parse(rest) {
            Ok(s) => kill_test(&s).await,
            Err(e) => Err(e.into()),
        },
        "zombie-test" => match ZombieSettings::parse(rest) {
            Ok(s) => zombie_test(&s).await,
            Err(e) => Err(e.into()),
        },
        "bench" => match bench::BenchSettings::parse(rest) {
            Ok(s) => bench::run(&s).await,
            Err(e) => Err(e.into()),
        },
        "soak" => match soak::SoakSettings::parse(rest) {
            Ok(s) => soak::run(&s).await,
            Err(e) => Err(e.into()),
        },
        "effects-test" => match effects::EffectsSettings::parse(rest) {
            Ok(s) => effects::main(&s).await,
            Err(e) => Err(e.into()),
        },
        "effects-child" => effects_child::main(rest).await,
        "retention-bench" => match retention_bench::RetentionSettings::parse(rest) {
            Ok(s) => retention_bench::run(&s).await,
            Err(e) => Err(e.into()),
        },
        "consume" => consume(rest).await,
        "publish" => publish(rest).await,
        "memory-demo" => return memory::main(rest).await,
        "report" => report_from(rest),
        _ => Err(USAGE.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wallet: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The main demo: a short kill test of b and c on every broker that answers; `--full` for
/// the article's settings.
async fn demo(args: &[String]) -> Result<(), BoxError> {
    let settings = match args.split_first() {
        Some((flag, rest)) if flag == "--full" => KillSettings::full().parse(rest)?,
        _ => KillSettings::demo().parse(args)?,
    };
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
    kill_test(&settings).await
}

async fn kill_test(s: &KillSettings) -> Result<(), BoxError> {
    let mut all = Vec::new();
    let mut failures = Vec::new();
    for &kind in &s.brokers {
        let broker = match brokers::connect(kind, s.kafka_impl).await {
            Ok(b) => b,
            Err(e) if !s.require_brokers => {
                println!("\n{kind}: skipped, {e}");
                continue;
            }
            Err(e) => return Err(format!("{kind}: {e}").into()),
        };
        kafka_note(kind, s.kafka_impl);
        match kill::on_broker(broker.as_ref(), s).await {
            Ok(results) => {
                report::table(&results);
                all.extend(results);
            }
            Err(e) => {
                kill::progress("");
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

/// `wallet report`: the tables, one chart and the JSON lines again, from the output of kill
/// tests run separately (one broker at a time, say).
fn report_from(args: &[String]) -> Result<(), BoxError> {
    let mut chart = PathBuf::from("target/wallet-kill-test.svg");
    let mut files = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--chart" => chart = args.next().ok_or("--chart needs a path")?.into(),
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}").into()),
            file => files.push(PathBuf::from(file)),
        }
    }
    if files.is_empty() {
        return Err("name at least one file holding the JSON lines of `wallet kill-test`".into());
    }
    let mut results = report::read_lines(&files)?;
    results.sort_by_key(|r| (r.broker, r.variant));
    for broker in BrokerKind::ALL {
        let of_broker: Vec<_> = results
            .iter()
            .filter(|r| r.broker == broker)
            .cloned()
            .collect();
        report::table(&of_broker);
    }
    chart::write(&chart, &results)?;
    println!("\nchart: {}\n", chart.display());
    report::json_lines(&results);
    Ok(())
}

async fn zombie_test(s: &ZombieSettings) -> Result<(), BoxError> {
    for &kind in &s.brokers {
        let broker = match brokers::connect(kind, s.kafka_impl).await {
            Ok(b) => b,
            Err(e) if !s.require_brokers => {
                println!("\n{kind}: skipped, {e}");
                continue;
            }
            Err(e) => return Err(format!("{kind}: {e}").into()),
        };
        kafka_note(kind, s.kafka_impl);
        zombie::on_broker(broker.as_ref(), s).await?;
    }
    Ok(())
}

/// Says in the output which Kafka implementation a run's figures come from.
fn kafka_note(kind: BrokerKind, kafka_impl: KafkaImpl) {
    if kind == BrokerKind::Kafka {
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        match kafka_impl {
            KafkaImpl::Tansu => println!(
                "\nkafka at {brokers}: --kafka-impl tansu (one record per produced batch, a \
                 stalled drain is replaced)"
            ),
            KafkaImpl::Mock => println!(
                "\nkafka at {brokers}: --kafka-impl mock (librdkafka's mock cluster: records \
                 batched, a stalled drain fails the run, {} partitions per topic)",
                if std::env::var_os("KAFKA_MOCK_CONTROL").is_some() {
                    "6"
                } else {
                    "4"
                }
            ),
        }
    }
}

/// One consumer, until killed or Ctrl-C.
async fn consume(args: &[String]) -> Result<(), BoxError> {
    let spec = ConsumerSpec::parse(args)?;
    // A consumer neither creates nor publishes: the Kafka implementation makes no difference.
    let broker = brokers::connect(spec.broker, KafkaImpl::default()).await?;
    let db = TestDb::attach(&spec.schema).await;
    let ctrl_c = Box::pin(async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    });
    let stats = broker.consume(&spec, &db, Watch::default(), ctrl_c).await?;
    eprintln!("{stats:?}");
    Ok(())
}

/// Creates the queue, topic or stream and publishes seeded credit events to it.
async fn publish(args: &[String]) -> Result<(), BoxError> {
    let (mut broker, mut name, mut events, mut seed) = (None, None, 1_000u32, 42u64);
    let mut kafka_impl = KafkaImpl::default();
    parse_flags(args, |flag, value| {
        match flag {
            "--broker" => broker = Some(value.parse()?),
            "--kafka-impl" => kafka_impl = value.parse()?,
            "--name" => name = Some(value.to_owned()),
            "--events" => events = num(value)?,
            "--seed" => seed = num(value)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let broker = brokers::connect(broker.ok_or("--broker is required")?, kafka_impl).await?;
    let name = name.ok_or("--name is required")?;
    let settings = KillSettings {
        events,
        seed,
        ..KillSettings::full()
    };
    let (outgoing, _) = kill::events(&settings, events);
    broker.create(&name).await?;
    broker.publish(&name, &outgoing).await?;
    println!(
        "published {events} credit events to {} `{name}`",
        broker.kind()
    );
    Ok(())
}
