//! The `observability` example as an operator sees it: started as a process, fed through Redis,
//! scraped over HTTP. Its series exist and move with the work, `/readyz` answers 200 while it
//! runs, and SIGTERM stops it cleanly. And a trace started by a producer continues in the
//! consumer's handler, through the `traceparent` field of the stream entry, also when the
//! message went through an outbox row and its relay.
//!
//! Needs PostgreSQL and Redis (`cargo xtask services`).
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_conformance::wallet::{self, CreditEvent};
use inbox_conformance::TestDb;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::Command;
use tokio::time::{sleep, timeout, Instant};
use transactional_inbox::postgres::{Outbox, PgTx};
use transactional_inbox::redis_streams::{RedisConnection, RedisStreamProducer};
use transactional_inbox::{
    Consumer, Handler, HandlerError, Message, MessageId, OutgoingMessage, Publish, TraceParent,
};

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::random::<u64>() >> 16)
}

/// `GET path` over a fresh connection: the status and the body.
async fn get(addr: &str, path: &str) -> (u16, String) {
    request(addr, "GET", path).await
}

/// `method path` over a fresh connection: the status and the body.
async fn request(addr: &str, method: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    timeout(Duration::from_secs(10), stream.read_to_end(&mut reply))
        .await
        .expect("the endpoint answers")
        .unwrap();
    let reply = String::from_utf8(reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

/// The samples of a Prometheus text page: `name{labels}` → value.
fn samples(page: &str) -> HashMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The value of `name` for consumer `consumer` (and any other labels given, in the order the
/// exporter writes them), 0 when absent.
fn value(page: &HashMap<String, f64>, name: &str, labels: &str) -> f64 {
    page.get(&format!("{name}{{{labels}}}"))
        .copied()
        .unwrap_or(0.0)
}

async fn scrape(addr: &str) -> (String, HashMap<String, f64>) {
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    let parsed = samples(&body);
    (body, parsed)
}

/// Scrapes until `ready` says the page is there, for up to 60 s.
async fn scrape_until(
    addr: &str,
    what: &str,
    ready: impl Fn(&HashMap<String, f64>) -> bool,
) -> (String, HashMap<String, f64>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (page, parsed) = scrape(addr).await;
        if ready(&parsed) {
            return (page, parsed);
        }
        assert!(Instant::now() < deadline, "never saw {what}:\n{page}");
        sleep(Duration::from_millis(200)).await;
    }
}

async fn publish(producer: &RedisStreamProducer, stream: &str, events: &[(&str, i64, i64)]) {
    for (id, account, amount) in events {
        producer
            .send_with_id(
                stream,
                &MessageId::new(*id).unwrap(),
                &CreditEvent::new(*account, *amount).to_json(),
            )
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn the_example_exports_moving_series_and_is_ready_while_it_runs() {
    let db = TestDb::new().await;
    let stream = unique("inbox-test:observability");
    let consumer = unique("observed");
    let mut child = Command::new(env!("CARGO_BIN_EXE_observability"))
        .args(["--listen", "127.0.0.1:0", "--stream", &stream])
        .args(["--consumer", &consumer, "--schema", &db.schema])
        .args(["--batch", "10", "--retention", "7d", "--purge-every", "1s"])
        .env("REDIS_URL", redis_url())
        .env("DATABASE_URL", inbox_conformance::database_url())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the example starts within a minute")
        .unwrap()
        .expect("a first line");
    let addr = first
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_owned();

    let label = format!("consumer=\"{consumer}\"");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = get(&addr, "/readyz").await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {status} {body}");
        sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(get(&addr, "/healthz").await.0, 200);
    assert_eq!(
        request(&addr, "HEAD", "/readyz").await,
        (200, String::new())
    );
    assert_eq!(request(&addr, "POST", "/readyz").await.0, 405);
    assert_eq!(get(&addr, "/nothing-here").await.0, 404);

    // Before any message: described, ready, nothing applied.
    let (page, before) = scrape(&addr).await;
    assert!(
        page.contains("# HELP inbox_handler_duration_seconds"),
        "metrics are described:\n{page}"
    );
    assert_eq!(
        value(&before, "inbox_consumer_ready", &label),
        1.0,
        "{page}"
    );
    assert_eq!(value(&before, "inbox_retention_seconds", &label), 604_800.0);
    assert_eq!(value(&before, "inbox_messages_applied_total", &label), 0.0);

    let producer = RedisConnection::new(redis_url())
        .producer()
        .connect()
        .await
        .unwrap();
    publish(
        &producer,
        &stream,
        &[
            ("obs-1", 1, 10),
            ("obs-2", 2, 20),
            ("obs-3", 1, 5),
            ("obs-2", 2, 20), // the producer sent it twice
            ("obs-4", 3, 1),
        ],
    )
    .await;
    let (page, first) = scrape_until(&addr, "4 applied", |p| {
        value(p, "inbox_messages_applied_total", &label) == 4.0
            && value(p, "inbox_duplicates_skipped_total", &label) == 1.0
            && value(p, "inbox_ack_duration_seconds_count", &label) >= 1.0
    })
    .await;
    assert_eq!(value(&first, "inbox_messages_received_total", &label), 5.0);
    for histogram in [
        "inbox_batch_size",
        "inbox_claim_duration_seconds",
        "inbox_handler_duration_seconds",
        "inbox_commit_duration_seconds",
        "inbox_ack_duration_seconds",
    ] {
        let count = value(&first, &format!("{histogram}_count"), &label);
        assert!(count >= 1.0, "{histogram} has no observation:\n{page}");
        let inf = value(
            &first,
            &format!("{histogram}_bucket"),
            &format!("{label},le=\"+Inf\""),
        );
        assert_eq!(inf, count, "{histogram} is a real histogram:\n{page}");
    }
    // Redis entry IDs carry the time they were added: one lag sample per message settled.
    assert_eq!(
        value(&first, "inbox_end_to_end_lag_seconds_count", &label),
        5.0,
        "{page}"
    );
    assert!(
        page.contains(&format!("inbox_in_flight_messages{{{label}}}")),
        "{page}"
    );
    let (_, window) = scrape_until(&addr, "the inbox window gauge", |p| {
        p.contains_key(&format!("inbox_oldest_remembered_age_seconds{{{label}}}"))
    })
    .await;
    assert!(value(&window, "inbox_oldest_remembered_age_seconds", &label) < 3600.0);

    // What the user cares about: each credit once.
    assert_eq!(wallet::balance(&db, 1).await, 15);
    assert_eq!(wallet::balance(&db, 2).await, 20);

    // More work: the counters and histograms move.
    publish(&producer, &stream, &[("obs-5", 3, 2), ("obs-6", 4, 7)]).await;
    let (_, second) = scrape_until(&addr, "6 applied", |p| {
        value(p, "inbox_messages_applied_total", &label) == 6.0
    })
    .await;
    for histogram in [
        "inbox_handler_duration_seconds_count",
        "inbox_commit_duration_seconds_count",
        "inbox_end_to_end_lag_seconds_count",
    ] {
        assert!(
            value(&second, histogram, &label) > value(&first, histogram, &label),
            "{histogram} did not move"
        );
    }
    assert_eq!(get(&addr, "/readyz").await.0, 200, "ready while running");

    // SIGTERM: a graceful stop with the counters printed.
    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("stops within 30 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
    let mut rest = Vec::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        rest.push(line);
    }
    assert!(
        rest.iter().any(|l| l.starts_with("stopped: applied 6,")),
        "{rest:?}"
    );
    assert!(TcpStream::connect(&addr).await.is_err(), "endpoint closed");
    db.drop().await;
}

/// A message ID and the trace context its handler ran in.
type Seen = (String, Option<TraceParent>);

/// Records the trace context the handler runs in, per message.
#[derive(Clone, Default)]
struct SeenTraces(Arc<Mutex<Vec<Seen>>>);

impl Handler<PgTx> for SeenTraces {
    async fn handle(
        &self,
        _tx: &mut PgTx,
        id: &MessageId,
        _message: &Message,
    ) -> Result<(), HandlerError> {
        self.0
            .lock()
            .unwrap()
            .push((id.to_string(), TraceParent::current()));
        Ok(())
    }
}

// One thread: the tracing subscriber is this thread's default.
#[tokio::test(flavor = "current_thread")]
async fn a_trace_crosses_redis_into_the_handler() {
    use opentelemetry::trace::TracerProvider as _;
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;

    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
    let _default = tracing::subscriber::set_default(subscriber);

    let db = TestDb::new().await;
    let stream = unique("inbox-test:traceparent");
    let producer = RedisConnection::new(redis_url())
        .producer()
        .connect()
        .await
        .unwrap();
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    // Produced inside a request's span: the entry carries that span's context, and so does an
    // outbox row written in it.
    let request = tracing::info_span!("checkout");
    let sent_from = async {
        let here = TraceParent::current().expect("an OpenTelemetry context");
        producer
            .send_with_id(&stream, &MessageId::new("traced").unwrap(), b"{}")
            .await
            .unwrap();
        let relayed = OutgoingMessage::new(MessageId::new("relayed").unwrap(), "{}");
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .write_message(&mut tx, &stream, &relayed)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        here
    }
    .instrument(request)
    .await;
    // And one produced outside any span: no header, a trace of its own.
    producer
        .send_with_id(&stream, &MessageId::new("untraced").unwrap(), b"{}")
        .await
        .unwrap();
    // The relay runs outside any span: the row brings its writer's context.
    let relay = outbox.relay(producer.clone()).run_until_idle();
    assert_eq!(relay.await.unwrap().published, 1);

    let source = RedisConnection::new(redis_url())
        .source(&stream, "g")
        .poll_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let seen = SeenTraces::default();
    Consumer::new("traced", source, db.inbox(), seen.clone())
        .run_until_idle()
        .await
        .unwrap();

    let seen = seen.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let (id, traced) = &seen[0];
    assert_eq!(id, "traced");
    let traced = traced.expect("the handler runs in a trace");
    assert_eq!(
        traced.trace_id(),
        sent_from.trace_id(),
        "the handler continues the producer's trace"
    );
    assert_ne!(
        traced.parent_id(),
        sent_from.parent_id(),
        "in a span of its own"
    );
    let (id, untraced) = &seen[1];
    assert_eq!(id, "untraced");
    assert_ne!(
        untraced.expect("still traced, as a new trace").trace_id(),
        sent_from.trace_id()
    );
    let (id, relayed) = &seen[2];
    assert_eq!(id, "relayed");
    assert_eq!(
        relayed.expect("traced").trace_id(),
        sent_from.trace_id(),
        "the handler continues the outbox writer's trace, not the relay's"
    );
    db.drop().await;
}
