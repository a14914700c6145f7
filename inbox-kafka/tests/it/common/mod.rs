//! Shared helpers of the Kafka tests: random topics and groups on the real broker, a running
//! consumer that can be stopped, and what is left on the broker afterwards (the conformance
//! suite's, `inbox_conformance::kafka`, where it has them).
//!
//! The same tests run on librdkafka's mock cluster, the `kafka-mock` process of the examples
//! (`KAFKA_BROKERS` its bootstrap address, `KAFKA_MOCK_CONTROL` its `--control` address). The
//! mock has no CreateTopics, so topics are then made through its control port; a test that needs
//! what the mock lacks skips itself with [`skip_on_mock`].
#![allow(dead_code, unused_imports, unreachable_pub)]

pub use inbox_conformance::kafka::{
    brokers, config, config_on, create_topic, header, lag, mock_control, producer, read_all,
    send_raw,
};
pub use inbox_conformance::unique_name as random;
pub use inbox_kafka::KafkaConnection;

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_conformance::wallet::{self, Credit, CreditEvent, Summary};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, Inbox, InboxStore, OutgoingMessage, PerMessage, Stats, StatsSnapshot};
use inbox_kafka::{KafkaProducer, KafkaSource};
use inbox_postgres::PgTx;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const WAIT: Duration = Duration::from_secs(90);

/// Logs to the test output; `RUST_LOG` filters (default: warnings, which include librdkafka's
/// `MAXPOLL` eviction and refused commits).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
}

/// On the mock cluster, says why the test is skipped and returns `true`.
pub fn skip_on_mock(reason: &str) -> bool {
    if mock_control().is_none() {
        return false;
    }
    println!("skipped on librdkafka's mock cluster (KAFKA_MOCK_CONTROL is set): {reason}");
    true
}

/// A fresh topic with `partitions` partitions and its dead-letter topic.
pub async fn topic(partitions: i32) -> String {
    init_tracing();
    let topic = random("inbox-test");
    create_topic(&topic, partitions).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    topic
}

pub async fn source(topic: &str, group: &str) -> KafkaSource {
    config(topic, group).connect().await.expect("kafka source")
}

/// Produces `n` credits spread over `partitions`, account `i % 7 + 1`, amount `i % 50 + 1`.
/// Returns the sum of the amounts.
pub async fn produce_credits(topic: &str, n: usize, partitions: i32) -> i64 {
    produce_credit_range(&producer().await, topic, 0..n, partitions).await
}

/// Produces the credits `range` of the sequence [`produce_credits`] starts, through `producer`.
/// Returns the sum of their amounts.
pub async fn produce_credit_range(
    producer: &KafkaProducer,
    topic: &str,
    range: std::ops::Range<usize>,
    partitions: i32,
) -> i64 {
    let mut total = 0;
    for i in range {
        let event = CreditEvent::new((i % 7 + 1) as i64, (i % 50 + 1) as i64);
        total += event.amount;
        let credit = OutgoingMessage::generate(event.to_json());
        let partition = Some(i as i32 % partitions);
        producer
            .send_to(topic, partition, &credit)
            .await
            .expect("produce");
    }
    total
}

/// A consumer running in a task until [`Running::stop`].
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<inbox_core::Result<StatsSnapshot>>,
    pub stats: Arc<Stats>,
}

impl Running {
    pub fn start<St>(
        name: &str,
        source: KafkaSource,
        store: St,
        handler: Credit,
        batch: usize,
    ) -> Self
    where
        St: InboxStore<Tx = PgTx>,
    {
        let consumer = Consumer::new(name, source, store, handler)
            .batch_size(batch)
            .error_backoff(Duration::from_millis(200));
        Self::spawn(consumer)
    }

    pub fn spawn<St>(consumer: Consumer<KafkaSource, Inbox<St, PerMessage<Credit>>>) -> Self
    where
        St: InboxStore<Tx = PgTx>,
    {
        let stats = consumer.stats();
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(consumer.run_until(async {
            let _ = stopped.await;
        }));
        Self {
            stop: Some(stop),
            task,
            stats,
        }
    }

    /// Graceful stop: the batch in flight finishes; the source leaves the group when dropped.
    pub async fn stop(mut self) -> inbox_core::Result<StatsSnapshot> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await.expect("consumer task panicked")
    }

    /// Waits for the consumer to return by itself (a crash hook).
    pub async fn join(self) -> inbox_core::Result<StatsSnapshot> {
        self.task.await.expect("consumer task panicked")
    }
}

/// Polls `check` until it is true or `WAIT` passes; returns whether it became true.
pub async fn eventually<F, Fut>(check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    inbox_testkit::eventually(WAIT, check).await
}

pub async fn summary(db: &TestDb) -> Summary {
    wallet::summary(db).await.expect("ledger summary")
}

/// Waits until `n` distinct events are in the ledger.
pub async fn wait_for_events(db: &TestDb, n: i64) -> bool {
    eventually(|| async { summary(db).await.distinct_events >= n }).await
}

/// Waits until `group` has committed everything on `topic`.
pub async fn wait_for_no_lag(topic: &str, group: &str, partitions: i32) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (t, g) = (topic.to_owned(), group.to_owned());
        let lag = tokio::task::spawn_blocking(move || lag(&t, &g, partitions))
            .await
            .expect("lag task");
        if lag == 0 || Instant::now() > deadline {
            return lag;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
