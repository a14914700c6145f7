//! [`PgInbox::migrate_to_partitioned`]: a plain inbox table converted in place, while consumers
//! run, by making it the default partition of a new partitioned table.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, PgConnection};

use super::{
    bound_literal, db_now_ms, is_partitioned, move_rows_sql, ms_to_time, name_prefix,
    partition_name, Conversion, Partitions, MAX_MS,
};
use crate::error::db;
use crate::pooling::LockHolder;
use crate::{KeyMode, PgInbox, Result};

const CONVERTING: &str = "converting the inbox table";

impl PgInbox {
    /// Converts the plain inbox table to the partitioned layout, in place and while consumers
    /// run; the configured [`Partitions`] (or the default) cut it.
    ///
    /// The plain table becomes the default partition (`<table>_default`) of a new partitioned
    /// table of the same name, so its rows are neither copied nor moved and stay deduplicated.
    /// Ranges start at the first partition boundary at least one span ahead, and cover `window`
    /// (the purge window) plus the partitions ahead: until they run out the former table's rows
    /// have expired, and a new range never has to scan a large default partition.
    ///
    /// Steps: the partitioned table and its ranges are created beside the plain one; the plain
    /// table gets a `CHECK` that its keys are outside the ranges (`NOT VALID`: a brief `ACCESS
    /// EXCLUSIVE` lock), its rows inside them are moved over, and the check is validated (a scan
    /// under `SHARE UPDATE EXCLUSIVE`, which claims do not wait for); one short transaction then
    /// renames the tables and attaches the plain one as the default partition, which the check
    /// proves without a scan, and drops the check. Meanwhile a claim of a key inside the ranges
    /// fails (the check) and is retried; the first range starts a span ahead so current keys are
    /// outside it. It holds the migration and the cleaner locks throughout, so `migrate` and
    /// the purge wait for it. On a failure the changes are undone.
    ///
    /// Hashed tables are refused: their keys would have to be recomputed from IDs they do not
    /// store. Every instance must run a version that knows the layout before the conversion:
    /// an older purge would delete from the partitioned table by `ctid`, which partitions repeat.
    pub async fn migrate_to_partitioned(&self, window: Duration) -> Result<Conversion> {
        if self.key_mode() == KeyMode::Hashed {
            return Ok(Conversion::Refused {
                reason: "a partitioned hashed table keys a UUIDv7 ID by its time, a plain one does not, \
                         and the IDs are not stored to recompute the keys; create the partitioned table \
                         under a new name for a new consumer, or keep this one plain"
                    .to_owned(),
            });
        }
        let t = self.table();
        let purge_key = self.purge_lock_key().await?;
        // Transaction-scoped locks, held beside the work (see `pooling.rs`).
        let mut holder = LockHolder::open(self.pool(), CONVERTING).await?;
        let result = async {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1)), pg_advisory_xact_lock($2)")
                .bind(format!("inbox migrate {t}"))
                .bind(purge_key)
                .execute(holder.conn())
                .await
                .map_err(db("taking the migration and cleaner locks"))?;
            let mut conn = self.pool().acquire().await.map_err(db(CONVERTING))?;
            self.convert(&mut conn, window).await
        }
        .await;
        holder.release().await;
        result
    }

    async fn convert(&self, conn: &mut PgConnection, window: Duration) -> Result<Conversion> {
        let t = self.table();
        let mut tx = conn.begin().await.map_err(db(CONVERTING))?;
        let partitioned = is_partitioned(&mut tx, t).await?;
        let now = db_now_ms(&mut tx).await?;
        tx.commit().await.map_err(db(CONVERTING))?;
        if partitioned {
            return Ok(Conversion::AlreadyPartitioned);
        }
        let p = self.partitions.unwrap_or_default();
        let w = p.width_ms();
        // The first boundary at least one span ahead: current keys stay outside the ranges.
        let first = (now + 2 * w - 1).div_euclid(w) * w;
        let window_ms = i64::try_from(window.as_millis()).unwrap_or(MAX_MS);
        let count = (window_ms + w - 1) / w + i64::from(p.ahead) + 1;
        let end = first + count * w;
        let prefix = name_prefix(t.table());
        let new = t.qualify(&format!("{prefix}_partitioned"));
        let check = format!("\"{prefix}_outside_ranges\"");
        let bound = |ms| bound_literal(self.key_mode(), ms);
        let (from, to) = (bound(first), bound(end));

        // 1. The partitioned table and its ranges, beside the plain one.
        let starts: Vec<i64> = (0..count).map(|i| first + i * w).collect();
        let created: Vec<String> = starts
            .iter()
            .map(|&lo| partition_name(t.table(), lo))
            .collect();
        let ranges: Vec<String> = starts
            .iter()
            .zip(&created)
            .map(|(&lo, name)| {
                format!(
                    "CREATE TABLE {} PARTITION OF {new} FOR VALUES FROM ('{}') TO ('{}')",
                    t.qualify(name),
                    bound(lo),
                    bound(lo + w)
                )
            })
            .collect();
        let mut tx = conn.begin().await.map_err(db(CONVERTING))?;
        for statement in self.table_statements(&new, &format!("{prefix}_partitioned"), true) {
            sqlx::query(AssertSqlSafe(statement)).execute(&mut *tx).await.map_err(db(
                "creating the partitioned table beside the plain one (a table `<inbox>_partitioned` left by a failed conversion must be dropped first)",
            ))?;
        }
        sqlx::raw_sql(AssertSqlSafe(ranges.join("; ")))
            .execute(&mut *tx)
            .await
            .map_err(db("creating the range partitions"))?;
        tx.commit().await.map_err(db(CONVERTING))?;

        let steps = async {
            // 2. From here no new row of the plain table falls in the ranges.
            self.with_lock_retries(conn, &p, format!(
                "ALTER TABLE {t} ADD CONSTRAINT {check} CHECK (message_id < '{from}' OR message_id >= '{to}') NOT VALID"
            ))
            .await?;
            // 3. The rows that already do move over (keys from a clock far ahead, random UUIDs).
            // The simple query protocol, as every statement here outside a transaction: a
            // transaction pooler passes it whole.
            let moved = sqlx::raw_sql(AssertSqlSafe(move_rows_sql(&t.to_string(), &new, &from, &to)))
                .execute(&mut *conn)
                .await?
                .rows_affected();
            sqlx::raw_sql(AssertSqlSafe(format!("ALTER TABLE {t} VALIDATE CONSTRAINT {check}")))
                .execute(&mut *conn)
                .await?;
            // 4. The swap.
            // Quoted by PostgreSQL: a name given by hand may hold any character, `"` too.
            let mut tx = conn.begin().await?;
            let pkey: Option<String> = sqlx::query_scalar(
                "SELECT quote_ident(conname) FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'p'",
            )
            .bind(t.to_string())
            .fetch_optional(&mut *tx)
            .await?;
            tx.commit().await?;
            let default = t.qualify(&format!("{prefix}_default"));
            let mut swap = vec![format!("ALTER TABLE {t} RENAME TO \"{prefix}_default\"")];
            if let Some(pkey) = pkey {
                swap.push(format!(
                    "ALTER TABLE {default} RENAME CONSTRAINT {pkey} TO \"{prefix}_default_pkey\""
                ));
            }
            swap.extend([
                format!(
                    "ALTER INDEX IF EXISTS {} RENAME TO \"{prefix}_default_processed\"",
                    t.sibling("processed")
                ),
                format!("ALTER TABLE {new} RENAME TO \"{}\"", t.table()),
                format!(
                    "ALTER TABLE {t} RENAME CONSTRAINT \"{prefix}_partitioned_pkey\" TO \"{}_pkey\"",
                    t.table()
                ),
                format!(
                    "ALTER INDEX {} RENAME TO \"{}_processed\"",
                    t.qualify(&format!("{prefix}_partitioned_processed")),
                    t.table()
                ),
                format!("ALTER TABLE {t} ATTACH PARTITION {default} DEFAULT"),
                format!("ALTER TABLE {default} DROP CONSTRAINT {check}"),
            ]);
            self.with_lock_retries(conn, &p, swap.join("; ")).await?;
            Ok::<u64, sqlx::Error>(moved)
        }
        .await;
        match steps {
            Ok(moved_rows) => {
                tracing::info!(table = %t, ranges = created.len(), moved_rows, "inbox table converted to the partitioned layout");
                Ok(Conversion::Converted {
                    created,
                    ranges_from: ms_to_time(first),
                    moved_rows,
                })
            }
            Err(e) => {
                // Undo: rows back, the check and the new table gone. The swap is one
                // transaction, so either all of it happened or none.
                let undo = format!(
                    "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {check};
                     INSERT INTO {t} (message_id, processed_minute, consumer_id)
                        SELECT message_id, processed_minute, consumer_id FROM {new};
                     DROP TABLE {new}"
                );
                if let Err(undo) = self.with_lock_retries(conn, &p, undo).await {
                    tracing::error!(table = %t, error = %undo, "undoing a failed conversion failed: drop the constraint `<inbox>_outside_ranges` now, or claims of keys in its ranges keep failing");
                }
                Err(db(CONVERTING)(e))
            }
        }
    }

    /// Runs `sql` (one or more statements) in a transaction with the configured lock timeout,
    /// retried while locks are contended.
    async fn with_lock_retries(
        &self,
        conn: &mut PgConnection,
        p: &Partitions,
        sql: String,
    ) -> Result<(), sqlx::Error> {
        let mut retries = p.retries();
        loop {
            let mut tx = retries.begin(conn).await?;
            let result = sqlx::raw_sql(AssertSqlSafe(sql.as_str()))
                .execute(&mut *tx)
                .await
                .map(Some);
            if let Some(ended) = retries.end(tx, result).await {
                return ended.map(|_| ());
            }
        }
    }
}
