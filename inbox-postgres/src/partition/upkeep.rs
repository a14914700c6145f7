//! The partitioned layout's upkeep: listing partitions, creating them ahead, and dropping the
//! ones whose rows have all expired (each under a short lock timeout, postponed when busy).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inbox_core::sql::primary_key;
use sqlx::{AssertSqlSafe, Connection, PgConnection};

use super::{
    bound_literal, db_now_ms, is_partitioned, lock_contended, ms_to_time, name_prefix, parse_bound,
    partition_name, qualify, Bound, DroppedPartition, Leaf, PartitionInfo, PartitionRange,
    Partitions, MAX_MS, MINUTE_MS,
};
use crate::error::db;
use crate::table::column_type;
use crate::{PgInbox, Result};

impl PgInbox {
    /// Lays the table out partitioned when [`migrate`](Self::migrate) creates it (see
    /// [`Partitions`]), and keeps its partitions: created ahead by `migrate` and by every
    /// purge, dropped by the purge. A table that exists already keeps its layout: convert a
    /// plain one with [`migrate_to_partitioned`](Self::migrate_to_partitioned). Claims follow
    /// the table's layout, read from the catalog before the first hashed claim, not this
    /// setting: [`KeyMode::Hashed`](crate::KeyMode::Hashed) keys differ between the layouts.
    pub fn partitioned(mut self, partitions: Partitions) -> Self {
        self.partitions = Some(partitions);
        self
    }

    /// The partitioning this store was configured with.
    pub fn partitioning(&self) -> Option<Partitions> {
        self.partitions
    }

    /// Whether the table is partitioned, as the catalog says.
    pub async fn is_partitioned(&self) -> Result<bool> {
        let context = "reading the table's layout";
        let mut conn = self.single(context).await?;
        let partitioned = is_partitioned(&mut conn, self.table()).await?;
        conn.done().await.map_err(db(context))?;
        Ok(partitioned)
    }

    /// The partitions of a partitioned inbox, ranges in key order and the default partition
    /// last; empty for a plain table.
    pub async fn partitions(&self) -> Result<Vec<PartitionInfo>> {
        let context = "listing the partitions";
        let mut conn = self.single(context).await?;
        let leaves = self.leaves(&mut conn).await?;
        conn.done().await.map_err(db(context))?;
        Ok(leaves
            .into_iter()
            .map(|leaf| PartitionInfo {
                name: leaf.name,
                range: match leaf.bound {
                    Bound::Range(from, to) => PartitionRange::Time {
                        from: ms_to_time(from),
                        to: ms_to_time(to),
                    },
                    Bound::Default => PartitionRange::Default,
                    Bound::Other(expr) => PartitionRange::Other(expr),
                },
                approx_rows: leaf.approx_rows,
                bytes: leaf.bytes,
            })
            .collect())
    }

