//! Redis over TLS only (feature `tls`): a `redis-server` of the test's own, listening with TLS
//! alone on a free port, with a certificate from a CA made at test time. The consumer, the
//! producer and the dead-letter reader run over `rediss://` from one connection trusting the CA;
//! a reader without it, a wrong CA, a wrong host name and a plaintext `redis://` are refused,
//! each with an error that says why, and none hangs.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::time::Duration;

use inbox_conformance::redis::TlsRedis;
use inbox_conformance::tls::{credits_with_resent_copies, refused, TestCa, CREDITS};
use inbox_conformance::wallet::{self, Credit};
use inbox_conformance::{unique_name, TestDb};
use inbox_core::replay::DeadLetters;
use inbox_core::{Consumer, Publish};
use inbox_redis_streams::redis::{Client, TlsCertificates};
use inbox_redis_streams::RedisConnection;

/// A client of `url` trusting `ca`.
fn client(url: &str, ca: &TestCa) -> Client {
    let root_cert = std::fs::read(&ca.ca).unwrap();
    let certificates = TlsCertificates {
        client_tls: None,
        root_cert: Some(root_cert),
    };
    Client::build_with_tls(url, certificates).unwrap()
}

/// The error of a producer connecting through `client` to `what`.
async fn connect_error(what: &str, client: Client) -> String {
    let connecting = RedisConnection::from_client(client)
        .operation_timeout(Duration::from_secs(3))
        .producer()
        .connect();
    refused(what, Duration::from_secs(10), connecting).await
}

#[tokio::test]
async fn a_consumer_runs_over_tls_and_wrong_certificates_or_plaintext_are_refused_clearly() {
    let dir = std::env::temp_dir().join(unique_name("inbox-redis-tls"));
    let ca = TestCa::new(&dir.join("server"), &["localhost"]).unwrap();
    let other_ca = TestCa::new(&dir.join("other"), &["localhost"]).unwrap();
    let redis = TlsRedis::start(&ca).await;
    let url = |scheme: &str, host: &str| format!("{scheme}://{host}:{}", redis.port());

    // End to end over rediss://: every credit once.
    let db = TestDb::new().await;
    let stream = unique_name("tls");
    let redis = RedisConnection::from_client(client(&url("rediss", "localhost"), &ca));
    let producer = redis.producer().connect().await.unwrap();
    let batch = credits_with_resent_copies();
    producer.send_batch(&stream, &batch).await.unwrap();
    producer.send(&stream, b"not a credit").await.unwrap();
    let source = redis
        .source(&stream, "wallet")
        .poll_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
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
    let dead_letter_stream = format!("{stream}:dlq");
    let mut reader = redis
        .dead_letters(&dead_letter_stream)
        .connect()
        .await
        .unwrap();
    let letters = reader.next(10).await.unwrap();
    let payloads: Vec<&[u8]> = letters.iter().map(|l| l.payload.as_slice()).collect();
    assert_eq!(payloads, [&b"not a credit"[..]]);
    let untrusting = RedisConnection::new(url("rediss", "localhost"))
        .operation_timeout(Duration::from_secs(3))
        .dead_letters(&dead_letter_stream)
        .connect();
    let refused_reader = refused(
        "the reader without the CA",
        Duration::from_secs(10),
        untrusting,
    );
    assert!(
        refused_reader.await.contains("UnknownIssuer"),
        "a reader without the private CA is refused"
    );

    // A certificate from a CA the client does not trust.
    let wrong_ca =
        connect_error("another CA", client(&url("rediss", "localhost"), &other_ca)).await;
    assert!(wrong_ca.contains("UnknownIssuer"), "{wrong_ca}");

    // A certificate for another name: issued for localhost, reached as 127.0.0.1.
    let wrong_name = connect_error("another name", client(&url("rediss", "127.0.0.1"), &ca)).await;
    assert!(wrong_name.contains("not valid for name"), "{wrong_name}");

    // Plaintext to a server that takes TLS only.
    let plaintext = connect_error(
        "plaintext",
        Client::open(url("redis", "127.0.0.1")).unwrap(),
    )
    .await;
    assert!(
        plaintext.contains("Connection reset by peer"),
        "{plaintext}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
