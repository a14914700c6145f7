//! [`PgLeases`]: processing and done rows with a lease and a fencing token, for side effects
//! outside the database ([`inbox_core::effect`]).

use std::time::Duration;

use inbox_core::effect::{Acquired, Attempt, Lease, LeaseStore, Release};
use inbox_core::sql::{hashed_key, primary_key, uuid_key};
use inbox_core::{InboxStore, InvalidId, MessageId, Recovery, StoreError};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use crate::error::{db, store_err};
use crate::migration::Migration;
use crate::retention::delete_in_batches;
use crate::table::column_type;
use crate::{KeyMode, PgInbox, PgTx, Result, TableName};

/// The SQLSTATE the done mark raises when a token is fenced out.
const FENCED: &str = "IB001";

/// The SQLSTATE of a lock wait ended by `lock_timeout`.
const LOCK_TIMED_OUT: &str = "55P03";

/// How long a lease waits for its row by default ([`PgLeases::lock_timeout`]).
pub const DEFAULT_LEASE_LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// The lease store on PostgreSQL: one row per consumer and message in table
/// `<inbox table>_effects` (or one given to [`PgLeases::with_table`]), keyed like the inbox (the
/// same [`KeyMode`] and the inbox's consumer-name ids).
///
/// - **Lease**, one statement, committed on its own: `INSERT … ON CONFLICT … DO UPDATE SET
///   token = token + 1, … WHERE done_at IS NULL AND locked_until <= now() RETURNING …`. A new
///   row gets token 1; a processing row whose lease ran out gets the next token; a live or done
///   row is left alone (then one more statement reads which it was). Racing consumers serialise
///   on the row: the first to commit wins the lease, the other sees it live. The statement waits
///   for the row at most [`PgLeases::lock_timeout`] (its own `lock_timeout`, set inside it): a
///   row that another transaction keeps locked (a done mark not yet committed) answers
///   [`Acquired::Busy`] then, instead of holding up the consumer until that transaction ends.
/// - **Done**, in the handler's transaction: `UPDATE … SET done_at = now() WHERE … AND token =
///   $token AND done_at IS NULL`, in a statement that raises an error (SQLSTATE `IB001`) when
///   no row matched, so a fenced-out transaction is aborted by the database itself and nothing
///   written in it can commit. The update holds the row lock until commit, so a new lease
///   cannot be taken while the done transaction is open; and the same statement sets the
///   transaction's `statement_timeout` to what is left of the lease (or keeps a shorter one),
///   so a statement of the handler's `record` cannot hold the row past the lease. The update
///   waits for a row another transaction keeps locked at most [`PgLeases::lock_timeout`], then
///   fails as a retryable error; so does **releasing** a lease.
/// - Leases and done marks use the database clock (`now()`), one clock for every consumer.
///
/// Keep done rows as long as the broker can redeliver, as for the inbox: purge them with
/// [`PgLeases::purge`]. Processing rows are never purged: each is a message whose effect is
/// unsettled (its consumer died and the message was not redelivered, or it was dead-lettered),
/// for a person to look at.
///
/// # Example
///
/// ```no_run
/// use inbox_core::effect::{Effect, EffectHandler, OnUnknown, Settled};
/// use inbox_core::{Consumer, HandlerError, Message, MessageSource};
/// use inbox_postgres::{PgInbox, PgLeases, PgTx};
///
/// /// Charges a card through a payment API that takes idempotency keys, and records the payment.
/// struct Charge;
///
/// impl EffectHandler<PgTx> for Charge {
///     fn on_unknown(&self) -> OnUnknown {
///         OnUnknown::Retry // the API deduplicates on the key: a retry cannot charge twice
///     }
///
///     async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
///         charge(effect.idempotency_key(), &message.payload).await?;
///         Ok(())
///     }
///
///     async fn record(&self, tx: &mut PgTx, effect: &Effect, settled: Settled, _: &Message) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO payments (message_id, settled) VALUES ($1, $2)")
///             .bind(effect.id().as_str())
///             .bind(settled.as_str())
///             .execute(&mut **tx) // commits with the done mark, or not at all
///             .await?;
///         Ok(())
///     }
/// }
/// # async fn charge(_key: &str, _body: &[u8]) -> std::io::Result<()> { Ok(()) }
///
/// /// `source`: a Kafka, SQS, RabbitMQ or Redis Streams adapter's source.
/// async fn run(source: impl MessageSource) -> Result<(), Box<dyn std::error::Error>> {
///     let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
///     let leases = PgLeases::new(PgInbox::new(pool))?; // table `inbox_effects`
///     leases.migrate().await?;
///     Consumer::effects("payments", source, leases, Charge).run().await?;
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct PgLeases {
    inbox: PgInbox,
    table: TableName,
    lock_timeout: Duration,
}

