//! Command-line settings: brokers, variants and the flags of each subcommand.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The five brokers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum BrokerKind {
    Kafka,
    Sqs,
    Rabbitmq,
    Redis,
    Nats,
}

impl BrokerKind {
    pub(crate) const ALL: [BrokerKind; 5] = [
        Self::Kafka,
        Self::Sqs,
        Self::Rabbitmq,
        Self::Redis,
        Self::Nats,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Kafka => "kafka",
            Self::Sqs => "sqs",
            Self::Rabbitmq => "rabbitmq",
            Self::Redis => "redis",
            Self::Nats => "nats",
        }
    }
}

/// The inbox store of the kill test's wallet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum StoreKind {
    /// `inbox-postgres`, in a schema of the run's own.
    #[default]
    Postgres,
    /// `inbox-mysql`, in a database of the run's own (`INBOX_MYSQL_URL`).
    Mysql,
    /// `inbox-postgres` behind `Sharded`: a schema of the run's own in each of the shard
    /// clusters (see `shards::shard_url`), credits routed by account.
    Sharded,
}

impl StoreKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Mysql => "mysql",
            Self::Sharded => "sharded",
        }
    }
}

impl FromStr for StoreKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "postgres" => Ok(Self::Postgres),
            "mysql" => Ok(Self::Mysql),
            "sharded" => Ok(Self::Sharded),
            _ => Err(format!(
                "unknown store `{s}`; use postgres, mysql or sharded"
            )),
        }
    }
}

impl FromStr for BrokerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == s.trim())
            .ok_or_else(|| format!("unknown broker `{s}`; use kafka, sqs, rabbitmq, redis or nats"))
    }
}

impl fmt::Display for BrokerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which Kafka-protocol broker `KAFKA_BROKERS` points at, for the harness work-arounds one needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum KafkaImpl {
    /// Tansu 0.6, what `cargo xtask services` starts: one record per produced batch, and a
    /// draining consumer that applies nothing is replaced (see `brokers/kafka.rs`, `kill.rs`).
    #[default]
    Tansu,
    /// librdkafka's mock cluster (`kafka-mock`): records batched normally, a stalled drain fails
    /// the run; no CreateTopics, so topics come from `kafka-mock --control` (`KAFKA_MOCK_CONTROL`)
    /// or are created on first use with the mock's 4 partitions.
    Mock,
}

impl KafkaImpl {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Tansu => "tansu",
            Self::Mock => "mock",
        }
    }

    /// Whether the harness works around Tansu 0.6's fetch and group-assignment behaviour.
    // Asked only by the Kafka broker's code.
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn tansu_workarounds(self) -> bool {
        self == Self::Tansu
    }
}

impl FromStr for KafkaImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Tansu, Self::Mock]
            .into_iter()
            .find(|k| k.name() == s.trim())
            .ok_or_else(|| format!("unknown Kafka implementation `{s}`; use tansu or mock"))
    }
}

/// The article's variants, generalised to each broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Variant {
    /// Ack on receipt, one message at a time.
    A1,
    /// The same in batches: 100 messages, 10 on SQS (its largest receive).
    A2,
    /// Ack after the DB commit, no inbox.
    B,
    /// The inbox, ack after the DB commit.
    C,
}

impl Variant {
    pub(crate) const ALL: [Variant; 4] = [Self::A1, Self::A2, Self::B, Self::C];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::A1 => "a1",
            Self::A2 => "a2",
            Self::B => "b",
            Self::C => "c",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::A1 => "a1: auto-ack, one at a time",
            Self::A2 => "a2: auto-ack, in batches",
            Self::B => "b: ack after the DB, no inbox",
            Self::C => "c: inbox + ack after the DB",
        }
    }

    /// Acked on receipt (the at-most-once anti-pattern): the source in `AckOnReceive`.
    pub(crate) fn auto_ack(self) -> bool {
        matches!(self, Self::A1 | Self::A2)
    }

    pub(crate) fn batch(self) -> usize {
        match self {
            Self::A2 => 100,
            _ => 1,
        }
    }
}

impl FromStr for Variant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s.trim())
            .ok_or_else(|| format!("unknown variant `{s}`; use a1, a2, b or c"))
    }
}

/// The one-line help of every `--kafka-impl`.
pub(crate) const KAFKA_IMPL_HELP: &str = "What KAFKA_BROKERS is: tansu or mock";

