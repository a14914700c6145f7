//! One database kind under the broker suite ([`TestStore`]), and PostgreSQL's: a throw-away
//! schema per test with the wallet beside the inbox, and the settings tests share.
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use std::future::Future;
use std::time::Duration;

use inbox_core::{InboxStore, MessageId};
use inbox_postgres::{KeyMode, Partitions, PgInbox, PgTx, TableName};

use crate::wallet::{self, Credit, CreditEvent, Summary};
use crate::FaultProxy;

/// One database kind under the suites, as sqlx's `TestSupport`: a database (or schema) per
/// test holding a migrated inbox and the wallet (accounts, ledger) beside it, so that a credit
/// and its claim commit in one transaction, and the wallet's SQL in this database's dialect.
/// [`suite!`](crate::suite) takes it as its second argument, [`store_suite!`](crate::store_suite)
/// a fresh one per scenario: [`TestDb`] (PostgreSQL, the default) or `store::MySqlDb` (feature
/// `mysql`); a store of your own over one of them implements it by delegating the wallet.
pub trait TestStore: Clone + Send + Sync + 'static {
    /// The inbox store.
    type Inbox: InboxStore + Clone;

    /// A fresh database (or schema) no other test uses, with the wallet's tables and a migrated
    /// inbox.
    fn create() -> impl Future<Output = Self> + Send;

    /// The database [`name`](TestStore::name) names, from another process: the kill
    /// scenario's consumer runs in a child process.
    fn attach(name: &str) -> impl Future<Output = Self> + Send;

    /// What [`attach`](TestStore::attach) finds this database by.
    fn name(&self) -> &str;

    /// The migrated inbox.
    fn inbox(&self) -> Self::Inbox;

    /// Rows in the inbox table.
    fn inbox_rows(&self) -> impl Future<Output = i64> + Send;

    /// Whether the outbox relay's scenarios run on this store: the outbox and its relay are
    /// PostgreSQL's. Default: `false`, and they are skipped with the reason printed.
    fn has_outbox() -> bool {
        false
    }

    /// Drops the database and everything in it.
    fn remove(self) -> impl Future<Output = ()> + Send;

    /// Adds `event`'s amount to its account and writes its ledger row, in `tx`. No unique key
    /// on the ledger's event ID: a duplicate credit shows up as a second row.
    fn apply(
        tx: &mut StoreTx<Self>,
        id: &MessageId,
        event: &CreditEvent,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Notes that `id` is being handled, outside any transaction: `true` the first time across
    /// all processes, `false` afterwards. Stalling handlers use it to stall once per event.
    fn first_handling(
        &self,
        id: &MessageId,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Reads the ledger.
    fn summary(&self) -> impl Future<Output = Result<Summary, sqlx::Error>> + Send;

    /// Every account's balance, by id.
    fn balances(&self) -> impl Future<Output = Result<Vec<(i64, i64)>, sqlx::Error>> + Send;

    /// Stalls started: the events [`first_handling`](TestStore::first_handling) said `true` to.
    fn stalls(&self) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// Ledger rows of `id`: how many of its credits committed.
    fn applied(&self, id: &MessageId) -> impl Future<Output = u64> + Send;

    /// Runs a statement that fails inside `tx` and ignores the error, as a handler that
    /// swallowed a database error would: the transaction cannot commit what it did.
    fn fail_and_swallow(&self, tx: &mut StoreTx<Self>) -> impl Future<Output = ()> + Send;

    /// An ID the inbox's claim refuses ([`RefusedId`](inbox_core::RefusedId)), if it refuses
    /// any (a key column of UUIDs refuses other text). Default: none, and the store suite's
    /// scenario of a refused ID is skipped.
    fn refused_id(&self) -> Option<MessageId> {
        None
    }

    /// Makes every claim so far older than the inbox keeps claims, and purges: how many claims
    /// were removed. Default: `None`, the store forgets nothing, and that scenario is skipped.
    fn age_and_purge(&self) -> impl Future<Output = Option<u64>> + Send {
        async { None }
    }

    /// The inbox with its connections through a [`FaultProxy`] the store suite refuses and
    /// cuts. Default: `None`, no proxy can stand in front of it, and those scenarios are
    /// skipped.
    fn proxied(&self) -> impl Future<Output = Option<(Self::Inbox, FaultProxy)>> + Send {
        async { None }
    }

    /// The wallet's credit handler, writing through this database's inbox transactions.
    fn credit(&self) -> Credit<Self> {
        Credit::new(self.clone())
    }
}

/// The inbox transaction of `D`, which a credit is written in.
pub type StoreTx<D> = <<D as TestStore>::Inbox as InboxStore>::Tx;

impl TestStore for TestDb {
    type Inbox = PgInbox;
    same_in_both_dialects!(
        param: "$1",
        values: "VALUES ($1, $2, $3)",
        upsert: "INSERT INTO accounts (id, balance) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        integer: "bigint"
    );

    async fn create() -> Self {
        Self::new().await
    }

    async fn attach(name: &str) -> Self {
        Self::attach(name).await
    }

    fn name(&self) -> &str {
        &self.schema
    }

    fn inbox(&self) -> PgInbox {
        self.inbox()
    }

    fn has_outbox() -> bool {
        true
    }

    async fn remove(self) {
        self.drop().await;
    }

    async fn fail_and_swallow(&self, tx: &mut PgTx) {
        let failed = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
        assert!(failed.is_err(), "division by zero fails");
    }

    async fn proxied(&self) -> Option<(PgInbox, FaultProxy)> {
        let options: PgConnectOptions = database_url().parse().expect("DATABASE_URL parses");
        let proxy = FaultProxy::in_front_of(options.get_host(), options.get_port()).await;
        let options = options
            .host("127.0.0.1")
            .port(proxy.addr().port())
            .options([("search_path", self.schema.as_str())]);
        Some((
            self.inbox_on(proxied_pool(options), "inbox", self.keys),
            proxy,
        ))
    }
}

/// The [`TestStore`] methods whose SQL PostgreSQL and MySQL share, on `self.pool` (and
/// `self.keys`, the inbox's key mode), given in the dialect's words: its first bind parameter,
/// a `VALUES` of three, the upsert adding the second parameter to the first's balance, and the
/// 64-bit integer type of a `CAST`.
macro_rules! same_in_both_dialects {
    (param: $p:literal, values: $values:literal, upsert: $upsert:literal, integer: $int:literal) => {
        async fn apply(
            tx: &mut crate::StoreTx<Self>,
            id: &MessageId,
            event: &CreditEvent,
        ) -> Result<(), sqlx::Error> {
            let (account, amount) = (event.account_id, event.amount);
            let upsert = sqlx::query($upsert).bind(account).bind(amount);
            upsert.execute(&mut **tx).await?;
            let ledger = concat!(
                "INSERT INTO ledger (event_id, account_id, amount) ",
                $values
            );
            let row = sqlx::query(ledger).bind(id.as_str()).bind(account);
            row.bind(amount).execute(&mut **tx).await?;
            Ok(())
        }

        async fn first_handling(&self, id: &MessageId) -> Result<bool, sqlx::Error> {
            let note = concat!("INSERT INTO wallet_stalls (event_id) VALUES (", $p, ")");
            match sqlx::query(note)
                .bind(id.as_str())
                .execute(&self.pool)
                .await
            {
                Ok(_) => Ok(true),
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
                Err(e) => Err(e),
            }
        }

        async fn summary(&self) -> Result<crate::wallet::Summary, sqlx::Error> {
            let (ledger_rows, distinct_events): (i64, i64) =
                sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM ledger")
                    .fetch_one(&self.pool)
                    .await?;
            let (mismatched, total_balance): (i64, i64) = sqlx::query_as(concat!(
                "SELECT CAST(COALESCE(sum(CASE WHEN a.balance <> COALESCE(l.total, 0) ",
                "THEN 1 ELSE 0 END), 0) AS ",
                $int,
                "), ",
                "CAST(COALESCE(sum(a.balance), 0) AS ",
                $int,
                ") FROM accounts a ",
                "LEFT JOIN (SELECT account_id, sum(amount) AS total FROM ledger ",
                "GROUP BY account_id) l ON l.account_id = a.id"
            ))
            .fetch_one(&self.pool)
            .await?;
            Ok(crate::wallet::Summary {
                ledger_rows,
                distinct_events,
                balances_exact: mismatched == 0,
                total_balance,
            })
        }

        async fn inbox_rows(&self) -> i64 {
            sqlx::query_scalar("SELECT count(*) FROM inbox")
                .fetch_one(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("cannot count inbox rows: {e}"))
        }

        async fn balances(&self) -> Result<Vec<(i64, i64)>, sqlx::Error> {
            sqlx::query_as("SELECT id, balance FROM accounts ORDER BY id")
                .fetch_all(&self.pool)
                .await
        }

        async fn stalls(&self) -> Result<i64, sqlx::Error> {
            sqlx::query_scalar("SELECT count(*) FROM wallet_stalls")
                .fetch_one(&self.pool)
                .await
        }

        async fn applied(&self, id: &MessageId) -> u64 {
            let n: i64 =
                sqlx::query_scalar(concat!("SELECT count(*) FROM ledger WHERE event_id = ", $p))
                    .bind(id.as_str())
                    .fetch_one(&self.pool)
                    .await
                    .expect("count ledger rows");
            u64::try_from(n).unwrap_or_default()
        }

        fn refused_id(&self) -> Option<MessageId> {
            (self.keys == KeyMode::Uuid).then(|| MessageId::new("not-a-uuid").expect("an ID"))
        }

        async fn age_and_purge(&self) -> Option<u64> {
            let minutes = i32::try_from(2 * KEPT.as_secs() / 60).expect("minutes");
            let age = concat!(
                "UPDATE inbox SET processed_minute = processed_minute - ",
                $p
            );
            sqlx::query(age)
                .bind(minutes)
                .execute(&self.pool)
                .await
                .expect("age the claims");
            let report = TestStore::inbox(self)
                .purge(KEPT, 1000)
                .await
                .expect("purge");
            Some(report.deleted())
        }
    };
}
#[cfg_attr(not(feature = "mysql"), allow(unused_imports))]
pub(crate) use same_in_both_dialects;

/// Connections through a proxy that [`TestStore::proxied`] refuses and cuts: two at most, no
/// ping per acquire, and a short acquire timeout, so that a refused connection is an error the
/// consumer sees, not a wait.
pub(crate) fn proxied_pool<DB: sqlx::Database>(
    options: <DB::Connection as sqlx::Connection>::Options,
) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .test_before_acquire(false)
        .connect_lazy_with(options)
}

