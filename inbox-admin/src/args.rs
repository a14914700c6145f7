//! The command line, parsed by clap: a command, options shared by every command, and durations
//! in humantime's forms (`14d`, `36h`, `90m`, `2w`, `1day 12h`).

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use inbox_postgres::{KeyMode, DEFAULT_PURGE_BATCH};

mod dead_letters;

pub(crate) use dead_letters::{
    Broker, DeadLetterSource, DeadLettersCommand, DeadLettersList, DeadLettersReplay,
    DeadLettersShow, KafkaProperty,
};

/// The shortest `purge --older-than` taken without `--force`: anything shorter is almost always a
/// slipped unit (`14m` for `14d`), and forgets messages a redelivery may still bring back.
pub(crate) const PURGE_FLOOR: Duration = Duration::from_secs(3600);

/// The operator CLI of the inbox: the PostgreSQL table, and the brokers' dead letters.
#[derive(Debug, Parser)]
#[command(
    name = "inbox-admin",
    version,
    arg_required_else_help = true,
    after_help = "\
Durations: a number and a unit, like 14d, 36h, 90m, 30s or 2w; parts add up (1d 12h).
Exit status: 0 done; 1 the command failed (database, table name, broker); 2 the command line is wrong;
3 `stats --min-window` found a consumer whose window is too short.
Progress: purge, measure-storage and dead-letters replay draw it on stderr when stderr is a terminal; elsewhere, and
with --json, a plain line every 10s (INBOX_ADMIN_PROGRESS_EVERY=30s sets the period, =off none)."
)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) target: Target,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Which database and inbox table a command works on (accepted before or after the command).
#[derive(Debug, Args)]
#[command(next_help_heading = "Database and table (any command)")]
pub(crate) struct Target {
    /// PostgreSQL connection URL (required by every command that reads or writes the database).
    #[arg(
        long,
        global = true,
        value_name = "URL",
        env = "DATABASE_URL",
        hide_env_values = true
    )]
    pub(crate) database_url: Option<String>,
    /// Schema of the inbox table [default: the connection's search_path].
    #[arg(long, global = true, value_name = "NAME")]
    pub(crate) schema: Option<String>,
    /// Name of the inbox table.
    #[arg(long, global = true, value_name = "NAME", default_value = "inbox")]
    pub(crate) table: String,
    /// Key column type; only `migrate` reads it, the other commands work with any.
    #[arg(
        long,
        global = true,
        value_name = "MODE",
        value_enum,
        default_value_t = Keys::Text
    )]
    pub(crate) key_mode: Keys,
}

/// `--key-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Keys {
    /// Message IDs as text, any string.
    Text,
    /// Native `uuid` keys; every message ID must be a UUID.
    Uuid,
    /// 16 bytes of SHA-256 over consumer and message ID, stored as `uuid`.
    Hashed,
}

