//! [`MySqlInbox`]: the inbox table and the claim, in the caller's transaction.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::sql::{claim_keys, first_claims, hashed_key, uuid_key, BoundConsumer};
use inbox_core::{ConsumerBinding, InboxStore, InvalidId, MessageId, StoreError};
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool};

use crate::error::{db, number, store_err, DUPLICATE_KEY};
use crate::table::TEXT_KEY_MAX;
use crate::tx::begin_sql;
use crate::{Error, KeyMode, MySqlTx, Result, TableName};

/// The transactional inbox on MariaDB or MySQL 8, InnoDB (see the crate docs, "Servers").
///
/// One table (default `inbox`) holds a row per applied message: the message key, the minute it
/// was processed and a small integer naming the consumer (from a `<table>_consumers` table). The
/// primary key is (consumer, message key), or the hashed key alone in [`KeyMode::Hashed`], whose
/// key already covers the consumer. A secondary index on the processed minute serves the purge.
///
/// # The claim
/// A plain `INSERT` in the caller's transaction, whose duplicate-key error (1062) means "seen":
/// InnoDB undoes the failed statement alone and the transaction goes on. Not `INSERT IGNORE`,
/// which would turn every other error of the statement (a value too long, a strict-mode
/// conversion) into a warning and a silent "seen"; not `ON DUPLICATE KEY UPDATE`, whose affected
/// row count means "new" or "seen" depending on the connection's `CLIENT_FOUND_ROWS` flag (on by
/// default in sqlx). A racing consumer inserting the same key waits on the first one's
/// uncommitted row: after its commit it gets the duplicate error, after its rollback it inserts.
///
/// A batch is one multi-row `INSERT` of the keys in sorted order (so that two consumers claiming
/// overlapping batches take their locks in the same order); when it hits a duplicate, the
/// statement is undone whole and the keys are claimed one by one.
///
/// # Isolation: READ COMMITTED
/// Every inbox transaction runs under `READ COMMITTED`, whatever the server's default
/// (`REPEATABLE READ` on InnoDB). Under `REPEATABLE READ` InnoDB takes gap locks on the ranges
/// its locking statements scan: the purge's range `DELETE` would lock the gap before the first
/// row it keeps, and handlers' `UPDATE … WHERE` on non-unique columns lock gaps too, so claims
/// and effects of unrelated messages would wait on each other and deadlock more often. The claim
/// itself needs no snapshot: its correctness rests on the primary key alone. It is also
/// PostgreSQL's default, so a handler behaves alike on both stores. What remains: a duplicate
/// key check takes a shared lock on the existing row, and two transactions inserting and
/// checking the same keys can still deadlock; InnoDB then rolls one back with error 1213, which
/// the consumer retries ([`Recovery::Retry`](inbox_core::Recovery::Retry)).
///
/// # A transaction the server ended
/// InnoDB answers a deadlock by rolling the whole transaction back. A handler that catches that
/// error and goes on must not commit half a message: see [`MySqlTx`], which runs with
/// `autocommit` off and finds out at commit.
///
/// Round-trips per transaction: acquiring the connection (sqlx pings it unless the pool is
/// built with `test_before_acquire(false)`), the opening statements, the claim (with the
/// handler's lock wait timeout after it, see [`InboxStore::bind`]), the handler's
/// statements, the check that the transaction is intact, and `COMMIT`.
#[derive(Debug, Clone)]
pub struct MySqlInbox {
    pool: MySqlPool,
    table: TableName,
    mode: KeyMode,
    /// The consumer this copy claims for ([`InboxStore::bind`]), its id resolved at the first
    /// `begin`.
    consumer: Option<Arc<BoundConsumer>>,
    lock_wait_timeout: Option<Duration>,
    handler_timeout: Option<Duration>,
    /// The session settings sent before each transaction's opening statements: the lock wait
    /// timeout the claim runs under.
    session: String,
    /// The statement the claim sends after its insert, in the same round-trip, to bound the
    /// handler's lock waits; empty when the claim's own bound is as short.
    handler_bound: String,
}

