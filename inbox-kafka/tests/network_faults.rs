//! The network between the consumer and the broker fails while it consumes: black-holed, or cut
//! again and again. Kafka clients connect to the address the broker advertises, not the one
//! they were given, so a proxy in front of a shared broker would only see the bootstrap. Each
//! test therefore runs a private Tansu listening on one port and advertising a [`FaultProxy`]
//! that forwards to it: every byte the consumer (and its commits and heartbeats) exchanges with
//! the broker crosses the proxy. Each fault must end, once the network is back, with every event
//! in the ledger exactly once and nothing left uncommitted, without restarting the consumer.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::Running;
use inbox_conformance::wallet::{summary, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_conformance::{wait_for_a_third, Restored};
use inbox_conformance::{FaultProxy, FaultRun, ProxyMode};
use inbox_core::OutgoingMessage;
use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use inbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use inbox_kafka::{KafkaAdmin, KafkaProducer, KafkaSource};
use inbox_testkit::{eventually, watch_errors};

const EVENTS: i64 = 300;
const PARTITIONS: i32 = 3;
const SECOND: Duration = Duration::from_secs(1);

/// A Tansu broker of this test's own (in-memory storage), reachable only through `proxy`;
/// killed when dropped, a panicking test included.
struct PrivateTansu {
    process: Child,
    proxy: FaultProxy,
}

impl PrivateTansu {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let listener: SocketAddr = ([127, 0, 0, 1], port).into();
        let proxy = FaultProxy::start(listener).await.unwrap();
        let tansu = std::env::var("TANSU").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            format!("{home}/.cargo/bin/tansu")
        });
        let process = Command::new(&tansu)
            .arg("broker")
            .args(["--storage-engine", "memory://tansu/"])
            .args(["--listener-url", &format!("tcp://{listener}")])
            .args([
                "--advertised-listener-url",
                &format!("tcp://{}", proxy.addr()),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {tansu}: {e}; install Tansu or set TANSU"));
        let server = Self { process, proxy };
        let up = eventually(10 * SECOND, || async {
            tokio::net::TcpStream::connect(listener).await.is_ok()
        })
        .await;
        assert!(up, "the private Tansu did not listen on {listener}");
        server
    }

    /// Where clients connect: the proxy.
    fn brokers(&self) -> String {
        self.proxy.addr().to_string()
    }
}

impl Drop for PrivateTansu {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// What the group had left at the end.
#[derive(Debug)]
struct Left {
    /// Records not committed by the group.
    uncommitted: i64,
}

type Run = FaultRun<Left>;

/// Every event applied once, adding up to `total`, and every record committed.
fn assert_exactly_once(run: &Run, total: i64) {
    run.assert_exactly_once(EVENTS, total);
    assert_eq!(
        run.broker.uncommitted, 0,
        "records left uncommitted: {run:?}"
    );
}

/// Records of `topic` not committed by `group`, summed over its partitions.
fn lag(brokers: &str, topic: &str, group: &str) -> i64 {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        list.add_partition(topic, p);
    }
    let committed = consumer.committed_offsets(list, 10 * SECOND).unwrap();
    let mut lag = 0;
    for p in 0..PARTITIONS {
        let (low, high) = consumer.fetch_watermarks(topic, p, 10 * SECOND).unwrap();
        let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => low,
        };
        lag += high - at;
    }
    lag
}

