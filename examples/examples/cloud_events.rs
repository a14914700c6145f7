//! Credits sent as CloudEvents by a producer of another stack, each applied once though one is
//! sent twice: `cargo run -p inbox-examples --example cloud_events` (`REDIS_URL`, `DATABASE_URL`).
//!
//! The producer knows nothing of this crate: it adds structured-mode CloudEvents (a JSON event
//! with `specversion`, `id`, `source`, `type` and `data`) to a Redis stream with a plain `XADD`.
//! The source reads each message's ID from the event (`IdFrom::cloud_events()`); with
//! `IdFrom::cloud_events_source_and_id()` it would be `source` and `id` together. The same
//! `id_from` works on every broker: `ce_id` headers on Kafka, `cloudEvents_id` on RabbitMQ.

mod common; // the wallet table, the events and the check, shared by the broker examples

use common::{BoxError, Wallet};
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::PgTx;
use transactional_inbox::redis_streams::{redis, url_from_env, IdFrom, RedisStreamSource};
use transactional_inbox::{Consumer, Handler, HandlerError, Message, MessageId};

struct Credit;

impl Handler<PgTx> for Credit {
    async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
        // Unparsable: dead-lettered, not retried.
        let event: serde_json::Value = m.json()?;
        let (account, amount): (i64, i64) = serde_json::from_value(event["data"].clone())
            .map_err(|e| HandlerError::permanent(format!("the event's data is no credit: {e}")))?;
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
    // The other stack's producer: one XADD per event, the event as JSON in `payload`.
    let client = redis::Client::open(url_from_env()?)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    for (id, data) in wallet.sends() {
        let event = serde_json::json!({
            "specversion": "1.0",
            "id": id.as_str(),
            "source": "/billing/credits",
            "type": "com.example.credit",
            "datacontenttype": "application/json",
            "data": serde_json::from_str::<serde_json::Value>(&data)?,
        });
        redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("payload")
            .arg(event.to_string())
            .query_async::<String>(&mut conn)
            .await?;
    }

    let source = RedisStreamSource::builder(&stream, "example-credits") // stream, group
        .id_from(IdFrom::cloud_events())
        .connect()
        .await?;
    let consumer = Consumer::new("example-credits", source, wallet.inbox.clone(), Credit);
    wallet.run_and_check(consumer).await
}
