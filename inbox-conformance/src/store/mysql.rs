//! A MySQL database per test, [`MySqlDb`]; its wallet and its side of the suites are in
//! [`crate::mysql_wallet`].

use inbox_mysql::{KeyMode, MySqlInbox, TableName};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, MySqlPool};

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
    /// The keys of the wallet's inbox ([`crate::mysql_wallet::inbox`]).
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
