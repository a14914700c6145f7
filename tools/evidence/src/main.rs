//! The evidence tool: the article's kill and zombie tests, the effect and fault tests, soak runs
//! and benchmarks, on Kafka, SQS, RabbitMQ, Redis Streams or NATS JetStream. Its workload is the
//! wallet: credit events `{account_id, amount}` with producer-set IDs, applied to accounts with a
//! ledger row each; what it shows is whether the inbox makes them effectively-once. Each run uses
//! a schema and a queue, topic or stream of its own.
//!
//! `evidence --help` lists the commands, the variants and the services. Variant `a1` is the test
//! kit's `AckOnReceive` around the source (on Kafka with offsets committed every 5 s, as
//! auto-commit does); `a2` the same in batches of 100 (10 on SQS, its receive limit).

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
mod shards;
mod soak;
mod zombie;

use std::io::Write;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use crate::cli::ConsumerSpec;
use crate::settings::{KillSettings, ZombieSettings};

/// The notes under `evidence --help`.
const NOTES: &str = "\
Variants: a1 ack on receipt, one at a time; a2 the same in batches; b ack after the DB commit, \
without the inbox; c the inbox.
Services: DATABASE_URL, KAFKA_BROKERS, AWS_ENDPOINT_URL_SQS, AMQP_URL, REDIS_URL, NATS_URL \
(defaults: what \
`cargo xtask services` starts). `cargo xtask demo` starts them, then runs `evidence demo`.
`evidence COMMAND --help` lists a command's options.";

/// The evidence that the inbox applies wallet credits effectively-once on Kafka, SQS, RabbitMQ,
/// Redis Streams or NATS JetStream: the kill, zombie, effect and fault tests, soak runs and benchmarks.
#[derive(Debug, Parser)]
#[command(name = "evidence", version, after_help = NOTES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A short kill test of b and c on every broker that answers; `--full` for the article's
    /// settings (4 variants, 5 runs of 20 kills).
    Demo {
        /// The article's settings instead of the short demo's.
        #[arg(long)]
        full: bool,
        #[command(flatten)]
        kill: KillSettings,
    },
    /// The kill test: the consumer process SIGKILLed again and again while it works through the
    /// credit events, then a last consumer drains; duplicates, losses and balances per variant,
    /// a table, a chart and JSON lines.
    KillTest(KillSettings),
    /// The zombie test: a consumer stalls past the broker's ownership while another takes its
    /// messages over.
    ZombieTest(ZombieSettings),
    /// msgs/s of b and c beside the broker alone and the database alone, a table and JSON lines.
    Bench(bench::BenchSettings),
    /// A long run per broker under SIGKILLs and network faults, then a drain: duplicates, losses
    /// and the children's RSS, a line and a JSON line per broker.
    Soak(soak::SoakSettings),
    /// Side effects outside the database under SIGKILLs, counted at a test provider; `--e2e
    /// true`: the outbox chain across two queues.
    #[command(mut_arg("brokers", |a| a.default_value("kafka,sqs,rabbitmq,redis")))]
    EffectsTest(effects::EffectsSettings),
    /// Cleanup at ingest speed: the batched DELETE purge beside the partition drop, while claims
    /// run; only PostgreSQL, a table and JSON lines.
    RetentionBench(retention_bench::RetentionSettings),
    /// One consumer, until killed or Ctrl-C (what the kill test's children run).
    Consume(ConsumerSpec),
    /// Creates a queue, topic or stream and publishes seeded credit events to it.
    Publish(kill::PublishArgs),
    /// The wallet on the in-memory broker with crash points; only PostgreSQL.
    MemoryDemo(memory::Settings),
    /// The tables, one chart and the JSON lines again, from saved `kill-test` output.
    Report(report::ReportArgs),
    /// A child of `effects-test`.
    #[command(hide = true)]
    EffectsChild(effects_child::ChildSpec),
}

/// Tells the parent `kill-test` that this `consume` child is connected and consuming.
pub(crate) fn ready() {
    if std::env::var_os("WALLET_CHILD").is_some() {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "ready");
        let _ = out.flush();
    }
}

