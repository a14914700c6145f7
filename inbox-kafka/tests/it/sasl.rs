//! SASL from the builders' settings (crate feature `tls`), against a private Tansu with
//! `--authentication`, reached over TLS: `security.protocol=sasl_ssl`, `sasl.mechanism`,
//! `sasl.username`, `sasl.password`, set with `.set(..)` like any librdkafka property.
//!
//! No login succeeds on Tansu 0.6 (see `PrivateTansuBuilder::authentication`): it has no PLAIN,
//! and no SCRAM users. What it shows is that the settings reach the broker (a SCRAM login is
//! answered `unknown-user`), that a refused login fails the first receive at once with an error
//! that says why and stops the consumer, and that the password never shows, in `Debug` or in
//! the logs. A login that succeeds is not tested here: no broker on this machine has one.

// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use inbox_core::SourceError;

use common::*;
use inbox_conformance::kafka::PrivateTansu;
use inbox_conformance::tls::TestCa;
use inbox_core::{MessageSource, Recovery};
use inbox_kafka::KafkaSourceBuilder;

const PASSWORD: &str = "pw-7f3a-never-shown";

/// Everything logged in this test binary, librdkafka's lines included.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&logs);
        tracing_subscriber::fmt()
            .with_env_filter("debug,sqlx=warn")
            .with_ansi(false)
            .with_writer(move || Capture(Arc::clone(&sink)))
            .init();
        logs
    })
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// TLS verified against the test CA, and a SASL login with `mechanism`. librdkafka's own
/// debug output for security is on, to show that it too keeps the password out of the logs.
fn sasl_ssl(ca: &TestCa, mechanism: &str) -> Vec<(&'static str, String)> {
    vec![
        ("security.protocol", "sasl_ssl".into()),
        ("ssl.ca.location", ca.ca.display().to_string()),
        ("broker.address.family", "v4".into()),
        ("sasl.mechanism", mechanism.into()),
        ("sasl.username", "wallet-app".into()),
        ("sasl.password", PASSWORD.into()),
        ("debug", "security".into()),
    ]
}

fn test_ca() -> TestCa {
    TestCa::new(
        &std::env::temp_dir().join(random("kafka-sasl")),
        &["localhost"],
    )
    .unwrap()
}

fn source_builder(topic: &str, brokers: &str, settings: &[(&str, String)]) -> KafkaSourceBuilder {
    let mut kafka = KafkaConnection::new(brokers).operation_timeout(Duration::from_secs(5));
    for (key, value) in settings {
        kafka = kafka.set(*key, value);
    }
    config_on(&kafka, topic, &random("group"))
}

/// Starts a TLS, authenticating Tansu and a source logging in with `mechanism`, and returns
/// the source's first receive error and how long it took.
async fn first_error(mechanism: &str) -> (SourceError, Duration) {
    let ca = test_ca();
    let tansu = PrivateTansu::builder()
        .tls(&ca)
        .authentication(true)
        .start()
        .await;
    let builder = source_builder("inbox-sasl", &tansu.brokers(), &sasl_ssl(&ca, mechanism));
    let shown = format!("{builder:?}");
    assert!(!shown.contains(PASSWORD), "{shown}");
    assert!(shown.contains(r#""sasl.password": "***""#), "{shown}");
    let mut source = builder.connect().await.unwrap();
    let started = Instant::now();
    let received = tokio::time::timeout(Duration::from_secs(60), source.receive(10))
        .await
        .expect("the first receive returned within a minute");
    let Err(e) = received else {
        panic!("a refused login receives nothing");
    };
    (e, started.elapsed())
}

fn assert_refused(e: &SourceError) {
    assert_eq!(e.recovery(), Recovery::Fatal, "{e}");
    let shown = e.to_string();
    assert!(shown.contains("refused the SASL login"), "{shown}");
    assert!(shown.contains("sasl.password"), "{shown}");
    assert!(!shown.contains(PASSWORD), "{shown}");
    let logged = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
    assert!(
        logged.contains("librdkafka"),
        "librdkafka's lines are in the logs"
    );
    assert!(!logged.contains(PASSWORD), "the password was logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scram_login_from_the_builders_settings_reaches_the_broker_and_is_refused_saying_so() {
    logs();
    let (e, took) = first_error("SCRAM-SHA-512").await;
    println!("SCRAM refused, after {took:?}: {e}");
    assert_refused(&e);
    // The broker's answer: the user name reached it, and it has no such user.
    assert!(e.to_string().contains("unknown-user"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mechanism_the_broker_does_not_offer_is_refused_saying_so() {
    logs();
    let (e, took) = first_error("PLAIN").await;
    println!("PLAIN refused, after {took:?}: {e}");
    assert_refused(&e);
    assert!(
        e.to_string().contains("PLAIN mechanism handshake failed"),
        "{e}"
    );
}

#[tokio::test]
async fn a_producer_hides_the_password_in_debug() {
    let builder = KafkaConnection::new("localhost:9093")
        .set("security.protocol", "sasl_ssl")
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "wallet-app")
        .set("sasl.password", PASSWORD)
        .producer();
    let shown = format!("{builder:?}");
    assert!(!shown.contains(PASSWORD), "{shown}");
    assert!(shown.contains("wallet-app"), "{shown}");
}
