//! A call out of the process, made once per event: `Consumer::effects` reads payments from a
//! Redis stream and charges each through an HTTP payment provider, passing the event's
//! idempotency key and the lease's fencing token; `PgLeases` keeps each event's processing and
//! done row in PostgreSQL. Four events are published, one of them twice (same ID); then the
//! provider is asked how often it charged each.
//!
//! ```sh
//! cargo run -p inbox-examples --example effect_call
//! ```
//!
//! `DATABASE_URL` and `REDIS_URL` override the local defaults; `RUST_LOG=info` logs each message.

use std::env::var;
use std::time::Duration;

use transactional_inbox::effect::{not_applied, Effect, EffectHandler, OnUnknown};
use transactional_inbox::postgres::sqlx;
// A real HTTP server on loopback that deduplicates on `Idempotency-Key`: it stands in for a
// payment provider such as Stripe, and its client for the provider's SDK.
use inbox_conformance::provider::{ProviderClient, ProviderMode, TestProvider};
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::AssertSqlSafe;
use transactional_inbox::postgres::{PgInbox, PgLeases, PgTx};
use transactional_inbox::redis_streams::{redis, RedisStreamProducer, RedisStreamSource};
use transactional_inbox::{Consumer, HandlerError, Message, MessageId, Publish};

const DATABASE_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/inbox";
const REDIS_URL: &str = "redis://127.0.0.1:6379";
const CONSUMER: &str = "payments";

/// Charges each payment through the provider's client.
struct Charge(ProviderClient);

impl EffectHandler<PgTx> for Charge {
    fn on_unknown(&self) -> OnUnknown {
        OnUnknown::Retry // the provider deduplicates on the key: a retry cannot charge twice
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        // The key is `payments:<event ID>` on every redelivery; `?` (a cut connection): unknown.
        let (key, token) = (effect.idempotency_key(), effect.token());
        let reply = self.0.call(key, token, &message.payload).await?;
        match reply.status {
            200 => Ok(()),
            429 => Err(not_applied("rate limited")), // refused before charging anything
            _ => Err(HandlerError::transient(reply.body)), // outcome unknown: retried, same key
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let db_url = var("DATABASE_URL").unwrap_or_else(|_| DATABASE_URL.into());
    let redis_url = var("REDIS_URL").unwrap_or_else(|_| REDIS_URL.into());
    // Each run in a schema and a stream of its own, dropped at the end, so reruns start clean.
    let run = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let (schema, stream) = (format!("effect_call_{run}"), format!("payments-{run}"));
    let options: PgConnectOptions = db_url.parse()?;
    let pool = PgPool::connect_with(options.options([("search_path", &schema)])).await?;
    let create = format!("CREATE SCHEMA {schema}");
    sqlx::raw_sql(AssertSqlSafe(create)).execute(&pool).await?;
    let leases = PgLeases::new(PgInbox::new(pool.clone()))?; // table `inbox_effects`
    leases.migrate().await?;
    let provider = TestProvider::start(ProviderMode::Keys).await?;

    let producer = RedisStreamProducer::builder()
        .url(&redis_url)
        .connect()
        .await?;
    let ids: Vec<MessageId> = (0..4).map(|_| MessageId::generate()).collect();
    for (id, cents) in ids.iter().zip([1000, 2500, 300, 50]) {
        let payload = cents.to_string();
        producer
            .send_with_id(&stream, id, payload.as_bytes())
            .await?;
    }
    producer.send_with_id(&stream, &ids[0], b"1000").await?; // a retried publish: same ID

    let source = RedisStreamSource::builder(&stream, CONSUMER)
        .poll_timeout(Duration::from_millis(200)) // `run_until_idle` returns this soon
        .url(&redis_url)
        .connect()
        .await?;
    let charge = Charge(provider.client());
    let consumer = Consumer::effects(CONSUMER, source, leases, charge);
    let stats = consumer.run_until_idle().await?;

    let charged = |id: &MessageId| provider.effects(&id.idempotency_key(CONSUMER));
    let charges: Vec<usize> = ids.iter().map(charged).collect();
    println!(
        "5 entries (4 events, one twice): {} charged, {} duplicate skipped; charges per event \
         at the provider: {charges:?}",
        stats.applied, stats.skipped_duplicates
    );
    let drop_schema = format!("DROP SCHEMA {schema} CASCADE");
    sqlx::raw_sql(AssertSqlSafe(drop_schema))
        .execute(&pool)
        .await?;
    let client = redis::Client::open(redis_url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    redis::cmd("DEL").arg(&stream).exec_async(&mut conn).await?;
    if charges != [1, 1, 1, 1] {
        return Err(format!("each event should be charged once: {charges:?}").into());
    }
    println!("ok: each event charged exactly once");
    Ok(())
}