/// The connection's own lock wait timeout, noted in a user variable the first time the store
/// bounds it for a handler, and put back before each claim: a pooled connection keeps the
/// handler's bound from its last transaction, and the pool may have set its own value.
const OWN_LOCK_WAIT: &str = "SET @inbox_own_lock_wait_timeout = \
     COALESCE(@inbox_own_lock_wait_timeout, @@SESSION.innodb_lock_wait_timeout); \
     SET SESSION innodb_lock_wait_timeout = CAST(@inbox_own_lock_wait_timeout AS UNSIGNED); ";

/// Whole seconds, rounded up, at least 1: InnoDB counts seconds.
fn seconds(timeout: Duration) -> u64 {
    (timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0)).max(1)
}

/// `key` as a MySQL hexadecimal literal's digits.
fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

impl MySqlInbox {
    /// The inbox in table `inbox` of the connection's database, keeping IDs as text.
    pub fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            table: TableName::default_inbox(),
            mode: KeyMode::Text,
            consumer: None,
            lock_wait_timeout: None,
            handler_timeout: None,
            session: String::new(),
            handler_bound: String::new(),
        }
    }

    /// Uses another table (see [`TableName`], which refuses names that are not plain SQL
    /// identifiers).
    pub fn with_table(mut self, table: TableName) -> Self {
        self.table = table;
        self
    }

    /// Keeps IDs as `mode` says: [`KeyMode::Text`] in a `varbinary(1024)` column, compared
    /// byte for byte (binary, not `varchar`: a `varchar` collation would make `evt-1` and
    /// `EVT-1`, and with `PAD SPACE` `evt-1 `, the same ID); [`KeyMode::Uuid`] and
    /// [`KeyMode::Hashed`] in a `binary(16)` column, hashed keys being those the PostgreSQL store
    /// computes.
    pub fn with_key_mode(mut self, mode: KeyMode) -> Self {
        self.mode = mode;
        self
    }

    /// Ends a wait for a row lock in the inbox transaction after `timeout`, in whole seconds
    /// rounded up (InnoDB's `innodb_lock_wait_timeout`, set on the store's connections; the
    /// server's default is 50 s). A claim of an ID whose row a peer has inserted but not
    /// committed waits for that peer; with a lock wait timeout the claim fails with error 1205,
    /// a transient error: the rest of the batch goes on and the message is retried. Pair it with
    /// [`Consumer::handler_timeout`](inbox_core::Consumer::handler_timeout).
    pub fn lock_wait_timeout(mut self, timeout: Duration) -> Self {
        self.lock_wait_timeout = Some(timeout);
        self.set_timeouts();
        self
    }

    /// The claim runs under the store's own lock wait timeout (or the connection's, when the
    /// store sets none); the statements after it under the handler's, when that is shorter.
    fn set_timeouts(&mut self) {
        self.session = match (self.lock_wait_timeout, self.handler_timeout) {
            (Some(own), _) => format!("SET SESSION innodb_lock_wait_timeout = {}; ", seconds(own)),
            (None, Some(_)) => OWN_LOCK_WAIT.to_owned(),
            (None, None) => String::new(),
        };
        self.handler_bound = match (self.handler_timeout, self.lock_wait_timeout) {
            (Some(handler), Some(own)) if seconds(handler) >= seconds(own) => String::new(),
            (Some(handler), _) => format!(
                "SET SESSION innodb_lock_wait_timeout = {}",
                seconds(handler)
            ),
            (None, _) => String::new(),
        };
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The inbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// How IDs are kept.
    pub fn key_mode(&self) -> KeyMode {
        self.mode
    }

    /// The small integer standing for `consumer`, created on first use (committed at once, so
    /// a rolled-back message never loses the mapping). A bound store reads it once, at its
    /// first [`begin`](InboxStore::begin), before the transaction opens.
    pub async fn consumer_id(&self, consumer: &str) -> Result<i16> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(db("registering the consumer name"))?;
        self.register(&mut conn, consumer).await
    }

    /// The id of `consumer` seen from `conn`, inserted when missing. Looks up first: a failed
    /// insert would use up an `AUTO_INCREMENT` value of the `smallint` all the same.
    async fn register(&self, conn: &mut MySqlConnection, consumer: &str) -> Result<i16> {
        if let Some(id) = self.lookup(conn, consumer).await? {
            return Ok(id);
        }
        let consumers = self.table.consumers();
        let inserted = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {consumers} (name) VALUES (?)"
        )))
        .bind(consumer)
        .execute(&mut *conn)
        .await;
        match inserted {
            Ok(done) => {
                return i16::try_from(done.last_insert_id()).map_err(|_| Error::TooManyConsumers {
                    name: consumer.to_owned(),
                    id: done.last_insert_id(),
                    table: consumers.clone(),
                });
            }
            Err(e) if number(&e) == Some(DUPLICATE_KEY) => {}
            Err(e) => return Err(db("registering the consumer name")(e)),
        }
        // Another process registered it between the two statements.
        match self.lookup(conn, consumer).await? {
            Some(id) => Ok(id),
            None => Err(db("reading the consumer id")(sqlx::Error::RowNotFound)),
        }
    }

    /// The id of `consumer` seen from `conn`, if it is registered.
    async fn lookup(&self, conn: &mut MySqlConnection, consumer: &str) -> Result<Option<i16>> {
        let consumers = self.table.consumers();
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {consumers} WHERE name = ?"
        )))
        .bind(consumer)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("reading the consumer id"))
    }

    /// The key of each ID; an ID this store cannot keep is refused ([`RefusedId`]): a non-UUID
    /// for [`KeyMode::Uuid`], a text key longer than the column for [`KeyMode::Text`]. (Today
    /// the core's own limit, `MessageId::MAX_LEN`, is the column's; the store keeps its own, in
    /// case the core's grows.)
    fn keys(&self, consumer: &str, ids: &[MessageId]) -> Result<Vec<Vec<u8>>, StoreError> {
        claim_keys(ids, |id| match self.mode {
            KeyMode::Text => text_key_fits(id.as_str()).map(|()| id.as_str().into()),
            KeyMode::Uuid => uuid_key(id).map(|u| u.as_bytes().to_vec()),
            KeyMode::Hashed => Ok(hashed_key(consumer, id.as_str()).to_vec()),
        })
    }

    /// Inserts `keys` in one statement: `Ok(true)` when all were new, `Ok(false)` when one was
    /// there already (and the statement inserted nothing). A non-empty `then` is sent after the
    /// insert in the same round-trip, and runs only when the insert succeeded.
    async fn insert(
        &self,
        tx: &mut MySqlTx,
        consumer_id: i16,
        keys: &[&Vec<u8>],
        then: &str,
    ) -> Result<bool, StoreError> {
        let t = &self.table;
        let insert = |values: String| {
            format!("INSERT INTO {t} (message_id, consumer_id, processed_minute) VALUES {values}")
        };
        let minute = "FLOOR(UNIX_TIMESTAMP() / 60)";
        let done = if then.is_empty() {
            let values = vec![format!("(?, ?, {minute})"); keys.len()].join(", ");
            let mut query = sqlx::query(AssertSqlSafe(insert(values)));
            for key in keys {
                query = query.bind(key.as_slice()).bind(consumer_id);
            }
            query.execute(&mut **tx).await.map(|_| ())
        } else {
            // Two statements in one round-trip take the text protocol, without parameters: the
            // keys go in as hexadecimal literals, which hold any bytes.
            let values: Vec<String> = keys
                .iter()
                .map(|key| format!("(X'{}', {consumer_id}, {minute})", hex(key)))
                .collect();
            let sql = format!("{}; {then}", insert(values.join(", ")));
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut **tx)
                .await
                .map(|_| ())
        };
        match done {
            Ok(_) => Ok(true),
            Err(e) if number(&e) == Some(DUPLICATE_KEY) => Ok(false),
            Err(e) => Err(store_err("claiming the message ID")(e)),
        }
    }
}