impl PgLeases {
    /// The lease table `<inbox table>_effects`, beside `inbox`, whose consumer-name ids and key
    /// mode it shares.
    ///
    /// # Errors
    /// [`Error::TableNameTooLong`](crate::Error::TableNameTooLong) when `<inbox table>_effects` is longer than
    /// [`TableName::MAX_LEN`]: name one with [`PgLeases::with_table`].
    pub fn new(inbox: PgInbox) -> Result<Self> {
        let t = inbox.table();
        let name = format!("{}_effects", t.table());
        let table = match t.schema() {
            Some(schema) => TableName::qualified(schema, &name)?,
            None => TableName::new(&name)?,
        };
        Ok(Self::with_table(inbox, table))
    }

    /// The lease table `table`, sharing `inbox`'s consumer-name ids and key mode.
    pub fn with_table(inbox: PgInbox, table: TableName) -> Self {
        Self {
            inbox,
            table,
            lock_timeout: DEFAULT_LEASE_LOCK_TIMEOUT,
        }
    }

    /// How long taking a lease waits for its row while another transaction holds it (default
    /// [`DEFAULT_LEASE_LOCK_TIMEOUT`], at least 1 ms). A racing lease holds the row for one
    /// statement, a done mark until its transaction commits; one that stays open longer (a
    /// zombie paused before `COMMIT`, a `record` that hangs) makes the lease answer
    /// [`Acquired::Busy`] after this wait, to be tried again after the rest of the row's lease
    /// or this wait, whichever is longer. A release or a done mark behind such a row fails
    /// after this wait with a retryable error instead of holding up the consumer.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// [`PgLeases::lock_timeout`] in milliseconds, as `set_config` takes it.
    fn lock_timeout_ms(&self) -> String {
        self.lock_timeout.as_millis().to_string()
    }

    /// The lease table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The inbox whose consumer names and key mode this store shares.
    pub fn inbox(&self) -> &PgInbox {
        &self.inbox
    }

