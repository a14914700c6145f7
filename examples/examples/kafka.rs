//! Credits from a Kafka topic, each applied once though one is published twice:
//! `cargo run -p inbox-examples --example kafka` (`KAFKA_BROKERS`, `DATABASE_URL`).

use inbox_core::{async_trait, Consumer, Handler, HandlerError, Message, MessageId};
use inbox_kafka::{KafkaAdmin, KafkaConfig, KafkaProducer, Record};
use inbox_postgres::{PgInbox, PgTx};
use std::time::Duration;

struct Credit;

#[async_trait]
impl Handler<PgTx> for Credit {
    async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
        let (account, amount): (i64, i64) = m.json()?; // unparsable: dead-lettered, not retried
        sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
            .bind(amount)
            .bind(account)
            .execute(&mut **tx) // the inbox transaction: commits with the claim, or not at all
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/inbox".into());
    let pool = sqlx::PgPool::connect(&url).await?;
    let inbox = PgInbox::new(pool.clone());
    inbox.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS accounts (id bigserial PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)")
        .execute(&pool)
        .await?;
    let account: i64 = sqlx::query_scalar("INSERT INTO accounts DEFAULT VALUES RETURNING id")
        .fetch_one(&pool)
        .await?;

    let topic = format!("inbox-example-{}", uuid::Uuid::new_v4());
    KafkaAdmin::from_env()?.create_topic(&topic, 1).await?;
    let producer = KafkaProducer::from_env()?;
    let ids: Vec<MessageId> = (0..3).map(|_| MessageId::generate()).collect();
    let amounts = [100, 250, 40];
    for i in [0, 1, 2, 0] {
        // Event 0 twice, under one ID: a producer retrying after a lost acknowledgement.
        let record = Record::new(format!("[{account},{}]", amounts[i])).id(ids[i].clone());
        producer.send(&topic, record).await?;
    }

    let source = KafkaConfig::from_env(&topic, [&topic])
        .create_dead_letter_topics(true)
        .build()?;
    let consumer = Consumer::new("example-credits", source, inbox, Credit);
    let seen = consumer.stats();
    let all_seen = async move {
        while seen.snapshot().applied + seen.snapshot().skipped_duplicates < 4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // Stops once the four deliveries are applied or skipped; gives up after a minute.
    let stats =
        tokio::time::timeout(Duration::from_secs(60), consumer.run_until(all_seen)).await??;

    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(&pool)
        .await?;
    let expected: i64 = amounts.iter().sum();
    println!("kafka: balance {balance}, expected {expected}; {stats:?}");
    if balance != expected {
        return Err("the balance is not the sum of the distinct events".into());
    }
    Ok(())
}
