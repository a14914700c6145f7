//! `measure-storage`: bytes per remembered ID for each key layout, measured on the database at
//! hand rather than quoted.
//!
//! Each run creates the inbox table through [`PgInbox::migrate`] (so the primary key and the BRIN
//! retention index are exactly what production gets), fills it with `rows` rows of one consumer
//! stamped with the current minute, runs `VACUUM (ANALYZE)` and reads `pg_relation_size` (heap,
//! main fork) and `pg_indexes_size` (every index). Tables live in a scratch schema that is dropped
//! at the end, also when a run fails.
//!
//! Progress counts the rows inserted over all layouts and runs; each run's figures get a line on
//! stderr (not with `--json`, whose object holds them).

use std::time::{Duration, Instant};

use inbox_postgres::{KeyMode, PgInbox, TableName};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::args::MeasureStorage;
use crate::purge::millis;
use crate::{db, CliError};
use inbox_admin::progress::{Counting, Progress};

/// Client-generated keys travel in arrays of this many.
const CHUNK: usize = 50_000;
const CONSUMER: &str = "measure";

#[derive(Debug, Clone, Copy)]
enum Keys {
    /// Random UUIDs as text strings (36 characters), like most string IDs: random order.
    TextV4,
    /// UUIDv7 strings as text: time-ordered text.
    TextV7,
    /// Native `uuid`, random (v4, `gen_random_uuid()`).
    UuidV4,
    /// Native `uuid`, time-ordered (v7, generated here as the producer helpers do).
    UuidV7,
    /// Hashed mode: the first 16 bytes of SHA-256 over consumer, a zero byte and a random text
    /// ID, computed in SQL with the formula of `KeyMode::Hashed`.
    Hashed,
}

impl Keys {
    const ALL: [Keys; 5] = [
        Keys::TextV4,
        Keys::TextV7,
        Keys::UuidV4,
        Keys::UuidV7,
        Keys::Hashed,
    ];

    fn label(self) -> &'static str {
        match self {
            Keys::TextV4 => "text (uuid v4 strings)",
            Keys::TextV7 => "text (uuid v7 strings)",
            Keys::UuidV4 => "uuid v4",
            Keys::UuidV7 => "uuid v7",
            Keys::Hashed => "hashed (16 bytes)",
        }
    }

    fn mode(self) -> KeyMode {
        match self {
            Keys::TextV4 | Keys::TextV7 => KeyMode::Text,
            Keys::UuidV4 | Keys::UuidV7 => KeyMode::Uuid,
            Keys::Hashed => KeyMode::Hashed,
        }
    }

    /// The layout's name in JSON.
    fn name(self) -> &'static str {
        match self {
            Keys::TextV4 => "text_v4",
            Keys::TextV7 => "text_v7",
            Keys::UuidV4 => "uuid_v4",
            Keys::UuidV7 => "uuid_v7",
            Keys::Hashed => "hashed",
        }
    }

    fn table(self) -> &'static str {
        match self {
            Keys::TextV4 => "m_text_v4",
            Keys::TextV7 => "m_text_v7",
            Keys::UuidV4 => "m_uuid_v4",
            Keys::UuidV7 => "m_uuid_v7",
            Keys::Hashed => "m_hashed",
        }
    }
}

/// One run's bytes per row.
#[derive(Debug, Clone, Copy)]
struct Sample {
    heap: f64,
    index: f64,
    elapsed: Duration,
}

const COUNTING: Counting = Counting {
    unit: "rows",
    verb: "inserted",
};

