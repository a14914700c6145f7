//! Command-line settings: brokers, variants and the flags of each subcommand.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The four brokers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum BrokerKind {
    Kafka,
    Sqs,
    Rabbitmq,
    Redis,
}

impl BrokerKind {
    pub(crate) const ALL: [BrokerKind; 4] = [Self::Kafka, Self::Sqs, Self::Rabbitmq, Self::Redis];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Kafka => "kafka",
            Self::Sqs => "sqs",
            Self::Rabbitmq => "rabbitmq",
            Self::Redis => "redis",
        }
    }
}

impl FromStr for BrokerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown broker `{s}`; use kafka, sqs, rabbitmq or redis"))
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
    pub(crate) fn tansu_workarounds(self) -> bool {
        self == Self::Tansu
    }
}

impl FromStr for KafkaImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Tansu, Self::Mock]
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown Kafka implementation `{s}`; use tansu or mock"))
    }
}

/// The article's variants, generalised to each broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Variant {
    /// The client's automatic ack, one message at a time.
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

    /// The broker's automatic acknowledgement (the at-most-once anti-pattern).
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
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown variant `{s}`; use a1, a2, b or c"))
    }
}

/// Reads `--flag value` pairs, handing each to `apply`.
pub(crate) fn parse_flags(
    args: &[String],
    mut apply: impl FnMut(&str, &str) -> Result<bool, String>,
) -> Result<(), String> {
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        if !apply(flag, value).map_err(|e| format!("{flag} {value}: {e}"))? {
            return Err(format!("unknown option {flag}"));
        }
    }
    Ok(())
}

pub(crate) fn num<T: FromStr>(value: &str) -> Result<T, String>
where
    T::Err: fmt::Display,
{
    value.parse().map_err(|e: T::Err| e.to_string())
}

pub(crate) fn list<T: FromStr<Err = String>>(value: &str) -> Result<Vec<T>, String> {
    value.split(',').map(str::trim).map(T::from_str).collect()
}

pub(crate) fn probability(value: &str) -> Result<f64, String> {
    let p: f64 = num(value)?;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err("a probability is between 0 and 1".into())
    }
}

/// What one consumer process (or task) does.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerSpec {
    pub(crate) broker: BrokerKind,
    pub(crate) variant: Variant,
    /// The queue, topic or stream.
    pub(crate) name: String,
    /// The Postgres schema holding the wallet tables and the inbox.
    pub(crate) schema: String,
    pub(crate) work: Duration,
    pub(crate) crash_between_commit_and_ack: f64,
    /// Which of several concurrent consumers this is (names its connection, Redis consumer).
    pub(crate) member: usize,
    /// Zombie-test settings: short ownership (visibility, claim idle, max poll interval).
    pub(crate) zombie: bool,
    /// How long a stalling event sleeps on its first handling (zombie test).
    pub(crate) stall: Duration,
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
            work: Duration::from_millis(10),
            crash_between_commit_and_ack: 0.0,
            member: 0,
            zombie: false,
            stall: Duration::ZERO,
            batch: None,
            lanes: 1,
            batched: false,
            no_database: false,
        }
    }

    pub(crate) fn parse(args: &[String]) -> Result<Self, String> {
        let mut broker = None;
        let mut variant = Variant::C;
        let mut name = None;
        let mut schema = None;
        let mut spec = Self::new(BrokerKind::Redis, variant, "", "");
        parse_flags(args, |flag, value| {
            match flag {
                "--broker" => broker = Some(value.parse()?),
                "--variant" => variant = value.parse()?,
                "--name" => name = Some(value.to_owned()),
                "--schema" => schema = Some(value.to_owned()),
                "--work-ms" => spec.work = Duration::from_millis(num(value)?),
                "--crash-between-commit-and-ack" => {
                    spec.crash_between_commit_and_ack = probability(value)?;
                }
                "--member" => spec.member = num(value)?,
                "--batch" => spec.batch = Some(num(value)?),
                "--lanes" => spec.lanes = num(value)?,
                "--handler" => spec.batched = value == "batch",
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        Ok(Self {
            broker: broker.ok_or("--broker is required")?,
            variant,
            name: name.ok_or("--name (queue, topic or stream) is required")?,
            schema: schema.ok_or("--schema is required")?,
            ..spec
        })
    }

    /// The arguments that make a `wallet consume` child run this spec.
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
