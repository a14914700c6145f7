//! Credits from a Redis stream into MySQL or MariaDB, each applied once though one is added
//! twice: `cargo run -p inbox-examples --example mysql` (`REDIS_URL`, `INBOX_MYSQL_URL`).
//! The same consumer as `redis_streams`, on the second store.

use std::time::Duration;

use transactional_inbox::mysql::{sqlx, MySqlInbox, MySqlTx};
use transactional_inbox::redis_streams::{RedisStreamProducer, RedisStreamSource};
use transactional_inbox::{Consumer, Handler, HandlerError, Message, MessageId, Publish};

type BoxError = Box<dyn std::error::Error>;

struct Credit;

impl Handler<MySqlTx> for Credit {
    async fn handle(
        &self,
        tx: &mut MySqlTx,
        _: &MessageId,
        m: &Message,
    ) -> Result<(), HandlerError> {
        let (account, amount): (i64, i64) = m.json()?; // unparsable: dead-lettered, not retried
        sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = ?")
            .bind(amount)
            .bind(account)
            .execute(&mut **tx) // the inbox transaction: commits with the claim, or not at all
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("INBOX_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://inbox:inbox@127.0.0.1:3306/inbox".into());
    let pool = sqlx::MySqlPool::connect(&url).await?;
    let inbox = MySqlInbox::new(pool.clone());
    inbox.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts \
         (id bigint AUTO_INCREMENT PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)",
    )
    .execute(&pool)
    .await?;
    let account = sqlx::query("INSERT INTO accounts () VALUES ()")
        .execute(&pool)
        .await?
        .last_insert_id();

    // Three events, the first sent twice under one ID, as by a producer retrying after a lost
    // acknowledgement.
    let amounts = [100, 250, 40];
    let ids: Vec<MessageId> = (0..3).map(|_| MessageId::generate()).collect();
    let stream = format!("inbox-example-{}", uuid::Uuid::new_v4());
    let producer = RedisStreamProducer::builder().connect().await?; // Redis at REDIS_URL
    for i in [0, 1, 2, 0] {
        let payload = format!("[{account},{}]", amounts[i]);
        producer
            .send_with_id(&stream, &ids[i], payload.as_bytes())
            .await?;
    }

    let source = RedisStreamSource::builder(&stream, "example-credits") // stream, group
        .connect()
        .await?;
    let consumer = Consumer::new("example-credits", source, inbox, Credit);
    let seen = consumer.stats();
    let all_seen = async move {
        while seen.snapshot().applied + seen.snapshot().skipped_duplicates < 4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let stats =
        tokio::time::timeout(Duration::from_secs(60), consumer.run_until(all_seen)).await??;
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = ?")
        .bind(account)
        .fetch_one(&pool)
        .await?;
    let expected: i64 = amounts.iter().sum();
    println!("balance {balance}, expected {expected}; {stats:?}");
    if balance != expected {
        return Err("the balance is not the sum of the distinct events".into());
    }
    Ok(())
}
