//! The partitioned layout's upkeep: listing partitions, creating them ahead, and dropping the
//! ones whose rows have all expired (each under a short lock timeout, postponed when busy).

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{AssertSqlSafe, Connection, PgConnection};

use super::{
    bound_literal, db_now_ms, is_partitioned, lock_contended, move_rows_sql, ms_to_time,
    name_prefix, parse_bound, partition_name, Bound, DroppedPartition, Leaf, PartitionInfo,
    PartitionRange, Partitions, MAX_MS, MINUTE_MS,
};
use crate::error::db;
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
        let context = "creating partitions";
        let mut read = self.single(context).await?;
        let leaves = self.leaves(&mut read).await?;
        read.done().await.map_err(db(context))?;
        let mut conn = self.pool().acquire().await.map_err(db(context))?;
        let from = millis(from).div_euclid(p.width_ms()) * p.width_ms();
        self.create_ranges(&mut conn, &p, &leaves, from, millis(to))
            .await
    }

    /// Creates the current partition and the configured number ahead where missing, continuing
    /// from the newest range; a store not configured partitioned takes the newest range's span
    /// and the default number ahead. Returns the names created.
    pub(crate) async fn create_ahead(&self, conn: &mut PgConnection) -> Result<Vec<String>> {
        let mut tx = conn.begin().await.map_err(db("listing the partitions"))?;
        let now = db_now_ms(&mut tx).await?;
        let leaves = self.leaves(&mut tx).await?;
        tx.commit().await.map_err(db("listing the partitions"))?;
        let ranges = || {
            leaves.iter().filter_map(|l| match l.bound {
                Bound::Range(from, to) => Some((from, to)),
                _ => None,
            })
        };
        let p = self.partitions.unwrap_or_else(|| {
            // Not configured (an operator's tool, say): the span of the newest range.
            let newest = ranges().next_back().map(|(from, to)| to - from);
            Partitions {
                width_minutes: newest.map_or(24 * 60, |ms| (ms / MINUTE_MS).max(1)),
                ..Partitions::default()
            }
        });
        let current = now.div_euclid(p.width_ms()) * p.width_ms();
        let end = current + (i64::from(p.ahead) + 1) * p.width_ms();
        // Contiguous after the newest range; a range that ended in the past leaves a gap, whose
        // keys the default partition takes.
        let newest = ranges().map(|(_, to)| to).max();
        let from = newest.map_or(current, |to| to.max(current));
        self.create_ranges(conn, &p, &leaves, from, end).await
    }

    /// Creates the partitions of one span each from `lo` until one reaches `end`, but those
    /// overlapping a range of `leaves`; the names created.
    async fn create_ranges(
        &self,
        conn: &mut PgConnection,
        p: &Partitions,
        leaves: &[Leaf],
        mut lo: i64,
        end: i64,
    ) -> Result<Vec<String>> {
        let mut created = Vec::new();
        while lo < end {
            let hi = lo + p.width_ms();
            let taken = |l: &Leaf| matches!(l.bound, Bound::Range(a, b) if a < hi && lo < b);
            if !leaves.iter().any(taken) {
                created.extend(self.create_range(conn, p, leaves, lo, hi).await?);
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
        let qualified = t.qualify(&name);
        let (from, to) = (
            bound_literal(self.key_mode(), lo),
            bound_literal(self.key_mode(), hi),
        );
        let mut ddl = vec![format!(
            "CREATE TABLE {qualified} (LIKE {t} INCLUDING DEFAULTS)"
        )];
        if let Some(default) = leaves.iter().find(|l| l.bound == Bound::Default) {
            // Blocks only claims that land in the default partition, until the commit.
            let d = &default.sql;
            ddl.push(format!("LOCK TABLE {d} IN SHARE ROW EXCLUSIVE MODE"));
            ddl.push(move_rows_sql(d, &qualified, &from, &to));
        }
        ddl.push(format!(
            "ALTER TABLE {t} ATTACH PARTITION {qualified} FOR VALUES FROM ('{from}') TO ('{to}')"
        ));
        let ddl = ddl.join("; ");
        let key = self.table_lock_key("inbox partitions").await?;
        let context = "creating a partition";
        let mut retries = p.retries();
        let created = loop {
            let mut tx = retries.begin(conn).await.map_err(db(context))?;
            let result: Result<_, sqlx::Error> = async {
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
                sqlx::raw_sql(AssertSqlSafe(ddl.as_str()))
                    .execute(&mut *tx)
                    .await?;
                Ok(Some(()))
            }
            .await;
            if let Some(ended) = retries.end(tx, result).await {
                break ended.map_err(db(context))?;
            }
        };
        if created.is_some() {
            tracing::info!(table = %t, partition = %name, "inbox partition created");
        }
        Ok(created.map(|()| name))
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
        let context = "detaching a partition";
        let mut retries = p.retries();
        let detached = loop {
            let mut tx = retries.begin(conn).await.map_err(db(context))?;
            let result: Result<_, sqlx::Error> = async {
                // The check reads the BRIN index, never the whole partition: its statistics
                // can be stale.
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "LOCK TABLE {l} IN SHARE MODE; SET LOCAL enable_seqscan = off"
                )))
                .execute(&mut *tx)
                .await?;
                let live: bool = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT EXISTS (SELECT 1 FROM {l} WHERE processed_minute >= $1)"
                )))
                .bind(cutoff_minute)
                .fetch_one(&mut *tx)
                .await?;
                if live {
                    return Ok(None);
                }
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "ALTER TABLE {t} DETACH PARTITION {l}"
                )))
                .execute(&mut *tx)
                .await?;
                Ok(Some(()))
            }
            .await;
            if let Some(ended) = retries.end(tx, result).await {
                break ended;
            }
        };
        match detached {
            Ok(Some(())) => {
                self.drop_detached(conn, &p, l).await;
                Ok(DropOutcome::Dropped(DroppedPartition {
                    name: leaf.name.clone(),
                    approx_rows: leaf.approx_rows,
                    lock_wait: retries.waited,
                }))
            }
            Ok(None) => Ok(DropOutcome::Live),
            Err(e) if lock_contended(&e) => {
                tracing::warn!(table = %t, partition = %leaf.name, attempts = p.attempts, "inbox partition not detached: claims held the table longer than the lock timeout; postponed to the next purge");
                Ok(DropOutcome::Postponed)
            }
            Err(e) => Err(db(context)(e)),
        }
    }

    /// Drops a detached partition: no claim can reach it any more, so this takes no lock on the
    /// inbox table. One left over (the drop failed) is found and dropped by the next purge.
    async fn drop_detached(&self, conn: &mut PgConnection, p: &Partitions, sql: &str) {
        let result: Result<(), sqlx::Error> = async {
            let mut tx = p.retries().begin(conn).await?;
            sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {sql}")))
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
        let context = "looking for detached partitions";
        let mut tx = conn.begin().await.map_err(db(context))?;
        let leftovers: Vec<String> = sqlx::query_scalar(
            "SELECT c.oid::regclass::text FROM pg_class c
             WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = $1::regclass)
               AND c.relkind = 'r' AND NOT c.relispartition AND c.relname ~ $2",
        )
        .bind(self.table().to_string())
        .bind(pattern)
        .fetch_all(&mut *tx)
        .await
        .map_err(db(context))?;
        tx.commit().await.map_err(db(context))?;
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
