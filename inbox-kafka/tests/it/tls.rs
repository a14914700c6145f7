//! TLS for real (crate feature `tls`): a private Tansu reached over TLS only, with a CA and a
//! server certificate for `localhost` made for the test. A consumer over `security.protocol=ssl`
//! applies every credit once; a CA that did not sign the certificate, a host name the
//! certificate does not name and a plaintext client are each refused quickly, with an error
//! that says why.
//!
//! Tansu 0.6 cannot serve TLS itself, so `socat` terminates it in front of the broker (see
//! `inbox_conformance::kafka::PrivateTansu`): what is tested is librdkafka's side of TLS, which
//! is this crate's.

// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::kafka::PrivateTansu;
use inbox_conformance::tls::TestCa;
use inbox_conformance::wallet::Credit;
use inbox_conformance::TestDb;
use inbox_core::{MessageSource, Recovery, SourceError};
use inbox_kafka::{KafkaSource, KafkaSourceBuilder};

/// A CA and a server certificate for `localhost`, in a directory of their own.
fn test_ca(name: &str) -> TestCa {
    let dir = std::env::temp_dir().join(random(name));
    TestCa::new(&dir, &["localhost"]).unwrap()
}

/// The client settings for TLS verified against `ca`.
fn tls(ca: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("security.protocol", "ssl".into()),
        ("ssl.ca.location", ca.display().to_string()),
        // librdkafka's default since 2.0, set so that the test says what it relies on.
        ("ssl.endpoint.identification.algorithm", "https".into()),
        // `localhost` is also ::1, where nothing listens.
        ("broker.address.family", "v4".into()),
    ]
}

