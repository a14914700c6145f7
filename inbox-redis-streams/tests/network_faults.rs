//! Redis itself restarts while the consumer consumes (black-holed and cut connections are in the
//! conformance suite). A producer writes [`EVENTS`] credits at a steady pace straight to Redis
//! while the consumer, in this process, applies them to PostgreSQL; the restart must end, once
//! Redis is back, with every event in the ledger exactly once and nothing left pending, without
//! restarting the consumer.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{builder, pending_with, stream_key};
use inbox_conformance::wallet::{summary, Credit, CreditEvent};
use inbox_conformance::{wait_for_a_third, FaultRun, Restored, TestDb};
use inbox_core::{Consumer, MessageId, Publish};
use inbox_redis_streams::redis::{self, Client};
use inbox_redis_streams::RedisStreamProducer;
use inbox_testkit::{eventually, watch_errors};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const EVENTS: i64 = 300;
const ACCOUNTS: i64 = 7;
/// One event every this long: 300 events take about 4.5 s, so the consumer keeps up and sits
/// in its blocking read much of the time, and the fault hits reads and acks alike.
const PACE: Duration = Duration::from_millis(15);
/// How long a command may wait for Redis (the blocking read gets its `block` on top): a
/// black-holed connection is given up after this.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(1);
/// What a lost read or a failed ack left pending is reclaimed after this at the latest.
const CLAIM_IDLE: Duration = Duration::from_secs(2);
const SECOND: Duration = Duration::from_secs(1);

/// What the stream had left at the end.
#[derive(Debug)]
struct Left {
    /// Entries read by the group and not acked.
    pending: i64,
    /// Entries in the stream (retried sends may add a copy).
    stream_len: i64,
}

type Run = FaultRun<Left>;

/// Every event applied once, nothing pending, and the stream still holding every entry.
fn assert_exactly_once(run: &Run) {
    run.assert_exactly_once(EVENTS, (1..=EVENTS).sum());
    assert_eq!(run.broker.pending, 0, "entries left pending: {run:?}");
    assert!(
        run.broker.stream_len >= EVENTS,
        "entries gone from the stream: {run:?}"
    );
}

