//! `evidence retention-bench`: cleanup at ingest speed, the batched `DELETE` purge of the plain
//! table beside the partition drop of the partitioned one, in one run.
//!
//! Per layout, in a schema of its own with UUIDv7 keys ([`KeyMode::Uuid`]): the inbox is filled
//! with `--days` simulated days of history, `--rows-per-day` rows a day whose IDs and processed
//! minutes are spread evenly over the days before today 00:00 UTC (the scale against the full
//! rate is printed), then `VACUUM (ANALYZE)` and its size is read. Then the claim load starts:
//! transactions of `--batch` fresh UUIDv7 IDs, each the set-based claim and the commit, on one
//! connection, as the database-alone row of `evidence bench` does (without the handler's
//! statement). After a warm-up it runs alone for `--claim-seconds`, then goes on while the
//! cleanup removes the oldest day: the purge (the window puts the cutoff on a day boundary, so
//! both layouts remove the same rows: a `DELETE` in batches there, one partition drop here),
//! then a `VACUUM` of the table, which the dead rows of a `DELETE` need and a drop does not.
//!
//! Measured: claim msgs/s without and during the cleanup (over the cleanup, at least 5 s from
//! its start), the cleanup's rows/s, the longest claim transaction that overlapped it, and the
//! share of a full-rate day's claim capacity the cleanup would cost (see [`cost_share`]).

use inbox_core::Transaction as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inbox_conformance::TestDb;
use inbox_core::{BoxError, ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::{KeyMode, Partitions, PgInbox, Storage, TableName};
use serde_json::json;
use sqlx::AssertSqlSafe;
use uuid::{NoContext, Timestamp, Uuid};

use crate::cli::{named, positive, seconds};

const DAY_MS: i64 = 86_400_000;
/// The throughput this project aims for, msgs/s: the full rate the figures are scaled to.
const FULL_RATE: f64 = 27_000.0;
/// Rows inserted per statement while filling.
const FILL_CHUNK: usize = 50_000;
/// The shortest span claims are counted over from the start of a cleanup.
const MIN_SPAN: Duration = Duration::from_secs(5);
/// Claims before the baseline starts: connections, prepared statements, caches.
const WARM_UP: Duration = Duration::from_secs(2);

/// The flags of `retention-bench`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RetentionSettings {
    /// Inbox rows per simulated day.
    #[arg(long, value_name = "N", default_value = "1000000", value_parser = clap::value_parser!(u64).range(1..))]
    rows_per_day: u64,
    /// Simulated days of history.
    #[arg(long, value_name = "N", default_value = "3")]
    days: u32,
    /// Days kept: the cleanup removes what is older (at least 1, below --days).
    #[arg(long, value_name = "N", default_value = "2")]
    window_days: u32,
    /// How long the claims run alone: seconds, or a duration such as 10s.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = seconds)]
    claim_seconds: u64,
    /// Messages per claim transaction.
    #[arg(long, value_name = "N", default_value = "1000", value_parser = positive)]
    batch: usize,
    /// Rows per `DELETE` of the purge.
    #[arg(long, value_name = "N", default_value_t = inbox_postgres::DEFAULT_PURGE_BATCH, value_parser = clap::value_parser!(i64).range(1..))]
    purge_batch: i64,
    /// The plain table, the partitioned one, or both.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "plain|partitioned,…",
        default_value = "plain,partitioned"
    )]
    layouts: Vec<Layout>,
}

named! {
    /// How the inbox table is laid out.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Layout ("layout") {
        Plain = "plain",
        Partitioned = "partitioned",
    }
}

impl RetentionSettings {
    /// What the flags cannot say one at a time.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.window_days == 0 || self.window_days >= self.days {
            return Err("--window-days must be at least 1 and below --days".into());
        }
        Ok(())
    }
}

/// One layout's figures.
#[derive(Debug)]
struct LayoutRun {
    layout: Layout,
    filled: Storage,
    fill_seconds: f64,
    baseline: ClaimStats,
    during: ClaimStats,
    /// The purge and the VACUUM after it.
    cleanup_seconds: f64,
    purge_seconds: f64,
    removed_rows: i64,
    expired_left: i64,
    dropped: Vec<String>,
    postponed: usize,
    drop_lock_wait: Duration,
    after: Storage,
}

/// Claim transactions over a span.
#[derive(Debug, Clone, Copy)]
struct ClaimStats {
    msgs_per_s: f64,
    max_latency: Duration,
    p99_latency: Duration,
}

