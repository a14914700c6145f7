//! Retention: the batched purge (and on the partitioned layout, the partition drops), its
//! single-cleaner lock, the oldest remembered time per consumer (the window alarm) and the
//! table's storage.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Postgres};
use tokio::task::JoinHandle;

use crate::error::db;
use crate::partition::{is_partitioned, ms_to_time, Bound, DropOutcome, DroppedPartition};
use crate::pooling::LockHolder;
use crate::{PgInbox, Result};

/// The default number of rows one purge batch deletes: small enough that each batch's locks and
/// WAL stay short, large enough that a day's rows take a few hundred statements.
pub const DEFAULT_PURGE_BATCH: i64 = 10_000;

/// The gauge [`PgInbox::oldest_per_consumer`] sets, per `consumer` label: seconds since the
/// oldest remembered message was processed. Page when it drops below the longest redelivery
/// window of the consumer's sources.
pub const OLDEST_AGE_GAUGE: &str = "inbox_oldest_remembered_age_seconds";

/// The gauge [`spawn_purger`] sets, per `table` label (the inbox table as configured): the Unix
/// time, in seconds, of its last purge that ran (not of one skipped because another instance
/// held the cleaner lock). Across instances, its maximum is when the table was last purged:
/// alert when that grows old, as a purger that stopped lets the table grow without bound.
pub const PURGE_LAST_SUCCESS_GAUGE: &str = "inbox_purge_last_success_timestamp_seconds";

/// What a [`PgInbox::purge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PurgeReport {
    /// This call held the cleaner lock and deleted in batches.
    #[non_exhaustive]
    Purged {
        /// Rows processed before this minute (minutes since the Unix epoch) were deleted.
        cutoff_minute: i64,
        /// Rows deleted by each batch, in order; the last one is 0. On the partitioned layout,
        /// the batches of every partition purged by `DELETE` that deleted rows, then one 0.
        batches: Vec<u64>,
        /// Partitioned layout: the partitions dropped whole.
        dropped: Vec<DroppedPartition>,
        /// Partitioned layout: partitions due but not detached within the attempts (claims held
        /// the table); the next purge tries again.
        postponed: Vec<String>,
        /// Partitioned layout: the partitions created ahead.
        created: Vec<String>,
    },
    /// Another cleaner (in this or another process) held the lock, so this call deleted
    /// nothing. Not an error: that cleaner does the work.
    SkippedOtherCleaner,
}

impl PurgeReport {
    /// Rows deleted in all batches.
    pub fn deleted(&self) -> u64 {
        self.batches().iter().sum()
    }

    /// Rows deleted by each batch (empty when skipped).
    pub fn batches(&self) -> &[u64] {
        match self {
            PurgeReport::Purged { batches, .. } => batches,
            PurgeReport::SkippedOtherCleaner => &[],
        }
    }

    /// The partitions dropped whole (partitioned layout).
    pub fn dropped(&self) -> &[DroppedPartition] {
        match self {
            PurgeReport::Purged { dropped, .. } => dropped,
            PurgeReport::SkippedOtherCleaner => &[],
        }
    }

    /// The partitions due but postponed (partitioned layout).
    pub fn postponed(&self) -> &[String] {
        match self {
            PurgeReport::Purged { postponed, .. } => postponed,
            PurgeReport::SkippedOtherCleaner => &[],
        }
    }

    /// The partitions created ahead (partitioned layout).
    pub fn created(&self) -> &[String] {
        match self {
            PurgeReport::Purged { created, .. } => created,
            PurgeReport::SkippedOtherCleaner => &[],
        }
    }
}

/// How far back one consumer's memory reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerWindow {
    /// The consumer's name.
    pub consumer: String,
    /// When its oldest remembered message was processed (to the minute); `None` without rows.
    pub oldest: Option<SystemTime>,
    /// Rows remembered for it.
    pub rows: i64,
}

impl ConsumerWindow {
    /// `now − oldest`: how long a redelivery may lag and still be recognised. `None` without
    /// rows (nothing remembered, so no window to alarm on).
    pub fn window(&self, now: SystemTime) -> Option<Duration> {
        self.oldest
            .map(|oldest| now.duration_since(oldest).unwrap_or(Duration::ZERO))
    }

