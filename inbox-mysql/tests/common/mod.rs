//! The wallet on MySQL, for the broker tests: accounts with balances and a ledger row per
//! applied credit carrying its event ID, so duplicates are `ledger rows − distinct event IDs`
//! and losses `published − distinct event IDs`.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::TestQueue;
use inbox_core::{async_trait, Handler, HandlerError, Message, MessageId, StatsSnapshot};
use inbox_mysql::{KeyMode, MySqlInbox, MySqlTx};
use sqlx::MySqlPool;

pub const ACCOUNTS: i64 = 7;

/// A fresh database with the wallet's tables and a migrated inbox.
pub async fn wallet_db() -> MySqlDb {
    let db = MySqlDb::new().await;
    for statement in [
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL) ENGINE=InnoDB",
        "CREATE TABLE ledger (event_id varchar(64) NOT NULL, account_id bigint NOT NULL, \
         amount bigint NOT NULL) ENGINE=InnoDB",
    ] {
        sqlx::query(statement)
            .execute(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    for id in 1..=ACCOUNTS {
        sqlx::query("INSERT INTO accounts VALUES (?, 0)")
            .bind(id)
            .execute(&db.pool)
            .await
            .expect("account");
    }
    inbox(&db).migrate().await.expect("migrate");
    db
}

/// The inbox of the wallet's database.
pub fn inbox(db: &MySqlDb) -> MySqlInbox {
    db.inbox("inbox", KeyMode::Text)
}

/// Credits the account and writes the ledger row, in the inbox transaction; sleeps `work` first.
#[derive(Debug, Clone, Default)]
pub struct Credit {
    pub work: Duration,
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
        sqlx::query("INSERT INTO ledger VALUES (?, ?, ?)")
            .bind(id.as_str())
            .bind(event.account_id)
            .bind(event.amount)
            .execute(&mut **tx)
            .await?;
        sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = ?")
            .bind(event.amount)
            .bind(event.account_id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// What the wallet holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub ledger_rows: i64,
    pub distinct_events: i64,
    pub total_balance: i64,
    /// Every balance equals the sum of its ledger rows.
    pub balances_exact: bool,
}

pub async fn summary(pool: &MySqlPool) -> Summary {
    let (ledger_rows, distinct_events, ledger_total): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), CAST(COALESCE(sum(amount), 0) AS SIGNED) \
         FROM ledger",
    )
    .fetch_one(pool)
    .await
    .expect("ledger");
    let total_balance: i64 =
        sqlx::query_scalar("SELECT CAST(COALESCE(sum(balance), 0) AS SIGNED) FROM accounts")
            .fetch_one(pool)
            .await
            .expect("balances");
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM accounts a WHERE a.balance <> \
         (SELECT COALESCE(sum(amount), 0) FROM ledger l WHERE l.account_id = a.id)",
    )
    .fetch_one(pool)
    .await
    .expect("balances per account");
    Summary {
        ledger_rows,
        distinct_events,
        total_balance,
        balances_exact: mismatched == 0 && ledger_total == total_balance,
    }
}

/// Runs consumers (`run`, given a new source of `member`) until idle, one after another,
/// until the ledger holds `events` distinct events or `limit` passes.
pub async fn drain<Q, R, F>(
    queue: &Q,
    db: &MySqlDb,
    member: &str,
    events: i64,
    limit: Duration,
    mut run: R,
) -> Vec<StatsSnapshot>
where
    Q: TestQueue,
    R: FnMut(Q::Source) -> F,
    F: Future<Output = inbox_core::Result<StatsSnapshot>>,
{
    let start = Instant::now();
    let mut runs = Vec::new();
    loop {
        let stats = run(queue.source(member).await)
            .await
            .unwrap_or_else(|e| panic!("consumer {member}: {e}"));
        runs.push(stats);
        let done = summary(&db.pool).await.distinct_events;
        if done >= events {
            return runs;
        }
        assert!(
            start.elapsed() < limit,
            "not drained within {limit:?}: {done} of {events}; {runs:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What is left on the broker once it had a few seconds to settle.
pub async fn left<Q: TestQueue>(queue: &Q) -> u64 {
    let start = Instant::now();
    loop {
        let left = queue.left().await;
        if left == 0 || start.elapsed() > Duration::from_secs(10) {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