    /// Creates the range partitions covering ID times `[from, to)` that are missing, aligned to
    /// the configured span: for a backfill or a replay of old messages that should not all go to
    /// the default partition. Returns the names created.
    pub async fn create_partitions(&self, from: SystemTime, to: SystemTime) -> Result<Vec<String>> {
        let p = self.partitions.unwrap_or_default();
        let millis = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(MAX_MS))
                .min(MAX_MS)
        };
        let (from, to) = (millis(from), millis(to));
        let context = "creating partitions";
        let mut read = self.single(context).await?;
        let existing = self.leaves(&mut read).await?;
        read.done().await.map_err(db(context))?;
        let mut conn = self.pool().acquire().await.map_err(db(context))?;
        let taken: Vec<(i64, i64)> = existing
            .iter()
            .filter_map(|l| match l.bound {
                Bound::Range(a, b) => Some((a, b)),
                _ => None,
            })
            .collect();
        let mut created = Vec::new();
        let mut lo = from.div_euclid(p.width_ms()) * p.width_ms();
        while lo < to {
            let hi = lo + p.width_ms();
            if !taken.iter().any(|&(a, b)| a < hi && lo < b) {
                if let Some(name) = self.create_range(&mut conn, &p, &existing, lo, hi).await? {
                    created.push(name);
                }
            }
            lo = hi;
        }
        Ok(created)
    }

    /// Creates the current partition and the configured number ahead where missing, continuing
    /// from the newest range; a store not configured partitioned takes the newest range's span
    /// and the default number ahead. Returns the names created.
    pub(crate) async fn create_ahead(&self, conn: &mut PgConnection) -> Result<Vec<String>> {
        let mut tx = conn.begin().await.map_err(db("listing the partitions"))?;
        let now = db_now_ms(&mut tx).await?;
        let leaves = self.leaves(&mut tx).await?;
        tx.commit().await.map_err(db("listing the partitions"))?;
        let p = self.partitions.unwrap_or_else(|| {
            // Not configured (an operator's tool, say): the span of the newest range.
            let newest = leaves.iter().rev().find_map(|l| match l.bound {
                Bound::Range(from, to) => Some(to - from),
                _ => None,
            });
            Partitions {
                width_minutes: newest.map_or(24 * 60, |ms| (ms / MINUTE_MS).max(1)),
                ..Partitions::default()
            }
        });
        let current = now.div_euclid(p.width_ms()) * p.width_ms();
        let end = current + (i64::from(p.ahead) + 1) * p.width_ms();
        let newest = leaves
            .iter()
            .filter_map(|l| match l.bound {
                Bound::Range(_, to) => Some(to),
                _ => None,
            })
            .max();
        // Contiguous after the newest range; a range that ended in the past leaves a gap, whose
        // keys the default partition takes.
        let mut lo = newest.map_or(current, |to| to.max(current));
        let mut created = Vec::new();
        while lo < end {
            let hi = lo + p.width_ms();
            if let Some(name) = self.create_range(conn, &p, &leaves, lo, hi).await? {
                created.push(name);
            }
            lo = hi;
        }
        Ok(created)
    }

    /// Creates and attaches the partition `[lo, hi)`, moving the default partition's rows of
    /// that range into it; `None` when a partition of that name exists.
    async fn create_range(
        &self,
        conn: &mut PgConnection,
        p: &Partitions,
        leaves: &[Leaf],
        lo: i64,
        hi: i64,
    ) -> Result<Option<String>> {
        let t = self.table();
        let name = partition_name(t.table(), lo);
        let qualified = qualify(t, &name);
        let (from, to) = (
            bound_literal(self.key_mode(), lo),
            bound_literal(self.key_mode(), hi),
        );
        let default = leaves.iter().find(|l| l.bound == Bound::Default);
        let key = self.table_lock_key("inbox partitions").await?;
        for attempt in 1..=p.attempts {
            let mut tx = conn.begin().await.map_err(db("creating a partition"))?;
            let result: Result<Option<()>, sqlx::Error> = async {
                sqlx::query(AssertSqlSafe(p.lock_timeout_sql())).execute(&mut *tx).await?;
                // Creators (migrate on every instance, the purge) take turns.
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(key)
                    .execute(&mut *tx)
                    .await?;
                let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                    .bind(&qualified)
                    .fetch_one(&mut *tx)
                    .await?;
                if exists {
                    return Ok(None);
                }
                sqlx::query(AssertSqlSafe(format!(
                    "CREATE TABLE {qualified} (LIKE {t} INCLUDING DEFAULTS)"
                )))
                .execute(&mut *tx)
                .await?;
                if let Some(default) = default {
                    let d = &default.sql;
                    // Blocks only claims that land in the default partition, until the commit.
                    sqlx::query(AssertSqlSafe(format!(
                        "LOCK TABLE {d} IN SHARE ROW EXCLUSIVE MODE"
                    )))
                    .execute(&mut *tx)
                    .await?;
                    sqlx::query(AssertSqlSafe(format!(
                        "WITH moved AS (
                            DELETE FROM {d} WHERE message_id >= '{from}' AND message_id < '{to}'
                            RETURNING message_id, processed_minute, consumer_id)
                         INSERT INTO {qualified} (message_id, processed_minute, consumer_id)
                         SELECT message_id, processed_minute, consumer_id FROM moved"
                    )))
                    .execute(&mut *tx)
                    .await?;
                }
                sqlx::query(AssertSqlSafe(format!(
                    "ALTER TABLE {t} ATTACH PARTITION {qualified} FOR VALUES FROM ('{from}') TO ('{to}')"
                )))
                .execute(&mut *tx)
                .await?;
                Ok(Some(()))
            }
            .await;
            match result {
                Ok(Some(())) => {
                    tx.commit().await.map_err(db("creating a partition"))?;
                    tracing::info!(table = %t, partition = %name, "inbox partition created");
                    return Ok(Some(name));
                }
                Ok(None) => {
                    tx.rollback().await.map_err(db("creating a partition"))?;
                    return Ok(None);
                }
                Err(e) if lock_contended(&e) && attempt < p.attempts => {
                    let _ = tx.rollback().await;
                    tokio::time::sleep(p.lock_timeout).await;
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(db("creating a partition")(e));
                }
            }
        }
        Ok(None)
    }

    /// Detaches `leaf` unless a row in it was processed at or after `cutoff_minute` (checked
    /// under a `SHARE` lock on it, so none can arrive in between), then drops it.
    pub(crate) async fn drop_due(
        &self,
        conn: &mut PgConnection,
        leaf: &Leaf,
        cutoff_minute: i64,
    ) -> Result<DropOutcome> {
        let p = self.partitions.unwrap_or_default();
        let t = self.table();
        let l = &leaf.sql;
        let mut lock_wait = Duration::ZERO;
        for attempt in 1..=p.attempts {
            let started = Instant::now();
            let mut tx = conn.begin().await.map_err(db("detaching a partition"))?;
            let result: Result<bool, sqlx::Error> = async {
                sqlx::query(AssertSqlSafe(p.lock_timeout_sql()))
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(AssertSqlSafe(format!("LOCK TABLE {l} IN SHARE MODE")))
                    .execute(&mut *tx)
                    .await?;
                // The check reads the BRIN index, never the whole partition: its statistics
                // can be stale.
                sqlx::raw_sql("SET LOCAL enable_seqscan = off")
                    .execute(&mut *tx)
                    .await?;
                let live: bool = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT EXISTS (SELECT 1 FROM {l} WHERE processed_minute >= $1)"
                )))
                .bind(cutoff_minute)
                .fetch_one(&mut *tx)
                .await?;
                if live {
                    return Ok(false);
                }
                sqlx::query(AssertSqlSafe(format!(
                    "ALTER TABLE {t} DETACH PARTITION {l}"
                )))
                .execute(&mut *tx)
                .await?;
                Ok(true)
            }
            .await;
            match result {
                Ok(true) => {
                    tx.commit().await.map_err(db("detaching a partition"))?;
                    lock_wait += started.elapsed();
                    self.drop_detached(conn, &p, l).await;
                    return Ok(DropOutcome::Dropped(DroppedPartition {
                        name: leaf.name.clone(),
                        approx_rows: leaf.approx_rows,
                        lock_wait,
                    }));
                }
                Ok(false) => {
                    tx.rollback().await.map_err(db("detaching a partition"))?;
                    return Ok(DropOutcome::Live);
                }
                Err(e) if lock_contended(&e) => {
                    let _ = tx.rollback().await;
                    lock_wait += started.elapsed();
                    if attempt < p.attempts {
                        tokio::time::sleep(p.lock_timeout).await;
                    }
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(db("detaching a partition")(e));
                }
            }
        }
        tracing::warn!(table = %t, partition = %leaf.name, attempts = p.attempts, "inbox partition not detached: claims held the table longer than the lock timeout; postponed to the next purge");
        Ok(DropOutcome::Postponed)
    }

    /// Drops a detached partition: no claim can reach it any more, so this takes no lock on the
    /// inbox table. One left over (the drop failed) is found and dropped by the next purge.
    async fn drop_detached(&self, conn: &mut PgConnection, p: &Partitions, sql: &str) {
        let result: Result<(), sqlx::Error> = async {
            let mut tx = conn.begin().await?;
            sqlx::query(AssertSqlSafe(p.lock_timeout_sql()))
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(format!("DROP TABLE {sql}")))
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(table = %self.table(), partition = %sql, error = %e, "detached inbox partition not dropped yet; the next purge drops it");
        }
    }

    /// Drops partitions this crate detached whose drop failed: tables named like its partitions,
    /// in the inbox table's schema, that are not attached.
    pub(crate) async fn drop_leftovers(&self, conn: &mut PgConnection) -> Result<()> {
        let p = self.partitions.unwrap_or_default();
        let pattern = format!(
            "^{}_p[0-9]{{8}}_[0-9]{{4}}$",
            name_prefix(self.table().table())
        );
        let mut tx = conn
            .begin()
            .await
            .map_err(db("looking for detached partitions"))?;
        let leftovers: Vec<String> = sqlx::query_scalar(
            "SELECT c.oid::regclass::text FROM pg_class c
             WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = $1::regclass)
               AND c.relkind = 'r' AND NOT c.relispartition AND c.relname ~ $2",
        )
        .bind(self.table().to_string())
        .bind(pattern)
        .fetch_all(&mut *tx)
        .await
        .map_err(db("looking for detached partitions"))?;
        tx.commit()
            .await
            .map_err(db("looking for detached partitions"))?;
        for sql in leftovers {
            self.drop_detached(conn, &p, &sql).await;
        }
        Ok(())
    }

    /// The leaves of the table, ranges by start and the others after them.
    pub(crate) async fn leaves(&self, conn: &mut PgConnection) -> Result<Vec<Leaf>> {
        let rows: Vec<(String, String, String, i64, i64)> = sqlx::query_as(
            "SELECT c.relname::text, c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid),
                    greatest(c.reltuples, 0)::bigint, pg_total_relation_size(c.oid)
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = $1::regclass",
        )
        .bind(self.table().to_string())
        .fetch_all(&mut *conn)
        .await
        .map_err(db("listing the partitions"))?;
        let mut leaves: Vec<Leaf> = rows
            .into_iter()
            .map(|(name, sql, bound, approx_rows, bytes)| Leaf {
                name,
                sql,
                bound: parse_bound(&bound, self.key_mode()),
                approx_rows,
                bytes,
            })
            .collect();
        leaves.sort_by_key(|l| match l.bound {
            Bound::Range(from, _) => (0, from),
            Bound::Other(_) => (1, 0),
            Bound::Default => (2, 0),
        });
        Ok(leaves)
    }

    /// The statements creating a partitioned inbox table `qualified` and its BRIN index, without
    /// partitions; its primary key and index are named `<index_base>_pkey`, `_processed`.
    pub(crate) fn partitioned_table_statements(
        &self,
        qualified: &str,
        index_base: &str,
    ) -> [String; 2] {
        let key = column_type(self.key_mode());
        let primary_key = primary_key(self.key_mode());
        let name = index_base;
        [
            format!(
                "CREATE TABLE IF NOT EXISTS {qualified} (
                    message_id {key} NOT NULL,
                    processed_minute integer NOT NULL
                        DEFAULT (floor(extract(epoch FROM now()) / 60))::integer,
                    consumer_id smallint NOT NULL,
                    CONSTRAINT \"{name}_pkey\" PRIMARY KEY ({primary_key}))
                 PARTITION BY RANGE (message_id)"
            ),
            // autosummarize: the purge's checks read the BRIN summaries of fresh pages too.
            format!(
                "CREATE INDEX IF NOT EXISTS \"{name}_processed\" ON {qualified}
                 USING brin (processed_minute) WITH (autosummarize = on)"
            ),
        ]
    }
}

/// What [`PgInbox::drop_due`] did.
#[derive(Debug)]
pub(crate) enum DropOutcome {
    Dropped(DroppedPartition),
    /// A row in it was processed within the window: kept, its expired rows to be deleted.
    Live,
    /// Its locks were not had within the attempts.
    Postponed,
}