/// Measures every layout and returns what to print on stdout: the table, or one JSON object.
pub(crate) async fn run(pool: &PgPool, args: &MeasureStorage) -> Result<Vec<String>, CliError> {
    let (rows, runs) = (args.rows, args.runs);
    let started = Instant::now();
    let total = u64::try_from(rows.saturating_mul(runs))
        .ok()
        .map(|n| n.saturating_mul(Keys::ALL.len() as u64));
    let progress = Progress::start(
        "inbox-admin measure-storage",
        COUNTING,
        total,
        false,
        args.json,
    );
    let schema = format!("inbox_measure_{}", Uuid::new_v4().simple());
    sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(pool)
        .await
        .map_err(db("creating the scratch schema"))?;
    let result = measure_all(pool, &schema, args, &progress).await;
    drop(progress);
    let dropped = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(pool)
        .await;
    if let Err(e) = dropped {
        eprintln!("inbox-admin: could not drop scratch schema {schema}: {e}");
    }
    let results = result?;
    Ok(if args.json {
        vec![json(rows, runs, &results, started.elapsed()).to_string()]
    } else {
        table_lines(rows, runs, &results)
    })
}

async fn measure_all(
    pool: &PgPool,
    schema: &str,
    args: &MeasureStorage,
    progress: &Progress,
) -> Result<Vec<(Keys, Vec<Sample>)>, CliError> {
    let (rows, runs) = (args.rows, args.runs);
    let mut results = Vec::new();
    for keys in Keys::ALL {
        let mut samples = Vec::new();
        for run in 1..=runs {
            progress.set_message(format!("{}, run {run}/{runs}", keys.label()));
            let started = Instant::now();
            let sample = measure_one(pool, schema, keys, rows, progress).await?;
            let sample = Sample {
                elapsed: started.elapsed(),
                ..sample
            };
            if !args.json {
                progress.println(&format!(
                    "{:<24} run {run}/{runs}: heap {:.1} + index {:.1} = {:.1} bytes/row ({:.1}s)",
                    keys.label(),
                    sample.heap,
                    sample.index,
                    sample.heap + sample.index,
                    sample.elapsed.as_secs_f64()
                ));
            }
            samples.push(sample);
        }
        results.push((keys, samples));
    }
    Ok(results)
}

