//! [`PgInbox`]: the inbox table and the claim, in the caller's transaction.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::sql::{claim_keys, first_claims, hashed_key, uuid_key, BoundConsumer};
use inbox_core::{ConsumerBinding, InboxStore, MessageId, StoreError};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};
use tokio::sync::OnceCell;
use uuid::Uuid;

use crate::error::{db, store_err};
use crate::migration::Migration;
use crate::partition::{hashed_key_with_time, is_partitioned};
use crate::pooling;
use crate::{KeyMode, Partitions, PgTx, Result, TableName};

/// The transactional inbox on PostgreSQL.
///
/// One table (default `inbox`) holds a row per applied message: the message key, the minute it
/// was processed and a small integer naming the consumer (from a `<table>_consumers` table), so
/// the consumer name costs 2 bytes per row instead of its text. The primary key is
/// (consumer, message key), or the hashed key alone in [`KeyMode::Hashed`], whose key already
/// covers the consumer. A BRIN index on the processed minute serves retention at a few bytes per
/// thousand rows.
///
/// The claim is `INSERT … ON CONFLICT DO NOTHING` in the caller's transaction: one statement for
/// one ID, one statement with `unnest` for a batch. A racing consumer inserting the same key
/// waits on the first one's uncommitted row and then finds the conflict: the primary key
/// serialises them.
///
/// Round-trips per transaction: `BEGIN` (with the timeouts), the claim (which also sets the
/// handler's statement timeout, see [`InboxStore::bind`]), the handler's
/// statements, a check that the transaction was not aborted by a statement whose error the
/// handler swallowed, and `COMMIT`.
/// sqlx's pool also pings each connection it hands out unless the pool is built with
/// `PgPoolOptions::test_before_acquire(false)`, which the inbox does not need: a dead connection
/// fails the transaction's first statement, and the consumer retries on another.
#[derive(Debug, Clone)]
pub struct PgInbox {
    pool: PgPool,
    table: TableName,
    mode: KeyMode,
    /// The consumer this copy claims for ([`InboxStore::bind`]), its id resolved at the first
    /// `begin`.
    consumer: Option<Arc<BoundConsumer>>,
    lock_timeout: Option<Duration>,
    statement_timeout: Option<Duration>,
    /// The consumer's handler timeout, which bounds each statement after the claim too.
    handler_timeout: Option<Duration>,
    /// The layout `migrate` creates and the purge keeps; `None`: plain.
    pub(crate) partitions: Option<Partitions>,
    /// The table's layout as `migrate` or the first hashed claim found it (0 before, then 1 +
    /// whether partitioned), shared by the clones: hashed keys follow the table, not the
    /// configuration.
    layout: Arc<AtomicU8>,
    /// Whether a transaction pooler stands in front of the database, found once for the store
    /// and its clones ([`pooling::check`]).
    pooled: Arc<OnceCell<bool>>,
    /// The consumer ids read so far, by name: a name keeps its id.
    consumer_ids: Arc<Mutex<HashMap<String, i16>>>,
}

enum Keys {
    Text(Vec<String>),
    Uuid(Vec<Uuid>),
}

