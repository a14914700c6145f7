//! The statements that create the inbox tables: run by [`PgInbox::migrate`], printed by
//! [`PgInbox::migration_sql`] for schemas applied with another migration tool.

use inbox_core::sql::{primary_key, push_statements};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::error::db;
use crate::partition::name_prefix;
use crate::table::column_type;
use crate::{Error, KeyMode, PgInbox, Result, TableName};

impl PgInbox {
    /// The SQL that creates this inbox's tables and indexes, as [`migrate`](Self::migrate)
    /// creates them in an empty schema, for its table name, key mode and layout: for
    /// applications whose schema is applied by their own migration tool (sqlx, refinery, Flyway).
    /// Reads nothing from the database; the statements are the ones `migrate` runs.
    ///
    /// The plain layout's statements all say `IF NOT EXISTS`, so running them twice changes
    /// nothing, and `migrate` afterwards changes nothing either. The partitioned layout's
    /// table, index and default partition are all there is to create once; its range
    /// partitions follow the clock, so they are not in the SQL: `migrate`, every
    /// [`purge`](Self::purge) and [`create_partitions`](Self::create_partitions) add them
    /// (until a range covers a key, its row goes to the default partition, which is correct,
    /// only slower to clean up).
    ///
    /// ```
    /// use inbox_postgres::{KeyMode, PgInbox, TableName};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // A pool that never connects: printing the SQL needs no database.
    /// let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/inbox")?;
    /// let inbox = PgInbox::new(pool)
    ///     .with_table(TableName::qualified("billing", "inbox")?)
    ///     .with_key_mode(KeyMode::Uuid);
    /// let sql = inbox.migration_sql();
    /// assert!(sql.contains(r#"CREATE TABLE IF NOT EXISTS "billing"."inbox" ("#));
    /// assert!(sql.contains("message_id uuid NOT NULL"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn migration_sql(&self) -> String {
        let t = self.table();
        let partitioned = self.partitions.is_some();
        let [table, index] = self.table_statements(&t.to_string(), t.table(), partitioned);
        let mut statements = vec![self.consumers_table_sql(), table, index];
        let layout = if partitioned {
            statements.push(self.default_partition_sql());
            "partitioned"
        } else {
            "plain"
        };
        let keys = format!("{:?}", self.key_mode()).to_lowercase();
        let mut sql = format!(
            "-- The inbox {t}: {keys} keys, {layout} layout; what PgInbox::migrate creates.\n"
        );
        if partitioned {
            sql.push_str(
                "-- Run once. Range partitions follow the clock: PgInbox::migrate and every purge \
                 add them.\n",
            );
        }
        push_statements(&mut sql, statements);
        sql
    }

    /// `<table>_consumers`: the small integer that stands for each consumer name.
    pub(crate) fn consumers_table_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {consumers} (
                id smallint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                name text NOT NULL UNIQUE)",
            consumers = self.table().sibling("consumers")
        )
    }

    /// The inbox table `qualified` and its BRIN index on the processed minute, which serves the
    /// purge, in the `partitioned` layout or the plain one; the partitioned layout names its
    /// primary key and index `<index_base>_pkey`, `_processed`.
    pub(crate) fn table_statements(
        &self,
        qualified: &str,
        index_base: &str,
        partitioned: bool,
    ) -> [String; 2] {
        let key = column_type(self.key_mode());
        let primary_key = primary_key(self.key_mode());
        // autosummarize: the checks of a partition's purge read the BRIN summaries of fresh
        // pages too.
        let (constraint, partition_by, with) = if partitioned {
            (
                format!("CONSTRAINT \"{index_base}_pkey\" "),
                "\nPARTITION BY RANGE (message_id)",
                " WITH (autosummarize = on)",
            )
        } else {
            (String::new(), "", "")
        };
        // Column order matters for size: the 16-byte key, then the 4-byte minute and the
        // 2-byte consumer pack into 48 bytes with the tuple header.
        [
            format!(
                "CREATE TABLE IF NOT EXISTS {qualified} (
                    message_id {key} NOT NULL,
                    processed_minute integer NOT NULL
                        DEFAULT (floor(extract(epoch FROM now()) / 60))::integer,
                    consumer_id smallint NOT NULL,
                    {constraint}PRIMARY KEY ({primary_key})){partition_by}"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS \"{index_base}_processed\" ON {qualified} USING brin (processed_minute){with}"
            ),
        ]
    }

    /// The default partition of a partitioned table: it takes every key outside the ranges.
    pub(crate) fn default_partition_sql(&self) -> String {
        let t = self.table();
        let default = t.qualify(&format!("{}_default", name_prefix(t.table())));
        format!("CREATE TABLE {default} PARTITION OF {t} DEFAULT")
    }
}

/// The one skeleton of every `migrate` (inbox, leases, outbox): a transaction under an advisory
/// lock named after the table, so instances migrating at once take turns, its statements run in
/// order, the key type checked where the table has one, and the commit.
pub(crate) struct Migration {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    what: &'static str,
}

impl Migration {
    /// Opens the transaction and takes the lock `lock`; `what` names the tables in errors.
    pub(crate) async fn begin(pool: &PgPool, lock: String, what: &'static str) -> Result<Self> {
        let mut tx = pool.begin().await.map_err(db("starting a migration"))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(lock)
            .execute(&mut *tx)
            .await
            .map_err(db("taking the migration lock"))?;
        Ok(Self { tx, what })
    }

    /// The open transaction, for what a migration reads between its statements.
    pub(crate) fn tx(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Runs `statements` in order.
    pub(crate) async fn run(&mut self, statements: impl IntoIterator<Item = String>) -> Result<()> {
        for statement in statements {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *self.tx)
                .await
                .map_err(db(self.what))?;
        }
        Ok(())
    }

    /// Fails when `table`'s `message_id` column is not of `mode`'s type: a table made with
    /// another key mode.
    pub(crate) async fn check_key_type(&mut self, table: &TableName, mode: KeyMode) -> Result<()> {
        let found: String = sqlx::query_scalar(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute
             WHERE attrelid = $1::regclass AND attname = 'message_id'",
        )
        .bind(table.to_string())
        .fetch_one(&mut *self.tx)
        .await
        .map_err(db("checking the key type"))?;
        if found != column_type(mode) {
            return Err(Error::KeyModeMismatch {
                table: table.to_string(),
                found,
                expected: mode,
            });
        }
        Ok(())
    }

    pub(crate) async fn commit(self) -> Result<()> {
        self.tx
            .commit()
            .await
            .map_err(db("committing the migration"))
    }
}