async fn measure_one(
    pool: &PgPool,
    schema: &str,
    keys: Keys,
    rows: i64,
    progress: &Progress,
) -> Result<Sample, CliError> {
    let table = TableName::qualified(schema, keys.table())?;
    let inbox = PgInbox::new(pool.clone())
        .with_table(table.clone())
        .with_key_mode(keys.mode());
    inbox.migrate().await?;
    let consumer = inbox.consumer_id(CONSUMER).await?;
    insert(pool, &table, keys, consumer, rows, progress).await?;
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM (ANALYZE) {table}")))
        .execute(pool)
        .await
        .map_err(db("vacuuming the measured table"))?;
    let storage = inbox.storage().await?;
    sqlx::query(AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(pool)
        .await
        .map_err(db("dropping the measured table"))?;
    let n = storage.rows.max(1) as f64;
    Ok(Sample {
        heap: storage.heap_bytes as f64 / n,
        index: storage.index_bytes as f64 / n,
        elapsed: Duration::ZERO,
    })
}

async fn insert(
    pool: &PgPool,
    table: &TableName,
    keys: Keys,
    consumer: i16,
    rows: i64,
    progress: &Progress,
) -> Result<(), CliError> {
    let server_side = |key: &str| {
        format!(
            "INSERT INTO {table} (message_id, consumer_id)
             SELECT {key}, $1 FROM generate_series(1, $2)"
        )
    };
    let sql = match keys {
        Keys::TextV4 => server_side("gen_random_uuid()::text"),
        Keys::UuidV4 => server_side("gen_random_uuid()"),
        Keys::Hashed => server_side(&format!(
            "encode(substring(sha256(convert_to('{CONSUMER}', 'UTF8') || '\\x00'::bytea
                 || convert_to(gen_random_uuid()::text, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid"
        )),
        Keys::TextV7 | Keys::UuidV7 => {
            return insert_v7(pool, table, keys, consumer, rows, progress).await;
        }
    };
    sqlx::query(AssertSqlSafe(sql))
        .bind(consumer)
        .bind(rows)
        .execute(pool)
        .await
        .map_err(db("inserting measured rows"))?;
    progress.inc(u64::try_from(rows).unwrap_or(0));
    Ok(())
}

async fn insert_v7(
    pool: &PgPool,
    table: &TableName,
    keys: Keys,
    consumer: i16,
    rows: i64,
    progress: &Progress,
) -> Result<(), CliError> {
    let array = match keys {
        Keys::TextV7 => "text[]",
        _ => "uuid[]",
    };
    let sql =
        format!("INSERT INTO {table} (message_id, consumer_id) SELECT unnest($1::{array}), $2");
    let mut left = usize::try_from(rows).unwrap_or(usize::MAX);
    while left > 0 {
        let n = left.min(CHUNK);
        left -= n;
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
        let query = sqlx::query(AssertSqlSafe(sql.as_str()));
        let query = match keys {
            Keys::TextV7 => query.bind(ids.iter().map(Uuid::to_string).collect::<Vec<_>>()),
            _ => query.bind(ids),
        };
        query
            .bind(consumer)
            .execute(pool)
            .await
            .map_err(db("inserting measured rows"))?;
        progress.inc(n as u64);
    }
    Ok(())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.is_empty() {
        0.0
    } else if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The medians of one layout's runs: heap, index and total bytes per row.
fn medians(samples: &[Sample]) -> (f64, f64, f64) {
    (
        median(samples.iter().map(|s| s.heap).collect()),
        median(samples.iter().map(|s| s.index).collect()),
        median(samples.iter().map(|s| s.heap + s.index).collect()),
    )
}

/// Gigabytes (10^9 bytes) for `rows` rows of `total` bytes each.
fn gb(total: f64, rows: f64) -> f64 {
    total * rows / 1e9
}

fn table_lines(rows: i64, runs: i64, results: &[(Keys, Vec<Sample>)]) -> Vec<String> {
    let mut lines = vec![
        format!(
            "bytes per remembered ID after VACUUM, {rows} rows, median of {runs} run(s); \
             index = primary key + BRIN on processed_minute"
        ),
        String::new(),
        format!(
            "{:<24} {:>10} {:>11} {:>11} {:>12} {:>13}",
            "keys", "heap B/row", "index B/row", "total B/row", "70M rows GB", "190M rows GB"
        ),
    ];
    for (keys, samples) in results {
        let (heap, index, total) = medians(samples);
        lines.push(format!(
            "{:<24} {heap:>10.1} {index:>11.1} {total:>11.1} {:>12.2} {:>13.2}",
            keys.label(),
            gb(total, 70e6),
            gb(total, 190e6),
        ));
    }
    lines.push(String::new());
    lines.push(
        "GB = 10^9 bytes: total B/row x 70,000,000 (5M/day x 14 days) and x 190,000,000."
            .to_owned(),
    );
    lines
}

/// The figures of [`table_lines`] and of every run, as one JSON object.
fn json(
    rows: i64,
    runs: i64,
    results: &[(Keys, Vec<Sample>)],
    elapsed: Duration,
) -> serde_json::Value {
    let layouts: Vec<_> = results
        .iter()
        .map(|(keys, samples)| {
            let (heap, index, total) = medians(samples);
            let runs: Vec<_> = samples
                .iter()
                .map(|s| {
                    serde_json::json!({
                        "heap_bytes_per_row": s.heap,
                        "index_bytes_per_row": s.index,
                        "total_bytes_per_row": s.heap + s.index,
                        "elapsed_ms": millis(s.elapsed),
                    })
                })
                .collect();
            serde_json::json!({
                "keys": keys.name(),
                "label": keys.label(),
                "heap_bytes_per_row": heap,
                "index_bytes_per_row": index,
                "total_bytes_per_row": total,
                "gb_for_70m_rows": gb(total, 70e6),
                "gb_for_190m_rows": gb(total, 190e6),
                "runs": runs,
            })
        })
        .collect();
    serde_json::json!({
        "rows_per_run": rows,
        "runs_per_layout": runs,
        "layouts": layouts,
        "elapsed_ms": millis(elapsed),
    })
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_runs() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![]), 0.0);
    }
}
