//! The statements that create the inbox tables: run by [`MySqlInbox::migrate`], printed by
//! [`MySqlInbox::migration_sql`] for schemas applied with another migration tool.

use inbox_core::sql::{primary_key, push_statements};
use sqlx::{AssertSqlSafe, MySqlConnection};

use crate::error::db;
use crate::table::column_type;
use crate::{Error, MySqlInbox, Result};

impl MySqlInbox {
    /// Creates the inbox tables if missing; safe to run from many instances at once (they take
    /// turns on a named lock, `GET_LOCK`). Fails when the table exists with another key mode.
    ///
    /// MySQL commits each `CREATE TABLE` by itself: the statements cannot share a transaction,
    /// and each says `IF NOT EXISTS`, so a migration cut off halfway is finished by the next.
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(db("creating the inbox tables"))?;
        let lock = format!("inbox migrate {}", self.table());
        let taken: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await
            .map_err(db("taking the migration lock"))?;
        if taken != Some(1) {
            return Err(Error::MigrationLocked {
                table: self.table().to_string(),
            });
        }
        let result = self.create(&mut conn).await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await
            .map_err(db("releasing the migration lock"));
        result.and(released.map(|_| ()))
    }

    async fn create(&self, conn: &mut MySqlConnection) -> Result<()> {
        for statement in self.statements() {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *conn)
                .await
                .map_err(db("creating the inbox tables"))?;
        }
        let t = self.table();
        let found: String = sqlx::query_scalar(
            "SELECT CAST(COLUMN_TYPE AS CHAR) FROM information_schema.COLUMNS
             WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?
               AND COLUMN_NAME = 'message_id'",
        )
        .bind(t.database())
        .bind(t.table())
        .fetch_one(&mut *conn)
        .await
        .map_err(db("checking the key type"))?;
        if !found.eq_ignore_ascii_case(column_type(self.key_mode())) {
            return Err(Error::KeyModeMismatch {
                table: t.to_string(),
                found,
                expected: self.key_mode(),
            });
        }
        Ok(())
    }

    /// The SQL that creates this inbox's tables, as [`migrate`](Self::migrate) runs it, for
    /// applications whose schema is applied by their own migration tool. Reads nothing from the
    /// database; every statement says `IF NOT EXISTS`.
    ///
    /// ```
    /// use inbox_mysql::{KeyMode, MySqlInbox, TableName};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // A pool that never connects: printing the SQL needs no database.
    /// let pool = sqlx::MySqlPool::connect_lazy("mysql://127.0.0.1/inbox")?;
    /// let inbox = MySqlInbox::new(pool)
    ///     .with_table(TableName::qualified("billing", "inbox")?)
    ///     .with_key_mode(KeyMode::Uuid);
    /// let sql = inbox.migration_sql();
    /// assert!(sql.contains("CREATE TABLE IF NOT EXISTS `billing`.`inbox` ("));
    /// assert!(sql.contains("message_id binary(16) NOT NULL"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn migration_sql(&self) -> String {
        let mut sql = format!(
            "-- The inbox {}: {:?} keys; what MySqlInbox::migrate creates.\n",
            self.table(),
            self.key_mode()
        );
        push_statements(&mut sql, self.statements());
        sql
    }

    fn statements(&self) -> [String; 2] {
        let t = self.table();
        let key = column_type(self.key_mode());
        let primary_key = primary_key(self.key_mode());
        [
            format!(
                "CREATE TABLE IF NOT EXISTS {consumers} (
                    id smallint NOT NULL AUTO_INCREMENT PRIMARY KEY,
                    name varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL UNIQUE
                ) ENGINE=InnoDB",
                consumers = t.consumers()
            ),
            // The minute the claim committed, from the server's clock; the index serves the
            // purge.
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    message_id {key} NOT NULL,
                    consumer_id smallint NOT NULL,
                    processed_minute int NOT NULL,
                    PRIMARY KEY ({primary_key}),
                    KEY processed (processed_minute)
                ) ENGINE=InnoDB"
            ),
        ]
    }
}