    /// The window alarm: true when this consumer remembers rows but its window is shorter than
    /// `required` (the longest redelivery window of its sources), so a late redelivery of an
    /// already-forgotten message would be applied twice.
    pub fn shorter_than(&self, required: Duration, now: SystemTime) -> bool {
        self.window(now).is_some_and(|w| w < required)
    }
}

/// The size of the inbox table (of all its partitions, when partitioned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Storage {
    /// Rows in the table (an exact count).
    pub rows: i64,
    /// The table's main fork (`pg_relation_size`), summed over the partitions.
    pub heap_bytes: i64,
    /// All of the table's indexes: the primary key and the BRIN index (`pg_indexes_size`),
    /// summed over the partitions.
    pub index_bytes: i64,
}

impl Storage {
    /// Heap plus index bytes per row, `None` for an empty table.
    pub fn bytes_per_row(&self) -> Option<f64> {
        (self.rows > 0).then(|| (self.heap_bytes + self.index_bytes) as f64 / self.rows as f64)
    }
}

impl PgInbox {
    /// The advisory-lock key cleaners of this table share: the first 8 bytes of SHA-256 over
    /// `inbox purge <schema>.<table>`, with the schema the table resolves to (through the
    /// `search_path` when none was given), so inboxes in other tables or schemas purge
    /// independently.
    pub async fn purge_lock_key(&self) -> Result<i64> {
        self.table_lock_key("inbox purge").await
    }

