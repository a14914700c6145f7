//! `inbox-admin dead-letters` reaching brokers as managed ones are reached: servers of the
//! test's own that take TLS only, with a CA made at test time (Kafka through a `--kafka-config`
//! file of `security.protocol=ssl` and `ssl.ca.location=`, with `-X` beside it, RabbitMQ through `amqps://` and `--amqp-ca`,
//! Redis through `rediss://` and `--redis-ca`), and a Redis Cluster (`--redis-cluster`, over TLS
//! with `--redis-ca` too).
//!
//! On each, the adapter's own consumer dead-letters a batch over TLS while the downstream is
//! down; the CLI lists the batch and replays it; a consumer reads it back from the source over
//! TLS and applies each credit once; nothing stays parked. The same command without the CA is
//! refused, saying why, well before a minute. A server that cannot start fails the test.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::future::Future;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use inbox_conformance::kafka::{config_on, PrivateTansu};
use inbox_conformance::rabbitmq::tls_node::TlsNode;
use inbox_conformance::redis::{LocalCluster, TlsRedis};
use inbox_conformance::tls::TestCa;
use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::{unique_name, TestDb};
use inbox_core::{
    Consumer, Handler, HandlerError, Message, MessageId, MessageSource, OutgoingMessage, Publish,
    StatsSnapshot,
};
use inbox_kafka::KafkaConnection;
use inbox_rabbitmq::RabbitConnection;
use inbox_redis_streams::redis::{Client, TlsCertificates};
use inbox_redis_streams::RedisConnection;

use crate::common;
use common::*;

/// Credits dead-lettered and replayed per broker.
const N: i64 = 5;

/// The reason every credit fails with while the downstream is down.
const DOWN: &str = "downstream down";

/// How long one CLI command may run, a refused connection included.
const LIMIT: Duration = Duration::from_secs(60);

/// How long a broker's consumers may take to park or to apply the batch.
const DRAIN: Duration = Duration::from_secs(120);

/// A handler whose downstream is down: every credit fails for good, and is dead-lettered.
struct Down;

impl<T: Send> Handler<T> for Down {
    async fn handle(&self, _: &mut T, _: &MessageId, _: &Message) -> Result<(), HandlerError> {
        Err(HandlerError::permanent(DOWN))
    }
}

/// One broker as the scenario reaches it: the adapter's producer and sources, built from a
/// connection trusting the test CA, and the CLI flags that reach the same broker.
struct Reached<P, F> {
    /// `--broker`.
    broker: &'static str,
    /// The queue, topic or stream the credits are sent to and replayed to.
    source: String,
    /// `--from`: its dead-letter destination.
    dead_letters: String,
    /// How the CLI reaches the broker, the CA included.
    flags: Vec<String>,
    /// The flags without the CA, and words of the refusal they meet; `None` where there is no
    /// CA to leave out.
    untrusting: Option<(Vec<String>, &'static [&'static str])>,
    producer: P,
    /// A new source of `source` in the consumer group `wallet`.
    new_source: F,
}

/// `inbox-admin dead-letters <command> --broker .. --from .. <flags> <args>`, run off the
/// runtime's threads: the test's TLS fronts and proxies run on them.
async fn dead_letters(
    command: &str,
    broker: &str,
    from: &str,
    flags: &[String],
    args: &[&str],
) -> (Output, Duration) {
    let mut all: Vec<String> = ["dead-letters", command, "--broker", broker, "--from", from]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    all.extend(flags.iter().cloned());
    all.extend(args.iter().map(|s| (*s).to_owned()));
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = all.iter().map(String::as_str).collect();
        admin_within(&args, &[], LIMIT)
    })
    .await
    .unwrap()
}