/// The brokers with `settings` for every client, and a 5 s operation timeout.
fn connection(brokers: &str, settings: &[(&'static str, String)]) -> KafkaConnection {
    let mut kafka = KafkaConnection::new(brokers).operation_timeout(Duration::from_secs(5));
    for (key, value) in settings {
        kafka = kafka.set(*key, value);
    }
    kafka
}

fn source_builder(
    topic: &str,
    brokers: &str,
    settings: &[(&'static str, String)],
) -> KafkaSourceBuilder {
    config_on(&connection(brokers, settings), topic, &random("group"))
}

/// The first receive's error, and how long it took; panics if it succeeds or takes a minute.
async fn first_error(source: &mut KafkaSource) -> (SourceError, Duration) {
    let started = Instant::now();
    let received = tokio::time::timeout(Duration::from_secs(60), source.receive(10))
        .await
        .expect("the first receive returned within a minute");
    match received {
        Err(e) => (e, started.elapsed()),
        Ok(batch) => panic!(
            "received {} messages over a refused connection",
            batch.len()
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_over_tls_applies_every_credit_once() {
    init_tracing();
    let ca = test_ca("kafka-tls");
    let tansu = PrivateTansu::builder().tls(&ca).start().await;
    let brokers = tansu.brokers();
    let settings = tls(&ca.ca);
    let topic = random("inbox-tls");
    let kafka = connection(&brokers, &settings);
    kafka
        .admin()
        .unwrap()
        .create_topic(&topic, 2)
        .await
        .unwrap();
    let producer = kafka.producer().connect().await.unwrap();
    let published = 200;
    let total = produce_credit_range(&producer, &topic, 0..published, 2).await;

    let db = TestDb::new().await;
    // The dead-letter topic is made by the source's own admin client, over TLS too.
    let source = source_builder(&topic, &brokers, &settings)
        .create_dead_letter_topics(true)
        .connect()
        .await
        .unwrap();
    let running = Running::start(
        "wallet-tls",
        source,
        db.inbox(),
        Credit::new(db.clone()),
        50,
    );
    let all = wait_for_events(&db, published as i64).await;
    let stats = running.stop().await.unwrap();
    let summary = summary(&db).await;
    println!("over TLS: {stats:?} {summary:?}");
    assert!(all, "not every credit arrived over TLS: {summary:?}");
    assert_eq!(summary.duplicates(), 0, "{summary:?}");
    assert_eq!(summary.lost(published as i64), 0, "{summary:?}");
    assert_eq!(summary.total_balance, total);
    assert!(summary.balances_exact);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_another_ca_signed_is_refused_saying_so() {
    init_tracing();
    let ca = test_ca("kafka-tls");
    let other = test_ca("kafka-tls-other");
    let tansu = PrivateTansu::builder().tls(&ca).start().await;
    let mut source = source_builder("inbox-tls-refused", &tansu.brokers(), &tls(&other.ca))
        .connect()
        .await
        .unwrap();
    let (e, took) = first_error(&mut source).await;
    println!("wrong CA, after {took:?}: {e}");
    assert_eq!(e.recovery(), Recovery::Fatal, "{e}");
    let shown = format!("{e} {:?}", std::error::Error::source(&e));
    assert!(shown.contains("TLS handshake"), "{shown}");
    assert!(shown.contains("certificate verify failed"), "{shown}");
    assert!(shown.contains("ssl.ca.location"), "{shown}");

    // A consumer on such a source stops, and `run` returns the error.
    let db = TestDb::new().await;
    let source = source_builder("inbox-tls-refused", &tansu.brokers(), &tls(&other.ca))
        .connect()
        .await
        .unwrap();
    let running = Running::start(
        "wallet-tls-refused",
        source,
        db.inbox(),
        Credit::new(db.clone()),
        10,
    );
    let stopped = tokio::time::timeout(Duration::from_secs(60), running.join())
        .await
        .expect("the consumer stopped by itself");
    let Err(e) = stopped else {
        panic!("the consumer ran on over a refused TLS handshake")
    };
    println!("the consumer stopped: {e}");
    assert!(e.to_string().contains("certificate verify failed"), "{e}");

    // The dead-letter reader (replay's) on the same connection says why too, soon.
    let started = Instant::now();
    let reading = connection(&tansu.brokers(), &tls(&other.ca))
        .dead_letters("inbox-tls-refused.dlq")
        .connect();
    let refused = tokio::time::timeout(Duration::from_secs(30), reading)
        .await
        .expect("the reader gave up within 30 s");
    let Err(e) = refused else {
        panic!("the dead-letter reader connected over a refused TLS handshake")
    };
    println!("the dead-letter reader, after {:?}: {e}", started.elapsed());
    assert!(e.to_string().contains("certificate verify failed"), "{e}");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_host_name_is_refused_saying_so() {
    init_tracing();
    let ca = test_ca("kafka-tls");
    let tansu = PrivateTansu::builder().tls(&ca).start().await;
    // The certificate names `localhost`; the client asks for 127.0.0.1.
    let port = tansu.tls_port().unwrap();
    let mut source = source_builder(
        "inbox-tls-refused",
        &format!("127.0.0.1:{port}"),
        &tls(&ca.ca),
    )
    .connect()
    .await
    .unwrap();
    let (e, took) = first_error(&mut source).await;
    println!("wrong host name, after {took:?}: {e}");
    assert_eq!(e.recovery(), Recovery::Fatal, "{e}");
    let shown = e.to_string();
    assert!(shown.contains("TLS handshake"), "{shown}");
    assert!(shown.contains("certificate verify failed"), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_on_the_tls_listener_fails_clearly() {
    init_tracing();
    let ca = test_ca("kafka-tls");
    let tansu = PrivateTansu::builder().tls(&ca).start().await;
    let plaintext = [("broker.address.family", "v4".to_owned())];
    let mut source = source_builder("inbox-tls-refused", &tansu.brokers(), &plaintext)
        .connect()
        .await
        .unwrap();
    let (e, took) = first_error(&mut source).await;
    println!("plaintext on TLS, after {took:?}: {e}");
    let shown = e.to_string();
    assert!(shown.contains(&tansu.brokers()), "{shown}");
    assert!(shown.contains("the last connection failure"), "{shown}");
    assert!(shown.contains("check security.protocol"), "{shown}");
}