/// How long the store suite's purge keeps claims; [`TestStore::age_and_purge`] ages them twice
/// as much.
pub(crate) const KEPT: Duration = Duration::from_secs(14 * 24 * 3600);

/// The database tests use: `DATABASE_URL`, or the local default the services command sets up.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/inbox".to_owned())
}

/// Runs `statements` on one connection to `url`.
///
/// # Panics
/// When the server cannot be reached or a statement fails.
async fn admin(url: &str, statements: &[String]) {
    let admin = pool_at(url, |o| o).await;
    for statement in statements {
        sqlx::raw_sql(AssertSqlSafe(statement.clone()))
            .execute(&admin)
            .await
            .unwrap_or_else(|e| panic!("cannot set up the test database ({statement}): {e}"));
    }
    admin.close().await;
}

/// `url` with its database replaced by `database`.
fn in_database(url: &str, database: &str) -> String {
    let (server, rest) = url.rsplit_once('/').unwrap_or((url, ""));
    match rest.split_once('?') {
        Some((_, query)) => format!("{server}/{database}?{query}"),
        None => format!("{server}/{database}"),
    }
}

/// Connections to `url`, `options` applied.
///
/// # Panics
/// When the server cannot be reached.
async fn pool_at(url: &str, options: impl FnOnce(PgConnectOptions) -> PgConnectOptions) -> PgPool {
    let parsed: PgConnectOptions = url.parse().unwrap_or_else(|e| {
        panic!(
            "database URL {} does not parse: {e}",
            inbox_core::redact_url(url)
        )
    });
    // No ping per acquire (a round-trip per transaction): a dead connection fails the
    // transaction's first statement, and the consumer retries on another.
    PgPoolOptions::new()
        .max_connections(8)
        .test_before_acquire(false)
        .connect_with(options(parsed))
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {}: {e}; run `cargo xtask services` or set DATABASE_URL", inbox_core::redact_url(url)))
}