pub(crate) async fn run(s: &RetentionSettings) -> Result<(), BoxError> {
    let full_day = FULL_RATE * 86_400.0;
    println!(
        "retention bench: {} simulated days of history, {} rows a day (full rate {FULL_RATE:.0} msgs/s \
         is {full_day:.0} rows a day: scale 1:{:.0}), window {} days, so the cleanup removes the \
         oldest day; claims of {} fresh UUIDv7 IDs per transaction on one connection",
        s.days,
        s.rows_per_day,
        full_day / s.rows_per_day as f64,
        s.window_days,
        s.batch,
    );
    let mut results = Vec::new();
    for &layout in &s.layouts {
        let db = TestDb::new().await;
        let result = measure(s, layout, &db).await;
        db.drop().await;
        results.push(result?);
    }
    println!();
    print_table(s, &results);
    println!();
    for r in &results {
        println!("{}", json_line(s, r));
    }
    Ok(())
}

async fn measure(
    s: &RetentionSettings,
    layout: Layout,
    db: &TestDb,
) -> Result<LayoutRun, BoxError> {
    let mut inbox = PgInbox::new(db.pool.clone())
        .with_table(TableName::qualified(&db.schema, "bench")?)
        .with_key_mode(KeyMode::Uuid);
    if layout == Layout::Partitioned {
        inbox = inbox.partitioned(Partitions::default());
    }
    inbox.migrate().await?;
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(&db.pool)
        .await?;
    let today = now - now.rem_euclid(DAY_MS);
    let start = today - i64::from(s.days) * DAY_MS;
    if layout == Layout::Partitioned {
        inbox.create_partitions(time(start), time(today)).await?;
    }

    eprintln!(
        "{}: filling {} rows",
        layout.name(),
        s.rows_per_day * u64::from(s.days)
    );
    let started = Instant::now();
    fill(&inbox, s, start, today).await?;
    let fill_seconds = started.elapsed().as_secs_f64();
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM (ANALYZE) {}", inbox.table())))
        .execute(&db.pool)
        .await?;
    let filled = inbox.storage().await?;

    let cutoff = today - i64::from(s.window_days) * DAY_MS;
    let expired = |table: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
                "SELECT count(*) FROM {table} WHERE processed_minute < $1"
            )))
            .bind(cutoff / 60_000)
            .fetch_one(&pool)
            .await
        }
    };
    let expired_before = expired(inbox.table().to_string()).await?;

    eprintln!(
        "{}: claims alone for {} s, then during the cleanup",
        layout.name(),
        s.claim_seconds
    );
    let load = ClaimLoad::start(inbox.clone(), s.batch);
    tokio::time::sleep(WARM_UP).await;
    let alone_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(s.claim_seconds)).await;
    // The window that puts the cutoff on `cutoff` (to the minute, on the database clock).
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(&db.pool)
        .await?;
    let window = Duration::from_secs(u64::try_from(now / 60_000 - cutoff / 60_000)? * 60);
    let cleanup_started = Instant::now();
    let report = inbox.purge(window, s.purge_batch).await?;
    let purge_ended = Instant::now();
    // The rest of the cleanup: dead rows a DELETE leaves are reclaimed only by a VACUUM (here
    // at once rather than whenever autovacuum comes), heap and every index; a drop leaves none.
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM {}", inbox.table())))
        .execute(&db.pool)
        .await?;
    let cleanup_ended = Instant::now();
    let span_end = cleanup_ended.max(cleanup_started + MIN_SPAN);
    tokio::time::sleep_until(span_end.into()).await;
    let samples = load.stop().await?;
    let baseline = stats(
        &samples,
        (alone_from, cleanup_started),
        (alone_from, cleanup_started),
    );
    let during = stats(
        &samples,
        (cleanup_started, span_end),
        (cleanup_started, cleanup_ended),
    );
    let expired_left = expired(inbox.table().to_string()).await?;

    Ok(LayoutRun {
        layout,
        filled,
        fill_seconds,
        baseline,
        during,
        cleanup_seconds: (cleanup_ended - cleanup_started).as_secs_f64(),
        purge_seconds: (purge_ended - cleanup_started).as_secs_f64(),
        removed_rows: expired_before - expired_left,
        expired_left,
        dropped: report.dropped().iter().map(|d| d.name.clone()).collect(),
        postponed: report.postponed().len(),
        drop_lock_wait: report.dropped().iter().map(|d| d.lock_wait).sum(),
        after: inbox.storage().await?,
    })
}