impl From<Keys> for KeyMode {
    fn from(keys: Keys) -> Self {
        match keys {
            Keys::Text => KeyMode::Text,
            Keys::Uuid => KeyMode::Uuid,
            Keys::Hashed => KeyMode::Hashed,
        }
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create the inbox tables and indexes (safe to run again).
    #[command(
        long_about = "Create the inbox tables and indexes (safe to run again).\n\n\
            With --partitioned a missing table is created range-partitioned by its message key: \
            with UUIDv7 IDs one partition per --partition-every of ID time, plus a default \
            partition, so that `purge` drops a whole partition instead of deleting its rows. The \
            partitions up to --partitions-ahead after the current one are created now and by \
            every purge. An existing table keeps its layout (see `partition`).\n\n\
            With --print-sql nothing is run: the statements are printed, for a schema applied \
            by your own migration tool, and no database is contacted."
    )]
    Migrate(Migrate),
    /// Delete expired rows in batches, printing each batch.
    #[command(
        long_about = "Delete rows processed longer ago than --older-than, in batches of --batch \
            rows (each its own short transaction), printing each batch.\n\n\
            A window below 1h is refused unless --force (or --yes) is given: it is almost always \
            a slipped unit (14m for 14d), and forgets messages a redelivery may still bring back, \
            which would then be applied twice."
    )]
    Purge(Purge),
    /// Rows, bytes per row and the oldest remembered time per consumer.
    #[command(
        long_about = "Rows, bytes per row and the oldest remembered time per consumer.\n\n\
            With --min-window, exit status 3 when a consumer's window (now - its oldest row) is \
            shorter than it: a redelivery older than that window would be applied again."
    )]
    Stats(Stats),
    /// Bytes per row for text, uuid v4, uuid v7 and hashed keys, measured in a scratch schema
    /// dropped afterwards.
    MeasureStorage(MeasureStorage),
    /// Convert a plain inbox table to the partitioned layout, in place, while consumers run.
    #[command(
        long_about = "Convert a plain inbox table to the partitioned layout, in place, while \
            consumers run: the plain table becomes the default partition `<table>_default` of a \
            new partitioned table of the same name, so its rows stay deduplicated without being \
            copied. Ranges start one --partition-every ahead and cover --window (the purge \
            window) and --partitions-ahead more; keys of earlier times keep going to the default \
            partition, purged by DELETE until they expire.\n\n\
            Claims wait at most a few 200 ms lock waits; a claim of a key inside the new ranges \
            (a clock far ahead) fails and is retried until the switch. Every instance must run a \
            version that knows the partitioned layout first. Hashed tables are refused: their \
            keys cannot be recomputed (exit status 1)."
    )]
    Partition(Partition),
    /// The partitions of a partitioned inbox: key-time range, rows and bytes.
    Partitions(ListPartitions),
    /// List, show and replay the dead letters of a Kafka topic, SQS queue, RabbitMQ queue, Redis
    /// stream or NATS JetStream subject.
    #[command(
        subcommand,
        long_about = "List, show and replay the dead letters of a Kafka topic, SQS queue, \
            RabbitMQ queue, Redis stream or NATS JetStream subject (--from: the dead-letter \
            destination itself, like orders.dlq or orders:dlq).\n\n\
            A replay publishes each selected dead letter back to its original source with its \
            ID, payload, key and headers, waits for the broker's confirm, and only then removes \
            it from the dead-letter destination: a crash in between leaves a copy in both, \
            and the inbox skips the one applied second. Messages the inbox already applied are \
            skipped the same way. Kafka cannot delete a record: a consumer group \
            (--kafka-group, default inbox-admin-replay) commits past what was replayed, and \
            `list` shows what the group has not committed.\n\n\
            The reader and the replay's producer reach the broker through one connection, with \
            the same settings: TLS and SASL for Kafka as librdkafka properties (-X \
            security.protocol=sasl_ssl -X ssl.ca.location=ca.pem ..., or -F FILE of KEY=VALUE \
            lines, where a password is not shown in the process list); amqps:// and rediss:// \
            URLs, with --amqp-ca and --redis-ca for a private CA; a Redis Cluster with \
            --redis-cluster; for NATS --nats-ca and --nats-creds."
    )]
    DeadLetters(Box<DeadLettersCommand>),
}

#[derive(Debug, Args)]
pub(crate) struct Migrate {
    /// Create the table partitioned by message-key range (UUIDv7 time).
    #[arg(long)]
    pub(crate) partitioned: bool,
    /// With --partitioned: one partition per this span of ID time (whole minutes, like 1d or 6h).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1d", requires = "partitioned")]
    pub(crate) partition_every: Duration,
    /// With --partitioned: partitions kept ready after the current one.
    #[arg(long, value_name = "N", default_value_t = 3, requires = "partitioned")]
    pub(crate) partitions_ahead: u32,
    /// Print the SQL that creates the table, for your own migrations, instead of running it
    /// (connects to nothing).
    #[arg(long)]
    pub(crate) print_sql: bool,
    /// Print one JSON object (table, key_mode, layout) instead of the sentence.
    #[arg(long, conflicts_with = "print_sql")]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct Partition {
    /// The purge window (like 14d): ranges are created this far ahead, so that none has to be
    /// added while the former table still holds many rows.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) window: Duration,
    /// One partition per this span of ID time (whole minutes, like 1d or 6h).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1d")]
    pub(crate) partition_every: Duration,
    /// Partitions kept ready after the current one.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub(crate) partitions_ahead: u32,
    /// Print one JSON object (table, converted, ranges_from, created_partitions, moved_rows,
    /// partitions) instead of the lines.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ListPartitions {
    /// One JSON object per partition (table, name, from, to, default, approx_rows, bytes).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct Purge {
    /// Delete rows processed longer ago than this (like 14d); below 1h only with --force.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) older_than: Duration,
    /// Rows deleted per statement (each batch is its own short transaction).
    #[arg(
        long,
        value_name = "ROWS",
        default_value_t = DEFAULT_PURGE_BATCH,
        value_parser = clap::value_parser!(i64).range(1..)
    )]
    pub(crate) batch: i64,
    /// Purge even when --older-than is below the 1h floor (which usually means a slipped unit,
    /// like 14m for 14d).
    #[arg(long, visible_alias = "yes")]
    pub(crate) force: bool,
    /// Print one JSON object (deleted_rows, batch_deleted_rows, elapsed_ms, partitions dropped,
    /// ...) instead of the lines; no progress is drawn.
    #[arg(long)]
    pub(crate) json: bool,
}

