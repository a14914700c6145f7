//! A wallet consumer run the way production runs it: Redis Streams into PostgreSQL, with
//! Prometheus metrics (`metrics-exporter-prometheus`), `/healthz`, `/readyz` (what
//! `transactional_inbox::Probes` answers) and `/metrics` served by hyper, the inbox purger with its
//! window gauge, and a graceful stop on SIGTERM or Ctrl-C.
//!
//! ```sh
//! cargo run -p inbox-examples --bin observability -- --listen 127.0.0.1:9464
//! curl -s 127.0.0.1:9464/metrics | grep inbox_
//! ```
//!
//! Publish credit events (`{"account_id": 1, "amount": 5}` with an `event_id` field) to the
//! stream; `docs/dashboards/inbox.json` and `docs/alerts/inbox.rules.yml` read what it exports.
//! It prints `listening on http://<address>` once the endpoint is up.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::AssertSqlSafe;
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::{spawn_purger, PgInbox, PgTx, TableName};
use transactional_inbox::redis_streams::RedisConnection;
use transactional_inbox::{
    BatchHandler, BatchItem, BoxError, Consumer, HandlerError, Message, MessageId, Probes,
};

/// Histogram buckets of the `*_seconds` metrics: 1 ms to 1 min.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Buckets of `inbox_batch_size`.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// One wallet consumer on Redis Streams with metrics and probes.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Where `/healthz`, `/readyz` and `/metrics` are served (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:9464")]
    listen: SocketAddr,
    /// The stream to consume.
    #[arg(long, default_value = "wallet-credits")]
    stream: String,
    /// The Redis consumer group.
    #[arg(long, default_value = "wallet")]
    group: String,
    /// The inbox consumer name (the `consumer` label of every metric).
    #[arg(long, default_value = "wallet-credits")]
    consumer: String,
    /// Messages per transaction.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// The PostgreSQL schema of the wallet tables and the inbox; created if missing.
    #[arg(long, default_value = "public")]
    schema: String,
    /// How long the inbox remembers IDs (purged after that).
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// How often the purger runs and refreshes `inbox_oldest_remembered_age_seconds`.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    purge_every: Duration,
    /// PostgreSQL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres:postgres@127.0.0.1:5432/inbox",
        hide_env_values = true
    )]
    database_url: String,
    /// Redis.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    redis_url: String,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    // Real histograms (buckets) rather than summaries, so quantiles aggregate across instances.
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(transactional_inbox::telemetry::BATCH_SIZE.into()),
            BATCH_BUCKETS,
        )?
        .install_recorder()?;
    transactional_inbox::describe_metrics();
    let upkeep = {
        let prometheus = prometheus.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                prometheus.run_upkeep();
            }
        })
    };

    let options: PgConnectOptions = args.database_url.parse()?;
    let schema = TableName::qualified(&args.schema, "inbox")?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.options([("search_path", args.schema.as_str())]))
        .await
        .map_err(|e| {
            format!(
                "cannot reach PostgreSQL at {}: {e}",
                transactional_inbox::redact_url(&args.database_url)
            )
        })?;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS \"{}\"",
        args.schema
    )))
    .execute(&pool)
    .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts \
         (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)",
    )
    .execute(&pool)
    .await?;
    let inbox = PgInbox::new(pool).with_table(schema);
    inbox.migrate().await?;

    let source = RedisConnection::new(&args.redis_url)
        .source(&args.stream, &args.group)
        .consumer_name(format!("{}-{}", args.consumer, std::process::id()))
        .connect()
        .await?;
    let consumer = Consumer::batched(&args.consumer, source, inbox.clone(), Credits)
        .batch_size(args.batch)
        .inbox_retention(args.retention)
        .handler_timeout(Duration::from_secs(30));
    let purger = spawn_purger(inbox, args.retention, args.purge_every);

    let probes = Probes::new().consumer(consumer.health());
    let render = move || prometheus.render();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on http://{}", listener.local_addr()?)?;
    stdout.flush()?;
    let serving = tokio::spawn(serve(listener, probes, render));
    // Until SIGTERM or Ctrl-C; the batch in flight is finished and acked first.
    let ran = consumer.run().await;
    purger.abort();
    upkeep.abort();
    serving.abort();
    let stats = ran?;
    writeln!(
        stdout,
        "stopped: applied {}, skipped {}, dead-lettered {}",
        stats.applied, stats.skipped_duplicates, stats.dead_lettered
    )?;
    Ok(())
}

/// A credit event, as the stream carries it: `{"account_id": 1, "amount": 5}`.
#[derive(Debug, Deserialize)]
struct Credit {
    account_id: i64,
    amount: i64,
}

/// Credits a batch of events in its inbox transaction, in one statement: the amounts summed
/// per account and added to its balance (the account created at its first credit).
struct Credits;

impl BatchHandler<PgTx> for Credits {
    type Item = Credit;

    fn decode(&self, _id: &MessageId, message: &Message) -> Result<Credit, HandlerError> {
        message.json()
    }

    async fn handle_batch(
        &self,
        tx: &mut PgTx,
        batch: &[BatchItem<'_, Credit>],
    ) -> Result<(), HandlerError> {
        let accounts: Vec<i64> = batch.iter().map(|b| b.item.account_id).collect();
        let amounts: Vec<i64> = batch.iter().map(|b| b.item.amount).collect();
        sqlx::query(
            "INSERT INTO accounts (id, balance) \
             SELECT id, sum(amount) FROM unnest($1::bigint[], $2::bigint[]) AS c(id, amount) \
             GROUP BY id \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&accounts)
        .bind(&amounts)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// Serves `/healthz`, `/livez`, `/readyz` and `/metrics` (GET or HEAD) until aborted, one task
/// per connection.
async fn serve(
    listener: tokio::net::TcpListener,
    probes: Probes,
    render: impl Fn() -> String + Send + Sync + 'static,
) {
    let routes = Arc::new((probes, render));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: wait instead of spinning.
                tracing::warn!(error = %e, "cannot accept a probe connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let routes = Arc::clone(&routes);
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let (probes, render) = &*routes;
            let response = respond(&request, probes, render);
            async move { Ok::<_, Infallible>(response) }
        });
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "probe connection failed");
            }
        });
    }
}

fn respond(
    request: &Request<Incoming>,
    probes: &Probes,
    render: &impl Fn() -> String,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD\n".into());
    }
    let path = request.uri().path();
    if path == "/metrics" {
        let mut response = text(StatusCode::OK, render());
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        return response;
    }
    match probes.answer(path) {
        Some(answer) => text(
            StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            answer.body,
        ),
        None => text(
            StatusCode::NOT_FOUND,
            "not found; try /healthz, /readyz or /metrics\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}
