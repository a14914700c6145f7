//! The wallet on MySQL: the same accounts and ledger as [`crate::wallet`], for the MySQL
//! store's broker tests and the evidence tool's kill test on it. Duplicates are
//! `ledger rows − distinct event IDs`, losses `published − distinct event IDs`.

use std::time::Duration;

use inbox_core::{async_trait, Handler, HandlerError, Message, MessageId};
use inbox_mysql::{KeyMode, MySqlInbox, MySqlTx};
use sqlx::MySqlPool;

use crate::store::MySqlDb;
use crate::wallet::{CreditEvent, Summary};

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
pub async fn install(pool: &MySqlPool) -> Result<(), sqlx::Error> {
    for statement in [
        "CREATE TABLE IF NOT EXISTS accounts (
            id bigint PRIMARY KEY,
            balance bigint NOT NULL DEFAULT 0) ENGINE=InnoDB",
        // No unique key on event_id: a duplicate credit must show up as a second row.
        "CREATE TABLE IF NOT EXISTS ledger (
            id bigint AUTO_INCREMENT PRIMARY KEY,
            event_id varchar(255) NOT NULL,
            account_id bigint NOT NULL,
            amount bigint NOT NULL) ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS wallet_stalls (event_id varchar(255) PRIMARY KEY) ENGINE=InnoDB",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// The credit handler: adds the amount to the balance and writes a ledger row, both through the
/// inbox transaction.
#[derive(Debug, Clone)]
pub struct Credit {
    pool: MySqlPool,
    work: Duration,
    stall: Duration,
}

impl Credit {
    /// A handler writing to the wallet tables of `pool`'s database.
    pub fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            work: Duration::ZERO,
            stall: Duration::ZERO,
        }
    }

    /// Sleeps `work` per message, standing in for real work.
    pub fn work(mut self, work: Duration) -> Self {
        self.work = work;
        self
    }

    /// An event with `stall: true` sleeps `stall` on its first handling by any process
    /// (recorded in `wallet_stalls` outside the transaction), with its claim uncommitted.
    pub fn stall(mut self, stall: Duration) -> Self {
        self.stall = stall;
        self
    }
}

/// Records that `id` is being handled, outside any transaction: `true` the first time across
/// all processes.
pub async fn first_handling(pool: &MySqlPool, id: &MessageId) -> Result<bool, sqlx::Error> {
    match sqlx::query("INSERT INTO wallet_stalls (event_id) VALUES (?)")
        .bind(id.as_str())
        .execute(pool)
        .await
    {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
        Err(e) => Err(e),
    }
}

/// How many stalls started.
pub async fn stalls(pool: &MySqlPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM wallet_stalls")
        .fetch_one(pool)
        .await
}

/// Ledger rows of `id`.
pub async fn rows_of(pool: &MySqlPool, id: &MessageId) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE event_id = ?")
        .bind(id.as_str())
        .fetch_one(pool)
        .await
}

#[async_trait]
impl Handler<MySqlTx> for Credit {
    async fn handle(
        &self,
        tx: &mut MySqlTx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let event: CreditEvent = message.json()?;
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        if event.stall && !self.stall.is_zero() && first_handling(&self.pool, id).await? {
            tokio::time::sleep(self.stall).await;
        }
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
}

/// Reads the ledger.
pub async fn summary(pool: &MySqlPool) -> Result<Summary, sqlx::Error> {
    let (ledger_rows, distinct_events): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM ledger")
            .fetch_one(pool)
            .await?;
    let (mismatched, total_balance): (i64, i64) = sqlx::query_as(
        "SELECT CAST(COALESCE(sum(a.balance <> COALESCE(l.total, 0)), 0) AS SIGNED),
                CAST(COALESCE(sum(a.balance), 0) AS SIGNED)
         FROM accounts a
         LEFT JOIN (SELECT account_id, sum(amount) AS total FROM ledger GROUP BY account_id) l
           ON l.account_id = a.id",
    )
    .fetch_one(pool)
    .await?;
    Ok(Summary {
        ledger_rows,
        distinct_events,
        balances_exact: mismatched == 0,
        total_balance,
    })
}

/// Every account's balance, by id.
pub async fn balances(pool: &MySqlPool) -> Result<Vec<(i64, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT id, balance FROM accounts ORDER BY id")
        .fetch_all(pool)
        .await
}
