//! [`PgTx`]: the transaction a handler writes through, which ends itself.

use std::ops::{Deref, DerefMut};

use inbox_core::{StoreError, Transaction};
use sqlx::{PgConnection, PgPool, Postgres};

use crate::error::{recovery, store_err};

/// The open transaction a handler writes its side effect through: `&mut **tx` is its
/// connection, for any sqlx query. The consumer commits or rolls it back; a handler never
/// does.
///
/// It is [`PgInbox`](crate::PgInbox)'s transaction, and any other PostgreSQL store's: a store of
/// your own opens it with [`PgTx::begin`] (or converts a `sqlx::Transaction` it began itself,
/// with `SET LOCAL`s of its own, through `From`) and returns it from
/// [`InboxStore::begin`](inbox_core::InboxStore::begin). Handlers written for `PgInbox`
/// (`Handler<PgTx>`) then run on that store unchanged. `docs/writing-a-store.md` builds one.
///
/// # Commit
/// [`commit`](Transaction::commit) notices a transaction the server has already aborted. When a
/// statement fails and the handler swallows the error (returns `Ok`), PostgreSQL aborts the
/// transaction and answers its `COMMIT` with `ROLLBACK`, not with an error, and sqlx reports
/// success. The consumer would then ack a message whose claim and effect were rolled back. So
/// `commit` first sends `SELECT 1`, which fails in an aborted transaction (SQLSTATE `25P02`),
/// rolls back, and fails with [`Recovery::Retry`](inbox_core::Recovery::Retry): the consumer
/// isolates the message and retries or dead-letters it. That is one more round-trip per
/// transaction, and the reason a store built on `PgTx` need not check for it itself.
///
/// Dropped without a commit or rollback (a crash, a cancelled future), the transaction rolls
/// back when its connection goes back to the pool.
#[derive(Debug)]
pub struct PgTx(sqlx::Transaction<'static, Postgres>);

impl PgTx {
    /// Opens a transaction on a connection from `pool` (`BEGIN`); the error says whether to
    /// reconnect (the pool or server cannot be reached) or give up (a closed pool).
    pub async fn begin(pool: &PgPool) -> Result<Self, StoreError> {
        pool.begin()
            .await
            .map(Self)
            .map_err(store_err("opening a transaction"))
    }
}

/// A transaction begun with sqlx (`pool.begin_with("BEGIN; SET LOCAL lock_timeout = 2000")`,
/// say), which then commits as [`PgTx`] does.
impl From<sqlx::Transaction<'static, Postgres>> for PgTx {
    fn from(tx: sqlx::Transaction<'static, Postgres>) -> Self {
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
    /// Commits, after checking in one round-trip that no earlier statement aborted the
    /// transaction (see [`PgTx`]'s `# Commit`).
    async fn commit(mut self) -> Result<(), StoreError> {
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
