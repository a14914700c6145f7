//! Retention: the batched purge, under one cleaner at a time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::db;
use crate::{MySqlInbox, Result};

/// The default number of rows one purge batch deletes: each batch is a transaction of its own,
/// short enough that its locks and undo log stay small.
pub const DEFAULT_PURGE_BATCH: u32 = 10_000;

/// What a [`MySqlInbox::purge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PurgeReport {
    /// This call held the cleaner lock and deleted in batches.
    #[non_exhaustive]
    Purged {
        /// Rows processed before this minute (minutes since the Unix epoch) were deleted.
        cutoff_minute: i64,
        /// Rows deleted by each batch, in order; the last one deleted fewer than a batch.
        batches: Vec<u64>,
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
}

impl MySqlInbox {
    /// Deletes the claims processed more than `keep` ago, `batch` rows per statement, each
    /// statement its own transaction under `READ COMMITTED` (no gap lock on the index range, so
    /// claims going on meanwhile never wait for it). One cleaner at a time per table: a named
    /// lock (`GET_LOCK`) held by this call; a call that finds it held returns
    /// [`PurgeReport::SkippedOtherCleaner`].
    ///
    /// After the purge a redelivered copy of a deleted claim's message is applied again: `keep`
    /// must be longer than the longest redelivery window of the consumers' sources.
    pub async fn purge(&self, keep: Duration, batch: u32) -> Result<PurgeReport> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let cutoff_minute = i64::try_from(now.saturating_sub(keep).as_secs() / 60).unwrap_or(0);
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(db("purging the inbox"))?;
        let lock = format!("inbox purge {}", self.table());
        let taken: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await
            .map_err(db("taking the purge lock"))?;
        if taken != Some(1) {
            return Ok(PurgeReport::SkippedOtherCleaner);
        }
        let delete = format!(
            "DELETE FROM {} WHERE processed_minute < ? ORDER BY processed_minute LIMIT ?",
            self.table()
        );
        let mut batches = Vec::new();
        let result = async {
            loop {
                sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .execute(&mut *conn)
                    .await
                    .map_err(db("purging the inbox"))?;
                let deleted = sqlx::query(sqlx::AssertSqlSafe(delete.as_str()))
                    .bind(cutoff_minute)
                    .bind(batch.max(1))
                    .execute(&mut *conn)
                    .await
                    .map_err(db("purging the inbox"))?
                    .rows_affected();
                batches.push(deleted);
                if deleted < u64::from(batch.max(1)) {
                    return Ok(());
                }
            }
        }
        .await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await
            .map_err(db("releasing the purge lock"));
        result.and(released.map(|_| PurgeReport::Purged {
            cutoff_minute,
            batches,
        }))
    }
}
