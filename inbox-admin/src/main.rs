//! `inbox-admin`: the operator CLI of the inbox: the PostgreSQL table, and the brokers' dead
//! letters (`dead-letters`, each broker behind a feature of its name).
//!
//! ```text
//! inbox-admin migrate --key-mode uuid
//! inbox-admin migrate --key-mode uuid --partitioned --partition-every 1d
//! inbox-admin migrate --key-mode uuid --print-sql > migrations/0001_inbox.sql
//! inbox-admin partition --window 14d          # a plain table converted in place
//! inbox-admin partitions                      # ranges, rows and bytes per partition
//! inbox-admin purge --older-than 14d --batch 10000
//! inbox-admin purge --older-than 14d --json  # one JSON object: deleted_rows, elapsed_ms, ...
//! inbox-admin stats --min-window 7d        # exit status 3: some consumer remembers too little
//! inbox-admin stats --json                 # one JSON object per consumer
//! inbox-admin measure-storage --rows 1000000 --runs 5
//! inbox-admin measure-storage --json       # one JSON object: bytes per row per key layout
//! inbox-admin dead-letters list --broker redis --from orders:dlq
//! inbox-admin dead-letters show --broker redis --from orders:dlq 1733369000000-0
//! inbox-admin dead-letters replay --broker kafka --from orders.dlq --reason "downstream down" --dry-run
//! inbox-admin dead-letters replay --broker sqs --from "$DLQ_URL" --since 2h
//! ```
//!
//! Managed brokers: TLS is built in (librdkafka's OpenSSL for Kafka, rustls for RabbitMQ and
//! Redis), and each broker's settings reach both the dead-letter reader and the replay's
//! producer.
//!
//! ```text
//! inbox-admin dead-letters list --broker kafka --from orders.dlq \
//!     --kafka-brokers b-1.internal:9096,b-2.internal:9096 \
//!     -X security.protocol=sasl_ssl -X sasl.mechanism=SCRAM-SHA-512 \
//!     -X sasl.username=ops -X sasl.password="$KAFKA_PASSWORD" \
//!     -X ssl.ca.location=/etc/ssl/kafka-ca.pem
//! inbox-admin dead-letters replay --broker rabbitmq --from orders.dlq --all \
//!     --amqp-url "amqps://ops:$PW@mq.internal:5671/%2f" --amqp-ca /etc/ssl/mq-ca.pem
//! inbox-admin dead-letters list --broker redis --from orders:dlq \
//!     --redis-url "rediss://:$PW@redis.internal:6380/0" --redis-ca /etc/ssl/redis-ca.pem
//! inbox-admin dead-letters list --broker redis --from '{orders}:dlq' \
//!     --redis-cluster rediss://node-1.internal:6379,rediss://node-2.internal:6379
//! ```
//!
//! `-X key=value` passes a librdkafka property to every Kafka client, as kcat does; an error
//! never shows the value of a secret one (`sasl.password`, ...). A CA file that cannot be read,
//! or that holds no PEM certificate, is refused naming its flag, as is a CA given for a URL
//! without TLS.
//!
//! `purge`, `measure-storage` and `dead-letters replay` show their progress on stderr (see [`progress`]).
//!
//! Exit status: 0 done, 1 the command failed, 2 the command line is wrong (clap's usage errors
//! and a `purge` window below the floor without `--force`) or the `stats --min-window` alarm.

mod args;
mod brokers;
mod dead_letters;
mod measure;
mod partitions;
mod purge;

use std::process::ExitCode;
use std::time::SystemTime;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use inbox_postgres::{KeyMode, Partitions, PgInbox, TableName};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::args::{format_duration, Cli, Command, Stats, Target};

