//! Credits from an SQS queue, each applied once though one is sent twice:
//! `cargo run -p inbox-examples --example sqs` (`AWS_ENDPOINT_URL_SQS`, `DATABASE_URL`).

mod common; // the wallet table, the events and the check, shared by the four examples

use common::{BoxError, Wallet};
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::PgTx;
use transactional_inbox::sqs::SqsConnection;
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
    // The AWS SDK's own chain: region and credentials from the environment, a profile or the
    // instance role; the endpoint is AWS's unless `AWS_ENDPOINT_URL_SQS` or `AWS_ENDPOINT_URL`
    // names another (`cargo xtask test` points them at its local SQS).
    let client = transactional_inbox::sqs::connect().await;
    let name = format!("inbox-example-{}", uuid::Uuid::new_v4());
    let created = client.create_queue().queue_name(name).send().await?;
    let queue = created.queue_url().ok_or("CreateQueue returned no URL")?;
    let sqs = SqsConnection::new(client); // the producer's and the source's
    let producer = sqs.producer().connect().await?;
    for (id, body) in wallet.sends() {
        producer.send_with_id(queue, &id, body.as_bytes()).await?;
    }

    let source = sqs.source(queue).connect().await?;
    let consumer = Consumer::new("example-credits", source, wallet.inbox.clone(), Credit);
    wallet.run_and_check(consumer).await
}
