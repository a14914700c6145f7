//! The wallet on MySQL: the same accounts and ledger as [`crate::wallet`], in MySQL's dialect
//! ([`TestStore`] for [`MySqlDb`]), so that the conformance suite and the evidence tool's kill test
//! run on the MySQL store. Duplicates are `ledger rows − distinct event IDs`, losses
//! `published − distinct event IDs`.

use inbox_core::MessageId;
use inbox_mysql::{KeyMode, MySqlInbox, MySqlTx};
use sqlx::MySqlPool;

use crate::store::MySqlDb;
use crate::wallet::{CreditEvent, Summary};
use crate::TestStore;

/// The inbox table of a wallet database.
pub const INBOX_TABLE: &str = "inbox";

/// A fresh database with `accounts`, `ledger` and a migrated inbox ([`inbox`]).
///
/// # Panics
/// When the server cannot be reached.
pub async fn wallet_db() -> MySqlDb {
    let db = MySqlDb::new().await;
    install(&db.pool).await.expect("the wallet tables");
    inbox(&db).migrate().await.expect("migrate the inbox");
    db
}

/// The inbox of a wallet database: table [`INBOX_TABLE`], text keys.
pub fn inbox(db: &MySqlDb) -> MySqlInbox {
    db.inbox(INBOX_TABLE, KeyMode::Text)
}

/// Creates `accounts`, `ledger` and `wallet_stalls` if missing.
async fn install(pool: &MySqlPool) -> Result<(), sqlx::Error> {
    for statement in [
        "CREATE TABLE IF NOT EXISTS accounts (
            id bigint PRIMARY KEY,
            balance bigint NOT NULL DEFAULT 0) ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS ledger (
            id bigint AUTO_INCREMENT PRIMARY KEY,
            event_id varchar(255) NOT NULL,
            account_id bigint NOT NULL,
            amount bigint NOT NULL) ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS wallet_stalls (event_id varchar(255) PRIMARY KEY) \
         ENGINE=InnoDB",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// The broker suite on the MySQL store: `suite!(broker, inbox_conformance::store::MySqlDb)`.
impl TestStore for MySqlDb {
    type Inbox = MySqlInbox;

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

    async fn inbox_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM inbox")
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("cannot count inbox rows: {e}"))
    }

    async fn remove(self) {
        self.drop().await;
    }

    async fn apply(
        tx: &mut MySqlTx,
        id: &MessageId,
        event: &CreditEvent,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
        )
        .bind(event.account_id)
        .bind(event.amount)
        .execute(&mut **tx)
        .await?;
        sqlx::query("INSERT INTO ledger (event_id, account_id, amount) VALUES (?, ?, ?)")
            .bind(id.as_str())
            .bind(event.account_id)
            .bind(event.amount)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn first_handling(&self, id: &MessageId) -> Result<bool, sqlx::Error> {
        match sqlx::query("INSERT INTO wallet_stalls (event_id) VALUES (?)")
            .bind(id.as_str())
            .execute(&self.pool)
            .await
        {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn summary(&self) -> Result<Summary, sqlx::Error> {
        let (ledger_rows, distinct_events): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM ledger")
                .fetch_one(&self.pool)
                .await?;
        let (mismatched, total_balance): (i64, i64) = sqlx::query_as(
            "SELECT CAST(COALESCE(sum(a.balance <> COALESCE(l.total, 0)), 0) AS SIGNED),
                    CAST(COALESCE(sum(a.balance), 0) AS SIGNED)
             FROM accounts a
             LEFT JOIN (SELECT account_id, sum(amount) AS total FROM ledger GROUP BY account_id) l
               ON l.account_id = a.id",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Summary {
            ledger_rows,
            distinct_events,
            balances_exact: mismatched == 0,
            total_balance,
        })
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
}