/// Whether the tests' inboxes take the partitioned layout: `INBOX_TEST_LAYOUT=partitioned` runs
/// the store's suites on it (daily partitions and a default one), `plain` or unset on the plain
/// table.
///
/// # Panics
/// On another value.
pub fn partitioned_layout() -> bool {
    match std::env::var("INBOX_TEST_LAYOUT").as_deref() {
        Ok("partitioned") => true,
        Ok("plain" | "") | Err(_) => false,
        Ok(other) => panic!("INBOX_TEST_LAYOUT={other}: write plain or partitioned"),
    }
}

/// The transaction pooler the tests' inboxes reach the database through, when
/// `INBOX_TEST_POOLER_URL` names one (PgBouncer in transaction mode, as `INBOX_PGBOUNCER_URL`):
/// the inbox and its handlers' statements go through it, the tests' own checks do not.
pub(crate) fn pooler_url() -> Option<String> {
    std::env::var("INBOX_TEST_POOLER_URL")
        .ok()
        .filter(|url| !url.is_empty())
}

/// A schema of its own for one test, holding the wallet tables and a migrated inbox.
///
/// Behind a transaction pooler (`INBOX_TEST_POOLER_URL`) the schema is in a database of its own
/// (named as the schema), whose default `search_path` names it: a pooled server session takes no
/// startup options, and the wallet's statements name their tables without a schema.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// Connections whose `search_path` is the schema, straight to the database.
    pub pool: PgPool,
    /// The schema's name (random, `t_…`).
    pub schema: String,
    /// The connections the inbox uses through the transaction pooler, if there is one.
    through: Option<PgPool>,
    /// The inbox's keys.
    keys: KeyMode,
}

