//! [`MySqlTx`]: the transaction a handler writes through, which ends itself, and notices when
//! the server ended it first.

use std::ops::{Deref, DerefMut};

use inbox_core::{Recovery, StoreError, Transaction};
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection};

use crate::error::store_err;

/// A session-local table whose one row lives exactly as long as the inbox transaction: gone
/// when the server rolled the transaction back (a deadlock), kept when the transaction is intact.
/// Temporary tables are per connection, and creating one commits nothing.
const OPEN_MARK: &str = "inbox_open_transaction";

/// The statements that open the inbox transaction, in one round-trip: the mark's table (once
/// per connection), the isolation level of the next transaction, `autocommit` off so that no
/// statement after a server-side rollback commits on its own, and the mark.
pub(crate) fn begin_sql(session_settings: &str) -> String {
    format!(
        "{session_settings}CREATE TEMPORARY TABLE IF NOT EXISTS {OPEN_MARK} (open tinyint NOT NULL) \
         ENGINE=InnoDB; SET TRANSACTION ISOLATION LEVEL READ COMMITTED; SET autocommit = 0; \
         INSERT INTO {OPEN_MARK} VALUES (1)"
    )
}

/// The open transaction a handler writes its side effect through: `&mut **tx` is its
/// connection, for any sqlx query. The consumer commits or rolls it back; a handler never does.
///
/// It runs with `autocommit` off, under `READ COMMITTED`. When InnoDB rolls the transaction back
/// by itself (a deadlock, error 1213, which a handler may have caught and ignored), the
/// statements that follow do not commit one by one, as they would after `START TRANSACTION`:
/// they open a new transaction, which [`commit`](Transaction::commit) finds out and rolls back,
/// failing with [`Recovery::Retry`].
///
/// Dropped without a commit or a rollback (a cancelled future, a panic), it closes its
/// connection instead of returning it to the pool: the server rolls back, and no pooled
/// connection is left with `autocommit` off.
#[derive(Debug)]
pub struct MySqlTx {
    conn: PoolConnection<MySql>,
    ended: bool,
}

impl MySqlTx {
    pub(crate) fn new(conn: PoolConnection<MySql>) -> Self {
        Self { conn, ended: false }
    }

    /// Ends the transaction with `statement`, then turns `autocommit` back on for the pool.
    async fn end(&mut self, statement: &'static str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(statement).execute(&mut *self.conn).await?;
        self.ended = true;
        Ok(())
    }
}

impl Deref for MySqlTx {
    type Target = MySqlConnection;

    fn deref(&self) -> &MySqlConnection {
        &self.conn
    }
}

impl DerefMut for MySqlTx {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        &mut self.conn
    }
}

impl Drop for MySqlTx {
    fn drop(&mut self) {
        if !self.ended {
            self.conn.close_on_drop();
        }
    }
}

const COMMIT: &str = "COMMIT; SET autocommit = 1";
const ROLLBACK: &str = "ROLLBACK; SET autocommit = 1";

impl Transaction for MySqlTx {
    async fn commit(mut self) -> Result<(), StoreError> {
        // The mark is there only if the transaction that claimed the messages is still the one
        // open: deleting it is the check, in the transaction, before COMMIT.
        let marked = sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {OPEN_MARK}")))
            .execute(&mut *self.conn)
            .await
            .map_err(store_err("committing"))?;
        if marked.rows_affected() != 1 {
            self.end(ROLLBACK)
                .await
                .map_err(store_err("rolling back a transaction the server had ended"))?;
            return Err(StoreError::new(
                Recovery::Retry,
                "committing",
                "the server rolled the inbox transaction back (a deadlock, error 1213, whose \
                 error the handler did not return); what ran after it was rolled back too, \
                 nothing was written: return SQL errors from the handler",
            ));
        }
        self.end(COMMIT).await.map_err(store_err("committing"))
    }

    async fn rollback(mut self) -> Result<(), StoreError> {
        self.end(ROLLBACK).await.map_err(store_err("rolling back"))
    }
}