/// The long help of every `--kafka-impl`.
pub(crate) const KAFKA_IMPL_LONG_HELP: &str = "What KAFKA_BROKERS is.
tansu (what `cargo xtask services` starts): one record per produced batch (Tansu 0.6 serves a \
fetch from mid-batch from the next batch on) and a draining consumer that applies nothing is \
replaced (Tansu can leave the last member with no partitions).
mock (librdkafka's mock cluster, `cargo run -p inbox-evidence --bin kafka-mock`): neither \
work-around, a stalled drain fails the run; topics get 6 partitions through \
`kafka-mock --control ADDR` when KAFKA_MOCK_CONTROL=ADDR, else 4, created on first use.";

/// A probability: a number from 0 to 1.
pub(crate) fn probability(value: &str) -> Result<f64, String> {
    let p: f64 = value.trim().parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err("a probability is between 0 and 1".into())
    }
}

/// A count from 1 up.
pub(crate) fn positive(value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A duration flag in `unit`: a plain number counts in that unit, as the flag's name says
/// (`--work-ms 10`), and a humantime duration is converted to it (`--work-ms 1s`).
fn duration_in(value: &str, unit: Duration, unit_name: &str) -> Result<u64, String> {
    let value = value.trim();
    if let Ok(n) = value.parse::<u64>() {
        return Ok(n);
    }
    let d = humantime::parse_duration(value).map_err(|e| {
        format!("`{value}` is neither a number of {unit_name} nor a duration such as 1500ms or 2m ({e})")
    })?;
    if d.as_nanos() % unit.as_nanos() != 0 {
        return Err(format!("`{value}` is not a whole number of {unit_name}"));
    }
    u64::try_from(d.as_nanos() / unit.as_nanos()).map_err(|_| format!("`{value}` is too long"))
}

/// Milliseconds: `10`, or a duration such as `1s`.
pub(crate) fn millis(value: &str) -> Result<u64, String> {
    duration_in(value, Duration::from_millis(1), "milliseconds")
}

/// Seconds: `60`, or a duration such as `1m`.
pub(crate) fn seconds(value: &str) -> Result<u64, String> {
    duration_in(value, Duration::from_secs(1), "seconds")
}

/// Minutes: `60`, or a duration such as `2h`.
pub(crate) fn minutes(value: &str) -> Result<u64, String> {
    duration_in(value, Duration::from_secs(60), "minutes")
}

/// `MIN..MAX`, both read by `one`.
fn range(
    value: &str,
    one: fn(&str) -> Result<u64, String>,
    example: &str,
) -> Result<(u64, u64), String> {
    let (lo, hi) = value
        .split_once("..")
        .ok_or_else(|| format!("use MIN..MAX, e.g. {example}"))?;
    let (lo, hi) = (one(lo)?, one(hi)?);
    if lo > hi {
        return Err("MIN is above MAX".into());
    }
    Ok((lo, hi))
}

/// A range of milliseconds: `1000..8000` or `1s..8s`.
pub(crate) fn millis_range(value: &str) -> Result<(u64, u64), String> {
    range(value, millis, "1000..8000 or 1s..8s")
}

/// A range of seconds from 1 up: `5..30` or `5s..1m`.
pub(crate) fn seconds_range(value: &str) -> Result<(u64, u64), String> {
    let (lo, hi) = range(value, seconds, "5..30 or 5s..1m")?;
    if lo == 0 {
        return Err("MIN must be at least 1 s".into());
    }
    Ok((lo, hi))
}

/// How a consumer applies its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HandlerKind {
    /// `Consumer::new` with the wallet's `Credit`: two statements per message.
    PerMessage,
    /// `Consumer::batched` with `BatchCredit`: one statement per transaction.
    Batch,
}

impl HandlerKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::PerMessage => "message",
            Self::Batch => "batch",
        }
    }
}

impl FromStr for HandlerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "message" => Ok(Self::PerMessage),
            "batch" => Ok(Self::Batch),
            _ => Err(format!("unknown handler `{s}`; use message or batch")),
        }
    }
}