impl TestDb {
    /// Creates a fresh schema with the wallet tables and a migrated inbox (text keys, the layout
    /// [`partitioned_layout`] says).
    ///
    /// # Panics
    /// When PostgreSQL cannot be reached: start it with `cargo xtask services` or set
    /// `DATABASE_URL`.
    pub async fn new() -> Self {
        Self::keyed(KeyMode::Text).await
    }

    /// [`TestDb::new`] with an inbox of `keys` keys: the store suite runs once per key mode.
    ///
    /// # Panics
    /// When PostgreSQL cannot be reached.
    pub async fn keyed(keys: KeyMode) -> Self {
        Self::create(&database_url(), pooler_url().as_deref(), keys).await
    }

    /// [`TestDb::new`] on the server at `url` (a cluster of the test's own).
    ///
    /// # Panics
    /// When that server cannot be reached.
    pub async fn at(url: &str) -> Self {
        Self::create(url, None, KeyMode::Text).await
    }

    async fn create(url: &str, pooler: Option<&str>, keys: KeyMode) -> Self {
        let schema = format!("t_{:016x}", rand::random::<u64>());
        let mut setup = vec![format!("CREATE SCHEMA \"{schema}\"")];
        if pooler.is_some() {
            setup = vec![
                format!("CREATE DATABASE \"{schema}\""),
                format!("ALTER DATABASE \"{schema}\" SET search_path = \"{schema}\""),
            ];
        }
        admin(url, &setup).await;
        if pooler.is_some() {
            admin(
                &in_database(url, &schema),
                &[format!("CREATE SCHEMA \"{schema}\"")],
            )
            .await;
        }
        let db = Self {
            keys,
            ..Self::connect(url, pooler, &schema).await
        };
        wallet::install(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("cannot create the wallet tables: {e}"));
        db.inbox()
            .migrate()
            .await
            .unwrap_or_else(|e| panic!("cannot migrate the inbox: {e}"));
        let partitioned = db.inbox().is_partitioned().await;
        assert!(
            matches!(partitioned, Ok(p) if p == partitioned_layout()),
            "the test inbox is not in the INBOX_TEST_LAYOUT layout: {partitioned:?}"
        );
        db
    }

    /// Connects to an existing test schema (from a child process).
    ///
    /// # Panics
    /// When PostgreSQL cannot be reached.
    pub async fn attach(schema: &str) -> Self {
        Self::connect(&database_url(), pooler_url().as_deref(), schema).await
    }

