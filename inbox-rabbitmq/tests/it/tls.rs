//! RabbitMQ over TLS only (feature `tls`): a node of the test's own beside the shared broker,
//! listening with `amqps` alone, with a certificate from a CA made at test time. The consumer,
//! the producer and the dead-letter reader, built from one connection trusting that CA, run
//! over `amqps://`; a wrong CA, a wrong host name and a plaintext `amqp://` are refused, each
//! with an error that says why, and none hangs.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::time::Duration;

use inbox_conformance::rabbitmq::tls_node::TlsNode;
use inbox_conformance::tls::{credits_with_resent_copies, refused, TestCa, CREDITS};
use inbox_conformance::wallet::{self, Credit};
use inbox_conformance::{unique_name, TestDb};
use inbox_core::replay::DeadLetters;
use inbox_core::{Consumer, Publish};
use inbox_rabbitmq::RabbitConnection;

/// The error of a producer connecting to `url` trusting `ca`.
async fn connect_error(url: &str, ca: &str) -> String {
    let connecting = RabbitConnection::new(url)
        .ca_certificates(ca)
        .producer()
        .connect();
    refused(
        &inbox_core::redact_url(url),
        Duration::from_secs(15),
        connecting,
    )
    .await
}

#[tokio::test]
async fn a_consumer_runs_over_tls_and_wrong_certificates_or_plaintext_are_refused_clearly() {
    let dir = std::env::temp_dir().join(unique_name("inbox-rabbitmq-tls"));
    let ca = TestCa::new(&dir.join("server"), &["localhost"]).unwrap();
    let other_ca = TestCa::new(&dir.join("other"), &["localhost"]).unwrap();
    let node = match TlsNode::start(&ca).await {
        Ok(node) => node,
        Err(why) => {
            println!("skipped: no RabbitMQ node of its own: {why}");
            return;
        }
    };
    let url =
        |scheme: &str, host: &str| format!("{scheme}://guest:guest@{host}:{}/%2f", node.port());
    let pem = std::fs::read_to_string(&ca.ca).unwrap();
    let other_pem = std::fs::read_to_string(&other_ca.ca).unwrap();

    // End to end over amqps://: every credit once.
    let db = TestDb::new().await;
    let queue = unique_name("tls");
    let broker = RabbitConnection::new(url("amqps", "localhost")).ca_certificates(pem.clone());
    let source = broker
        .source(&queue)
        .poll_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let producer = broker.producer().connect().await.unwrap();
    let batch = credits_with_resent_copies();
    producer.send_batch(&queue, &batch).await.unwrap();
    producer.send(&queue, b"not a credit").await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(20)
        .run_until_idle()
        .await
        .unwrap();
    let summary = wallet::summary(&db).await.unwrap();
    println!("over TLS: {stats:?}; {summary:?}");
    assert_eq!(
        (summary.duplicates(), summary.lost(CREDITS)),
        (0, 0),
        "{summary:?}"
    );
    assert_eq!(stats.skipped_duplicates, 20);
    assert_eq!(stats.dead_lettered, 1, "the unparsable message is parked");
    db.drop().await;

    // The dead-letter reader, built from the same connection, trusts the same CA.
    let dead_letter_queue = format!("{queue}.dlq");
    let mut reader = broker
        .dead_letters(&dead_letter_queue)
        .connect()
        .await
        .unwrap();
    let letters = reader.next(10).await.unwrap();
    reader.close().await.unwrap();
    let payloads: Vec<&[u8]> = letters.iter().map(|l| l.payload.as_slice()).collect();
    assert_eq!(payloads, [&b"not a credit"[..]]);
    let untrusting = RabbitConnection::new(url("amqps", "localhost"))
        .dead_letters(&dead_letter_queue)
        .connect();
    let refused_reader = refused(
        "the reader without the CA",
        Duration::from_secs(15),
        untrusting,
    );
    assert!(
        refused_reader.await.contains("UnknownIssuer"),
        "a reader without the private CA is refused"
    );

    // A certificate from a CA the client does not trust.
    let wrong_ca = connect_error(&url("amqps", "localhost"), &other_pem).await;
    assert!(wrong_ca.contains("UnknownIssuer"), "{wrong_ca}");

    // A certificate for another name: issued for localhost, reached as 127.0.0.1.
    let wrong_name = connect_error(&url("amqps", "127.0.0.1"), &pem).await;
    assert!(wrong_name.contains("not valid for name"), "{wrong_name}");

    // Plaintext to a listener that takes TLS only.
    let plaintext = connect_error(&url("amqp", "localhost"), &pem).await;
    assert!(
        plaintext.contains("connecting to amqp://guest:***@localhost"),
        "{plaintext}"
    );
    drop(node);
    let _ = std::fs::remove_dir_all(dir);
}