/// Refuses a text key longer than the key column: never cut short into another ID's key.
fn text_key_fits(id: &str) -> Result<(), InvalidId> {
    if id.len() <= TEXT_KEY_MAX {
        return Ok(());
    }
    Err(InvalidId::RefusedByStore(format!(
        "the message ID is {} bytes long, and this inbox keeps text keys of at most {TEXT_KEY_MAX} \
         bytes (a longer one would be cut short, and two IDs sharing the first {TEXT_KEY_MAX} \
         bytes would be one); use KeyMode::Hashed, which keeps 16 bytes of any ID",
        id.len()
    )))
}

impl InboxStore for MySqlInbox {
    type Tx = MySqlTx;

    /// Bound to `binding.consumer`; its id is read (or registered, committed at once) at the
    /// first `begin`, on the connection before its transaction opens, never inside one.
    ///
    /// `binding.handler_timeout` bounds every row lock wait of the inbox transaction after the
    /// claim as [`lock_wait_timeout`](Self::lock_wait_timeout) does (the shorter of the two
    /// counts, in whole seconds). A handler cut off by the consumer's handler timeout is only
    /// dropped; the rollback after it waits for the handler's statement, which a lock wait no
    /// longer holds longer than this. The claim itself waits under the store's own lock wait
    /// timeout (or the connection's): waiting on a peer's uncommitted claim of the same ID is no
    /// handler's doing, and cut off it would count against the message while the peer goes on.
    /// The claim's insert is followed by `SET SESSION innodb_lock_wait_timeout` in the same
    /// round-trip.
    fn bind(&self, binding: &ConsumerBinding) -> Self {
        let mut bound = self.clone();
        bound.consumer = Some(Arc::new(BoundConsumer::new(binding.consumer.as_str())));
        bound.handler_timeout = binding.handler_timeout;
        bound.set_timeouts();
        bound
    }