    /// Migrates the inbox (for its consumer-name table), then creates the lease table, its
    /// index and the function the done mark raises through, if missing. Safe to run from many
    /// instances at once. Fails when the table exists with another key mode.
    pub async fn migrate(&self) -> Result<()> {
        self.inbox.migrate().await?;
        let t = &self.table;
        let mode = self.inbox.key_mode();
        let key = column_type(mode);
        let primary_key = primary_key(mode);
        let lock = format!("inbox migrate {t}");
        let mut migration =
            Migration::begin(self.inbox.pool(), lock, "creating the lease table").await?;
        let statements = [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    message_id {key} NOT NULL,
                    consumer_id smallint NOT NULL,
                    token bigint NOT NULL DEFAULT 1,
                    -- the last token whose call surely did not apply (see Release::not_applied)
                    clean_token bigint NOT NULL DEFAULT 0,
                    attempts integer NOT NULL DEFAULT 1,
                    locked_until timestamptz NOT NULL,
                    done_at timestamptz,
                    first_leased_at timestamptz NOT NULL DEFAULT now(),
                    PRIMARY KEY ({primary_key}))"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {t} USING brin (done_at)",
                index = t.sibling_bare("done")
            ),
            format!(
                "CREATE OR REPLACE FUNCTION {fenced}(stale bigint) RETURNS boolean
                 LANGUAGE plpgsql AS $$
                 BEGIN
                     RAISE EXCEPTION 'lease token % is fenced out: a newer lease took over, or the message is done', stale
                         USING ERRCODE = '{FENCED}';
                 END $$",
                fenced = t.sibling("fenced")
            ),
        ];
        migration.run(statements).await?;
        migration.check_key_type(t, mode).await?;
        migration.commit().await
    }

    /// Deletes done rows marked more than `older_than` ago, `batch` rows per statement (at
    /// least 1), each statement its own transaction, until one deletes nothing; returns how
    /// many. Processing rows stay. Several cleaners at once do no harm, only wasted work.
    pub async fn purge(&self, older_than: Duration, batch: i64) -> Result<u64> {
        let t = &self.table;
        let sql = format!(
            "DELETE FROM {t} WHERE ctid IN (
                SELECT ctid FROM {t} WHERE done_at < now() - $1 * interval '1 second' LIMIT $2)"
        );
        let context = "deleting done lease rows";
        let mut conn = self.inbox.pool().acquire().await.map_err(db(context))?;
        let cutoff = (older_than.as_secs_f64(), batch);
        let batches = delete_in_batches(&mut conn, &sql, cutoff, false, context).await?;
        Ok(batches.iter().sum())
    }

    /// The message's key as text, cast to the key column's type in SQL.
    fn key(&self, consumer: &str, id: &MessageId) -> Result<String, StoreError> {
        Ok(match self.inbox.key_mode() {
            KeyMode::Uuid => uuid_key(id)
                .map_err(|e| StoreError::new(Recovery::Fatal, "keying the message", e))?
                .to_string(),
            KeyMode::Hashed => Uuid::from_bytes(hashed_key(consumer, id.as_str())).to_string(),
            KeyMode::Text => id.as_str().to_owned(),
        })
    }

    /// `message_id = $1 AND consumer_id = $2`, with the key cast to the column type.
    fn row(&self) -> String {
        let key = column_type(self.inbox.key_mode());
        format!("message_id = $1::text::{key} AND consumer_id = $2")
    }

    /// What a row that another transaction kept locked past the lock timeout holds, as last
    /// committed: done (the lock's holder committed meanwhile), or busy for the rest of its
    /// lease, and at least the lock timeout, since the lock's holder may hold on past its lease.
    async fn locked(&self, key: &str, consumer_id: i16) -> Result<Acquired, StoreError> {
        Ok(match self.not_leased(key, consumer_id).await? {
            Some(Acquired::Busy { retry_after }) => Acquired::Busy {
                retry_after: retry_after.max(self.lock_timeout),
            },
            Some(found) => found,
            // Inserted by a transaction not yet committed.
            None => Acquired::Busy {
                retry_after: self.lock_timeout,
            },
        })
    }

    /// What a row that could not be leased holds: done, or the time left on its lease.
    async fn not_leased(
        &self,
        key: &str,
        consumer_id: i16,
    ) -> Result<Option<Acquired>, StoreError> {
        let mut conn = self.inbox.single("reading the lease").await?;
        let found: Option<(bool, f64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT done_at IS NOT NULL,
                    greatest(extract(epoch FROM locked_until - now()), 0)::float8
             FROM {t} WHERE {row}",
            t = self.table,
            row = self.row()
        )))
        .bind(key)
        .bind(consumer_id)
        .fetch_optional(&mut *conn)
        .await
        .map_err(store_err("reading the lease"))?;
        conn.done().await.map_err(store_err("reading the lease"))?;
        Ok(found.map(|(done, left)| {
            if done {
                Acquired::Done
            } else {
                Acquired::Busy {
                    retry_after: Duration::try_from_secs_f64(left).unwrap_or(Duration::ZERO),
                }
            }
        }))
    }
}

