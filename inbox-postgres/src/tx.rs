//! [`PgTx`]: the transaction a handler writes through, which ends itself.

use std::ops::{Deref, DerefMut};

use inbox_core::{StoreError, Transaction};
use sqlx::{PgConnection, Postgres};

use crate::error::{recovery, store_err};

/// The open transaction a handler writes its side effect through: `&mut **tx` is its
/// connection, for any sqlx query. The consumer commits or rolls it back; a handler never
/// does.
#[derive(Debug)]
pub struct PgTx(sqlx::Transaction<'static, Postgres>);

impl PgTx {
    pub(crate) fn new(tx: sqlx::Transaction<'static, Postgres>) -> Self {
        Self(tx)
    }
}

impl Deref for PgTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl Transaction for PgTx {
    async fn commit(mut self) -> Result<(), StoreError> {
        // PostgreSQL answers COMMIT of an aborted transaction (a statement failed and the
        // handler ignored the error) with ROLLBACK and no error, which sqlx does not check. A
        // statement in an aborted transaction fails, so one round-trip finds it before COMMIT.
        if let Err(e) = sqlx::query("SELECT 1").execute(&mut *self.0).await {
            let recovery = recovery(&e);
            let aborted =
                matches!(&e, sqlx::Error::Database(d) if d.code().as_deref() == Some("25P02"));
            let context = if aborted {
                "committing: the transaction was aborted by an earlier statement whose error the \
                 handler did not return (nothing was written; return SQL errors, or run a statement \
                 that may fail behind a SAVEPOINT)"
            } else {
                "committing"
            };
            if let Err(rollback) = self.0.rollback().await {
                tracing::warn!(error = %rollback, "rollback of an aborted transaction failed");
            }
            return Err(StoreError::new(recovery, context, e));
        }
        self.0.commit().await.map_err(store_err("committing"))
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.0.rollback().await.map_err(store_err("rolling back"))
    }
}
