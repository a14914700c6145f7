//! PostgreSQL over TLS only (feature `tls`, on by default): a cluster of the test's own,
//! `inbox_tls` on port `INBOX_TLS_PG_PORT` (default 5440), with a certificate from a CA made at
//! test time and a `pg_hba.conf` that rejects every connection without TLS. The consumer runs
//! over `sslmode=verify-full`; a wrong CA, a wrong host name and a plaintext connection are
//! refused at once, each with an error that says why. Without root and Debian's cluster tools
//! the test says so and skips.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::path::Path;
use std::time::{Duration, Instant};

use inbox_conformance::pg_cluster::{ClusterSettings, PgCluster};
use inbox_conformance::tls::TestCa;
use inbox_conformance::wallet::{self, publish_credit, Credit};
use inbox_conformance::TestDb;
use inbox_core::Consumer;
use inbox_testkit::MemoryBroker;
use sqlx::postgres::PgPoolOptions;

const CERTS: &str = "/var/lib/postgresql/inbox-tls";

/// The cluster, serving TLS only with a certificate of `ca` for `localhost`.
fn tls_only_cluster(ca: &TestCa) -> Result<PgCluster, String> {
    let path = |p: &Path| p.display().to_string();
    let settings = ClusterSettings {
        conf: vec![
            "ssl = on".into(),
            format!("ssl_cert_file = '{}'", path(&ca.cert)),
            format!("ssl_key_file = '{}'", path(&ca.key)),
        ],
        hba: Some(
            "local all all peer\n\
             hostnossl all all all reject\n\
             hostssl all all all scram-sha-256\n"
                .into(),
        ),
    };
    PgCluster::up("inbox_tls", "INBOX_TLS_PG_PORT", 5440, &settings)
}

/// Connects to `url`, within 10 s: the error, if it failed.
async fn connect_error(url: &str) -> Option<String> {
    let started = Instant::now();
    let connecting = PgPoolOptions::new().max_connections(1).connect(url);
    let result = tokio::time::timeout(Duration::from_secs(10), connecting)
        .await
        .unwrap_or_else(|_| panic!("connecting to {url} hangs"));
    println!(
        "{url}: {:?} in {:?}",
        result.as_ref().err(),
        started.elapsed()
    );
    result.err().map(|e| e.to_string())
}

#[tokio::test]
async fn a_consumer_runs_over_tls_and_wrong_certificates_or_plaintext_are_refused_clearly() {
    let (ca, other_ca) = (
        TestCa::new(&Path::new(CERTS).join("server"), &["localhost"]),
        TestCa::new(&Path::new(CERTS).join("other"), &["localhost"]),
    );
    let (ca, other_ca) = match (ca, other_ca) {
        (Ok(ca), Ok(other)) => (ca, other),
        (Err(why), _) | (_, Err(why)) => {
            println!("skipped: cannot make the test CA: {why}");
            return;
        }
    };
    ca.give_to("postgres").unwrap();
    let cluster = match tls_only_cluster(&ca) {
        Ok(cluster) => cluster,
        Err(why) => {
            println!("skipped: no PostgreSQL cluster of its own: {why}");
            return;
        }
    };
    let verified = |host: &str, ca: &TestCa| {
        let query = format!("sslmode=verify-full&sslrootcert={}", ca.ca.display());
        cluster.url(host, &query)
    };

    // End to end over verify-full: every credit once.
    let url = verified("localhost", &ca);
    let db = TestDb::at(&url).await;
    let broker = MemoryBroker::new();
    let events = 200;
    for i in 0..events {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 1);
        if i % 10 == 0 {
            publish_credit(&broker, &format!("evt-{i}"), i % 7, 1); // a redelivered copy
        }
    }
    let stats = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(20)
    .run_until_idle()
    .await
    .unwrap();
    let summary = wallet::summary(&db).await.unwrap();
    let tls_in_use: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    println!("over TLS: {stats:?}; {summary:?}");
    assert!(tls_in_use, "the session is encrypted");
    assert_eq!(
        (summary.duplicates(), summary.lost(events)),
        (0, 0),
        "{summary:?}"
    );
    assert_eq!(stats.skipped_duplicates, 20);
    assert_eq!(broker.pending(), 0);
    db.drop().await;

    // `require` encrypts without checking the certificate.
    assert_eq!(
        connect_error(&cluster.url("127.0.0.1", "sslmode=require")).await,
        None
    );

    // A certificate from a CA the client does not trust.
    let wrong_ca = connect_error(&verified("localhost", &other_ca))
        .await
        .unwrap();
    assert!(wrong_ca.contains("UnknownIssuer"), "{wrong_ca}");

    // A certificate for another name: issued for localhost, reached as 127.0.0.1.
    let wrong_name = connect_error(&verified("127.0.0.1", &ca)).await.unwrap();
    assert!(
        wrong_name.contains("certificate not valid for name \"127.0.0.1\""),
        "{wrong_name}"
    );

    // Plaintext to a server that takes TLS only.
    let plaintext = connect_error(&cluster.url("127.0.0.1", "sslmode=disable"))
        .await
        .unwrap();
    assert!(
        plaintext.contains("pg_hba.conf rejects connection") && plaintext.contains("no encryption"),
        "{plaintext}"
    );
}
