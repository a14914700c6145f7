//! `inbox-admin`: the operator CLI of the PostgreSQL inbox.
//!
//! ```text
//! inbox-admin migrate --key-mode uuid
//! inbox-admin purge --older-than 14d --batch 10000
//! inbox-admin stats --min-window 7d        # exit status 2: some consumer remembers too little
//! inbox-admin measure-storage --rows 1000000 --runs 5
//! ```

mod args;
mod measure;

use std::process::ExitCode;
use std::time::SystemTime;

use inbox_postgres::{KeyMode, PgInbox, PurgeReport, TableName, DEFAULT_PURGE_BATCH};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::args::{format_duration, Args, USAGE};

/// What stopped a command.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum CliError {
    /// The command line is wrong; the usage text says how to fix it.
    #[error("{0}")]
    Usage(String),
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
}

pub(crate) fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> CliError {
    move |source| CliError::Database { context, source }
}

/// Exit status when `stats` finds a window shorter than `--min-window`.
const WINDOW_ALARM: u8 = 2;

#[tokio::main]
async fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.is_empty()
        || raw
            .iter()
            .any(|a| a == "--help" || a == "-h" || a == "help")
    {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run(raw).await {
        Ok(code) => code,
        Err(CliError::Usage(message)) => {
            eprintln!("inbox-admin: {message}\n\n{USAGE}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("inbox-admin: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(raw: Vec<String>) -> Result<ExitCode, CliError> {
    let args = Args::parse(raw.into_iter())?;
    match args.command.as_str() {
        "migrate" => {
            args.allow(&[])?;
            let inbox = inbox(&args).await?;
            inbox.migrate().await?;
            println!("migrated {} ({:?} keys)", inbox.table(), inbox.key_mode());
            Ok(ExitCode::SUCCESS)
        }
        "purge" => {
            args.allow(&["older-than", "batch"])?;
            let older_than = args.duration("older-than")?.ok_or_else(|| {
                CliError::Usage("`purge` needs `--older-than` (like 14d)".to_owned())
            })?;
            let batch = args.number("batch", DEFAULT_PURGE_BATCH)?;
            let inbox = inbox(&args).await?;
            let report = inbox.purge(older_than, batch).await?;
            match &report {
                PurgeReport::SkippedOtherCleaner => {
                    println!("skipped: another cleaner is purging {}", inbox.table());
                }
                _ => {
                    for (i, n) in report.batches().iter().enumerate() {
                        println!("batch {}: {n} rows", i + 1);
                    }
                    println!(
                        "deleted {} rows older than {}",
                        report.deleted(),
                        format_duration(older_than)
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        "stats" => {
            args.allow(&["min-window"])?;
            let min_window = args.duration("min-window")?;
            let inbox = inbox(&args).await?;
            stats(&inbox, min_window).await
        }
        "measure-storage" => {
            args.allow(&["rows", "runs"])?;
            let rows = args.number("rows", 1_000_000)?;
            let runs = args.number("runs", 5)?;
            let pool = connect(&args).await?;
            measure::run(&pool, rows, runs).await?;
            Ok(ExitCode::SUCCESS)
        }
        other => Err(CliError::Usage(format!("unknown command `{other}`"))),
    }
}

async fn stats(
    inbox: &PgInbox,
    min_window: Option<std::time::Duration>,
) -> Result<ExitCode, CliError> {
    let storage = inbox.storage().await?;
    let windows = inbox.oldest_per_consumer().await?;
    let now = SystemTime::now();
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
    println!("{:<24} {:>12} {:>16}  alarm", "consumer", "rows", "window");
    let mut alarm = false;
    for w in &windows {
        let short = min_window.is_some_and(|min| w.shorter_than(min, now));
        alarm |= short;
        let window = w
            .window(now)
            .map_or_else(|| "-".to_owned(), format_duration);
        println!(
            "{:<24} {:>12} {:>16}  {}",
            w.consumer,
            w.rows,
            window,
            if short {
                "SHORTER THAN --min-window"
            } else {
                ""
            }
        );
    }
    if alarm {
        if let Some(min) = min_window {
            eprintln!(
                "inbox-admin: some consumer remembers less than {}: redeliveries older than its window would be applied again",
                format_duration(min)
            );
        }
        return Ok(ExitCode::from(WINDOW_ALARM));
    }
    Ok(ExitCode::SUCCESS)
}

fn database_url(args: &Args) -> String {
    args.get("database-url")
        .map(str::to_owned)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| "postgres://postgres:postgres@127.0.0.1:5432/inbox".to_owned())
}

async fn connect(args: &Args) -> Result<PgPool, CliError> {
    PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url(args))
        .await
        .map_err(db("connecting to PostgreSQL"))
}

async fn inbox(args: &Args) -> Result<PgInbox, CliError> {
    let table = args.get("table").unwrap_or("inbox");
    let table = match args.get("schema") {
        Some(schema) => TableName::qualified(schema, table)?,
        None => TableName::new(table)?,
    };
    let mode = match args.get("key-mode").unwrap_or("text") {
        "text" => KeyMode::Text,
        "uuid" => KeyMode::Uuid,
        "hashed" => KeyMode::Hashed,
        other => {
            return Err(CliError::Usage(format!(
                "`--key-mode {other}` is not text, uuid or hashed"
            )))
        }
    };
    Ok(PgInbox::new(connect(args).await?)
        .with_table(table)
        .with_key_mode(mode))
}