/// `evidence consume`: what one consumer child of the kill test runs (see [`ConsumerSpec::to_args`]).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConsumeArgs {
    /// The broker to consume from.
    #[arg(long, value_name = "kafka|sqs|rabbitmq|redis")]
    broker: BrokerKind,
    /// a1 ack on receipt, a2 the same in batches, b ack after the DB commit without
    /// the inbox, c the inbox.
    #[arg(long, value_name = "a1|a2|b|c", default_value = "c")]
    variant: Variant,
    /// The queue, topic or stream.
    #[arg(long, value_name = "QUEUE")]
    name: String,
    /// The Postgres schema (with `--store mysql`, the MySQL database; with `--store sharded`,
    /// each shard's schema, comma-separated) holding the wallet tables and the inbox.
    #[arg(long)]
    schema: String,
    /// The inbox store.
    #[arg(
        long,
        value_name = "postgres|mysql|sharded",
        default_value = "postgres"
    )]
    store: StoreKind,
    /// The handler's work per message: milliseconds, or a duration such as 10ms.
    #[arg(long, value_name = "MS", default_value = "10", value_parser = millis)]
    work_ms: u64,
    /// Probability per message of aborting between the DB commit and the ack.
    #[arg(long, value_name = "P", default_value = "0", value_parser = probability)]
    crash_between_commit_and_ack: f64,
    /// Which of several concurrent consumers this is.
    #[arg(long, value_name = "N", default_value = "0")]
    member: usize,
    /// Messages per transaction [default: the variant's].
    #[arg(long, value_name = "N", value_parser = positive)]
    batch: Option<usize>,
    /// Lanes applied side by side.
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    lanes: usize,
    /// The per-message handler or the set-based batch one.
    #[arg(long, value_name = "message|batch", default_value = "message")]
    handler: HandlerKind,
}

impl ConsumeArgs {
    pub(crate) fn spec(self) -> ConsumerSpec {
        ConsumerSpec {
            work: Duration::from_millis(self.work_ms),
            crash_between_commit_and_ack: self.crash_between_commit_and_ack,
            member: self.member,
            batch: self.batch,
            lanes: self.lanes,
            batched: self.handler == HandlerKind::Batch,
            store: self.store,
            ..ConsumerSpec::new(self.broker, self.variant, &self.name, &self.schema)
        }
    }
}

/// What one consumer process (or task) does.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerSpec {
    pub(crate) broker: BrokerKind,
    pub(crate) variant: Variant,
    /// The queue, topic or stream.
    pub(crate) name: String,
    /// The Postgres schema (MySQL: the database) holding the wallet tables and the inbox.
    pub(crate) schema: String,
    /// The inbox store.
    pub(crate) store: StoreKind,
    pub(crate) work: Duration,
    pub(crate) crash_between_commit_and_ack: f64,
    /// Which of several concurrent consumers this is (names its connection, Redis consumer).
    pub(crate) member: usize,
    /// Messages per transaction; `None`: the variant's.
    pub(crate) batch: Option<usize>,
    /// Lanes applied side by side (`Consumer::parallel_lanes`).
    pub(crate) lanes: usize,
    /// The set-based `BatchCredit` instead of the per-message credit.
    pub(crate) batched: bool,
    /// No database at all: an in-memory store and a handler that only counts (the benchmark's
    /// "broker alone").
    pub(crate) no_database: bool,
}

impl ConsumerSpec {
    /// A consumer of `name` for `variant`, with the kill test's defaults: 10 ms of work per
    /// message, the variant's batch size, one lane, the per-message handler.
    pub(crate) fn new(broker: BrokerKind, variant: Variant, name: &str, schema: &str) -> Self {
        Self {
            broker,
            variant,
            name: name.to_owned(),
            schema: schema.to_owned(),
            store: StoreKind::Postgres,
            work: Duration::from_millis(10),
            crash_between_commit_and_ack: 0.0,
            member: 0,
            batch: None,
            lanes: 1,
            batched: false,
            no_database: false,
        }
    }

    /// The arguments that make a `evidence consume` child run this spec.
    pub(crate) fn to_args(&self) -> Vec<String> {
        [
            "consume",
            "--broker",
            self.broker.name(),
            "--variant",
            self.variant.name(),
            "--name",
            &self.name,
            "--schema",
            &self.schema,
            "--store",
            self.store.name(),
            "--work-ms",
            &self.work.as_millis().to_string(),
            "--crash-between-commit-and-ack",
            &self.crash_between_commit_and_ack.to_string(),
            "--member",
            &self.member.to_string(),
            "--lanes",
            &self.lanes.to_string(),
            "--handler",
            if self.batched { "batch" } else { "message" },
        ]
        .map(str::to_owned)
        .into_iter()
        .chain(
            self.batch
                .map(|b| ["--batch".to_owned(), b.to_string()])
                .into_iter()
                .flatten(),
        )
        .collect()
    }
}
