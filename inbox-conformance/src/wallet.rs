//! The wallet domain: accounts with balances and a ledger row per applied credit, as in the
//! article. Every applied credit writes one ledger row carrying its event ID, so duplicates are
//! `ledger rows − distinct event IDs` and losses `published − distinct event IDs`.

use std::time::Duration;

use inbox_core::{BatchHandler, BatchItem, Handler, HandlerError, Message, MessageId};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use inbox_postgres::PgTx;

use crate::db::{StoreTx, TestDb, TestStore};

/// A credit event: add `amount` to account `account_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditEvent {
    /// The account.
    pub account_id: i64,
    /// The amount to add.
    pub amount: i64,
    /// Stall on the first handling (see [`Credit::stall`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stall: bool,
}

impl CreditEvent {
    /// A plain credit.
    pub fn new(account_id: i64, amount: i64) -> Self {
        Self {
            account_id,
            amount,
            stall: false,
        }
    }

    /// The JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Publishes a credit of `amount` to `account` with ID `id` on the in-memory broker.
pub fn publish_credit(broker: &inbox_testkit::MemoryBroker, id: &str, account: i64, amount: i64) {
    broker.publish(Some(id), CreditEvent::new(account, amount).to_json());
}

/// Creates the wallet's tables where `pool` reaches, if missing: `accounts`, `ledger` and
/// `wallet_stalls`. No unique key on the ledger's event ID: a duplicate credit must show up as a
/// second row.
pub async fn install(pool: &PgPool) -> Result<(), sqlx::Error> {
    for statement in [
        "CREATE TABLE IF NOT EXISTS accounts (
            id bigint PRIMARY KEY,
            balance bigint NOT NULL DEFAULT 0)",
        "CREATE TABLE IF NOT EXISTS ledger (
            id bigserial PRIMARY KEY,
            event_id text NOT NULL,
            account_id bigint NOT NULL,
            amount bigint NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE TABLE IF NOT EXISTS wallet_stalls (event_id text PRIMARY KEY)",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// The credit handler: adds the amount to the balance and writes a ledger row, both through the
/// inbox transaction, in the test database `D` (PostgreSQL's by default).
#[derive(Debug, Clone)]
pub struct Credit<D = TestDb> {
    db: D,
    work: Duration,
    stall: Duration,
}

impl<D: TestStore> Credit<D> {
    /// A handler writing to the wallet tables of `db`.
    pub fn new(db: D) -> Self {
        Self {
            db,
            work: Duration::ZERO,
            stall: Duration::ZERO,
        }
    }

    /// Sleeps `work` per message, standing in for real work.
    pub fn work(mut self, work: Duration) -> Self {
        self.work = work;
        self
    }

    /// An event with `stall: true` sleeps `stall` on its first handling by any process (noted
    /// in `wallet_stalls` outside the transaction), so a zombie test can make a consumer lose
    /// ownership mid-handler exactly once per such event.
    pub fn stall(mut self, stall: Duration) -> Self {
        self.stall = stall;
        self
    }
}

impl<D: TestStore> Handler<StoreTx<D>> for Credit<D> {
    async fn handle(
        &self,
        tx: &mut StoreTx<D>,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let event: CreditEvent = message.json()?;
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        if event.stall && !self.stall.is_zero() && self.db.first_handling(id).await? {
            tokio::time::sleep(self.stall).await;
        }
        D::apply(tx, id, &event).await?;
        Ok(())
    }
}

/// The credit handler written set-based, for [`Consumer::batched`](inbox_core::Consumer::batched):
/// one statement per transaction writes every ledger row and adds each account's sum to its
/// balance, whatever the batch size.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchCredit;

impl BatchHandler<PgTx> for BatchCredit {
    type Item = CreditEvent;

    fn decode(&self, _id: &MessageId, message: &Message) -> Result<CreditEvent, HandlerError> {
        message.json()
    }

    async fn handle_batch(
        &self,
        tx: &mut PgTx,
        batch: &[BatchItem<'_, CreditEvent>],
    ) -> Result<(), HandlerError> {
        let ids: Vec<&str> = batch.iter().map(|b| b.id.as_str()).collect();
        let accounts: Vec<i64> = batch.iter().map(|b| b.item.account_id).collect();
        let amounts: Vec<i64> = batch.iter().map(|b| b.item.amount).collect();
        sqlx::query(
            "WITH credited AS (
                INSERT INTO ledger (event_id, account_id, amount)
                SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
                RETURNING account_id, amount)
             INSERT INTO accounts (id, balance)
             SELECT account_id, sum(amount) FROM credited GROUP BY account_id
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&ids)
        .bind(&accounts)
        .bind(&amounts)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// What the ledger says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Ledger rows: applied credits, duplicates included.
    pub ledger_rows: i64,
    /// Distinct event IDs in the ledger.
    pub distinct_events: i64,
    /// Every account's balance equals the sum of its ledger rows.
    pub balances_exact: bool,
    /// The sum of all balances.
    pub total_balance: i64,
}

impl Summary {
    /// Ledger rows beyond the first per event.
    pub fn duplicates(&self) -> i64 {
        self.ledger_rows - self.distinct_events
    }

    /// Published events that never reached the ledger.
    pub fn lost(&self, published: i64) -> i64 {
        published - self.distinct_events
    }
}

/// How many distinct events the ledger holds: the events applied so far.
pub async fn applied<D: TestStore>(db: &D) -> i64 {
    db.summary().await.map_or(0, |s| s.distinct_events)
}

/// Reads the ledger.
pub async fn summary<D: TestStore>(db: &D) -> Result<Summary, sqlx::Error> {
    db.summary().await
}

/// One account's balance (0 when it has none).
pub async fn balance<D: TestStore>(db: &D, account_id: i64) -> i64 {
    db.balances()
        .await
        .ok()
        .and_then(|all| all.into_iter().find(|(id, _)| *id == account_id))
        .map_or(0, |(_, balance)| balance)
}
