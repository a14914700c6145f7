//! Credits from a Redis stream, each applied once though one is added twice:
//! `cargo run -p inbox-examples --example redis_streams` (`REDIS_URL`, `DATABASE_URL`).

mod common; // the wallet table, the events and the check, shared by the four examples

use common::{BoxError, Wallet};
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::PgTx;
use transactional_inbox::redis_streams::RedisConnection;
use transactional_inbox::{Consumer, Handler, HandlerError, Message, MessageId, Publish};

struct Credit;

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
async fn main() -> Result<(), BoxError> {
    let wallet = Wallet::open().await?;
    let stream = format!("inbox-example-{}", uuid::Uuid::new_v4());
    let redis = RedisConnection::from_env(); // Redis at REDIS_URL, for the producer and the source
    let producer = redis.producer().connect().await?;
    for (id, payload) in wallet.sends() {
        producer
            .send_with_id(&stream, &id, payload.as_bytes())
            .await?;
    }

    let source = redis.source(&stream, "example-credits").connect().await?; // stream, group
    let consumer = Consumer::new("example-credits", source, wallet.inbox.clone(), Credit);
    wallet.run_and_check(consumer).await
}
