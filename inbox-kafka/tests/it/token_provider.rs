//! The OAUTHBEARER token provider, driven by librdkafka against a private Tansu with
//! `--authentication` (plaintext: the callback does not depend on TLS).
//!
//! Tansu 0.6 offers OAUTHBEARER but refuses every token (its check knows PLAIN and SCRAM only),
//! and no other broker here speaks it, so a login that succeeds is not tested. What is: the
//! provider is called when a client starts, before its first login, and again before each
//! token expires; a token the broker refuses and a provider that fails are each reported by the
//! source's first receive, saying which.

// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use inbox_conformance::kafka::PrivateTansu;
use inbox_core::{MessageSource, Recovery, SourceError};
use inbox_kafka::{Error, KafkaSource, Token, TokenError, TokenProvider};

/// Hands out tokens that live `lifetime`, or fails, and notes when it was called.
#[derive(Clone)]
struct TestTokens {
    lifetime: Duration,
    fail: Option<&'static str>,
    calls: Arc<Mutex<Vec<Instant>>>,
}

impl TestTokens {
    fn lasting(lifetime: Duration) -> Self {
        Self {
            lifetime,
            fail: None,
            calls: Arc::default(),
        }
    }

    fn failing(reason: &'static str) -> Self {
        Self {
            fail: Some(reason),
            ..Self::lasting(Duration::from_secs(60))
        }
    }

    fn calls(&self) -> Vec<Instant> {
        self.calls.lock().unwrap().clone()
    }
}

impl TokenProvider for TestTokens {
    async fn token(&self) -> Result<Token, TokenError> {
        self.calls.lock().unwrap().push(Instant::now());
        // A provider awaits something (an IAM endpoint); so does this one.
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Some(reason) = self.fail {
            return Err(reason.into());
        }
        Ok(Token {
            value: "header.payload.signature".into(),
            principal: "wallet-app".into(),
            expires_at: SystemTime::now() + self.lifetime,
        })
    }
}

/// `brokers` logged in to with `tokens`, for every client.
fn sasl(brokers: String, tokens: &TestTokens) -> KafkaConnection {
    KafkaConnection::new(brokers)
        .set("security.protocol", "sasl_plaintext")
        .operation_timeout(Duration::from_secs(5))
        .token_provider(tokens.clone())
}

async fn first_error(source: &mut KafkaSource) -> (SourceError, Duration) {
    let started = Instant::now();
    let received = tokio::time::timeout(Duration::from_secs(60), source.receive(10))
        .await
        .expect("the first receive returned within a minute");
    let Err(e) = received else {
        panic!("no message without a login");
    };
    (e, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_is_called_at_start_and_again_before_each_token_expires() {
    init_tracing();
    let tansu = PrivateTansu::builder().authentication(true).start().await;
    // librdkafka checks once a second whether 80 % of the lifetime has passed: with 8 s tokens
    // it asks again 7 s after each.
    let lifetime = Duration::from_secs(8);
    let tokens = TestTokens::lasting(lifetime);
    let started = Instant::now();
    let producer = KafkaConnection::new(tansu.brokers())
        .set("security.protocol", "sasl_plaintext")
        .token_provider(tokens.clone())
        .producer()
        .connect()
        .await
        .unwrap();
    let refreshed = inbox_testkit::eventually(Duration::from_secs(30), || async {
        tokens.calls().len() >= 3
    })
    .await;
    let calls: Vec<Duration> = tokens.calls().iter().map(|t| *t - started).collect();
    println!("provider called at {calls:?}");
    assert!(refreshed, "the provider was not asked again: {calls:?}");
    assert!(
        calls[0] < Duration::from_secs(2),
        "not asked at start: {calls:?}"
    );
    for pair in calls.windows(2) {
        let gap = pair[1] - pair[0];
        // Before the token expires, and not in a loop.
        assert!(gap < lifetime, "asked too late: {calls:?}");
        assert!(gap > lifetime / 2, "asked too soon: {calls:?}");
    }
    drop(producer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_the_broker_refuses_fails_the_first_receive_saying_so() {
    init_tracing();
    let tansu = PrivateTansu::builder().authentication(true).start().await;
    let tokens = TestTokens::lasting(Duration::from_secs(60));
    let mut source = config_on(
        &sasl(tansu.brokers(), &tokens),
        "inbox-token",
        &random("group"),
    )
    .connect()
    .await
    .unwrap();
    let (e, took) = first_error(&mut source).await;
    println!("token refused, after {took:?}: {e}");
    assert!(!tokens.calls().is_empty(), "the provider was not asked");
    assert_eq!(e.recovery(), Recovery::Fatal, "{e}");
    assert!(e.to_string().contains("refused the SASL login"), "{e}");
    assert!(
        !e.to_string().contains("header.payload"),
        "the token is shown: {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_provider_is_named_by_the_first_receive() {
    init_tracing();
    let tansu = PrivateTansu::builder().authentication(true).start().await;
    let tokens = TestTokens::failing("the IAM endpoint answered 503 (test)");
    let mut source = config_on(
        &sasl(tansu.brokers(), &tokens),
        "inbox-token",
        &random("group"),
    )
    .connect()
    .await
    .unwrap();
    let (e, took) = first_error(&mut source).await;
    println!("provider failed, after {took:?}: {e}");
    assert!(
        took < Duration::from_secs(5),
        "not before the timeout: {took:?}"
    );
    // Retryable: librdkafka asks the provider again, and the consumer receives again.
    assert_eq!(e.recovery(), Recovery::Retry, "{e}");
    assert!(
        e.to_string()
            .contains("the IAM endpoint answered 503 (test)"),
        "{e}"
    );
}

/// The dead-letter reader logs in as the consumers do, so `inbox-admin dead-letters` reads a
/// cluster that takes IAM tokens only with their provider. Tansu refuses every token: the
/// reading fails, after the provider was asked. librdkafka queues the token request as the
/// client starts; before the reader served that queue, its first metadata request could wait
/// out its timeout without a token ever asked for (3 of 6 runs here, and once in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_reader_asks_the_provider_when_it_starts() {
    init_tracing();
    let tansu = PrivateTansu::builder().authentication(true).start().await;
    let tokens = TestTokens::lasting(Duration::from_secs(60));
    let reading = sasl(tansu.brokers(), &tokens)
        .dead_letters(random("payments.dlq"))
        .connect();
    let e = tokio::time::timeout(Duration::from_secs(30), reading)
        .await
        .expect("the reading returned within 30 s")
        .expect_err("no reading without a login");
    println!("dead-letter reader refused: {e}");
    assert!(!tokens.calls().is_empty(), "the provider was not asked");
}

#[tokio::test]
async fn a_provider_with_another_mechanism_is_refused() {
    let scram = KafkaConnection::new(brokers())
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .token_provider(TestTokens::lasting(Duration::from_secs(60)));
    let e = config_on(&scram, "inbox-token", "group")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(e.to_string().contains("OAUTHBEARER"), "{e}");
    let e = KafkaConnection::new("127.0.0.1:9")
        .set("sasl.mechanism", "PLAIN")
        .token_provider(TestTokens::lasting(Duration::from_secs(60)))
        .producer()
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}
