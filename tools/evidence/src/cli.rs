//! Command-line settings: brokers, variants and the flags of each subcommand.

use std::time::Duration;

/// An enum named on the command line and in the output: `ALL`, `name`, `Display`, serde as its
/// name, and a `FromStr` that refuses an unknown name with the list of known ones (`$what` says
/// what the value is), all from one list of `Variant = "name"`.
macro_rules! named {
    (
        $(#[$meta:meta])*
        $vis:vis enum $ty:ident ($what:literal) {
            $($(#[$vmeta:meta])* $variant:ident = $name:literal,)+
        }
    ) => {
        $(#[$meta])*
        $vis enum $ty {
            $($(#[$vmeta])* $variant,)+
        }

        impl $ty {
            pub(crate) const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            pub(crate) fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                Self::ALL
                    .into_iter()
                    .find(|v| v.name() == s.trim())
                    .ok_or_else(|| {
                        let names = [$($name),+];
                        let (last, rest) = names.split_last().unwrap_or((&"", &[]));
                        let list = if rest.is_empty() {
                            (*last).to_owned()
                        } else {
                            format!("{} or {last}", rest.join(", "))
                        };
                        format!("unknown {} `{s}`; use {list}", $what)
                    })
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                <String as serde::Deserialize>::deserialize(d)?.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use named;

named! {
    /// The five brokers.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub(crate) enum BrokerKind ("broker") {
        Kafka = "kafka",
        Sqs = "sqs",
        Rabbitmq = "rabbitmq",
        Redis = "redis",
        Nats = "nats",
    }
}

named! {
    /// The inbox store of the kill test's wallet.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub(crate) enum StoreKind ("store") {
        /// `inbox-postgres`, in a schema of the run's own.
        #[default]
        Postgres = "postgres",
        /// `inbox-mysql`, in a database of the run's own (`INBOX_MYSQL_URL`).
        Mysql = "mysql",
        /// `inbox-postgres` behind `Sharded`: a schema of the run's own in each of the shard
        /// clusters (see `shards::shard_url`), credits routed by account.
        Sharded = "sharded",
    }
}

named! {
    /// Which Kafka-protocol broker `KAFKA_BROKERS` points at, for the harness work-arounds one
    /// needs ([`KAFKA_IMPL_LONG_HELP`] says which).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub(crate) enum KafkaImpl ("Kafka implementation") {
        /// Tansu 0.6, what `cargo xtask services` starts.
        #[default]
        Tansu = "tansu",
        /// librdkafka's mock cluster (`kafka-mock`).
        Mock = "mock",
    }
}

impl KafkaImpl {
    /// Whether the harness works around Tansu 0.6's fetch and group-assignment behaviour.
    // Asked only by the Kafka broker's code.
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn tansu_workarounds(self) -> bool {
        self == Self::Tansu
    }
}

named! {
    /// The article's variants, generalised to each broker.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub(crate) enum Variant ("variant") {
        /// Ack on receipt, one message at a time.
        A1 = "a1",
        /// The same in batches: 100 messages, 10 on SQS (its largest receive).
        A2 = "a2",
        /// Ack after the DB commit, no inbox.
        B = "b",
        /// The inbox, ack after the DB commit.
        C = "c",
    }
}

impl Variant {
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

/// [`millis`] as a `Duration`.
fn millis_duration(value: &str) -> Result<Duration, String> {
    millis(value).map(Duration::from_millis)
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

named! {
    /// How a consumer applies its messages.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum HandlerKind ("handler") {
        /// `Consumer::new` with the wallet's `Credit`: two statements per message.
        PerMessage = "message",
        /// `Consumer::batched` with `BatchCredit`: one statement per transaction.
        Batch = "batch",
    }
}

/// What one consumer process (or task) does; `evidence consume`, what the kill test's children
/// run, takes it as flags (see [`ConsumerSpec::to_args`]).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConsumerSpec {
    /// The broker to consume from.
    #[arg(long, value_name = "kafka|sqs|rabbitmq|redis|nats")]
    pub(crate) broker: BrokerKind,
    /// a1 ack on receipt, a2 the same in batches, b ack after the DB commit without
    /// the inbox, c the inbox.
    #[arg(long, value_name = "a1|a2|b|c", default_value = "c")]
    pub(crate) variant: Variant,
    /// The queue, topic or stream.
    #[arg(long, value_name = "QUEUE")]
    pub(crate) name: String,
    /// The Postgres schema (with `--store mysql`, the MySQL database; with `--store sharded`,
    /// each shard's schema, comma-separated) holding the wallet tables and the inbox.
    #[arg(long)]
    pub(crate) schema: String,
    /// The inbox store.
    #[arg(
        long,
        value_name = "postgres|mysql|sharded",
        default_value = "postgres"
    )]
    pub(crate) store: StoreKind,
    /// The handler's work per message: milliseconds, or a duration such as 10ms.
    #[arg(long = "work-ms", value_name = "MS", default_value = "10", value_parser = millis_duration)]
    pub(crate) work: Duration,
    /// Probability per message of aborting between the DB commit and the ack.
    #[arg(long, value_name = "P", default_value = "0", value_parser = probability)]
    pub(crate) crash_between_commit_and_ack: f64,
    /// Which of several concurrent consumers this is.
    // It names the consumer's connection and Redis consumer.
    #[arg(long, value_name = "N", default_value = "0")]
    pub(crate) member: usize,
    /// Messages per transaction [default: the variant's].
    #[arg(long, value_name = "N", value_parser = positive)]
    pub(crate) batch: Option<usize>,
    /// Lanes applied side by side.
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    pub(crate) lanes: usize,
    /// The per-message handler or the set-based batch one.
    #[arg(long, value_name = "message|batch", default_value = "message")]
    pub(crate) handler: HandlerKind,
    /// No database at all: an in-memory store and a handler that only counts (the benchmark's
    /// "broker alone").
    #[arg(skip)]
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
            handler: HandlerKind::PerMessage,
            no_database: false,
        }
    }

    /// The set-based `BatchCredit` instead of the per-message credit.
    pub(crate) fn batched(&self) -> bool {
        self.handler == HandlerKind::Batch
    }

    /// The arguments that make a `evidence consume` child run this spec.
    pub(crate) fn to_args(&self) -> Vec<String> {
        let batch = self.batch.map(|b| ("--batch", b.to_string()));
        let flags = [
            ("--broker", self.broker.to_string()),
            ("--variant", self.variant.to_string()),
            ("--name", self.name.clone()),
            ("--schema", self.schema.clone()),
            ("--store", self.store.to_string()),
            ("--work-ms", self.work.as_millis().to_string()),
            (
                "--crash-between-commit-and-ack",
                self.crash_between_commit_and_ack.to_string(),
            ),
            ("--member", self.member.to_string()),
            ("--lanes", self.lanes.to_string()),
            ("--handler", self.handler.to_string()),
        ];
        child_args("consume", flags.into_iter().chain(batch))
    }
}

/// A child's arguments: `command`, then `--flag value` pairs.
pub(crate) fn child_args(
    command: &str,
    flags: impl IntoIterator<Item = (&'static str, String)>,
) -> Vec<String> {
    let flags = flags
        .into_iter()
        .flat_map(|(flag, value)| [flag.into(), value]);
    std::iter::once(command.to_owned()).chain(flags).collect()
}