    /// An advisory-lock key for `purpose` on this table: the first 8 bytes of SHA-256 over
    /// `<purpose> <schema>.<table>`.
    pub(crate) async fn table_lock_key(&self, purpose: &str) -> Result<i64> {
        let t = self.table();
        let context = "finding the inbox table's schema";
        // In a transaction, as every statement of this crate (see `pooling.rs`).
        let mut tx = self.pool().begin().await.map_err(db(context))?;
        let schema: String = sqlx::query_scalar(
            "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.oid = $1::regclass",
        )
        .bind(t.to_string())
        .fetch_one(&mut *tx)
        .await
        .map_err(db(context))?;
        tx.commit().await.map_err(db(context))?;
        let digest = Sha256::digest(format!("{purpose} {schema}.{}", t.table()).as_bytes());
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&digest[..8]);
        Ok(i64::from_be_bytes(bytes))
    }

    /// Deletes rows processed more than `older_than` ago, `batch` rows per statement (at least
    /// 1; [`DEFAULT_PURGE_BATCH`] is a good start), until a batch deletes nothing. Each batch is
    /// its own short transaction, so a purge of millions of rows never holds locks or WAL for
    /// long, and an interrupted purge keeps what it did.
    ///
    /// Only one cleaner runs at a time across all instances: the purge holds a transaction-scoped
    /// advisory lock ([`purge_lock_key`](Self::purge_lock_key)) in a transaction of its own, on
    /// a connection of its own beside the pool's, and returns
    /// [`PurgeReport::SkippedOtherCleaner`] when another cleaner holds it. The lock ends with
    /// that transaction, so neither a cancelled purge nor a transaction pooler (PgBouncer) in
    /// front of the database can leave it behind. Every statement runs in a transaction, so
    /// the purge works through a transaction pooler.
    ///
    /// Rows are found through the BRIN index on `processed_minute` (time-ordered inserts keep it
    /// selective); the cutoff is taken from the database clock, the one the rows were stamped by.
    ///
    /// On a partitioned table (see [`Partitions`](crate::Partitions)) it first creates the
    /// partitions ahead, then drops the partitions whose whole key range is older than the
    /// cutoff and deletes, in batches, only the rows no drop can take: those of the default
    /// partition and the few whose ID time is far from their processing time. The layout is
    /// read from the catalog, so any instance purges either.
    pub async fn purge(&self, older_than: Duration, batch: i64) -> Result<PurgeReport> {
        let window_minutes = i64::try_from(older_than.as_secs() / 60).unwrap_or(i64::MAX / 2);
        let key = self.purge_lock_key().await?;
        let mut holder = LockHolder::open(self.pool(), "opening the cleaner's lock").await?;
        let result = async {
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                .bind(key)
                .fetch_one(holder.conn())
                .await
                .map_err(db("taking the cleaner lock"))?;
            if !locked {
                return Ok(PurgeReport::SkippedOtherCleaner);
            }
            let mut conn = self
                .pool()
                .acquire()
                .await
                .map_err(db("opening the cleaner connection"))?;
            let context = "reading the table's layout";
            let mut tx = conn.begin().await.map_err(db(context))?;
            let partitioned = is_partitioned(&mut tx, self.table()).await?;
            let cutoff_minute = cutoff_minute(&mut tx, window_minutes).await?;
            tx.commit().await.map_err(db(context))?;
            let (mut dropped, mut postponed, mut created) = (Vec::new(), Vec::new(), Vec::new());
            // What is left to delete from: the plain table, or the partitions no drop takes (see
            // `Partitions` for the rules), read through their BRIN index.
            let (to_delete, by_index) = if partitioned {
                match self.create_ahead(&mut conn).await {
                    Ok(names) => created = names,
                    Err(e) => tracing::warn!(table = %self.table(), error = %e, "inbox partitions not created ahead; keys beyond the last range go to the default partition"),
                }
                self.drop_leftovers(&mut conn).await?;
                let cutoff_ms = cutoff_minute.saturating_mul(60_000);
                let mut tx = conn.begin().await.map_err(db("listing the partitions"))?;
                let leaves = self.leaves(&mut tx).await?;
                tx.commit().await.map_err(db("listing the partitions"))?;
                let mut to_delete = Vec::new();
                for leaf in leaves {
                    match leaf.bound {
                        Bound::Range(_, to) if to <= cutoff_ms => {
                            match self.drop_due(&mut conn, &leaf, cutoff_minute).await? {
                                DropOutcome::Dropped(d) => dropped.push(d),
                                DropOutcome::Live => to_delete.push(leaf.sql),
                                DropOutcome::Postponed => postponed.push(leaf.name),
                            }
                        }
                        // Straddles the cutoff: dropped whole once due.
                        Bound::Range(from, _) if from < cutoff_ms => {}
                        _ => to_delete.push(leaf.sql),
                    }
                }
                (to_delete, true)
            } else {
                (vec![self.table().to_string()], false)
            };
            let mut batches = Vec::new();
            for table in &to_delete {
                // `ctid` is unique within one table only: never run this on a partitioned parent.
                let sql = format!(
                    "DELETE FROM {table} WHERE ctid IN (
                        SELECT ctid FROM {table} WHERE processed_minute < $1 LIMIT $2)"
                );
                let context = "deleting expired inbox rows";
                let cutoff = (cutoff_minute, batch);
                batches.extend(delete_in_batches(&mut conn, &sql, cutoff, by_index, context).await?);
            }
            batches.push(0);
            Ok(PurgeReport::Purged {
                cutoff_minute,
                batches,
                dropped,
                postponed,
                created,
            })
        }
        .await;
        holder.release().await;
        result
    }

    /// The oldest remembered time and the row count of every registered consumer, by name, and
    /// sets the [`OLDEST_AGE_GAUGE`] gauge for each consumer that has rows.
    ///
    /// This reads the whole table (there is no index on (consumer, time), which would cost more
    /// per row than the key itself); run it from a CLI or a periodic task, not per message.
    pub async fn oldest_per_consumer(&self) -> Result<Vec<ConsumerWindow>> {
        let t = self.table();
        let consumers = t.sibling("consumers");
        let context = "reading the oldest remembered time per consumer";
        let mut conn = self.single(context).await?;
        let rows: Vec<(String, Option<i32>, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT c.name, min(i.processed_minute), count(i.consumer_id)
             FROM {consumers} c LEFT JOIN {t} i ON i.consumer_id = c.id
             GROUP BY c.name ORDER BY c.name"
        )))
        .fetch_all(&mut *conn)
        .await
        .map_err(db(context))?;
        conn.done().await.map_err(db(context))?;
        let now = SystemTime::now();
        let windows: Vec<ConsumerWindow> = rows
            .into_iter()
            .map(|(consumer, minute, rows)| ConsumerWindow {
                consumer,
                oldest: minute.map(|m| ms_to_time(i64::from(m) * 60_000)),
                rows,
            })
            .collect();
        for w in &windows {
            if let Some(age) = w.window(now) {
                metrics::gauge!(OLDEST_AGE_GAUGE, "consumer" => w.consumer.clone())
                    .set(age.as_secs_f64());
            }
        }
        Ok(windows)
    }

    /// The row count and the on-disk size of the table and its indexes (of its partitions).
    pub async fn storage(&self) -> Result<Storage> {
        let t = self.table();
        let context = "measuring the inbox table";
        let mut conn = self.single(context).await?;
        let (rows, heap_bytes, index_bytes): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {t}),
                    coalesce(sum(pg_relation_size(relid)), 0)::bigint,
                    coalesce(sum(pg_indexes_size(relid)), 0)::bigint
             FROM (SELECT relid FROM pg_partition_tree($1::regclass) WHERE isleaf
                   -- A plain table is in no partition tree.
                   UNION SELECT oid FROM pg_class WHERE oid = $1::regclass AND relkind = 'r') leaves"
        )))
        .bind(t.to_string())
        .fetch_one(&mut *conn)
        .await
        .map_err(db(context))?;
        conn.done().await.map_err(db(context))?;
        Ok(Storage {
            rows,
            heap_bytes,
            index_bytes,
        })
    }
}