impl PgInbox {
    /// The inbox in table `inbox` of the connection's `search_path`, keeping IDs as text.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            table: TableName::default_name("inbox"),
            mode: KeyMode::Text,
            consumer: None,
            lock_timeout: None,
            statement_timeout: None,
            handler_timeout: None,
            partitions: None,
            layout: Arc::default(),
            pooled: Arc::default(),
            consumer_ids: Arc::default(),
        }
    }

    /// Uses another table (see [`TableName`], which refuses names that are not plain SQL
    /// identifiers).
    pub fn with_table(mut self, table: TableName) -> Self {
        self.table = table;
        self
    }

    /// Keeps IDs as `mode` says: [`KeyMode::Text`] in a `text` column, [`KeyMode::Uuid`] and
    /// [`KeyMode::Hashed`] in a `uuid` column. On the partitioned layout a hashed key of a
    /// UUIDv7 ID starts with the ID's time instead (see [`Partitions`]).
    pub fn with_key_mode(mut self, mode: KeyMode) -> Self {
        self.mode = mode;
        self
    }

    /// Ends a wait for a row lock in the inbox transaction after `timeout` (PostgreSQL's
    /// `lock_timeout`, for this transaction only). A claim of an ID whose row a peer has
    /// inserted but not committed waits for that peer; if the peer hangs (a handler stuck on a
    /// call) the claim would wait for ever and the broker would move the message on to the next
    /// consumer, which would wait too. With a lock timeout the claim fails as a transient error:
    /// the rest of the batch goes on and the message is retried. Pair it with
    /// [`Consumer::handler_timeout`](inbox_core::Consumer::handler_timeout) set below it, so a
    /// hung handler lets go of its rows first.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = Some(timeout);
        self
    }

    /// Cancels any one statement of the inbox transaction (the claim, a handler's query) that
    /// runs longer than `timeout` (PostgreSQL's `statement_timeout`, for this transaction only):
    /// it fails as a transient error and the message is retried.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = Some(timeout);
        self
    }

    /// `BEGIN` with the `SET LOCAL`s of the store's own timeouts, under which the claim runs,
    /// sent as one round-trip; `None`: `BEGIN`.
    fn begin_statement(&self) -> Option<String> {
        let settings: Vec<String> = [
            ("lock_timeout", self.lock_timeout),
            ("statement_timeout", self.statement_timeout),
        ]
        .into_iter()
        .filter_map(|(name, timeout)| Some(format!("SET LOCAL {name} = {}", millis(timeout?))))
        .collect();
        (!settings.is_empty()).then(|| format!("BEGIN; {}", settings.join("; ")))
    }

    /// What the claim statement adds, `, set_config('statement_timeout', …, true)`, for a handler
    /// timeout shorter than the store's statement timeout (else nothing). Evaluated inside the claim, it bounds the statements
    /// after it: PostgreSQL arms a statement's timer when the statement starts.
    fn handler_bound(&self) -> String {
        match (self.handler_timeout, self.statement_timeout) {
            (Some(handler), Some(store)) if handler >= store => String::new(),
            (Some(handler), _) => format!(
                ", set_config('statement_timeout', '{}', true)",
                millis(handler)
            ),
            (None, _) => String::new(),
        }
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &PgPool {
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

    /// Creates the inbox tables and indexes if missing; safe to run from many instances at once
    /// (they serialise on an advisory lock). Fails when the table exists with another key mode.
    ///
    /// With [`partitioned`](Self::partitioned), a missing table is created partitioned, with
    /// its default partition; the partitions of a partitioned table (whichever created it) are
    /// then created up to the configured number ahead. A table that exists keeps its layout
    /// (a warning says when it is not the configured one), and claims follow it.
    ///
    /// [`migration_sql`](Self::migration_sql) gives the same statements as text, for a schema
    /// applied by your own migration tool.
    pub async fn migrate(&self) -> Result<()> {
        let t = &self.table;
        let lock = format!("inbox migrate {t}");
        let mut migration = Migration::begin(&self.pool, lock, "creating the inbox tables").await?;
        // The builders `migration_sql` prints too (`migration.rs`).
        let [table, _] =
            self.table_statements(&t.to_string(), t.table(), self.partitions.is_some());
        migration.run([self.consumers_table_sql(), table]).await?;
        migration.check_key_type(t, self.mode).await?;
        let partitioned = is_partitioned(migration.tx(), t).await?;
        let [_, index] = self.table_statements(&t.to_string(), t.table(), partitioned);
        // `CREATE INDEX IF NOT EXISTS` locks the table (and on a partitioned one every partition)
        // in SHARE mode before it finds the index: a partitioned table's catalog is asked first.
        let (has_index, has_default): (bool, bool) = if partitioned {
            sqlx::query_as(
                "SELECT to_regclass($1) IS NOT NULL, (SELECT partdefid <> 0
                 FROM pg_partitioned_table WHERE partrelid = $2::regclass)",
            )
            .bind(t.sibling("processed"))
            .bind(t.to_string())
            .fetch_one(migration.tx())
            .await
            .map_err(db("looking for the BRIN index and the default partition"))?
        } else {
            (false, true)
        };
        let mut statements = Vec::new();
        if !has_index {
            statements.push(index);
        }
        if !has_default {
            statements.push(self.default_partition_sql());
        }
        migration.run(statements).await?;
        migration.commit().await?;
        self.layout
            .store(1 + u8::from(partitioned), Ordering::Relaxed);
        if partitioned != self.partitions.is_some() {
            tracing::warn!(
                table = %t,
                partitioned,
                "the inbox table's layout is not the configured one; it keeps its layout (convert a plain table with `inbox-admin partition`)"
            );
        }
        if partitioned {
            let mut conn = self
                .pool
                .acquire()
                .await
                .map_err(db("creating partitions"))?;
            self.create_ahead(&mut conn).await?;
        }
        Ok(())
    }

    /// Whether hashed keys take the partitioned layout's form: whether the table is
    /// partitioned, read from the catalog in `tx` the first time (one query per store and its
    /// clones) unless `migrate` saw it. Never the configured layout: a table made by another
    /// tool, or before a release that changed `.partitioned()`, keys its rows as it is laid out,
    /// and a key of the other form would make every redelivery a new message.
    async fn keys_with_time(&self, tx: &mut PgTx) -> Result<bool, StoreError> {
        match self.layout.load(Ordering::Relaxed) {
            0 => {}
            known => return Ok(known == 2),
        }
        let partitioned = is_partitioned(tx, &self.table).await?;
        self.layout
            .store(1 + u8::from(partitioned), Ordering::Relaxed);
        Ok(partitioned)
    }

    /// The small integer standing for `consumer`, created on first use (committed at once, so
    /// a rolled-back message never loses the mapping), and remembered by the store and its
    /// clones. A bound store reads it once, at its first [`begin`](InboxStore::begin), before
    /// the transaction opens.
    ///
    /// The first one also checks that the pool is fit for a transaction pooler in front of the
    /// database, if there is one ([`Error::StatementCacheBehindPooler`](crate::Error)).
    pub async fn consumer_id(&self, consumer: &str) -> Result<i16> {
        if let Some(id) = self.known_ids().get(consumer) {
            return Ok(*id);
        }
        self.pooled().await?;
        let context = "registering the consumer name";
        let mut tx = self.pool.begin().await.map_err(db(context))?;
        let id = self.register(&mut tx, consumer).await?;
        tx.commit().await.map_err(db(context))?;
        self.known_ids().insert(consumer.to_owned(), id);
        Ok(id)
    }

    fn known_ids(&self) -> std::sync::MutexGuard<'_, HashMap<String, i16>> {
        self.consumer_ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a transaction pooler stands in front of the database ([`pooling::check`], once).
    pub(crate) async fn pooled(&self) -> Result<bool> {
        self.pooled
            .get_or_try_init(|| pooling::check(&self.pool))
            .await
            .copied()
    }

    /// A connection for one statement outside any transaction of the caller's: the pool's,
    /// or behind a transaction pooler a transaction of its own ([`pooling::Single`]).
    pub(crate) async fn single(&self, context: &'static str) -> Result<pooling::Single> {
        let pooled = self.pooled().await?;
        pooling::Single::open(&self.pool, pooled, context).await
    }

    /// The id of `consumer` seen from `conn`, inserted when missing.
    ///
    /// Looks up first: `INSERT … ON CONFLICT DO NOTHING` draws an identity value even when the
    /// name exists, and the `smallint` sequence would run out after 32,767 process starts.
    async fn register(&self, conn: &mut PgConnection, consumer: &str) -> Result<i16> {
        if let Some(id) = self.lookup(conn, consumer).await? {
            return Ok(id);
        }
        let consumers = self.table.sibling("consumers");
        let inserted: Option<i16> = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {consumers} (name) VALUES ($1) ON CONFLICT (name) DO NOTHING RETURNING id"
        )))
        .bind(consumer)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("registering the consumer name"))?;
        if let Some(id) = inserted {
            return Ok(id);
        }
        // Another process registered it between the two statements.
        match self.lookup(conn, consumer).await? {
            Some(id) => Ok(id),
            None => Err(db("reading the consumer id")(sqlx::Error::RowNotFound)),
        }
    }

    /// The id of `consumer` seen from `conn`, if it is registered.
    async fn lookup(&self, conn: &mut PgConnection, consumer: &str) -> Result<Option<i16>> {
        let consumers = self.table.sibling("consumers");
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {consumers} WHERE name = $1"
        )))
        .bind(consumer)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("reading the consumer id"))
    }

    /// The key of each ID; a non-UUID for [`KeyMode::Uuid`] is refused
    /// ([`RefusedId`](inbox_core::RefusedId)). `with_time`: hashed keys in the partitioned
    /// layout's form.
    fn keys(&self, consumer: &str, ids: &[MessageId], with_time: bool) -> Result<Keys, StoreError> {
        let hashed = |id: &MessageId| {
            if with_time {
                hashed_key_with_time(consumer, id.as_str())
            } else {
                Uuid::from_bytes(hashed_key(consumer, id.as_str()))
            }
        };
        Ok(match self.mode {
            KeyMode::Text => Keys::Text(ids.iter().map(|id| id.as_str().to_owned()).collect()),
            KeyMode::Uuid => Keys::Uuid(claim_keys(ids, uuid_key)?),
            KeyMode::Hashed => Keys::Uuid(ids.iter().map(hashed).collect()),
        })
    }
}

