//! The wallet on MySQL: the same accounts and ledger as [`crate::wallet`], in MySQL's dialect
//! ([`TestStore`] for [`MySqlDb`]), so that the conformance suite and the evidence tool's kill test
//! run on the MySQL store, in a database of its own per test ([`MySqlDb`]). Duplicates are
//! `ledger rows − distinct event IDs`, losses `published − distinct event IDs`.

use std::time::Duration;

use inbox_core::MessageId;
use inbox_mysql::{KeyMode, MySqlInbox, MySqlTx, TableName};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, MySqlPool};

use crate::db::{proxied_pool, same_in_both_dialects, KEPT};
use crate::wallet::CreditEvent;
use crate::{FaultProxy, TestStore};

/// The MySQL or MariaDB server tests use: `INBOX_MYSQL_URL`, or the local default that `cargo
/// xtask services` sets up. Its user may create and drop databases named `<database>_*`.
pub fn mysql_url() -> String {
    std::env::var("INBOX_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://inbox:inbox@127.0.0.1:3306/inbox".to_owned())
}

/// A database of its own for one test, dropped by [`MySqlDb::drop`].
#[derive(Debug, Clone)]
pub struct MySqlDb {
    /// Connections to the database.
    pub pool: MySqlPool,
    /// The database's name (`<the URL's database>_t_…`).
    pub name: String,
    options: MySqlConnectOptions,
    /// The keys of the wallet's inbox ([`inbox`]).
    pub keys: KeyMode,
}

impl MySqlDb {
    /// Creates a fresh, empty database.
    ///
    /// # Panics
    /// When the server cannot be reached: start it with `cargo xtask services` or set
    /// `INBOX_MYSQL_URL`.
    pub async fn new() -> Self {
        let url = mysql_url();
        let options: MySqlConnectOptions = url.parse().expect("INBOX_MYSQL_URL parses");
        let base = options.get_database().unwrap_or("inbox").to_owned();
        let name = format!("{base}_t_{:016x}", rand::random::<u64>());
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .unwrap_or_else(|e| panic!("cannot reach MySQL at {}: {e}; run `cargo xtask services` or set INBOX_MYSQL_URL", inbox_core::redact_url(&url)));
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
            .execute(&admin)
            .await
            .expect("create the test database");
        admin.close().await;
        Self::attach(&name).await
    }

    /// The database `name` made by [`MySqlDb::new`], from another process.
    pub async fn attach(name: &str) -> Self {
        let options: MySqlConnectOptions = mysql_url().parse().expect("INBOX_MYSQL_URL parses");
        let options = options.database(name);
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .connect_with(options.clone())
            .await
            .expect("connect to the test database");
        Self {
            pool,
            name: name.to_owned(),
            options,
            keys: KeyMode::Text,
        }
    }

    /// The inbox in table `table` of this database, with `mode` keys, not yet migrated.
    pub fn inbox(&self, table: &str, mode: KeyMode) -> MySqlInbox {
        MySqlInbox::new(self.pool.clone())
            .with_table(TableName::new(table).expect("table name"))
            .with_key_mode(mode)
    }

    /// The connection options of this database.
    pub fn options(&self) -> &MySqlConnectOptions {
        &self.options
    }

    /// Drops the database.
    pub async fn drop(self) {
        let result = sqlx::query(AssertSqlSafe(format!("DROP DATABASE `{}`", self.name)))
            .execute(&self.pool)
            .await;
        if let Err(e) = result {
            eprintln!("dropping test database {}: {e}", self.name);
        }
        self.pool.close().await;
    }
}

/// The inbox table of a wallet database.
pub const INBOX_TABLE: &str = "inbox";

/// A fresh database with `accounts`, `ledger` and a migrated inbox ([`inbox`]).
///
/// # Panics
/// When the server cannot be reached.
pub async fn wallet_db() -> MySqlDb {
    keyed(KeyMode::Text).await
}

/// [`wallet_db`] with an inbox of `keys` keys: the store suite runs once per key mode.
///
/// # Panics
/// When the server cannot be reached.
pub async fn keyed(keys: KeyMode) -> MySqlDb {
    let mut db = MySqlDb::new().await;
    db.keys = keys;
    install(&db.pool).await.expect("the wallet tables");
    inbox(&db).migrate().await.expect("migrate the inbox");
    db
}

