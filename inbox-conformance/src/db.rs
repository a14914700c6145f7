//! The database side of the broker suite ([`TestStore`]), and PostgreSQL's: a throw-away schema
//! per test, and the settings tests share.
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use std::future::Future;

use inbox_core::InboxStore;
use inbox_postgres::{KeyMode, Partitions, PgInbox, TableName};

use crate::wallet::{self, Credit, Ledger};

/// The inbox store the broker suite runs on, with the wallet beside it in one database (or
/// schema) per test, so that a credit and its claim commit in one transaction.
/// [`suite!`](crate::suite) takes it as its second argument: [`TestDb`] (PostgreSQL, the
/// default) or `store::MySqlDb` (feature `mysql`).
pub trait TestStore: Sized + Send + Sync + 'static {
    /// The wallet's tables, reached through a pool whose transactions are the inbox's.
    type Ledger: Ledger<Tx = <Self::Inbox as InboxStore>::Tx>;
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

    /// The wallet.
    fn ledger(&self) -> &Self::Ledger;

    /// The migrated inbox.
    fn inbox(&self) -> Self::Inbox;

    /// The wallet's credit handler, writing through this database's inbox transactions.
    fn credit(&self) -> Credit<Self::Ledger> {
        Credit::new(self.ledger().clone())
    }

    /// Rows in the inbox table.
    fn inbox_rows(&self) -> impl Future<Output = i64> + Send;

    /// Whether the outbox relay's scenarios run on this store: the outbox and its relay are
    /// PostgreSQL's. Default: `false`, and they are skipped with the reason printed.
    fn has_outbox() -> bool {
        false
    }

    /// Drops the database and everything in it.
    fn remove(self) -> impl Future<Output = ()> + Send;
}

impl TestStore for TestDb {
    type Ledger = PgPool;
    type Inbox = PgInbox;

    async fn create() -> Self {
        Self::new().await
    }

    async fn attach(name: &str) -> Self {
        Self::attach(name).await
    }

    fn name(&self) -> &str {
        &self.schema
    }

    fn ledger(&self) -> &PgPool {
        &self.pool
    }

    fn inbox(&self) -> PgInbox {
        self.inbox()
    }

    async fn inbox_rows(&self) -> i64 {
        self.inbox_rows().await
    }

    fn has_outbox() -> bool {
        true
    }

    async fn remove(self) {
        self.drop().await;
    }
}

/// The database tests use: `DATABASE_URL`, or the local default the services command sets up.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/inbox".to_owned())
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

/// A schema of its own for one test, holding the wallet tables and a migrated inbox.
#[derive(Debug)]
pub struct TestDb {
    /// Connections whose `search_path` is the schema.
    pub pool: PgPool,
    /// The schema's name (random, `t_…`).
    pub schema: String,
}

impl TestDb {
    /// Creates a fresh schema with the wallet tables and a migrated inbox (text keys, the layout
    /// [`partitioned_layout`] says).
    ///
    /// # Panics
    /// When PostgreSQL cannot be reached: start it with `cargo xtask services` or set
    /// `DATABASE_URL`.
    pub async fn new() -> Self {
        Self::at(&database_url()).await
    }

    /// [`TestDb::new`] on the server at `url` (a cluster of the test's own).
    ///
    /// # Panics
    /// When that server cannot be reached.
    pub async fn at(url: &str) -> Self {
        let schema = format!("t_{:016x}", rand::random::<u64>());
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {}: {e}; run `cargo xtask services` or set DATABASE_URL", inbox_core::redact_url(url)));
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
            .execute(&admin)
            .await
            .unwrap_or_else(|e| panic!("cannot create schema {schema}: {e}"));
        admin.close().await;
        let db = Self::attach_at(url, &schema).await;
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
        Self::attach_at(&database_url(), schema).await
    }

    /// [`TestDb::attach`] on the server at `url`.
    ///
    /// # Panics
    /// When that server cannot be reached.
    pub async fn attach_at(url: &str, schema: &str) -> Self {
        let options: PgConnectOptions = url.parse().unwrap_or_else(|e| {
            panic!(
                "DATABASE_URL {} does not parse: {e}",
                inbox_core::redact_url(url)
            )
        });
        let options = options.options([("search_path", schema)]);
        // No ping per acquire (a round-trip per transaction): a dead connection fails the
        // transaction's first statement, and the consumer retries on another.
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {}: {e}; run `cargo xtask services` or set DATABASE_URL", inbox_core::redact_url(url)));
        Self {
            pool,
            schema: schema.to_owned(),
        }
    }

    /// The migrated inbox of this schema (table `inbox`, text keys).
    pub fn inbox(&self) -> PgInbox {
        self.inbox_named("inbox", KeyMode::Text)
    }

    /// An inbox in table `table` of this schema with `mode` keys, in the layout
    /// [`partitioned_layout`] says (not migrated: call `migrate`).
    ///
    /// # Panics
    /// When `table` is not a plain SQL identifier.
    pub fn inbox_named(&self, table: &str, mode: KeyMode) -> PgInbox {
        let table = TableName::qualified(&self.schema, table)
            .unwrap_or_else(|e| panic!("test table name refused: {e}"));
        let inbox = PgInbox::new(self.pool.clone())
            .with_table(table)
            .with_key_mode(mode);
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

    /// Drops the schema and everything in it.
    pub async fn drop(self) {
        let schema = &self.schema;
        let result = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
            .execute(&self.pool)
            .await;
        if let Err(e) = result {
            eprintln!("could not drop test schema {schema}: {e}");
        }
        self.pool.close().await;
    }
}