impl Purge {
    /// Why this purge must not run as given: a window below [`PURGE_FLOOR`] without `--force`.
    pub(crate) fn refusal(&self) -> Option<String> {
        (self.older_than < PURGE_FLOOR && !self.force).then(|| {
            format!(
                "`--older-than {}` is below the {} floor of `purge`: it would forget messages \
                 processed only that long ago, which a redelivery would apply again; check the \
                 unit (d is days, m is minutes), or pass `--force` to purge a window this short",
                humantime::format_duration(self.older_than),
                humantime::format_duration(PURGE_FLOOR),
            )
        })
    }
}

#[derive(Debug, Args)]
pub(crate) struct Stats {
    /// Alarm (exit status 3) when a consumer's window is shorter than this (like 7d).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) min_window: Option<Duration>,
    /// Print one JSON object per consumer (consumer, rows, window_seconds,
    /// shorter_than_min_window, table) instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct MeasureStorage {
    /// Rows inserted per key layout and run.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(i64).range(1..))]
    pub(crate) rows: i64,
    /// Runs per key layout; the median is printed.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i64).range(1..))]
    pub(crate) runs: i64,
    /// Print one JSON object (per key layout: median bytes per row, projections and every run)
    /// instead of the table; no progress is drawn.
    #[arg(long)]
    pub(crate) json: bool,
}

/// A command-line value that is not a duration.
#[derive(Debug, thiserror::Error)]
#[error("`{value}` is not a duration ({reason}); write a number and a unit, like 14d, 36h or 90m")]
pub(crate) struct NotADuration {
    value: String,
    reason: humantime::DurationError,
}

/// `14d`, `36h`, `90m`, `30s`, `2w`, `1d 12h`: humantime's forms.
pub(crate) fn parse_duration(value: &str) -> Result<Duration, NotADuration> {
    humantime::parse_duration(value).map_err(|reason| NotADuration {
        value: value.to_owned(),
        reason,
    })
}