/// The inbox of a wallet database: table [`INBOX_TABLE`], the database's keys.
pub fn inbox(db: &MySqlDb) -> MySqlInbox {
    db.inbox(INBOX_TABLE, db.keys)
}

/// Creates `accounts`, `ledger` and `wallet_stalls` if missing, with event IDs compared byte for
/// byte (as the inbox keeps them), and the two rows [`TestStore::fail_and_swallow`] deadlocks
/// on.
async fn install(pool: &MySqlPool) -> Result<(), sqlx::Error> {
    for statement in [
        "CREATE TABLE IF NOT EXISTS accounts (
            id bigint PRIMARY KEY,
            balance bigint NOT NULL DEFAULT 0) ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS ledger (
            id bigint AUTO_INCREMENT PRIMARY KEY,
            event_id varbinary(1024) NOT NULL,
            account_id bigint NOT NULL,
            amount bigint NOT NULL) ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS wallet_stalls (event_id varbinary(1024) PRIMARY KEY) \
         ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS pair (id int PRIMARY KEY) ENGINE=InnoDB",
        "INSERT IGNORE INTO pair VALUES (1), (2)",
        "CREATE TABLE IF NOT EXISTS ballast (n int NOT NULL) ENGINE=InnoDB",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// The broker suite on the MySQL store: `suite!(broker, inbox_conformance::store::MySqlDb)`.
impl TestStore for MySqlDb {
    type Inbox = MySqlInbox;
    same_in_both_dialects!(
        param: "?",
        values: "VALUES (?, ?, ?)",
        upsert: "INSERT INTO accounts (id, balance) VALUES (?, ?)
                 ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
        integer: "SIGNED"
    );

    async fn create() -> Self {
        wallet_db().await
    }

    async fn attach(name: &str) -> Self {
        Self::attach(name).await
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn inbox(&self) -> MySqlInbox {
        inbox(self)
    }

    async fn remove(self) {
        self.drop().await;
    }

    /// A failed statement in MySQL undoes only itself; the failure that breaks a transaction is
    /// a deadlock, which InnoDB answers by rolling the whole transaction back. So this makes
    /// one: it locks row 1, a heavier transaction (it inserted rows, so InnoDB prefers to roll
    /// back this one) locks row 2 and waits for row 1, and this one asks for row 2.
    async fn fail_and_swallow(&self, tx: &mut MySqlTx) {
        let lock = |row: i32| format!("SELECT id FROM pair WHERE id = {row} FOR UPDATE");
        sqlx::query(AssertSqlSafe(lock(1)))
            .fetch_all(&mut **tx)
            .await
            .expect("lock row 1");
        let mut other = self.pool.begin().await.expect("begin the other");
        let ballast = vec!["(0)"; 200].join(", ");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO ballast VALUES {ballast}"
        )))
        .execute(&mut *other)
        .await
        .expect("ballast");
        sqlx::query(AssertSqlSafe(lock(2)))
            .fetch_all(&mut *other)
            .await
            .expect("lock row 2");
        let waiter = tokio::spawn(async move {
            let waited = sqlx::query(AssertSqlSafe(lock(1)))
                .fetch_all(&mut *other)
                .await;
            (other, waited.map(|_| ()))
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let failed = sqlx::query(AssertSqlSafe(lock(2)))
            .fetch_all(&mut **tx)
            .await;
        let (other, waited) = waiter.await.expect("the other transaction");
        other.rollback().await.expect("roll the other back");
        let number = match &failed {
            Err(sqlx::Error::Database(e)) => e
                .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .map(|e| e.number()),
            _ => None,
        };
        assert_eq!(
            number,
            Some(inbox_mysql::DEADLOCK),
            "the handler's transaction is the deadlock's victim: {failed:?}; the other: {waited:?}"
        );
    }

    async fn proxied(&self) -> Option<(MySqlInbox, FaultProxy)> {
        let options = self.options().clone();
        let proxy = FaultProxy::in_front_of(options.get_host(), options.get_port()).await;
        let options = options.host("127.0.0.1").port(proxy.addr().port());
        let inbox = MySqlInbox::new(proxied_pool(options))
            .with_table(TableName::new(INBOX_TABLE).expect("table name"))
            .with_key_mode(self.keys);
        Some((inbox, proxy))
    }
}