fn time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// Rows processed when their UUIDv7 was made, evenly over `[from, to)`, in time order.
async fn fill(inbox: &PgInbox, s: &RetentionSettings, from: i64, to: i64) -> Result<(), BoxError> {
    let consumer = inbox.consumer_id("wallet").await?;
    let total = s.rows_per_day * u64::from(s.days);
    let span = u64::try_from(to - from)?;
    let sql = format!(
        "INSERT INTO {} (message_id, processed_minute, consumer_id)
         SELECT unnest($1::uuid[]), unnest($2::int[]), $3",
        inbox.table()
    );
    let mut i = 0u64;
    while i < total {
        let n = (total - i).min(FILL_CHUNK as u64);
        let (ids, minutes): (Vec<Uuid>, Vec<i32>) = (i..i + n)
            .map(|k| {
                let ms = u64::try_from(from).unwrap_or(0) + k * span / total;
                let id = Uuid::new_v7(Timestamp::from_unix(
                    NoContext,
                    ms / 1000,
                    u32::try_from(ms % 1000).unwrap_or(0) * 1_000_000,
                ));
                (id, i32::try_from(ms / 60_000).unwrap_or(i32::MAX))
            })
            .unzip();
        sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(ids)
            .bind(minutes)
            .bind(consumer)
            .execute(inbox.pool())
            .await?;
        i += n;
    }
    Ok(())
}

/// A claim transaction: when it began, how long it took, how many it claimed.
type Sample = (Instant, Duration, usize);

/// Claim transactions back to back on one connection until stopped.
struct ClaimLoad {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Vec<Sample>, BoxError>>,
}

impl ClaimLoad {
    fn start(inbox: PgInbox, batch: usize) -> Self {
        let inbox = inbox.bind(&ConsumerBinding::new("wallet"));
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let ids: Vec<MessageId> = (0..batch)
                    .map(|_| MessageId::new(Uuid::now_v7().to_string()))
                    .collect::<Result<_, _>>()?;
                let began = Instant::now();
                let mut tx = inbox.begin().await?;
                let claimed = inbox.claim(&mut tx, &ids).await?;
                tx.commit().await?;
                if claimed.iter().any(|new| !new) {
                    return Err("a fresh ID was found as a duplicate".into());
                }
                samples.push((began, began.elapsed(), batch));
            }
            Ok(samples)
        });
        Self { stop, task }
    }

    async fn stop(self) -> Result<Vec<Sample>, BoxError> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// The msgs/s of the transactions that ended within `count`, and the latencies of those that
