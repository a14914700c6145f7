//! The settings of `kill-test`, `demo` and `zombie-test`.

use std::path::PathBuf;

use crate::cli::{
    millis, millis_range, positive, probability, BrokerKind, KafkaImpl, StoreKind, Variant,
    KAFKA_IMPL_HELP, KAFKA_IMPL_LONG_HELP,
};

/// The brokers a test runs on: `--brokers`, `--require-brokers`, `--kafka-impl`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Brokers {
    /// Brokers to test; one that does not answer is skipped.
    #[arg(
        id = "brokers",
        long = "brokers",
        alias = "broker",
        value_delimiter = ',',
        value_name = "BROKER,…",
        default_value = "kafka,sqs,rabbitmq,redis,nats"
    )]
    pub(crate) list: Vec<BrokerKind>,
    /// Fail, rather than skip, when a broker cannot be reached.
    #[arg(long = "require-brokers", value_name = "BOOL", default_value = "false", action = clap::ArgAction::Set)]
    pub(crate) required: bool,
    #[arg(long, value_name = "tansu|mock", default_value = "tansu", help = KAFKA_IMPL_HELP, long_help = KAFKA_IMPL_LONG_HELP)]
    pub(crate) kafka_impl: KafkaImpl,
}

/// The flags of `kill-test` and `demo`. Where the short demo differs from the article's
/// settings (`kill-test`, `demo --full`), a flag left out takes the value of the one `demo`
/// runs with: the methods of the same name read them.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct KillSettings {
    #[command(flatten)]
    pub(crate) brokers: Brokers,
    /// Variants to run [default: a1,a2,b,c; demo: b,c].
    #[arg(
        long,
        alias = "variant",
        value_delimiter = ',',
        value_name = "VARIANT,…"
    )]
    variants: Option<Vec<Variant>>,
    /// Credit events per run [default: 10000; demo: 400].
    #[arg(long, value_name = "N")]
    events: Option<u32>,
    /// Accounts the events credit.
    #[arg(long, value_name = "N", default_value = "100", value_parser = clap::value_parser!(i64).range(1..))]
    pub(crate) accounts: i64,
    /// SIGKILLs of the consumer per run [default: 20; demo: 4].
    #[arg(long, value_name = "N")]
    kills: Option<u32>,
    /// Runs per variant [default: 5; demo: 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    runs: Option<u32>,
    /// Work before each kill, drawn from MIN..MAX: milliseconds, or durations such as 1s..8s
    /// [default: 1000..8000; demo: 500..2000].
    #[arg(long, value_name = "MIN..MAX", value_parser = millis_range)]
    kill_after_ms: Option<(u64, u64)>,
    /// The handler's work per message: milliseconds, or a duration such as 10ms.
    #[arg(long, value_name = "MS", default_value = "10", value_parser = millis)]
    pub(crate) work_ms: u64,
    /// Lanes each consumer applies side by side (`Consumer::parallel_lanes`): Kafka
    /// partitions, SQS FIFO groups; one lane on sources of one order.
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    pub(crate) lanes: usize,
    /// Seed of the events and the kill schedule.
    #[arg(long, value_name = "N", default_value = "42")]
    pub(crate) seed: u64,
    /// Probability per message that the consumer aborts itself between its DB commit and its
    /// ack [default: 0; demo: 0.02].
    #[arg(long, value_name = "P", value_parser = probability)]
    crash_between_commit_and_ack: Option<f64>,
    /// Also measure a run with no kills.
    #[arg(long, value_name = "BOOL", default_value = "true", action = clap::ArgAction::Set)]
    pub(crate) throughput: bool,
    /// Events of the no-kill run [default: --events].
    #[arg(long, value_name = "N")]
    throughput_events: Option<u32>,
    /// Where the chart goes.
    #[arg(
        long,
        value_name = "SVG",
        default_value = "target/wallet-kill-test.svg"
    )]
    pub(crate) chart: PathBuf,
    /// The inbox store of the wallet: `mysql` runs variant c on `inbox-mysql` in a database of
    /// its own at `INBOX_MYSQL_URL` (the other variants exist to show what the inbox prevents,
    /// and run on PostgreSQL).
    ///
    /// `sharded` runs variant c on `inbox-postgres` behind `Sharded`, credits routed by account
    /// over `--shards` PostgreSQL clusters of the run's own (made with Debian's
    /// `pg_createcluster`, as root): `inbox_shard_a` on `INBOX_SHARD_A_PG_PORT` (5443) and
    /// `inbox_shard_b` on `INBOX_SHARD_B_PG_PORT` (5444).
    #[arg(
        long,
        value_name = "postgres|mysql|sharded",
        default_value = "postgres"
    )]
    pub(crate) store: StoreKind,
    /// With `--store sharded`: 1 or 2 shards.
    #[arg(long, value_name = "N", default_value = "2", value_parser = clap::value_parser!(u8).range(1..=2))]
    shards: u8,
    /// The short demo's settings for the flags left out, rather than the article's.
    #[arg(skip)]
    pub(crate) demo: bool,
}

