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

use std::collections::HashMap;
use std::convert::Infallible;
use std::env::var;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::AssertSqlSafe;
use transactional_inbox::effect::{not_applied, Effect, EffectHandler, OnUnknown};
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::{PgInbox, PgLeases, PgTx};
use transactional_inbox::redis_streams::{redis, RedisConnection};
use transactional_inbox::{Consumer, HandlerError, Message, MessageId, Publish};

const DATABASE_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/inbox";
const REDIS_URL: &str = "redis://127.0.0.1:6379";
const CONSUMER: &str = "payments";

/// Charges each payment with `POST <url>`, through any HTTP client.
struct Charge {
    http: Client<HttpConnector, Full<Bytes>>,
    url: String,
}

impl EffectHandler<PgTx> for Charge {
    fn on_unknown(&self) -> OnUnknown {
        OnUnknown::Retry // the provider deduplicates on the key: a retry cannot charge twice
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        // The key is `payments:<event ID>` on every redelivery; `?` (a cut connection): unknown.
        let request = Request::post(&self.url)
            .header("Idempotency-Key", effect.idempotency_key())
            .header("Fencing-Token", effect.token())
            .body(Full::new(Bytes::copy_from_slice(&message.payload)))?;
        let reply = self.http.request(request).await?;
        match reply.status() {
            StatusCode::OK => Ok(()),
            StatusCode::TOO_MANY_REQUESTS => Err(not_applied("rate limited")), // charged nothing
            status => Err(HandlerError::transient(format!("provider: {status}"))), // unknown
        }
    }
}

/// A payment provider on loopback that charges once per `Idempotency-Key`, as Stripe does: a
/// repeated key answers as the first call did and charges nothing. It stands in for the real
/// provider so the example runs anywhere; it counts its charges per key.
#[derive(Clone, Default)]
struct Provider(Arc<Mutex<HashMap<String, usize>>>);

impl Provider {
    /// Serves on a free loopback port until the process ends; returns its URL.
    async fn start(&self) -> std::io::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/charges", listener.local_addr()?);
        let provider = self.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let provider = provider.clone();
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    let response = provider.charge(&request);
                    async move { Ok::<_, Infallible>(response) }
                });
                let http = hyper::server::conn::http1::Builder::new();
                tokio::spawn(http.serve_connection(TokioIo::new(stream), service));
            }
        });
        Ok(url)
    }

    fn charge(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        let key = request.headers().get("Idempotency-Key");
        let Some(key) = key.and_then(|k| k.to_str().ok()) else {
            let mut refused = Response::new(Full::from("an Idempotency-Key header, please"));
            *refused.status_mut() = StatusCode::BAD_REQUEST;
            return refused;
        };
        let mut charges = self.0.lock().unwrap_or_else(|e| e.into_inner());
        charges.entry(key.to_owned()).or_insert(1); // a key seen before charges nothing
        Response::new(Full::from("charged"))
    }

    fn charges(&self, key: &str) -> usize {
        let charges = self.0.lock().unwrap_or_else(|e| e.into_inner());
        charges.get(key).copied().unwrap_or(0)
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
    let provider = Provider::default();
    let url = provider.start().await?;

    let redis = RedisConnection::new(&redis_url); // the producer's and the source's
    let producer = redis.producer().connect().await?;
    let ids: Vec<MessageId> = (0..4).map(|_| MessageId::generate()).collect();
    for (id, cents) in ids.iter().zip([1000, 2500, 300, 50]) {
        let payload = cents.to_string();
        producer
            .send_with_id(&stream, id, payload.as_bytes())
            .await?;
    }
    producer.send_with_id(&stream, &ids[0], b"1000").await?; // a retried publish: same ID

    let source = redis
        .source(&stream, CONSUMER)
        .poll_timeout(Duration::from_millis(200)) // `run_until_idle` returns this soon
        .connect()
        .await?;
    let http = Client::builder(TokioExecutor::new()).build_http();
    let consumer = Consumer::effects(CONSUMER, source, leases, Charge { http, url });
    let stats = consumer.run_until_idle().await?;

    let charged = |id: &MessageId| provider.charges(&id.idempotency_key(CONSUMER));
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