/// The minute (since the Unix epoch) `window_minutes` before now, on the database clock.
async fn cutoff_minute(conn: &mut PgConnection, window_minutes: i64) -> Result<i64> {
    sqlx::query_scalar("SELECT floor(extract(epoch FROM now()) / 60)::bigint - $1")
        .bind(window_minutes)
        .fetch_one(conn)
        .await
        .map_err(db("reading the database clock"))
}

/// Runs the batched `DELETE` `sql` (`$1`: `cutoff`, `$2`: `batch`), each batch a transaction
/// of its own on `conn`, until one deletes nothing; the rows of each batch that deleted some.
/// `by_index`: the delete must read the index, never scan the whole table, whose statistics can
/// be stale (`SET LOCAL enable_seqscan = off`).
pub(crate) async fn delete_in_batches<C>(
    conn: &mut PgConnection,
    sql: &str,
    (cutoff, batch): (C, i64),
    by_index: bool,
    context: &'static str,
) -> Result<Vec<u64>>
where
    C: for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Copy + Send + Sync,
{
    let mut batches = Vec::new();
    loop {
        let mut tx = conn.begin().await.map_err(db(context))?;
        if by_index {
            sqlx::raw_sql("SET LOCAL enable_seqscan = off")
                .execute(&mut *tx)
                .await
                .map_err(db(context))?;
        }
        let deleted = sqlx::query(AssertSqlSafe(sql))
            .bind(cutoff)
            .bind(batch.max(1))
            .execute(&mut *tx)
            .await
            .map_err(db(context))?
            .rows_affected();
        tx.commit().await.map_err(db(context))?;
        if deleted == 0 {
            return Ok(batches);
        }
        batches.push(deleted);
    }
}

/// Runs [`PgInbox::purge`] of rows older than `window` every `every` (the first right away),
/// with [`DEFAULT_PURGE_BATCH`], until the handle is aborted. Any number of instances may run
/// one: the advisory lock lets one purge at a time and the others skip. After a purge that ran,
/// it sets [`PURGE_LAST_SUCCESS_GAUGE`] and refreshes the [`OLDEST_AGE_GAUGE`] gauge. Failures are logged and retried next period.
pub fn spawn_purger(inbox: PgInbox, window: Duration, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every.max(Duration::from_secs(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match inbox.purge(window, DEFAULT_PURGE_BATCH).await {
                Ok(report @ PurgeReport::Purged { .. }) => {
                    tracing::info!(
                        table = %inbox.table(),
                        deleted = report.deleted(),
                        batches = report.batches().len(),
                        dropped_partitions = report.dropped().len(),
                        postponed_partitions = report.postponed().len(),
                        created_partitions = report.created().len(),
                        "inbox purge done"
                    );
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default();
                    metrics::gauge!(PURGE_LAST_SUCCESS_GAUGE, "table" => inbox.table().to_string())
                        .set(now.as_secs_f64());
                    if let Err(e) = inbox.oldest_per_consumer().await {
                        tracing::warn!(table = %inbox.table(), error = %e, "inbox window gauge not refreshed");
                    }
                }
                Ok(_) => {
                    tracing::debug!(table = %inbox.table(), "inbox purge skipped: another cleaner runs");
                }
                Err(e) => {
                    tracing::warn!(table = %inbox.table(), error = %e, "inbox purge failed; retrying next period");
                }
            }
        }
    })
}
