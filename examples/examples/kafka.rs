//! Credits from a Kafka topic, each applied once though one is published twice:
//! `cargo run -p inbox-examples --example kafka` (`KAFKA_BROKERS`, `DATABASE_URL`).

mod common; // the wallet table, the events and the check, shared by the four examples

use common::{BoxError, Wallet};
use transactional_inbox::kafka::KafkaConnection;
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::PgTx;
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
    let topic = format!("inbox-example-{}", uuid::Uuid::new_v4());
    let kafka = KafkaConnection::from_env(); // brokers from KAFKA_BROKERS
    kafka.admin()?.create_topic(&topic, 1).await?;
    let producer = kafka.producer().connect().await?;
    for (id, payload) in wallet.sends() {
        producer
            .send_with_id(&topic, &id, payload.as_bytes())
            .await?;
    }

    let source = kafka
        .source([&topic], &topic) // topics, group
        .create_dead_letter_topics(true)
        .connect()
        .await?;
    let consumer = Consumer::new("example-credits", source, wallet.inbox.clone(), Credit);
    wallet.run_and_check(consumer).await
}