/// Writes the credits at [`PACE`], each retried under its own ID until Redis takes it (a retry
/// that reached Redis twice is applied once).
fn publish(client: Client, stream: String) -> JoinHandle<()> {
    let url = format!("redis://{}", client.get_connection_info().addr());
    tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut producer: Option<RedisStreamProducer> = None;
        for n in 0..EVENTS {
            let id = MessageId::generate();
            let event = CreditEvent::new(1 + n % ACCOUNTS, n + 1).to_json();
            loop {
                assert!(Instant::now() < deadline, "could not publish event {n}");
                let conn = match &producer {
                    Some(p) => p,
                    None => match RedisStreamProducer::builder().url(&url).connect().await {
                        Ok(p) => producer.insert(p),
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                };
                match conn.send_with_id(&stream, &id, &event).await {
                    Ok(_) => break,
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            tokio::time::sleep(PACE).await;
        }
    })
}

/// Consumes the credits over `consumer` (through a proxy or to a private server) while
/// `direct` publishes them, runs `fault` once a third is applied, and waits for the consumer
/// to finish by itself once the fault is over.
async fn consume_through(
    name: &str,
    consumer: Client,
    direct: Client,
    fault: impl Future<Output = ()>,
) -> Run {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
    let db = TestDb::new().await;
    let stream = stream_key(name);
    let source = builder(&stream, "c1")
        .claim_idle(CLAIM_IDLE)
        .operation_timeout(OPERATION_TIMEOUT)
        .client(consumer)
        .connect()
        .await
        .unwrap();
    let publishing = publish(direct.clone(), stream.clone());
    let consumer = Consumer::new(
        "wallet",
        source,
        db.inbox(),
        Credit::new(db.pool.clone()).work(Duration::from_millis(2)),
    )
    .batch_size(10)
    .error_backoff(Duration::from_millis(200));
    let stats = consumer.stats();
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let applied_at_fault = wait_for_a_third(&db.pool, EVENTS, 30 * SECOND).await;
    let (fault_started, detecting) = watch_errors(Arc::clone(&stats));
    fault.await;
    let Restored {
        at: restored,
        applied: applied_at_restore,
        progressed,
        first_progress,
    } = Restored::measure(&db.pool, EVENTS, 30 * SECOND).await;
    let fault_lasted = restored - fault_started;
    let mut conn = direct.get_multiplexed_async_connection().await.unwrap();
    let finished = progressed
        && eventually(60 * SECOND, || {
            let mut conn = conn.clone();
            let stream = stream.clone();
            let db = &db;
            async move {
                inbox_conformance::wallet::applied(&db.pool).await >= EVENTS
                    && pending_with(&mut conn, &stream).await == 0
            }
        })
        .await;
    let all_done = restored.elapsed();

    let _ = stop.send(());
    let stopped = tokio::time::timeout(30 * SECOND, running).await;
    detecting.abort();
    let detected = detecting.await.ok().flatten();
    let stopped_in_time = stopped.is_ok();
    let stats = match stopped {
        Ok(joined) => joined.unwrap().expect("the consumer stopped with an error"),
        Err(_) => {
            println!("{name}: the consumer did not stop within 30 s of shutdown");
            stats.snapshot()
        }
    };
    publishing.abort();
    let broker = Left {
        pending: pending_with(&mut conn, &stream).await,
        stream_len: redis::cmd("XLEN")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .unwrap(),
    };
    let run = Run {
        ledger: summary(&db.pool).await.unwrap(),
        stats,
        applied_at_fault,
        applied_at_restore,
        detected,
        fault_lasted,
        first_progress,
        all_done,
        broker,
    };
    run.report(name, EVENTS);
    assert!(
        progressed,
        "no progress within 30 s of Redis's return: {run:?}"
    );
    assert!(
        finished,
        "not finished within 60 s of Redis's return: {run:?}"
    );
    assert!(stopped_in_time, "the consumer did not stop: {run:?}");
    let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await;
    db.drop().await;
    run
}

/// A `redis-server` of this test's own, persisting every write to its append-only file, killed
/// when dropped (a panicking test included) with its directory removed.
struct PrivateRedis {
    port: u16,
    dir: PathBuf,
    process: Option<Child>,
}

impl PrivateRedis {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("inbox-redis-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            port,
            dir,
            process: None,
        };
        server.spawn().await;
        server
    }

    fn client(&self) -> Client {
        Client::open(format!("redis://127.0.0.1:{}", self.port)).unwrap()
    }

    /// Starts the server on its port and directory and waits for it to answer.
    async fn spawn(&mut self) {
        let server = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&server)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {server}: {e}; install Redis or set REDIS_SERVER")
            });
        self.process = Some(child);
        let client = self.client();
        let up = eventually(10 * SECOND, || async {
            let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                return false;
            };
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .is_ok()
        })
        .await;
        assert!(
            up,
            "the private redis-server did not answer on {}",
            self.port
        );
    }

    /// `SHUTDOWN`: Redis closes every client and exits, its append-only file complete.
    async fn shutdown(&mut self) {
        let mut conn = self
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").query_async(&mut conn).await;
        let process = self.process.as_mut().unwrap();
        let exited = eventually(10 * SECOND, || {
            let done = matches!(process.try_wait(), Ok(Some(_)));
            async move { done }
        })
        .await;
        assert!(exited, "redis-server did not exit after SHUTDOWN");
        self.process = None;
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn a_restarted_server_keeps_the_group_and_the_consumer_carries_on() {
    let mut server = PrivateRedis::start().await;
    let client = server.client();
    let fault = async {
        server.shutdown().await;
        tokio::time::sleep(2 * SECOND).await;
        server.spawn().await;
    };
    let run = consume_through("restart", client.clone(), client, fault).await;
    assert_exactly_once(&run);
    assert!(
        run.detected.is_some(),
        "the restart went unnoticed: {run:?}"
    );
}