fn attempt(token: i64, clean_token: i64) -> Attempt {
    if token == 1 {
        Attempt::First
    } else if clean_token == token - 1 {
        Attempt::AfterNotApplied
    } else {
        Attempt::AfterExpiry
    }
}

impl LeaseStore for PgLeases {
    type Tx = PgTx;

    async fn acquire(
        &self,
        consumer: &str,
        id: &MessageId,
        lease: Duration,
    ) -> Result<Acquired, StoreError> {
        let consumer_id = self.inbox.consumer_id(consumer).await?;
        let key = self.key(consumer, id)?;
        let t = &self.table;
        let conflict = primary_key(self.inbox.key_mode());
        // `set_config(…, true)` sets the lock timeout for this statement's own transaction,
        // before the insert waits on the row: no round-trip of its own.
        let sql = format!(
            "INSERT INTO {t} AS e (message_id, consumer_id, locked_until)
             SELECT $1::text::{k}, $2, now() + $3 * interval '1 second'
             FROM (SELECT set_config('lock_timeout', $4, true)) AS bounded
             ON CONFLICT ({conflict}) DO UPDATE
             SET token = e.token + 1, attempts = e.attempts + 1, locked_until = EXCLUDED.locked_until
             WHERE e.done_at IS NULL AND e.locked_until <= now()
             RETURNING token, clean_token, attempts,
                       greatest(extract(epoch FROM now() - first_leased_at), 0)::float8",
            k = column_type(self.inbox.key_mode())
        );
        // A row found neither leasable nor there (purged between the two statements) is
        // looked at again; a done row is the only kind a purge removes, so this ends.
        let lock_ms = self.lock_timeout_ms();
        for _ in 0..3 {
            let mut conn = self.inbox.single("taking a lease").await?;
            let leased: Option<(i64, i64, i32, f64)> =
                match sqlx::query_as(AssertSqlSafe(sql.as_str()))
                    .bind(&key)
                    .bind(consumer_id)
                    .bind(lease.as_secs_f64())
                    .bind(&lock_ms)
                    .fetch_optional(&mut *conn)
                    .await
                {
                    Ok(leased) => {
                        conn.done().await.map_err(store_err("taking a lease"))?;
                        leased
                    }
                    Err(sqlx::Error::Database(e))
                        if e.code().as_deref() == Some(LOCK_TIMED_OUT) =>
                    {
                        return self.locked(&key, consumer_id).await;
                    }
                    Err(e) => return Err(store_err("taking a lease")(e)),
                };
            if let Some((token, clean_token, attempts, since)) = leased {
                return Ok(Acquired::Leased(Lease {
                    token: u64::try_from(token).unwrap_or(0),
                    attempt: attempt(token, clean_token),
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    since_first: Duration::try_from_secs_f64(since).unwrap_or(Duration::ZERO),
                }));
            }
            if let Some(found) = self.not_leased(&key, consumer_id).await? {
                return Ok(found);
            }
        }
        Err(StoreError::new(
            Recovery::Retry,
            "taking a lease",
            format!("the lease row of {id:?} disappeared while it was being read"),
        ))
    }