/// Resolves on Ctrl-C: when a child (`consume`, `effects-child`) should stop; never where the
/// signal cannot be listened for.
pub(crate) async fn ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error,lapin=off".into()))
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Demo { full, kill } => kill::demo(full, kill).await,
        Command::KillTest(s) => kill::run(&s).await,
        Command::ZombieTest(s) => zombie::run(&s).await,
        Command::Bench(s) => bench::run(&s).await,
        Command::Soak(s) => soak::run(&s).await,
        Command::EffectsTest(s) => effects::main(&s).await,
        Command::EffectsChild(spec) => effects_child::main(&spec).await,
        Command::RetentionBench(s) => match s.check() {
            Ok(()) => retention_bench::run(&s).await,
            Err(e) => usage_error("retention-bench", &e),
        },
        Command::Consume(args) => consume::main(args).await,
        Command::Publish(args) => kill::publish(args).await,
        Command::MemoryDemo(s) => return memory::main(&s).await,
        Command::Report(args) => report::from_files(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("evidence: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Exits as clap does for a bad flag (usage on stderr, status 2), for what the flags cannot say
/// one at a time.
fn usage_error(command: &str, message: &str) -> ! {
    let mut cli = Cli::command();
    cli.build();
    let sub = cli.find_subcommand_mut(command).cloned();
    sub.unwrap_or(cli)
        .bin_name(format!("evidence {command}"))
        .error(clap::error::ErrorKind::ValueValidation, message)
        .exit()
}

#[cfg(test)]
mod tests {
    // A failed parse should fail the test loudly.
    #![allow(clippy::unwrap_used)]

    use clap::{CommandFactory, Parser};

    use super::{Cli, Command};
    use crate::cli::{BrokerKind, ConsumerSpec, HandlerKind, Variant};
    use crate::effects_child::{ChildSpec, Mode, Role};

    fn parse(args: &[&str]) -> Command {
        Cli::try_parse_from(std::iter::once("evidence").chain(args.iter().copied()))
            .unwrap()
            .command
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn list_defaults_are_split_and_flags_override_them() {
        let Command::KillTest(s) = parse(&["kill-test"]) else {
            panic!("not kill-test")
        };
        assert_eq!(s.brokers.list, BrokerKind::ALL);
        assert_eq!(s.variants(), Variant::ALL);
        assert_eq!(
            (s.events(), s.throughput_events(), s.kill_after_ms()),
            (10_000, 10_000, (1_000, 8_000))
        );

        let Command::Demo {
            full: false,
            kill: mut s,
        } = parse(&["demo", "--broker", "redis", "--events", "300"])
        else {
            panic!("not the short demo")
        };
        s.demo = true;
        assert_eq!(s.brokers.list, [BrokerKind::Redis]);
        assert_eq!(s.variants(), [Variant::B, Variant::C]);
        assert_eq!(
            (s.events(), s.throughput_events(), s.kills()),
            (300, 300, 4)
        );
    }

    #[test]
    fn durations_take_plain_numbers_in_the_flags_unit_or_humantime() {
        let Command::KillTest(s) = parse(&[
            "kill-test",
            "--kill-after-ms",
            "1s..2500ms",
            "--work-ms",
            "3",
        ]) else {
            panic!("not kill-test")
        };
        assert_eq!((s.kill_after_ms(), s.work_ms), ((1_000, 2_500), 3));
        for ok in [
            &["soak", "--kill-every", "5..30", "--max-minutes", "100"][..],
            &[
                "soak",
                "--kill-every",
                "5s..1m",
                "--max-minutes",
                "1h30m",
                "--fault-every",
                "2m",
            ],
        ] {
            assert!(matches!(parse(ok), Command::Soak(_)), "{ok:?}");
        }
        for bad in [
            &["soak", "--kill-every", "0..30"][..],
            &["soak", "--kill-every", "30..5"],
            &["soak", "--max-minutes", "90s"],
            &["kill-test", "--kill-after-ms", "1000"],
            &["bench", "--variants", "a1"],
            &["bench", "--batches", "1,0"],
        ] {
            assert!(
                Cli::try_parse_from(std::iter::once("evidence").chain(bad.iter().copied()))
                    .is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_children_command_lines_parse_back_to_their_specs() {
        let spec = ConsumerSpec {
            crash_between_commit_and_ack: 0.005,
            member: 2,
            batch: Some(100),
            lanes: 6,
            handler: HandlerKind::Batch,
            ..ConsumerSpec::new(BrokerKind::Kafka, Variant::A2, "kafka-a2-0", "wallet_x")
        };
        let args: Vec<String> = spec.to_args();
        let Command::Consume(parsed) = parse(&args.iter().map(String::as_str).collect::<Vec<_>>())
        else {
            panic!("not consume: {args:?}")
        };
        assert_eq!(format!("{parsed:?}"), format!("{spec:?}"));

        let child = ChildSpec {
            role: Role::Relay,
            broker: BrokerKind::Sqs,
            name: "y".into(),
            destination: String::new(),
            schema: "wallet_y".into(),
            mode: Mode::NeitherSkip,
            work_ms: 40,
        };
        let args = child.to_args();
        let Command::EffectsChild(parsed) =
            parse(&args.iter().map(String::as_str).collect::<Vec<_>>())
        else {
            panic!("not effects-child: {args:?}")
        };
        assert_eq!(format!("{parsed:?}"), format!("{child:?}"));
    }
}
