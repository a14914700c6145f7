//! The MySQL store under the store suite: a [`MySqlDb`] database per scenario, the inbox in one
//! key mode, and a table of effects.

use std::time::Duration;

use inbox_core::{HandlerError, MessageId};
use inbox_mysql::{KeyMode, MySqlInbox, MySqlTx, TableName};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, MySqlPool};

use super::StoreUnderTest;
use crate::FaultProxy;

/// How long the suite's purge keeps claims; [`StoreUnderTest::age_and_purge`] ages them twice
/// as much.
const KEPT: Duration = Duration::from_secs(14 * 24 * 3600);

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

/// [`MySqlInbox`] in one [`KeyMode`], in a database of its own.
#[derive(Debug)]
pub struct MySql {
    db: MySqlDb,
    inbox: MySqlInbox,
    mode: KeyMode,
}

impl MySql {
    /// A fresh database with an inbox of `mode` keys, a table of effects and the two rows a
    /// handler deadlocks on.
    ///
    /// # Panics
    /// When the server cannot be reached.
    pub async fn new(mode: KeyMode) -> Self {
        let db = MySqlDb::new().await;
        let inbox = db.inbox("store_inbox", mode);
        inbox.migrate().await.expect("migrate the inbox");
        for statement in [
            "CREATE TABLE effects (message_id varbinary(1024) NOT NULL) ENGINE=InnoDB",
            "CREATE TABLE pair (id int PRIMARY KEY) ENGINE=InnoDB",
            "INSERT INTO pair VALUES (1), (2)",
            "CREATE TABLE ballast (n int NOT NULL) ENGINE=InnoDB",
        ] {
            sqlx::query(statement)
                .execute(&db.pool)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
        Self { db, inbox, mode }
    }
}

impl StoreUnderTest for MySql {
    type Store = MySqlInbox;

    fn store(&self) -> MySqlInbox {
        self.inbox.clone()
    }

    async fn apply(&self, tx: &mut MySqlTx, id: &MessageId) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects VALUES (?)")
            .bind(id.as_str())
            .execute(&mut **tx)
            .await?;
        Ok(())
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
        let mut other = self.db.pool.begin().await.expect("begin the other");
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

    async fn applied(&self, id: &MessageId) -> u64 {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = ?")
            .bind(id.as_str())
            .fetch_one(&self.db.pool)
            .await
            .expect("count effects");
        u64::try_from(n).unwrap_or_default()
    }

    fn refused_id(&self) -> Option<MessageId> {
        (self.mode == KeyMode::Uuid).then(|| MessageId::new("not-a-uuid").expect("an ID"))
    }

    async fn age_and_purge(&self) -> Option<u64> {
        let minutes = i64::try_from(2 * KEPT.as_secs() / 60).expect("minutes");
        sqlx::query("UPDATE store_inbox SET processed_minute = processed_minute - ?")
            .bind(minutes)
            .execute(&self.db.pool)
            .await
            .expect("age the claims");
        let report = self.inbox.purge(KEPT, 1000).await.expect("purge");
        Some(report.deleted())
    }

    async fn proxied(&self) -> Option<(MySqlInbox, FaultProxy)> {
        let options = self.db.options().clone();
        let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
            .await
            .expect("resolve the database")
            .next()
            .expect("the database has an address");
        let proxy = FaultProxy::start(upstream).await.expect("the proxy");
        let options = options.host("127.0.0.1").port(proxy.addr().port());
        // No ping per acquire; a short acquire timeout, so a refused connection is an error the
        // consumer sees, not a wait.
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_millis(500))
            .test_before_acquire(false)
            .connect_lazy_with(options);
        let inbox = MySqlInbox::new(pool)
            .with_table(TableName::new("store_inbox").expect("table name"))
            .with_key_mode(self.mode);
        Some((inbox, proxy))
    }

    async fn cleanup(self) {
        self.db.drop().await;
    }
}