impl KillSettings {
    /// `given`, else the short demo's value or the article's.
    fn or<T>(&self, given: Option<T>, article: T, demo: T) -> T {
        given.unwrap_or(if self.demo { demo } else { article })
    }

    /// The article's 4 variants; the demo's b and c.
    pub(crate) fn variants(&self) -> Vec<Variant> {
        let demo = vec![Variant::B, Variant::C];
        self.or(self.variants.clone(), Variant::ALL.to_vec(), demo)
    }

    /// The article's 10,000 events; the demo's 400.
    pub(crate) fn events(&self) -> u32 {
        self.or(self.events, 10_000, 400)
    }

    /// The article's 20 kills; the demo's 4.
    pub(crate) fn kills(&self) -> u32 {
        self.or(self.kills, 20, 4)
    }

    /// The article's 5 runs; the demo's 1.
    pub(crate) fn runs(&self) -> u32 {
        self.or(self.runs, 5, 1)
    }

    /// Work before each kill, drawn from this range (ms): the article's 1–8 s; the demo's
    /// 0.5–2 s.
    pub(crate) fn kill_after_ms(&self) -> (u64, u64) {
        self.or(self.kill_after_ms, (1_000, 8_000), (500, 2_000))
    }

    /// None in the article; in the demo 0.02, so that b shows its duplicates even in a short
    /// run (the article saw 5 per 20 kills).
    pub(crate) fn crash_between_commit_and_ack(&self) -> f64 {
        self.or(self.crash_between_commit_and_ack, 0.0, 0.02)
    }

    /// The no-kill run's events: `--events` unless said.
    pub(crate) fn throughput_events(&self) -> u32 {
        self.throughput_events.unwrap_or(self.events())
    }

    /// With `StoreKind::Sharded`: how many shard clusters.
    pub(crate) fn shards(&self) -> usize {
        usize::from(self.shards)
    }
}

/// The flags of `zombie-test` (`zombie.rs` says what it does).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ZombieSettings {
    #[command(flatten)]
    pub(crate) brokers: Brokers,
    /// Variants to run: b, c (a consumer that acks on receipt holds nothing to lose).
    #[arg(
        long,
        alias = "variant",
        value_delimiter = ',',
        value_name = "VARIANT,…",
        default_value = "b,c"
    )]
    pub(crate) variants: Vec<Variant>,
    /// Credit events per run.
    #[arg(long, value_name = "N", default_value = "5000")]
    pub(crate) events: u32,
    /// One event in this many stalls on its first handling.
    #[arg(long, value_name = "N", default_value = "500", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) stall_every: u32,
    /// Runs per variant.
    #[arg(long, value_name = "N", default_value = "1")]
    pub(crate) runs: u32,
    /// The handler's work per message: milliseconds, or a duration such as 2ms.
    #[arg(long, value_name = "MS", default_value = "2", value_parser = millis)]
    pub(crate) work_ms: u64,
}