/// overlapped `latency`.
fn stats(samples: &[Sample], count: (Instant, Instant), latency: (Instant, Instant)) -> ClaimStats {
    let msgs: usize = samples
        .iter()
        .filter(|s| s.0 + s.1 >= count.0 && s.0 + s.1 <= count.1)
        .map(|s| s.2)
        .sum();
    let seconds = (count.1 - count.0).as_secs_f64();
    let mut latencies: Vec<Duration> = samples
        .iter()
        .filter(|s| s.0 <= latency.1 && s.0 + s.1 >= latency.0)
        .map(|s| s.1)
        .collect();
    latencies.sort();
    let p99 = latencies
        .get((latencies.len() * 99 / 100).min(latencies.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default();
    ClaimStats {
        msgs_per_s: if seconds > 0.0 {
            msgs as f64 / seconds
        } else {
            0.0
        },
        max_latency: latencies.last().copied().unwrap_or_default(),
        p99_latency: p99,
    }
}

/// The share of a full-rate day's claim capacity the cleanup costs: the claim-seconds lost
/// while it ran, `(1 − during/baseline) × span`, times the cleanups a full-rate day needs. A
/// `DELETE` purge's work grows with the rows: `full-rate rows a day / rows removed` of these.
/// A drop's does not (it unlinks files and reads BRIN summaries): one a day. Noise can make
/// `during` exceed `baseline`; the loss is then counted as 0.
fn cost_share(r: &LayoutRun) -> f64 {
    let span = r.cleanup_seconds.max(MIN_SPAN.as_secs_f64());
    let lost = (1.0 - r.during.msgs_per_s / r.baseline.msgs_per_s).max(0.0) * span;
    let per_day = match r.layout {
        Layout::Plain => FULL_RATE * 86_400.0 / r.removed_rows.max(1) as f64,
        Layout::Partitioned => 1.0,
    };
    lost * per_day / 86_400.0
}

fn mb(bytes: i64) -> f64 {
    bytes as f64 / 1e6
}

fn bytes_per_row(s: &Storage) -> f64 {
    s.bytes_per_row().unwrap_or(0.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn print_table(s: &RetentionSettings, results: &[LayoutRun]) {
    println!(
        "{:<12} {:>11} {:>9} {:>7} {:>10} {:>10} {:>9} {:>8} {:>9} {:>10} {:>13} {:>13} {:>9} {:>11} {:>8}",
        "layout",
        "rows",
        "MB",
        "B/row",
        "claims/s",
        "during",
        "removed",
        "purge s",
        "vacuum s",
        "rows/s",
        "max ms alone",
        "max ms during",
        "lock ms",
        "B/row after",
        "cost %",
    );
    for r in results {
        let rate = r.removed_rows as f64 / r.cleanup_seconds.max(1e-6);
        println!(
            "{:<12} {:>11} {:>9.1} {:>7.1} {:>10.0} {:>10.0} {:>9} {:>8.3} {:>9.3} {:>10.0} {:>13.1} {:>13.1} {:>9.1} {:>11.1} {:>8.3}",
            r.layout.name(),
            r.filled.rows,
            mb(r.filled.heap_bytes + r.filled.index_bytes),
            bytes_per_row(&r.filled),
            r.baseline.msgs_per_s,
            r.during.msgs_per_s,
            r.removed_rows,
            r.purge_seconds,
            r.cleanup_seconds - r.purge_seconds,
            rate,
            ms(r.baseline.max_latency),
            ms(r.during.max_latency),
            ms(r.drop_lock_wait),
            bytes_per_row(&r.after),
            100.0 * cost_share(r),
        );
    }
    println!();
    println!(
        "rows, MB, B/row: after {} simulated days, VACUUM (ANALYZE)ed, heap + every index. \
         claims/s: alone, over the --claim-seconds right before the cleanup (after a 2 s warm-up); \
         during: from the cleanup's start over max(cleanup, 5 s), the same load going on. The \
         cleanup is the purge, then a VACUUM of the table (the dead rows of a DELETE need one; a \
         drop leaves none). removed: rows processed before the cutoff that the purge removed. \
         rows/s: removed / (purge s + vacuum s). max \
         ms: the longest claim transaction, alone and overlapping the cleanup. lock ms: the \
         partition drop's detaching transaction. \
         cost %: the share of a full-rate day's claim capacity ({FULL_RATE:.0} msgs/s) the \
         cleanup costs, see retention_bench.rs. B/row after: after that VACUUM, with the \
         rows the claims added: the space of deleted rows is reusable but not returned.",
        s.days
    );
    if let Some(plain) = results.iter().find(|r| r.layout == Layout::Plain) {
        let rate = plain.removed_rows as f64 / plain.cleanup_seconds.max(1e-6);
        println!(
            "the batched DELETE and its VACUUM remove {rate:.0} rows/s under this claim load: {} \
             the {FULL_RATE:.0} msgs/s ingest",
            if rate >= FULL_RATE {
                "keeps up with"
            } else {
                "falls behind"
            }
        );
    }
    for r in results {
        if r.expired_left != 0 || r.postponed != 0 {
            println!(
                "{}: {} expired rows left, {} partitions postponed",
                r.layout.name(),
                r.expired_left,
                r.postponed
            );
        }
    }
}

fn json_line(s: &RetentionSettings, r: &LayoutRun) -> String {
    json!({
        "bench": "retention",
        "layout": r.layout.name(),
        "rows_per_day": s.rows_per_day,
        "days": s.days,
        "window_days": s.window_days,
        "scale": FULL_RATE * 86_400.0 / s.rows_per_day as f64,
        "batch": s.batch,
        "purge_batch": s.purge_batch,
        "fill_rows_per_s": r.filled.rows as f64 / r.fill_seconds,
        "rows": r.filled.rows,
        "heap_bytes": r.filled.heap_bytes,
        "index_bytes": r.filled.index_bytes,
        "bytes_per_row": bytes_per_row(&r.filled),
        "claims_per_s_alone": r.baseline.msgs_per_s,
        "claims_per_s_during_cleanup": r.during.msgs_per_s,
        "claim_max_ms_alone": ms(r.baseline.max_latency),
        "claim_p99_ms_alone": ms(r.baseline.p99_latency),
        "claim_max_ms_during_cleanup": ms(r.during.max_latency),
        "claim_p99_ms_during_cleanup": ms(r.during.p99_latency),
        "cleanup_seconds": r.cleanup_seconds,
        "purge_seconds": r.purge_seconds,
        "vacuum_seconds": r.cleanup_seconds - r.purge_seconds,
        "removed_rows": r.removed_rows,
        "cleanup_rows_per_s": r.removed_rows as f64 / r.cleanup_seconds.max(1e-6),
        "purge_rows_per_s": r.removed_rows as f64 / r.purge_seconds.max(1e-6),
        "expired_left": r.expired_left,
        "dropped": r.dropped,
        "postponed": r.postponed,
        "drop_lock_wait_ms": ms(r.drop_lock_wait),
        "rows_after_cleanup": r.after.rows,
        "bytes_after_cleanup": r.after.heap_bytes + r.after.index_bytes,
        "bytes_per_row_after_cleanup": bytes_per_row(&r.after),
        "cost_share_of_claim_capacity": cost_share(r),
    })
    .to_string()
}
