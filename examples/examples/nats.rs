//! Credits from a NATS JetStream stream, each applied once though one is published twice:
//! `cargo run -p inbox-examples --example nats` (`NATS_URL`, `DATABASE_URL`).

mod common; // the wallet table, the events and the check, shared by the broker examples

use common::{BoxError, Wallet};
use transactional_inbox::nats::async_nats::jetstream::{self, stream};
use transactional_inbox::nats::{async_nats, NatsConnection};
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
    let name = format!("inbox-example-{}", uuid::Uuid::new_v4().simple());
    let (subject, dead_letters) = (format!("{name}.credits"), format!("{name}.dlq"));
    // One stream stores the credits and their dead letters (made here; usually by your setup).
    let js = jetstream::new(async_nats::connect(std::env::var("NATS_URL")?).await?);
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone(), dead_letters.clone()],
        ..Default::default()
    })
    .await?;

    let nats = NatsConnection::from_env(); // NATS at NATS_URL, for the producer and the source
    let producer = nats.producer().connect().await?;
    for (id, payload) in wallet.sends() {
        producer
            .send_with_id(&subject, &id, payload.as_bytes())
            .await?;
    }

    let source = nats
        .source(&name, "example-credits") // stream, durable consumer (created if missing)
        .filter_subject(&subject)
        .dead_letter_subject(&dead_letters)
        .connect()
        .await?;
    let consumer = Consumer::new("example-credits", source, wallet.inbox.clone(), Credit);
    let checked = wallet.run_and_check(consumer).await;
    js.delete_stream(&name).await?;
    checked
}
