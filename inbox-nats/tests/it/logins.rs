//! TLS and logins on one `NatsConnection`, against `nats-server`s of the tests' own (a free
//! port, JetStream on, killed on drop): a private CA with a user and password, a token, an
//! NKey. Each carries credits end to end (producer, source, consumer, dead-letter reader from
//! the one connection); a wrong CA, password, token or seed is refused at `connect`, quickly,
//! naming the server, and the secrets show in no `Debug` output.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::path::{Path, PathBuf};
use std::time::Duration;

use inbox_conformance::tls::{refused, TestCa};
use inbox_core::{Consumer, Publish};
use inbox_nats::async_nats::jetstream::{self, stream};
use inbox_nats::async_nats::ConnectOptions;
use inbox_nats::NatsConnection;
use inbox_testkit::{MemoryStore, Sum};
use tokio::process::{Child, Command};

/// A `nats-server` of this test's own, with `config` added to its listener and store.
struct PrivateNats {
    _server: Child,
    port: u16,
    dir: PathBuf,
}

impl PrivateNats {
    async fn start(dir: &Path, config: &str) -> Self {
        std::fs::create_dir_all(dir).expect("the server's directory");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|free| free.local_addr())
            .expect("a free port")
            .port();
        let file = dir.join("nats.conf");
        let store = dir.join("store");
        std::fs::write(
            &file,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\" }}\n{config}\n",
                store.display()
            ),
        )
        .expect("write the server's configuration");
        let program = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .unwrap_or("nats-server");
        let server = Command::new(program)
            .arg("-c")
            .arg(&file)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start nats-server (apt-get install nats-server)");
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Self {
                    _server: server,
                    port,
                    dir: dir.to_owned(),
                };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("nats-server did not listen on {port}");
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn scratch(test: &str) -> PathBuf {
    std::env::temp_dir().join(inbox_conformance::unique_name(&format!(
        "inbox-nats-{test}"
    )))
}

/// Five credits through the producer, applied once by a consumer, one poison payload parked and
/// read back, all from `nats`; `admin` makes the stream.
async fn carries_credits(nats: &NatsConnection, admin: ConnectOptions, url: &str) {
    let client = admin.connect(url).await.expect("admin connects");
    jetstream::new(client)
        .create_stream(stream::Config {
            name: "CREDITS".into(),
            subjects: vec!["credits".into(), "credits.dlq".into()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
    let producer = nats.producer().connect().await.expect("producer connects");
    for amount in 1..=5 {
        let id = producer
            .send("credits", amount.to_string().as_bytes())
            .await
            .unwrap();
        producer
            .send_with_id("credits", &id, amount.to_string().as_bytes())
            .await
            .unwrap();
    }
    producer.send("credits", b"not a number").await.unwrap();
    let source = nats
        .source("CREDITS", "wallet")
        .filter_subject("credits")
        .dead_letter_subject("credits.dlq")
        .poll_timeout(Duration::from_millis(200))
        .connect()
        .await
        .expect("source connects");
    let store = MemoryStore::<i64>::new();
    let stats = Consumer::new("wallet", source, store.clone(), Sum)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(store.state().await, 15, "each credit applied once");
    assert_eq!((stats.skipped_duplicates, stats.dead_lettered), (5, 1));
    let mut reader = nats
        .dead_letters("credits.dlq")
        .connect()
        .await
        .expect("reader connects");
    let mut parked = Vec::new();
    inbox_core::replay::scan(&mut reader, &mut |letter| {
        parked.push(letter.payload.clone())
    })
    .await
    .unwrap();
    assert_eq!(parked, [b"not a number".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_and_a_password_carries_credits_and_wrong_ones_are_refused() {
    let dir = scratch("tls");
    let ca = TestCa::new(&dir.join("ca"), &["localhost", "IP:127.0.0.1"]).unwrap();
    let server = PrivateNats::start(
        &dir.join("server"),
        &format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\n\
             authorization {{ user: wallet, password: s3cret }}",
            ca.cert.display(),
            ca.key.display()
        ),
    )
    .await;
    let url = format!("tls://127.0.0.1:{}", server.port);
    let nats = NatsConnection::new(&url)
        .root_certificates(&ca.ca)
        .user_and_password("wallet", "s3cret");
    assert!(!format!("{nats:?}").contains("s3cret"), "{nats:?}");
    let admin = ConnectOptions::with_user_and_password("wallet".into(), "s3cret".into())
        .add_root_certificates(ca.ca.clone())
        .require_tls(true);
    carries_credits(&nats, admin, &url).await;

    let limit = Duration::from_secs(5);
    let wrong_password = NatsConnection::new(&url)
        .root_certificates(&ca.ca)
        .user_and_password("wallet", "guess");
    let e = refused(
        "a wrong password",
        limit,
        wrong_password.producer().connect(),
    )
    .await;
    assert!(e.contains(&format!("127.0.0.1:{}", server.port)), "{e}");
    assert!(!e.contains("guess"), "{e}");
    let other_ca = TestCa::new(&dir.join("other-ca"), &["localhost"]).unwrap();
    let untrusted = NatsConnection::new(&url)
        .root_certificates(&other_ca.ca)
        .user_and_password("wallet", "s3cret");
    refused(
        "a CA that did not sign",
        limit,
        untrusted.producer().connect(),
    )
    .await;
    let plain = NatsConnection::new(format!("nats://127.0.0.1:{}", server.port))
        .user_and_password("wallet", "s3cret");
    refused("the system's CAs only", limit, plain.producer().connect()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_login_carries_credits_and_a_wrong_token_is_refused() {
    let dir = scratch("token");
    let server = PrivateNats::start(&dir, "authorization { token: t0ken-s3cret }").await;
    let url = format!("nats://127.0.0.1:{}", server.port);
    let nats = NatsConnection::new(&url).token("t0ken-s3cret");
    assert!(!format!("{nats:?}").contains("t0ken-s3cret"), "{nats:?}");
    carries_credits(
        &nats,
        ConnectOptions::with_token("t0ken-s3cret".into()),
        &url,
    )
    .await;
    let wrong = NatsConnection::new(&url).token("guess");
    refused(
        "a wrong token",
        Duration::from_secs(5),
        wrong.source("CREDITS", "wallet").connect(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_login_carries_credits_and_another_seed_is_refused() {
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let dir = scratch("nkey");
    let server = PrivateNats::start(
        &dir,
        &format!(
            "authorization {{ users: [ {{ nkey: {} }} ] }}",
            user.public_key()
        ),
    )
    .await;
    let url = format!("nats://127.0.0.1:{}", server.port);
    let nats = NatsConnection::new(&url).nkey(&seed);
    assert!(!format!("{nats:?}").contains(&seed), "{nats:?}");
    carries_credits(&nats, ConnectOptions::with_nkey(seed.clone()), &url).await;
    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let wrong = NatsConnection::new(&url).nkey(stranger);
    refused(
        "an unknown NKey",
        Duration::from_secs(5),
        wrong.dead_letters("credits.dlq").connect(),
    )
    .await;
}