/// A timeout in whole milliseconds for PostgreSQL, at least 1: 0 would mean no timeout at all.
fn millis(timeout: Duration) -> u128 {
    timeout.as_millis().max(1)
}

impl InboxStore for PgInbox {
    type Tx = PgTx;

    /// Bound to `binding.consumer`; its id is read (or registered) at the first `begin`, on a
    /// connection of its own before the transaction opens, never inside one.
    ///
    /// `binding.handler_timeout` bounds every statement of the inbox transaction after the claim
    /// as [`statement_timeout`](Self::statement_timeout) does (the shorter of the two counts). A
    /// handler cut off by the consumer's handler timeout is only dropped: sqlx sends no cancel
    /// request, and the rollback after it waits for the handler's statement to end. A statement
    /// waiting on a row lock another session holds would keep the consumer waiting, with its own
    /// locks held, until that lock is released; the server now cancels it after the handler
    /// timeout at the latest. The claim itself runs under the store's own
    /// [`lock_timeout`](Self::lock_timeout) and [`statement_timeout`](Self::statement_timeout)
    /// only: waiting on a peer's uncommitted claim of the same ID is no handler's doing, and cut
    /// off it would count against the message while the peer goes on. The claim statement sets
    /// the handler's bound for the statements after it (`set_config('statement_timeout', …,
    /// true)`), in its own round-trip.
    fn bind(&self, binding: &ConsumerBinding) -> Self {
        let mut bound = self.clone();
        bound.consumer = Some(Arc::new(BoundConsumer::new(binding.consumer.as_str())));
        bound.handler_timeout = binding.handler_timeout;
        bound
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        if let Some(consumer) = self.consumer.as_deref() {
            if consumer.id().is_none() {
                consumer.set_id(self.consumer_id(consumer.name()).await?);
            }
        }
        let begun = match self.begin_statement() {
            // One round-trip: the simple query protocol runs the statements together.
            Some(statement) => self.pool.begin_with(AssertSqlSafe(statement)).await,
            None => self.pool.begin().await,
        };
        begun
            .map(PgTx::from)
            .map_err(store_err("opening a transaction"))
    }

