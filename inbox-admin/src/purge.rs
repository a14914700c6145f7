//! `purge`: [`PgInbox::purge`] with progress, and its report as lines or one JSON object.
//!
//! The library purge deletes batch after batch on a connection of its own and reports only when
//! done; it has no per-batch callback, and a purge driven batch by batch from here would bypass
//! its cleaner lock and its partition drops. So the progress is observed from the side: every
//! 0.5 s the tool reads the table's `n_tup_del` counters (`pg_stat_user_tables`, summed over the
//! partitions) and shows the rows deleted since the start, which the purging session publishes
//! about once a second, between its batches. The total is the planner's estimate of the rows
//! older than the cutoff (an `EXPLAIN`, no scan) on an analyzed plain table; on a partitioned
//! table most rows go with dropped partitions, which no counter sees, so a spinner counts the
//! deleted rows only. The report printed at the end has the exact figures.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use inbox_postgres::{PgInbox, PurgeReport};
use sqlx::{AssertSqlSafe, PgPool};

use crate::args::{format_duration, Purge};
use crate::{partitions, CliError};
use inbox_admin::progress::{Counter, Counting, Progress};

/// How often the deletion counters are read.
const POLL: Duration = Duration::from_millis(500);

const COUNTING: Counting = Counting {
    unit: "rows",
    verb: "deleted",
};

/// Runs the purge, showing progress on stderr, and returns what to print on stdout.
pub(crate) async fn run(inbox: &PgInbox, args: &Purge) -> Result<Vec<String>, CliError> {
    let started = Instant::now();
    let table = inbox.table().to_string();
    let baseline = deletions(inbox.pool(), &table).await.ok();
    let total = match inbox.is_partitioned().await {
        Ok(false) => estimate(inbox.pool(), &table, args.older_than).await,
        _ => None,
    };
    let progress = Progress::start("inbox-admin purge", COUNTING, total, true, args.json);
    let poller = baseline.map(|baseline| {
        let observe = observe(
            inbox.pool().clone(),
            table.clone(),
            baseline,
            args.batch,
            progress.counter(),
        );
        tokio::spawn(observe)
    });
    let report = inbox.purge(args.older_than, args.batch).await;
    if let Some(poller) = poller {
        poller.abort();
        let _ = poller.await;
    }
    drop(progress);
    let report = report?;
    let elapsed = started.elapsed();
    Ok(if args.json {
        vec![json(&table, args, &report, elapsed).to_string()]
    } else {
        lines(&table, args, &report)
    })
}

/// The human report: one line per batch, the total, what happened to partitions.
fn lines(table: &str, args: &Purge, report: &PurgeReport) -> Vec<String> {
    if let PurgeReport::SkippedOtherCleaner = report {
        return vec![format!("skipped: another cleaner is purging {table}")];
    }
    let mut lines: Vec<String> = report
        .batches()
        .iter()
        .enumerate()
        .map(|(i, n)| format!("batch {}: {n} rows", i + 1))
        .collect();
    lines.push(format!(
        "deleted {} rows older than {}",
        report.deleted(),
        format_duration(args.older_than)
    ));
    lines.extend(partitions::purge_lines(report));
    lines
}