/// What stopped a command.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum CliError {
    /// The inbox store failed.
    #[error(transparent)]
    Store(#[from] inbox_postgres::Error),
    /// A statement of this tool failed.
    #[error("database error while {context}: {source}")]
    Database {
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// The store declined to do what was asked, and said why.
    #[error("{0}")]
    Refused(String),
    /// A broker failed while reading or replaying dead letters.
    #[error(transparent)]
    Broker(#[from] inbox_core::OperationError),
    /// A broker failed without saying why; the usual causes, and where to look.
    #[cfg(feature = "kafka")]
    #[error("{source}; {hint}")]
    BrokerHint {
        source: inbox_core::OperationError,
        hint: &'static str,
    },
    /// An error whose text showed the value of a `-X` property that may be a secret: the text,
    /// with that value as `***`.
    #[error("{0}")]
    Hidden(String),
}

pub(crate) fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> CliError {
    move |source| CliError::Database { context, source }
}

/// Exit status when `stats` finds a window shorter than `--min-window`.
const WINDOW_ALARM: u8 = 3;

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors exit 2 and `--help`/`--version` exit 0, both inside `parse`.
    let cli = Cli::parse();
    if let Command::Purge(purge) = &cli.command {
        if let Some(refusal) = purge.refusal() {
            refuse("purge", refusal);
        }
    }
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("inbox-admin: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Exits with clap's usage-error status and format, with the usage line of `command`.
fn refuse(command: &str, message: String) -> ! {
    let mut cli = Cli::command();
    cli.build();
    match cli.find_subcommand_mut(command) {
        Some(sub) => sub.error(ErrorKind::ValueValidation, message).exit(),
        None => cli.error(ErrorKind::ValueValidation, message).exit(),
    }
}

async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let target = &cli.target;
    match cli.command {
        Command::Migrate(m) => {
            let mut inbox = if m.print_sql {
                // A pool that never connects: the SQL is built from the options alone.
                let pool =
                    PgPoolOptions::new().connect_lazy_with(PgConnectOptions::new_without_pgpass());
                PgInbox::new(pool)
                    .with_table(table(target)?)
                    .with_key_mode(target.key_mode.into())
            } else {
                inbox(target).await?
            };
            if m.partitioned {
                inbox = inbox
                    .partitioned(Partitions::every(m.partition_every).ahead(m.partitions_ahead));
            }
            if m.print_sql {
                print!("{}", inbox.migration_sql());
                return Ok(ExitCode::SUCCESS);
            }
            inbox.migrate().await?;
            let layout = if inbox.is_partitioned().await? {
                "partitioned"
            } else {
                "plain"
            };
            if m.json {
                let line = serde_json::json!({
                    "table": inbox.table().to_string(),
                    "key_mode": key_mode_name(inbox.key_mode()),
                    "layout": layout,
                });
                println!("{line}");
            } else {
                println!(
                    "migrated {} ({:?} keys, {layout})",
                    inbox.table(),
                    inbox.key_mode()
                );
            }
        }
        Command::Partition(p) => print(partitions::convert(inbox(target).await?, &p).await?),
        Command::Partitions(l) => print(partitions::list(&inbox(target).await?, &l).await?),
        Command::Purge(p) => print(purge::run(&inbox(target).await?, &p).await?),
        Command::Stats(stats) => return self::stats(&inbox(target).await?, &stats).await,
        Command::MeasureStorage(m) => print(measure::run(&connect(target).await?, &m).await?),
        Command::DeadLetters(d) => print(dead_letters::run(*d).await?),
    }
    Ok(ExitCode::SUCCESS)
}

fn print(lines: Vec<String>) {
    for line in lines {
        println!("{line}");
    }
}

/// `--key-mode`'s spelling of `mode`.
fn key_mode_name(mode: KeyMode) -> &'static str {
    match mode {
        KeyMode::Text => "text",
        KeyMode::Uuid => "uuid",
        KeyMode::Hashed => "hashed",
    }
}

async fn stats(inbox: &PgInbox, stats: &Stats) -> Result<ExitCode, CliError> {
    let min_window = stats.min_window;
    let windows = inbox.oldest_per_consumer().await?;
    let now = SystemTime::now();
    let short =
        |w: &inbox_postgres::ConsumerWindow| min_window.is_some_and(|min| w.shorter_than(min, now));
    if stats.json {
        for w in &windows {
            let line = serde_json::json!({
                "table": inbox.table().to_string(),
                "consumer": w.consumer,
                "rows": w.rows,
                "window_seconds": w.window(now).map(|d| d.as_secs()),
                "shorter_than_min_window": short(w),
            });
            println!("{line}");
        }
    } else {
        print_storage(inbox).await?;
        println!("{:<24} {:>12} {:>16}  alarm", "consumer", "rows", "window");
        for w in &windows {
            let window = w
                .window(now)
                .map_or_else(|| "-".to_owned(), format_duration);
            let alarm = if short(w) {
                "SHORTER THAN --min-window"
            } else {
                ""
            };
            println!("{:<24} {:>12} {window:>16}  {alarm}", w.consumer, w.rows);
        }
    }
    match min_window {
        Some(min) if windows.iter().any(short) => {
            eprintln!(
                "inbox-admin: some consumer remembers less than {}: redeliveries older than its window would be applied again",
                format_duration(min)
            );
            Ok(ExitCode::from(WINDOW_ALARM))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

async fn print_storage(inbox: &PgInbox) -> Result<(), CliError> {
    let storage = inbox.storage().await?;
    println!("table        {}", inbox.table());
    println!("rows         {}", storage.rows);
    println!(
        "heap         {} bytes, indexes {} bytes",
        storage.heap_bytes, storage.index_bytes
    );
    match storage.bytes_per_row() {
        Some(b) => println!("bytes/row    {b:.1}"),
        None => println!("bytes/row    - (empty)"),
    }
    println!();
    Ok(())
}

async fn connect(target: &Target) -> Result<PgPool, CliError> {
    let Some(url) = &target.database_url else {
        return Err(CliError::Refused(
            "no database to connect to: pass --database-url or set DATABASE_URL".into(),
        ));
    };
    PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .map_err(db("connecting to PostgreSQL"))
}

/// The inbox table `target` names.
fn table(target: &Target) -> Result<TableName, CliError> {
    Ok(match &target.schema {
        Some(schema) => TableName::qualified(schema, &target.table)?,
        None => TableName::new(&target.table)?,
    })
}

async fn inbox(target: &Target) -> Result<PgInbox, CliError> {
    let table = table(target)?;
    Ok(PgInbox::new(connect(target).await?)
        .with_table(table)
        .with_key_mode(target.key_mode.into()))
}