    async fn claim(&self, tx: &mut PgTx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        let (consumer, consumer_id) = BoundConsumer::for_claim(self.consumer.as_deref())?;
        let t = &self.table;
        let with_time = self.mode == KeyMode::Hashed && self.keys_with_time(tx).await?;
        let keys = self.keys(consumer, ids, with_time)?;
        // One statement: the insert, then (in the same round-trip) the handler's statement
        // timeout for what follows, so the claim waits on a peer's row under the store's own
        // timeouts only.
        let source = if ids.len() == 1 {
            "VALUES ($1, $2)".to_owned()
        } else {
            let array = match keys {
                Keys::Text(_) => "text[]",
                Keys::Uuid(_) => "uuid[]",
            };
            format!("SELECT unnest($1::{array}), $2")
        };
        let sql = format!(
            "WITH claimed AS (
                 INSERT INTO {t} (message_id, consumer_id) {source}
                 ON CONFLICT DO NOTHING RETURNING message_id)
             SELECT array(SELECT message_id FROM claimed){bound}",
            bound = self.handler_bound()
        );
        match keys {
            Keys::Text(keys) => claim_keys_as(tx, sql, keys, consumer_id).await,
            Keys::Uuid(keys) => claim_keys_as(tx, sql, keys, consumer_id).await,
        }
    }
}

/// Runs the claim `sql` for `keys` (one bound as a value, several as an array); the flags of
/// [`first_claims`].
async fn claim_keys_as<K>(
    tx: &mut PgTx,
    sql: String,
    keys: Vec<K>,
    consumer_id: i16,
) -> Result<Vec<bool>, StoreError>
where
    K: Eq + std::hash::Hash + Send + Unpin + sqlx::Type<Postgres> + sqlx::postgres::PgHasArrayType,
    K: for<'q> sqlx::Encode<'q, Postgres> + for<'r> sqlx::Decode<'r, Postgres>,
{
    let query = sqlx::query_scalar::<_, Vec<K>>(AssertSqlSafe(sql));
    let query = match keys.as_slice() {
        [one] => query.bind(one),
        _ => query.bind(&keys),
    };
    let fresh = query
        .bind(consumer_id)
        .fetch_one(&mut **tx)
        .await
        .map_err(store_err("claiming message IDs"))?;
    Ok(first_claims(&keys, fresh.into_iter().collect()))
}