    async fn begin(&self) -> Result<MySqlTx, StoreError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(store_err("opening a transaction"))?;
        if let Some(consumer) = self.consumer.as_deref() {
            if consumer.id().is_none() {
                consumer.set_id(self.register(&mut conn, consumer.name()).await?);
            }
        }
        // Wrapped first: a failure below closes the connection instead of pooling it with
        // `autocommit` off.
        let mut tx = MySqlTx::new(conn);
        sqlx::raw_sql(AssertSqlSafe(begin_sql(&self.session)))
            .execute(&mut *tx)
            .await
            .map_err(store_err("opening a transaction"))?;
        Ok(tx)
    }

    async fn claim(&self, tx: &mut MySqlTx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let (consumer, consumer_id) = BoundConsumer::for_claim(self.consumer.as_deref())?;
        let keys = self.keys(consumer, ids)?;
        // Two IDs can make one key (a UUID in capitals and in lower case): each key once, in
        // order, so that racing batches lock in the same order.
        let mut distinct: Vec<&Vec<u8>> = keys.iter().collect::<HashSet<_>>().into_iter().collect();
        distinct.sort();
        let mut fresh: HashSet<&Vec<u8>> = HashSet::new();
        // The claim waits on a peer's uncommitted row under the store's own lock wait timeout;
        // the handler's bound is set after it, in the same round-trip. A duplicate undoes the
        // insert and skips the bound: the keys are then claimed one by one, and the bound set
        // after them if a handler is to run.
        let bound = self.handler_bound.as_str();
        if self.insert(tx, consumer_id, &distinct, bound).await? {
            fresh.extend(distinct);
        } else if distinct.len() > 1 {
            for key in distinct {
                if self.insert(tx, consumer_id, &[key], "").await? {
                    fresh.insert(key);
                }
            }
            if !fresh.is_empty() && !bound.is_empty() {
                sqlx::raw_sql(AssertSqlSafe(bound))
                    .execute(&mut **tx)
                    .await
                    .map_err(store_err("bounding the handler's lock waits"))?;
            }
        }
        Ok(first_claims(&keys, fresh))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_key_longer_than_the_column_is_refused_with_the_fix() {
        assert!(text_key_fits(&"x".repeat(TEXT_KEY_MAX)).is_ok());
        let err = text_key_fits(&"x".repeat(1100)).expect_err("too long");
        let text = err.to_string();
        assert!(text.contains("1100 bytes long"), "{text}");
        assert!(text.contains("at most 1024 bytes"), "{text}");
        assert!(text.contains("KeyMode::Hashed"), "{text}");
    }
}
