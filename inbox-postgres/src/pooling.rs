//! A transaction pooler in front of PostgreSQL (PgBouncer with `pool_mode = transaction`): it
//! hands each transaction to whichever server session is free, so nothing that lives in a
//! session survives from one transaction to the next. Every statement of this crate runs inside
//! a transaction, its locks are transaction-scoped (`pg_try_advisory_xact_lock`) and its
//! settings `SET LOCAL`. What it cannot make safe is a pool whose connections cache prepared
//! statements: a statement prepared in one server session is missing from the next, or another
//! client's statement stands under its name. [`check`] finds that combination and refuses it.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Row, Transaction};

use crate::error::db;
use crate::{Error, Result};

/// Whether `pool` reaches PostgreSQL through a transaction pooler;
/// [`Error::StatementCacheBehindPooler`] when its connections also cache prepared statements
/// that the pooler does not carry from one server session to the next.
///
/// A direct connection keeps one server session for its life. Through a transaction pooler, a
/// second client connection whose transaction is open takes a session of its own, and often
/// the very one the first client just used. The probe asks the server's process ID of one
/// pooled connection, opens a transaction on a second connection (outside the pool, so a pool
/// of one cannot wait on itself) and asks again from both. It uses the simple query protocol,
/// which a transaction pooler passes whole. A pooler that happens to hand the first connection
/// its former session back goes unnoticed; the statement cache check below then never runs,
/// and the errors of a cached statement (`26000`, `42P05`) stop the consumer as
/// [`Recovery::Fatal`](inbox_core::Recovery::Fatal).
pub(crate) async fn check(pool: &PgPool) -> Result<bool> {
    let context = "checking for a transaction pooler";
    let mut first = pool.acquire().await.map_err(db(context))?;
    let mut second = PgConnection::connect_with(&pool.connect_options())
        .await
        .map_err(db(context))?;
    let before = backend(&mut first).await?;
    sqlx::raw_sql("BEGIN")
        .execute(&mut second)
        .await
        .map_err(db(context))?;
    let pinned = backend(&mut second).await;
    let pooled = match pinned {
        Ok(pinned) if pinned == before => Ok(true),
        Ok(_) => backend(&mut first).await.map(|after| after != before),
        Err(e) => Err(e),
    };
    let _ = second.close().await;
    if !pooled? {
        return Ok(false);
    }
    // Behind a pooler: a statement that sqlx prepares is kept by name unless the cache is off.
    let mut tx = first.begin().await.map_err(db(context))?;
    let prepared_in = backend(&mut tx).await?;
    let answered = echoes(&mut tx, 1).await;
    let cached = tx.cached_statements_size() > 0;
    let _ = tx.rollback().await;
    if !answered {
        return Err(Error::StatementCacheBehindPooler);
    }
    if !cached {
        return Ok(true);
    }
    // The pool caches. A pooler that carries prepared statements from one server session to the
    // next (PgBouncer 1.21 and later with `max_prepared_statements`) makes that safe: hold the
    // session the statement was prepared in with a transaction of a third connection, and run
    // the cached statement again, in another session. Where the pooler hands the holder another
    // session, the answer is unknown, and the pool is refused.
    let mut holder = LockHolder::open(pool, context).await?;
    let carried = if backend(holder.conn()).await? == prepared_in {
        let mut tx = first.begin().await.map_err(db(context))?;
        let again = echoes(&mut tx, 2).await;
        let _ = tx.rollback().await;
        again
    } else {
        false
    };
    holder.release().await;
    if carried {
        Ok(true)
    } else {
        Err(Error::StatementCacheBehindPooler)
    }
}

/// Whether the parameterized probe statement, run with `n`, answers `n`: another client's
/// statement under the same name would answer otherwise, or fail.
async fn echoes(conn: &mut PgConnection, n: i32) -> bool {
    let row = sqlx::query("SELECT $1::int4").bind(n).fetch_one(conn).await;
    row.and_then(|row| row.try_get::<i32, _>(0))
        .is_ok_and(|answer| answer == n)
}

/// The server process the next statement of `conn` runs in.
async fn backend(conn: &mut PgConnection) -> Result<i32> {
    sqlx::raw_sql("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .and_then(|row| row.try_get(0))
        .map_err(db("checking for a transaction pooler"))
}

/// A transaction of its own, on a connection of its own, that holds transaction-scoped advisory
/// locks while work that spans many short transactions runs on other connections: a purge, a
/// conversion. A session lock would stay with whatever server session a transaction pooler
/// gave it, and an unrelated client would hold it from then on; this one ends with its
/// transaction, or with its connection when the process dies or the future is dropped. The
/// connection is not the pool's, so it cannot starve the work of one.
pub(crate) struct LockHolder {
    conn: PgConnection,
}

impl LockHolder {
    /// Opens the transaction; `context` names the work in errors.
    pub(crate) async fn open(pool: &PgPool, context: &'static str) -> Result<Self> {
        let mut conn = PgConnection::connect_with(&pool.connect_options())
            .await
            .map_err(db(context))?;
        // Idle in its transaction for as long as the work runs: a server-wide idle timeout
        // must not end it half way.
        sqlx::raw_sql("BEGIN; SET LOCAL idle_in_transaction_session_timeout = 0")
            .execute(&mut conn)
            .await
            .map_err(db(context))?;
        Ok(Self { conn })
    }

    /// The connection, inside the transaction, to take the locks on.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Ends the transaction, releasing its locks, and closes the connection.
    pub(crate) async fn release(mut self) {
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut self.conn).await;
        let _ = self.conn.close().await;
    }
}

/// Where one statement outside any caller's transaction runs: on a pooled connection, in
/// autocommit, when PostgreSQL is reached directly (one round-trip); in a transaction of its own
/// behind a transaction pooler, which could otherwise run the statement's parse and its
/// execution in two server sessions (two round-trips more).
pub(crate) enum Single {
    Direct(PoolConnection<Postgres>),
    Pooled(Transaction<'static, Postgres>),
}

impl Single {
    pub(crate) async fn open(pool: &PgPool, pooled: bool, context: &'static str) -> Result<Self> {
        if pooled {
            pool.begin().await.map(Self::Pooled)
        } else {
            pool.acquire().await.map(Self::Direct)
        }
        .map_err(db(context))
    }

    /// Commits the transaction, if there is one.
    pub(crate) async fn done(self) -> Result<(), sqlx::Error> {
        match self {
            Self::Direct(_) => Ok(()),
            Self::Pooled(tx) => tx.commit().await,
        }
    }
}

impl Deref for Single {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pooled(tx) => tx,
        }
    }
}

impl DerefMut for Single {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pooled(tx) => tx,
        }
    }
}