    async fn release(
        &self,
        consumer: &str,
        id: &MessageId,
        token: u64,
        release: Release,
    ) -> Result<bool, StoreError> {
        let consumer_id = self.inbox.consumer_id(consumer).await?;
        let key = self.key(consumer, id)?;
        // The lock timeout as in `acquire`, set inside the statement before it waits on the
        // row: a row another transaction keeps locked ends the release as a retryable error.
        let mut conn = self.inbox.single("releasing a lease").await?;
        let done = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET locked_until = now(),
                 clean_token = CASE WHEN $4 THEN token ELSE clean_token END,
                 attempts = CASE WHEN $5 THEN 0 ELSE attempts END
             FROM (SELECT set_config('lock_timeout', $6, true)) AS bounded
             WHERE {row} AND token = $3 AND done_at IS NULL",
            t = self.table,
            row = self.row()
        )))
        .bind(&key)
        .bind(consumer_id)
        .bind(i64::try_from(token).unwrap_or(i64::MAX))
        .bind(release.not_applied)
        .bind(release.dead_lettered)
        .bind(self.lock_timeout_ms())
        .execute(&mut *conn)
        .await
        .map_err(store_err("releasing a lease"))?;
        conn.done().await.map_err(store_err("releasing a lease"))?;
        Ok(done.rows_affected() == 1)
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        InboxStore::begin(&self.inbox).await
    }

    async fn complete(
        &self,
        tx: &mut PgTx,
        consumer: &str,
        id: &MessageId,
        token: u64,
    ) -> Result<bool, StoreError> {
        let consumer_id = self.inbox.consumer_id(consumer).await?;
        let key = self.key(consumer, id)?;
        // The CASE runs the raising function only when no row matched (it is volatile, so it
        // is not evaluated ahead of time). When a row matched, the rest of the transaction
        // gets what is left of the lease as its statement timeout, unless it has a shorter
        // one: `lease` reads the row as it was before the update. The update waits for a row
        // another transaction keeps locked at most the lock timeout (`bounded`, set before the
        // wait), a retryable error after it; the transaction's own lock timeout is put back
        // for the handler's `record`.
        let sql = format!(
            "WITH lease AS (
                 SELECT greatest(ceil(extract(epoch FROM locked_until - clock_timestamp()) * 1000), 1)::bigint AS ms
                 FROM {t} WHERE {row} AND token = $3 AND done_at IS NULL),
             done AS (
                 UPDATE {t} SET done_at = now(), locked_until = now()
                 FROM (SELECT current_setting('lock_timeout') AS before,
                              set_config('lock_timeout', $4, true)) AS bounded
                 WHERE {row} AND token = $3 AND done_at IS NULL
                 RETURNING bounded.before)
             SELECT CASE WHEN EXISTS (SELECT 1 FROM done)
                 THEN set_config('statement_timeout', coalesce(
                     (SELECT least(lease.ms, nullif(s.setting::bigint, 0))::text
                      FROM lease, pg_settings s WHERE s.name = 'statement_timeout'),
                     current_setting('statement_timeout')), true) IS NOT NULL
                   AND set_config('lock_timeout', (SELECT before FROM done), true) IS NOT NULL
                 ELSE {fenced}($3) END",
            t = self.table,
            row = self.row(),
            fenced = self.table.sibling("fenced")
        );
        let marked = sqlx::query_scalar::<_, bool>(AssertSqlSafe(sql))
            .bind(&key)
            .bind(consumer_id)
            .bind(i64::try_from(token).unwrap_or(i64::MAX))
            .bind(self.lock_timeout_ms())
            .fetch_one(&mut **tx)
            .await;
        match marked {
            Ok(marked) => Ok(marked),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(FENCED) => Ok(false),
            Err(e) => Err(store_err("marking the message done")(e)),
        }
    }

    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        match self.inbox.key_mode() {
            KeyMode::Uuid => uuid_key(id).map(|_| ()),
            KeyMode::Text | KeyMode::Hashed => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attempt_follows_from_the_tokens() {
        assert_eq!(attempt(1, 0), Attempt::First);
        assert_eq!(attempt(2, 1), Attempt::AfterNotApplied);
        assert_eq!(attempt(2, 0), Attempt::AfterExpiry);
        // Not applied two leases ago, then a lease that ended unknown.
        assert_eq!(attempt(3, 1), Attempt::AfterExpiry);
    }
}