    /// [`TestDb::attach`] on the server at `url`.
    ///
    /// # Panics
    /// When that server cannot be reached.
    pub async fn attach_at(url: &str, schema: &str) -> Self {
        Self::connect(url, None, schema).await
    }

    async fn connect(url: &str, pooler: Option<&str>, schema: &str) -> Self {
        let direct = match pooler {
            Some(_) => in_database(url, schema),
            None => url.to_owned(),
        };
        let pool = pool_at(&direct, |o| o.options([("search_path", schema)])).await;
        let through = match pooler {
            // A pooled server session keeps no prepared statement from one transaction to
            // the next: no statement cache.
            Some(pooler) => Some(
                pool_at(&in_database(pooler, schema), |o| {
                    o.statement_cache_capacity(0)
                })
                .await,
            ),
            None => None,
        };
        Self {
            pool,
            schema: schema.to_owned(),
            through,
            keys: KeyMode::Text,
        }
    }

    /// The migrated inbox of this schema (table `inbox`, text keys unless made
    /// [`keyed`](TestDb::keyed)).
    pub fn inbox(&self) -> PgInbox {
        self.inbox_named("inbox", self.keys)
    }

    /// An inbox in table `table` of this schema with `mode` keys, in the layout
    /// [`partitioned_layout`] says (not migrated: call `migrate`).
    ///
    /// # Panics
    /// When `table` is not a plain SQL identifier.
    pub fn inbox_named(&self, table: &str, mode: KeyMode) -> PgInbox {
        let pool = self.through.as_ref().unwrap_or(&self.pool).clone();
        self.inbox_on(pool, table, mode)
    }

    /// [`TestDb::inbox_named`] on `pool`.
    fn inbox_on(&self, pool: PgPool, table: &str, mode: KeyMode) -> PgInbox {
        let table = TableName::qualified(&self.schema, table)
            .unwrap_or_else(|e| panic!("test table name refused: {e}"));
        let inbox = PgInbox::new(pool).with_table(table).with_key_mode(mode);
        if partitioned_layout() {
            inbox.partitioned(Partitions::default())
        } else {
            inbox
        }
    }

    /// Rows in the inbox table.
    pub async fn inbox_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM inbox")
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("cannot count inbox rows: {e}"))
    }

    /// Inserts `n` rows into this schema's `inbox` table for `consumer`, processed `age` ago (to
    /// the minute), with IDs `<consumer>-<minutes>-<i>`: old rows for retention tests.
    ///
    /// # Panics
    /// When the rows cannot be inserted.
    pub async fn insert_aged_rows(&self, consumer: &str, n: i64, age: std::time::Duration) {
        let id = self
            .inbox()
            .consumer_id(consumer)
            .await
            .unwrap_or_else(|e| panic!("cannot register consumer {consumer}: {e}"));
        let minutes = i64::try_from(age.as_secs() / 60).unwrap_or(i64::MAX);
        sqlx::query(
            "INSERT INTO inbox (message_id, processed_minute, consumer_id)
             SELECT $1 || '-' || $3 || '-' || g,
                    (floor(extract(epoch FROM now()) / 60) - $3)::integer, $2
             FROM generate_series(1, $4) g",
        )
        .bind(consumer)
        .bind(id)
        .bind(minutes)
        .bind(n)
        .execute(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("cannot insert aged inbox rows: {e}"));
    }

    /// Drops the schema and everything in it (its database, behind a transaction pooler).
    pub async fn drop(self) {
        let schema = &self.schema;
        let dropped = async {
            if let Some(through) = &self.through {
                through.close().await;
                self.pool.close().await;
                let admin = PgPoolOptions::new().max_connections(1);
                let admin = admin.connect(&database_url()).await?;
                let sql = format!("DROP DATABASE \"{schema}\" WITH (FORCE)");
                return sqlx::raw_sql(AssertSqlSafe(sql)).execute(&admin).await;
            }
            let sql = format!("DROP SCHEMA \"{schema}\" CASCADE");
            let result = sqlx::query(AssertSqlSafe(sql)).execute(&self.pool).await;
            self.pool.close().await;
            result
        };
        if let Err(e) = dropped.await {
            eprintln!("could not drop test schema {schema}: {e}");
        }
    }
}