/// Publishes [`EVENTS`] credits to a private broker, consumes them through its proxy with a
/// fetch queue kept short (so the consumer keeps needing the broker), runs `fault` once a
/// third is applied and waits for the consumer to finish by itself.
async fn consume_through(
    name: &str,
    tansu: &PrivateTansu,
    fault: impl Future<Output = ()>,
) -> (Run, i64) {
    common::init_tracing();
    let brokers = tansu.brokers();
    let topic = common::random("inbox-faults");
    let group = common::random("wallet");
    let admin = KafkaAdmin::new(&brokers).unwrap();
    admin.create_topic(&topic, PARTITIONS).await.unwrap();
    admin
        .create_topic(&format!("{topic}.dlq"), 1)
        .await
        .unwrap();
    let producer = KafkaProducer::builder()
        .brokers(&brokers)
        .connect()
        .await
        .unwrap();
    let mut total = 0;
    for i in 0..EVENTS {
        let event = CreditEvent::new(i % 7 + 1, i % 50 + 1);
        total += event.amount;
        let credit = OutgoingMessage::generate(event.to_json());
        let partition = Some(i as i32 % PARTITIONS);
        producer.send_to(&topic, partition, &credit).await.unwrap();
    }
    drop(producer);

    let db = TestDb::new().await;
    let source = KafkaSource::builder([&topic], &group)
        .brokers(&brokers)
        .poll_timeout(Duration::from_millis(500))
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "1000")
        // A short local queue: the consumer fetches as it goes, so the fault meets fetches as
        // well as commits.
        .set_consumer("queued.min.messages", "10")
        .set_consumer("max.partition.fetch.bytes", "2048")
        .connect()
        .await
        .unwrap();
    let handler = Credit::new(db.pool.clone()).work(Duration::from_millis(10));
    let running = Running::start("wallet", source, db.inbox(), handler, 10);

    let applied_at_fault = wait_for_a_third(&db.pool, EVENTS, 60 * SECOND).await;
    let (fault_started, detecting) = watch_errors(Arc::clone(&running.stats));
    fault.await;
    let Restored {
        at: restored,
        applied: applied_at_restore,
        progressed,
        first_progress,
    } = Restored::measure(&db.pool, EVENTS, 120 * SECOND).await;
    let fault_lasted = restored - fault_started;
    let lag_now = || {
        let (b, t, g) = (brokers.clone(), topic.clone(), group.clone());
        async move {
            tokio::task::spawn_blocking(move || lag(&b, &t, &g))
                .await
                .unwrap()
        }
    };
    let finished = progressed
        && eventually(120 * SECOND, || async {
            inbox_conformance::wallet::applied(&db.pool).await >= EVENTS && lag_now().await == 0
        })
        .await;
    let all_done = restored.elapsed();

    let stats = running.stats.snapshot();
    let stopped = tokio::time::timeout(30 * SECOND, running.stop()).await;
    detecting.abort();
    let detected = detecting.await.ok().flatten();
    let stopped_in_time = stopped.is_ok();
    let stats = match stopped {
        Ok(result) => result.expect("the consumer stopped with an error"),
        Err(_) => stats,
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
        broker: Left {
            uncommitted: lag_now().await,
        },
    };
    run.report(name, EVENTS);
    assert!(
        progressed,
        "no progress within 120 s of the network's return: {run:?}"
    );
    assert!(
        finished,
        "not finished within 120 s of the network's return: {run:?}"
    );
    assert!(
        stopped_in_time,
        "the consumer did not stop within 30 s: {run:?}"
    );
    db.drop().await;
    (run, total)
}

/// These tests bring their own broker, not the one at KAFKA_BROKERS: on the mock cluster's run
/// they would only repeat the Tansu run.
fn skipped_on_mock() -> bool {
    common::skip_on_mock(
        "the test runs a private Tansu advertised through a fault proxy, whatever KAFKA_BROKERS \
         says; the mock cluster cannot take its place, as it advertises its own listeners and \
         the client would bypass the proxy",
    )
}

#[tokio::test]
async fn a_black_holed_broker_connection_recovers_by_itself() {
    if skipped_on_mock() {
        return;
    }
    let tansu = PrivateTansu::start().await;
    let fault = async {
        tansu.proxy.set_mode(ProxyMode::Blackhole);
        tokio::time::sleep(4 * SECOND).await;
        tansu.proxy.set_mode(ProxyMode::Pass);
    };
    let (run, total) = consume_through("blackhole", &tansu, fault).await;
    assert_exactly_once(&run, total);
    // The dead connections are given up after the operation timeout (10 s), not librdkafka's
    // default socket timeout of 60 s.
    assert!(
        run.first_progress < 30 * SECOND,
        "stuck on dead connections long after the network came back: {run:?}"
    );
}

#[tokio::test]
async fn broker_connections_cut_again_and_again_lose_and_repeat_nothing() {
    if skipped_on_mock() {
        return;
    }
    let tansu = PrivateTansu::start().await;
    let fault = async {
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            tansu.proxy.cut();
        }
    };
    let (run, total) = consume_through("cuts", &tansu, fault).await;
    assert_exactly_once(&run, total);
}
