//! Inbox, then outbox: consumer A reads orders from one Redis stream and, in its inbox
//! transaction, writes a credit for each into the outbox table; an `OutboxRelay` publishes the
//! committed rows to a second stream; consumer B adds each credit to an `accounts` table. Four
//! orders are published, one of them twice (same ID); then the balances are checked.
//!
//! ```sh
//! cargo run -p inbox-examples --example outbox
//! ```
//!
//! `DATABASE_URL` and `REDIS_URL` override the local defaults; `RUST_LOG=info` logs each message.

use std::env::var;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::AssertSqlSafe;
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::{Outbox, PgInbox, PgTx};
use transactional_inbox::redis_streams::{redis, RedisConnection};
use transactional_inbox::{Consumer, Handler, HandlerError, Message, MessageId, Publish};

const DATABASE_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/inbox";
const REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Consumer A: forwards each order through the outbox `.0` to the stream named `.1`.
struct Forward(Outbox, String);

impl Handler<PgTx> for Forward {
    async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
        // Commits with the inbox claim or not at all; the relay sends it under one stable ID.
        self.0.write(tx, &self.1, &m.payload).await?;
        Ok(())
    }
}

/// Consumer B: adds `[account, amount]` to the account's balance.
struct Credit;

impl Handler<PgTx> for Credit {
    async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
        let (account, amount): (i64, i64) = m.json()?;
        sqlx::query("UPDATE accounts SET balance = balance + $2 WHERE id = $1")
            .bind(account)
            .bind(amount)
            .execute(&mut **tx) // the inbox transaction: commits with the claim, or not at all
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let db_url = var("DATABASE_URL").unwrap_or_else(|_| DATABASE_URL.into());
    let redis_url = var("REDIS_URL").unwrap_or_else(|_| REDIS_URL.into());
    // Each run in a schema and streams of its own, dropped at the end, so reruns start clean.
    let run = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let schema = format!("outbox_{run}");
    let (orders, credits) = (format!("orders-{run}"), format!("credits-{run}"));
    let options: PgConnectOptions = db_url.parse()?;
    let pool = PgPool::connect_with(options.options([("search_path", &schema)])).await?;
    let setup = format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO {schema}.accounts VALUES (1, 0), (2, 0);"
    );
    sqlx::raw_sql(AssertSqlSafe(setup)).execute(&pool).await?;
    let (inbox, outbox) = (PgInbox::new(pool.clone()), Outbox::new(pool.clone()));
    inbox.migrate().await?;
    outbox.migrate().await?;

    // One producer for both streams: each send names its stream.
    let redis = RedisConnection::new(&redis_url); // the producer's and the sources'
    let producer = redis.producer().connect().await?;
    let ids: Vec<MessageId> = (0..4).map(|_| MessageId::generate()).collect();
    let orders_json = ["[1, 100]", "[2, 250]", "[1, 30]", "[2, 5]"]; // [account, amount]
    for (id, order) in ids.iter().zip(orders_json) {
        producer.send_with_id(&orders, id, order.as_bytes()).await?;
    }
    let retry = orders_json[0].as_bytes();
    producer.send_with_id(&orders, &ids[0], retry).await?; // a retried publish: same ID

    // A short poll wait, so that each `run_until_idle` returns soon after the stream is read.
    let poll = Duration::from_millis(200);
    let source =
        |stream: &str, group: &str| redis.source(stream, group).poll_timeout(poll).connect();
    // In production the three run side by side, each with `run()`; here one after the other.
    let forward = Forward(outbox.clone(), credits.clone());
    let from_orders = source(&orders, "forward").await?;
    let a = Consumer::new("forward", from_orders, inbox.clone(), forward);
    let a = a.run_until_idle().await?;
    let relay = outbox.relay(producer).run_until_idle().await?; // to `credits`, from the rows
    let from_credits = source(&credits, "credit").await?;
    let b = Consumer::new("credit", from_credits, inbox, Credit);
    let b = b.run_until_idle().await?;

    let sql = "SELECT id, balance FROM accounts ORDER BY id";
    let balances: Vec<(i64, i64)> = sqlx::query_as(sql).fetch_all(&pool).await?;
    println!(
        "A: {} forwarded, {} duplicate skipped; relay: {} published; B: {} credited; \
         balances {balances:?}",
        a.applied, a.skipped_duplicates, relay.published, b.applied
    );
    let drop_schema = format!("DROP SCHEMA {schema} CASCADE");
    sqlx::raw_sql(AssertSqlSafe(drop_schema))
        .execute(&pool)
        .await?;
    let client = redis::Client::open(redis_url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let keys = [&orders, &credits];
    redis::cmd("DEL").arg(&keys).exec_async(&mut conn).await?;
    if balances != [(1, 130), (2, 255)] || b.applied != 4 {
        return Err(format!("each order should be credited once: {balances:?}").into());
    }
    println!("ok: each order credited exactly once");
    Ok(())
}