/// Runs consumers of `new_source` with a handler from `handler` until idle, one after another,
/// until `counted` of their stats adds up to `n`.
async fn consume_until<S, Fut, H>(
    db: &TestDb,
    new_source: &impl Fn() -> Fut,
    handler: impl Fn() -> H,
    counted: fn(&StatsSnapshot) -> u64,
    n: u64,
) where
    S: MessageSource + Send + 'static,
    Fut: Future<Output = S>,
    H: Handler<inbox_conformance::StoreTx<TestDb>> + 'static,
{
    let started = Instant::now();
    let mut total = 0;
    while total < n {
        assert!(
            started.elapsed() < DRAIN,
            "only {total} of {n} within {DRAIN:?}"
        );
        let stats = Consumer::new("wallet", new_source().await, db.inbox(), handler())
            .run_until_idle()
            .await
            .unwrap();
        total += counted(&stats);
    }
    assert_eq!(total, n, "more than the batch");
}

/// The scenario on `broker`.
async fn parked_listed_replayed_and_applied_once<P, F, Fut, S>(broker: Reached<P, F>)
where
    P: Publish,
    F: Fn() -> Fut,
    Fut: Future<Output = S>,
    S: MessageSource + Send + 'static,
{
    let db = TestDb::new().await;
    let n = N as u64;
    // A first source declares the queue (RabbitMQ), makes the group (Redis) or joins it
    // (Kafka) before anything is sent.
    let first = (broker.new_source)().await;
    let credits: Vec<OutgoingMessage> = (1..=N)
        .map(|i| {
            OutgoingMessage::new(
                MessageId::generate(),
                CreditEvent::new(1 + i % 3, i).to_json(),
            )
        })
        .collect();
    broker
        .producer
        .send_batch(&broker.source, &credits)
        .await
        .unwrap();
    let stats = Consumer::new("wallet", first, db.inbox(), Down)
        .run_until_idle()
        .await
        .unwrap();
    let rest = n - stats.dead_lettered;
    if rest > 0 {
        consume_until(&db, &broker.new_source, || Down, |s| s.dead_lettered, rest).await;
    }

    let cli = |command: &'static str, flags: &'static [&'static str]| {
        dead_letters(
            command,
            broker.broker,
            &broker.dead_letters,
            &broker.flags,
            flags,
        )
    };
    let ok = |(out, took): (Output, Duration), what: &str| {
        assert!(out.status.success(), "{what}: {out:?}");
        println!("{}: {what} in {took:?}", broker.broker);
        json_object(&out)
    };
    let listed = ok(cli("list", &["--json"]).await, "list");
    assert_eq!(listed["count"], N, "{listed}");
    let reasons = listed["by_reason"].as_array().unwrap();
    assert!(
        reasons.len() == 1 && reasons[0]["reason"].as_str().unwrap().contains(DOWN),
        "{listed}"
    );

    let replayed = ok(cli("replay", &["--all", "--json"]).await, "replay");
    assert_eq!(replayed["moved"], N, "{replayed}");
    assert_eq!(replayed["by_source"][&broker.source], N, "{replayed}");

    // Read back from the source, through the same connection: every credit applied, once.
    consume_until(
        &db,
        &broker.new_source,
        || Credit::new(db.clone()),
        |s| s.applied,
        n,
    )
    .await;
    let ledger = wallet::summary(&db).await.unwrap();
    assert_eq!((ledger.ledger_rows, ledger.distinct_events), (N, N));
    assert_eq!(ledger.total_balance, (1..=N).sum::<i64>());
    let after = ok(cli("list", &["--json"]).await, "list after the replay");
    assert_eq!(after["count"], 0, "dead letters left: {after}");

    db.drop().await;

    // Without the CA: refused, saying why, in bounded time.
    let Some((untrusting, refusal)) = &broker.untrusting else {
        return;
    };
    let (out, took) = dead_letters(
        "list",
        broker.broker,
        &broker.dead_letters,
        untrusting,
        &["--json"],
    )
    .await;
    let stderr = text(&out.stderr);
    println!(
        "{}: without the CA, refused in {took:?}: {stderr}",
        broker.broker
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    for words in *refusal {
        assert!(stderr.contains(words), "no {words:?} in {stderr}");
    }
    assert!(out.stdout.is_empty(), "{out:?}");
}

/// A CA and a server certificate for `localhost`, in a directory of their own.
fn test_ca(name: &str) -> TestCa {
    let dir = std::env::temp_dir().join(unique_name(name));
    TestCa::new(&dir, &["localhost"]).unwrap()
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// A `rediss://` client of `url` trusting `ca`.
fn redis_client(url: &str, ca: &TestCa) -> Client {
    let certificates = TlsCertificates {
        client_tls: None,
        root_cert: Some(std::fs::read(&ca.ca).unwrap()),
    };
    Client::build_with_tls(url, certificates).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_a_config_file_and_x_properties() {
    let ca = test_ca("inbox-admin-kafka-tls");
    let tansu = PrivateTansu::builder().tls(&ca).start().await;
    let brokers = tansu.brokers();
    let settings = [
        ("security.protocol", "ssl".to_owned()),
        ("ssl.ca.location", path(&ca.ca)),
        // `localhost` is also ::1, where nothing listens.
        ("broker.address.family", "v4".to_owned()),
    ];
    let mut kafka = KafkaConnection::new(&brokers).operation_timeout(Duration::from_secs(5));
    for (key, value) in &settings {
        kafka = kafka.set(*key, value);
    }
    // The TLS settings from a --kafka-config file, the address family with -X beside it.
    let cli = |keep: fn(&str) -> bool| {
        let mut cli = vec!["--kafka-brokers".to_owned(), brokers.clone()];
        let mut file = String::from("# TLS to the test broker\n");
        for (key, value) in settings.iter().filter(|(key, _)| keep(key)) {
            if *key == "broker.address.family" {
                cli.extend(["-X".to_owned(), format!("{key}={value}")]);
            } else {
                file.push_str(&format!("{key} = {value}\n"));
            }
        }
        let config = ca.dir.join(unique_name("kafka-properties"));
        std::fs::write(&config, file).unwrap();
        cli.extend(["-F".to_owned(), path(&config)]);
        cli
    };
    let topic = unique_name("inbox-admin-tls");
    kafka
        .admin()
        .unwrap()
        .create_topic(&topic, 1)
        .await
        .unwrap();
    let producer = kafka.producer().connect().await.unwrap();
    let new_source = || {
        let source = config_on(&kafka, &topic, "wallet").create_dead_letter_topics(true);
        async move { source.connect().await.unwrap() }
    };
    parked_listed_replayed_and_applied_once(Reached {
        broker: "kafka",
        source: topic.clone(),
        dead_letters: format!("{topic}.dlq"),
        flags: cli(|_| true),
        // The reader's TLS error: librdkafka's reason, and what to check.
        untrusting: Some((
            cli(|key| key != "ssl.ca.location"),
            &["certificate verify failed", "ssl.ca.location"],
        )),
        producer,
        new_source,
    })
    .await;
    let _ = std::fs::remove_dir_all(&ca.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_amqps_with_amqp_ca() {
    let ca = test_ca("inbox-admin-rabbitmq-tls");
    let node = TlsNode::start(&ca)
        .await
        .unwrap_or_else(|why| panic!("no TLS RabbitMQ node of the test's own: {why}"));
    let url = format!("amqps://guest:guest@localhost:{}/%2f", node.port());
    let pem = std::fs::read_to_string(&ca.ca).unwrap();
    let rabbitmq = RabbitConnection::new(&url).ca_certificates(pem);
    let queue = unique_name("inbox-admin-tls");
    let producer = rabbitmq.producer().connect().await.unwrap();
    let new_source = || {
        let source = rabbitmq
            .source(&queue)
            .poll_timeout(Duration::from_millis(300));
        async move { source.connect().await.unwrap() }
    };
    parked_listed_replayed_and_applied_once(Reached {
        broker: "rabbitmq",
        source: queue.clone(),
        dead_letters: format!("{queue}.dlq"),
        flags: flags(&["--amqp-url", &url, "--amqp-ca", &path(&ca.ca)]),
        untrusting: Some((flags(&["--amqp-url", &url]), &["UnknownIssuer"])),
        producer,
        new_source,
    })
    .await;
    drop(node);
    let _ = std::fs::remove_dir_all(&ca.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_rediss_with_redis_ca() {
    let ca = test_ca("inbox-admin-redis-tls");
    let server = TlsRedis::start(&ca).await;
    let url = format!("rediss://localhost:{}", server.port());
    let redis = RedisConnection::from_client(redis_client(&url, &ca));
    let stream = unique_name("inbox-admin-tls");
    let producer = redis.producer().connect().await.unwrap();
    let new_source = || {
        let source = redis
            .source(&stream, "wallet")
            .poll_timeout(Duration::from_millis(200));
        async move { source.connect().await.unwrap() }
    };
    parked_listed_replayed_and_applied_once(Reached {
        broker: "redis",
        source: stream.clone(),
        dead_letters: format!("{stream}:dlq"),
        flags: flags(&["--redis-url", &url, "--redis-ca", &path(&ca.ca)]),
        untrusting: Some((flags(&["--redis-url", &url]), &["UnknownIssuer"])),
        producer,
        new_source,
    })
    .await;
    drop(server);
    let _ = std::fs::remove_dir_all(&ca.dir);
}

/// A Redis Cluster (of one node) that takes TLS only, with a private CA: `--redis-cluster` with
/// `rediss://` nodes and `--redis-ca`, the adapter's connection with `ca_certificates`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_redis_cluster_through_redis_cluster_and_redis_ca() {
    let dir = std::env::temp_dir().join(unique_name("inbox-admin-redis-cluster-tls"));
    let ca = TestCa::new(&dir, &["localhost", "IP:127.0.0.1"]).unwrap();
    let node = TlsRedis::start_cluster(&ca).await;
    let url = format!("rediss://127.0.0.1:{}", node.port());
    let redis =
        RedisConnection::cluster([url.clone()]).ca_certificates(std::fs::read(&ca.ca).unwrap());
    let stream = unique_name("inbox-admin-cluster-tls");
    let producer = redis.producer().connect().await.unwrap();
    let new_source = || {
        let source = redis
            .source(&stream, "wallet")
            .poll_timeout(Duration::from_millis(200));
        async move { source.connect().await.unwrap() }
    };
    parked_listed_replayed_and_applied_once(Reached {
        broker: "redis",
        source: stream.clone(),
        dead_letters: format!("{{{stream}}}:dlq"),
        flags: flags(&["--redis-cluster", &url, "--redis-ca", &path(&ca.ca)]),
        untrusting: Some((flags(&["--redis-cluster", &url]), &["UnknownIssuer"])),
        producer,
        new_source,
    })
    .await;
    drop(node);
    let _ = std::fs::remove_dir_all(&ca.dir);
}

/// Without TLS: what is shown is `--redis-cluster` over several nodes: the dead letters are
/// found on the node holding their stream, and replayed to the node holding the source's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_through_redis_cluster() {
    let cluster = LocalCluster::start().await;
    let urls = cluster.urls();
    let redis = RedisConnection::cluster(urls.clone());
    let stream = unique_name("inbox-admin-cluster");
    let producer = redis.producer().connect().await.unwrap();
    let new_source = || {
        let source = redis
            .source(&stream, "wallet")
            .poll_timeout(Duration::from_millis(200));
        async move { source.connect().await.unwrap() }
    };
    parked_listed_replayed_and_applied_once(Reached {
        broker: "redis",
        source: stream.clone(),
        // On a cluster the dead-letter stream shares the source's hash slot.
        dead_letters: format!("{{{stream}}}:dlq"),
        flags: flags(&["--redis-cluster", &urls.join(",")]),
        untrusting: None,
        producer,
        new_source,
    })
    .await;
}

/// `dead-letters list` with `flags`, expected to fail with exit status `code` before reaching
/// any broker; its stderr.
fn refused(code: i32, flags: &[&str]) -> String {
    let mut args = vec!["dead-letters", "list", "--from", "orders.dlq"];
    args.extend_from_slice(flags);
    let (out, _) = admin_within(&args, &[], LIMIT);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {out:?}");
    text(&out.stderr)
}

#[test]
fn settings_that_cannot_work_are_refused_naming_the_flag_and_hiding_secrets() {
    let missing = std::env::temp_dir()
        .join(unique_name("no-such-ca"))
        .join("ca.pem");
    let missing = path(&missing);

    let e = refused(
        1,
        &[
            "--broker",
            "rabbitmq",
            "--amqp-url",
            "amqps://h/%2f",
            "--amqp-ca",
            &missing,
        ],
    );
    assert!(
        e.contains(&format!(
            "cannot read `{missing}`, given with --amqp-ca: No such file"
        )),
        "{e}"
    );
    let e = refused(
        1,
        &[
            "--broker",
            "redis",
            "--redis-url",
            "rediss://h:6380",
            "--redis-ca",
            &missing,
        ],
    );
    assert!(
        e.contains(&format!(
            "cannot read `{missing}`, given with --redis-ca: No such file"
        )),
        "{e}"
    );
    let e = refused(
        1,
        &[
            "--broker",
            "kafka",
            "--kafka-brokers",
            "127.0.0.1:1",
            "-X",
            "security.protocol=ssl",
            "-X",
            &format!("ssl.ca.location={missing}"),
        ],
    );
    assert!(
        e.contains(&format!(
            "cannot read `{missing}`, given with -X ssl.ca.location: No such file"
        )),
        "{e}"
    );
    // The same from a --kafka-config file, whose password no error shows.
    let dir = std::env::temp_dir().join(unique_name("inbox-admin-kafka-config"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("kafka.properties");
    std::fs::write(
        &config,
        format!("security.protocol=sasl_ssl\nsasl.password=hunter2\nssl.ca.location={missing}\n"),
    )
    .unwrap();
    let kafka_config = |file: &str| {
        refused(
            1,
            &[
                "--broker",
                "kafka",
                "--kafka-brokers",
                "127.0.0.1:1",
                "-F",
                file,
            ],
        )
    };
    let e = kafka_config(&path(&config));
    assert!(
        e.contains(&format!(
            "cannot read `{missing}`, given with ssl.ca.location in --kafka-config: No such file"
        )) && !e.contains("hunter2"),
        "{e}"
    );
    std::fs::write(&config, "sasl.password:hunter2\n").unwrap();
    let e = kafka_config(&path(&config));
    assert!(
        e.contains("line 1 has no `=`") && !e.contains("hunter2"),
        "{e}"
    );
    let e = kafka_config(&path(&dir.join("missing.properties")));
    assert!(e.contains("given with --kafka-config: No such file"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);

    // A CA for a connection without TLS would go unused.
    let e = refused(
        1,
        &[
            "--broker",
            "rabbitmq",
            "--amqp-url",
            "amqp://guest:hunter2@h/%2f",
            "--amqp-ca",
            &missing,
        ],
    );
    assert!(
        e.contains(
            "--amqp-ca is for TLS, but --amqp-url `amqp://guest:***@h/%2f` does not start with \
             amqps://"
        ),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "{e}");
    let e = refused(
        1,
        &[
            "--broker",
            "redis",
            "--redis-cluster",
            "127.0.0.1:7000,127.0.0.1:7001",
        ],
    );
    assert!(
        e.contains("--redis-cluster node `127.0.0.1:7000` is not a Redis URL"),
        "{e}"
    );

    // A secret never shows: neither in a value that is not key=value, nor where librdkafka
    // repeats the value of a property it does not know.
    let e = refused(2, &["--broker", "kafka", "-X", "sasl.password:hunter2"]);
    assert!(e.contains("-X key=value"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
    let e = refused(
        1,
        &[
            "--broker",
            "kafka",
            "--kafka-brokers",
            "127.0.0.1:1",
            "-X",
            "sasl.pasword=hunter2",
        ],
    );
    assert!(
        e.contains("No such configuration property: \"sasl.pasword\""),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "{e}");
}
