//! What the broker examples share: the wallet's table, the events they send, and the check
//! that each was applied once.

use std::time::Duration;

use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::{PgInbox, PgTx};
use transactional_inbox::{BatchHandler, Consumer, Inbox, MessageId, MessageSource};

pub(crate) type BoxError = Box<dyn std::error::Error>;

/// The amounts of the three distinct credit events.
const AMOUNTS: [i64; 3] = [100, 250, 40];

/// An account of its own in `accounts`, and the inbox, on `DATABASE_URL`.
pub(crate) struct Wallet {
    pool: sqlx::PgPool,
    pub(crate) inbox: PgInbox,
    account: i64,
}

impl Wallet {
    pub(crate) async fn open() -> Result<Self, BoxError> {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/inbox".into());
        let pool = sqlx::PgPool::connect(&url).await?;
        let inbox = PgInbox::new(pool.clone());
        inbox.migrate().await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS accounts \
             (id bigserial PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)",
        )
        .execute(&pool)
        .await?;
        let account = sqlx::query_scalar("INSERT INTO accounts DEFAULT VALUES RETURNING id")
            .fetch_one(&pool)
            .await?;
        Ok(Self {
            pool,
            inbox,
            account,
        })
    }

    /// The four sends, as (ID, payload `[account, amount]`): event 0 goes twice under one ID, as
    /// from a producer retrying after a lost acknowledgement.
    pub(crate) fn sends(&self) -> Vec<(MessageId, String)> {
        let ids: Vec<MessageId> = (0..3).map(|_| MessageId::generate()).collect();
        [0, 1, 2, 0]
            .into_iter()
            .map(|i| (ids[i].clone(), format!("[{},{}]", self.account, AMOUNTS[i])))
            .collect()
    }

    /// Runs `consumer` until the four deliveries are applied or skipped (a minute at most), then
    /// checks the balance is the sum of the three distinct events.
    #[allow(dead_code)] // the replay example sees one copy per ID: `run_and_check_seeing`
    pub(crate) async fn run_and_check<S, H>(
        &self,
        consumer: Consumer<S, Inbox<PgInbox, H>>,
    ) -> Result<(), BoxError>
    where
        S: MessageSource,
        H: BatchHandler<PgTx>,
    {
        self.run_and_check_seeing(consumer, 4).await
    }

    /// As [`Wallet::run_and_check`], until `deliveries` are applied or skipped.
    pub(crate) async fn run_and_check_seeing<S, H>(
        &self,
        consumer: Consumer<S, Inbox<PgInbox, H>>,
        deliveries: u64,
    ) -> Result<(), BoxError>
    where
        S: MessageSource,
        H: BatchHandler<PgTx>,
    {
        let seen = consumer.stats();
        let all_seen = async move {
            while seen.snapshot().applied + seen.snapshot().skipped_duplicates < deliveries {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let stats =
            tokio::time::timeout(Duration::from_secs(60), consumer.run_until(all_seen)).await??;
        let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
            .bind(self.account)
            .fetch_one(&self.pool)
            .await?;
        let expected: i64 = AMOUNTS.iter().sum();
        println!("balance {balance}, expected {expected}; {stats:?}");
        if balance != expected {
            return Err("the balance is not the sum of the distinct events".into());
        }
        Ok(())
    }
}