/// The same figures as [`lines`], as one JSON object.
fn json(table: &str, args: &Purge, report: &PurgeReport, elapsed: Duration) -> serde_json::Value {
    let dropped: Vec<_> = report
        .dropped()
        .iter()
        .map(|d| {
            serde_json::json!({
                "name": d.name,
                "approx_rows": d.approx_rows,
                "lock_wait_ms": millis(d.lock_wait),
            })
        })
        .collect();
    serde_json::json!({
        "table": table,
        "older_than_seconds": args.older_than.as_secs(),
        "batch_size_rows": args.batch,
        "skipped_other_cleaner": matches!(report, PurgeReport::SkippedOtherCleaner),
        "deleted_rows": report.deleted(),
        "batch_deleted_rows": report.batches(),
        "created_partitions": report.created(),
        "dropped_partitions": dropped,
        "postponed_partitions": report.postponed(),
        "elapsed_ms": millis(elapsed),
    })
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Reads the deletion counters every [`POLL`] and shows the rows deleted since `baseline`.
async fn observe(
    pool: PgPool,
    table: String,
    baseline: HashMap<i64, i64>,
    batch: i64,
    counter: Counter,
) {
    let batch = u64::try_from(batch).unwrap_or(1).max(1);
    let mut tick = tokio::time::interval(POLL);
    loop {
        tick.tick().await;
        // Best effort: a failed read leaves the count where it was.
        if let Ok(now) = deletions(&pool, &table).await {
            let deleted = deleted_since(&baseline, &now);
            counter.set_position(deleted);
            if deleted > 0 {
                counter.set_message(format!("batch ~{}", deleted.div_ceil(batch)));
            }
        }
    }
}

/// `n_tup_del` of the table, or of each of its leaf partitions, by table OID.
async fn deletions(pool: &PgPool, table: &str) -> Result<HashMap<i64, i64>, sqlx::Error> {
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT relid::bigint, n_tup_del FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM pg_partition_tree($1::regclass) WHERE isleaf
                         -- A plain table is in no partition tree.
                         UNION SELECT oid FROM pg_class WHERE oid = $1::regclass AND relkind = 'r')",
    )
    .bind(table)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Rows deleted between two readings of [`deletions`]. A partition created since counts from 0,
/// one dropped since counts no more (the purge drops partitions before it deletes).
fn deleted_since(baseline: &HashMap<i64, i64>, now: &HashMap<i64, i64>) -> u64 {
    now.iter()
        .map(|(relid, &n)| {
            let before = baseline.get(relid).copied().unwrap_or(0);
            u64::try_from(n.saturating_sub(before)).unwrap_or(0)
        })
        .sum()
}

/// The planner's estimate of the rows the purge of a plain table deletes, without reading them;
/// `None` when the table was never analyzed (no statistics to estimate from) or on any error.
async fn estimate(pool: &PgPool, table: &str, older_than: Duration) -> Option<u64> {
    let analyzed: bool =
        sqlx::query_scalar("SELECT reltuples >= 0 FROM pg_class WHERE oid = $1::regclass")
            .bind(table)
            .fetch_one(pool)
            .await
            .ok()?;
    if !analyzed {
        return None;
    }
    // The cutoff of `PgInbox::purge`, on the database clock.
    let window_minutes = i64::try_from(older_than.as_secs() / 60).unwrap_or(i64::MAX / 2);
    let cutoff: i64 =
        sqlx::query_scalar("SELECT floor(extract(epoch FROM now()) / 60)::bigint - $1")
            .bind(window_minutes)
            .fetch_one(pool)
            .await
            .ok()?;
    // A validated table name and a number.
    let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "EXPLAIN SELECT 1 FROM {table} WHERE processed_minute < {cutoff}"
    )))
    .fetch_all(pool)
    .await
    .ok()?;
    plan.first().and_then(|top| planned_rows(top))
}

/// The `rows=` of a plan line: `Seq Scan on inbox  (cost=0.00..35.50 rows=2550 width=4)`.
fn planned_rows(line: &str) -> Option<u64> {
    let (_, rest) = line.rsplit_once(" rows=")?;
    rest.split(' ').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deletions_count_from_the_baseline_per_table() {
        let baseline = HashMap::from([(1, 100), (2, 5), (3, 40)]);
        // 2 gained 30, 3 was dropped, 4 is new with 7.
        let now = HashMap::from([(1, 100), (2, 35), (4, 7)]);
        assert_eq!(deleted_since(&baseline, &now), 37);
        assert_eq!(deleted_since(&baseline, &baseline), 0);
        // A counter reset (statistics reset) counts nothing rather than wrapping.
        assert_eq!(deleted_since(&baseline, &HashMap::from([(1, 0)])), 0);
    }

    #[test]
    fn the_planned_rows_are_read_from_the_top_plan_line() {
        let line = "Bitmap Heap Scan on inbox  (cost=12.03..1520.28 rows=25023 width=4)";
        assert_eq!(planned_rows(line), Some(25_023));
        assert_eq!(
            planned_rows("Seq Scan on t  (cost=0.00..1.00 rows=1 width=4)"),
            Some(1)
        );
        assert_eq!(planned_rows("Result  (cost=0.00..0.01)"), None);
    }
}