/// `1d 2h 3m`, for windows printed back to the operator.
pub(crate) fn format_duration(d: Duration) -> String {
    let minutes = d.as_secs() / 60;
    let (days, hours, minutes) = (minutes / 1440, minutes / 60 % 24, minutes % 60);
    match (days, hours) {
        (0, 0) => format!("{minutes}m"),
        (0, _) => format!("{hours}h {minutes}m"),
        _ => format!("{days}d {hours}h {minutes}m"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::CommandFactory;

    use super::*;

    pub(super) fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("inbox-admin").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse() {
        for (text, secs) in [
            ("14d", 14 * 86_400),
            ("90m", 5400),
            ("36h", 36 * 3600),
            ("30s", 30),
            ("2w", 14 * 86_400),
            ("1d 12h", 36 * 3600),
            ("1.5d", 36 * 3600),
            ("2 weeks", 14 * 86_400),
        ] {
            assert_eq!(
                parse_duration(text).unwrap(),
                Duration::from_secs(secs),
                "{text}"
            );
        }
        for bad in ["", "d", "14", "14x", "-1d", "fortnight", "help"] {
            let e = parse_duration(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("`{bad}` is not a duration")), "{e}");
        }
        assert_eq!(
            format_duration(Duration::from_secs(20 * 86_400 + 3600 + 120)),
            "20d 1h 2m"
        );
    }

    #[test]
    fn options_parse_before_or_after_the_command() {
        let cli = parse(&[
            "--schema",
            "ops",
            "purge",
            "--older-than",
            "14d",
            "--batch=500",
        ])
        .unwrap();
        assert_eq!(cli.target.schema.as_deref(), Some("ops"));
        let Command::Purge(purge) = cli.command else {
            panic!("not purge: {:?}", cli.command)
        };
        assert_eq!(purge.older_than, Duration::from_secs(14 * 86_400));
        assert_eq!(purge.batch, 500);
        assert!(purge.refusal().is_none());
        assert!(!purge.json);

        let cli = parse(&["purge", "--older-than", "14d", "--json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Purge(Purge { json: true, .. })
        ));
        let cli = parse(&["measure-storage", "--json", "--rows", "10"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::MeasureStorage(MeasureStorage {
                json: true,
                rows: 10,
                runs: 5
            })
        ));
        let cli = parse(&["migrate", "--json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Migrate(Migrate { json: true, .. })
        ));

        let cli = parse(&["migrate", "--key-mode", "hashed", "--table", "t"]).unwrap();
        assert_eq!(cli.target.key_mode, Keys::Hashed);
        assert_eq!(cli.target.table, "t");
        let Command::Migrate(migrate) = cli.command else {
            panic!("not migrate: {:?}", cli.command)
        };
        assert!(!migrate.partitioned);
        assert!(!migrate.print_sql);

        let cli = parse(&["migrate", "--print-sql", "--partitioned"]).unwrap();
        let Command::Migrate(migrate) = cli.command else {
            panic!("not migrate: {:?}", cli.command)
        };
        assert!(migrate.print_sql && migrate.partitioned);
    }

    #[test]
    fn partition_options_parse() {
        let cli = parse(&["migrate", "--partitioned", "--partition-every", "6h"]).unwrap();
        let Command::Migrate(migrate) = cli.command else {
            panic!("not migrate: {:?}", cli.command)
        };
        assert!(migrate.partitioned);
        assert_eq!(migrate.partition_every, Duration::from_secs(6 * 3600));
        assert_eq!(migrate.partitions_ahead, 3);

        let cli = parse(&["partition", "--window", "14d", "--partitions-ahead", "5"]).unwrap();
        let Command::Partition(partition) = cli.command else {
            panic!("not partition: {:?}", cli.command)
        };
        assert_eq!(partition.window, Duration::from_secs(14 * 86_400));
        assert_eq!(partition.partition_every, Duration::from_secs(86_400));
        assert_eq!(partition.partitions_ahead, 5);
        assert!(matches!(
            parse(&["partitions", "--json"]).unwrap().command,
            Command::Partitions(ListPartitions { json: true })
        ));
    }

    #[test]
    fn purge_below_the_floor_needs_force() {
        let purge = |args: &[&str]| match parse(args).unwrap().command {
            Command::Purge(p) => p,
            other => panic!("not purge: {other:?}"),
        };
        let refusal = purge(&["purge", "--older-than", "14m"]).refusal().unwrap();
        assert!(refusal.contains("`--older-than 14m`"), "{refusal}");
        assert!(refusal.contains("--force"), "{refusal}");
        assert!(purge(&["purge", "--older-than", "0s"]).refusal().is_some());
        assert!(purge(&["purge", "--older-than", "59m 59s"])
            .refusal()
            .is_some());
        assert!(purge(&["purge", "--older-than", "1h"]).refusal().is_none());
        assert!(purge(&["purge", "--older-than", "0s", "--force"])
            .refusal()
            .is_none());
        assert!(purge(&["purge", "--older-than", "14m", "--yes"])
            .refusal()
            .is_none());
    }

    #[test]
    fn usage_mistakes_are_errors() {
        for args in [
            &[][..],
            &["purge"],
            &["purge", "--older-than", "14d", "help"],
            &["purge", "--older-than", "help"],
            &["purge", "--older-than", "14d", "--batch", "0"],
            &["stats", "--min-windw", "7d"],
            &["stats", "--min-window"],
            &["migrate", "--key-mode", "sha1"],
            &["measure-storage", "--runs", "-1"],
            &["migrate", "--partition-every", "1d"],
            &["partition"],
            &["partition", "--window", "14"],
            &["partitions", "--window", "14d"],
            &["migrate", "--print-sql", "--json"],
            &["dead-letters", "list", "--broker", "redis"],
            &["dead-letters", "list", "--broker", "pulsar", "--from", "x"],
            &["dead-letters", "replay", "--broker", "redis", "--from", "x"],
            &[
                "dead-letters",
                "replay",
                "--broker",
                "redis",
                "--from",
                "x",
                "--all",
                "--reason",
                "r",
            ],
            &[
                "dead-letters",
                "replay",
                "--broker",
                "redis",
                "--from",
                "x",
                "--since",
                "soon",
            ],
            &["dead-letters", "show", "--broker", "redis", "--from", "x"],
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
        }
    }
}
