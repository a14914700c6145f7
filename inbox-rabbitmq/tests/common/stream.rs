//! A consumer crediting a stream of wallet events into PostgreSQL while a test breaks its broker
//! connection, and what the ledger says afterwards.

use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::wallet::{self, Credit, Summary};
use inbox_conformance::TestDb;
use inbox_core::Publish;
use inbox_core::{Consumer, Stats, StatsSnapshot};
use inbox_rabbitmq::RabbitSourceBuilder;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{amqp_url, cleanup, credit, drain, left_on, publisher};

pub use inbox_conformance::rabbitmq::{broker_addr, url_via};

/// A consumer running in the background over a queue of `events` published credits.
pub struct Stream {
    pub db: TestDb,
    /// The queue's config as the test (publisher, admin) sees it: straight to the broker.
    pub direct: RabbitSourceBuilder,
    pub events: i64,
    expected_total: i64,
    stats: Arc<Stats>,
    stop: watch::Sender<bool>,
    task: JoinHandle<inbox_core::Result<StatsSnapshot>>,
}

/// What a run ended with.
#[derive(Debug)]
pub struct Outcome {
    pub events: i64,
    pub summary: Summary,
    pub expected_total: i64,
    pub stats: StatsSnapshot,
    pub left_on_queue: u32,
    pub dead_lettered: usize,
}

impl Outcome {
    pub fn duplicates(&self) -> i64 {
        self.summary.duplicates()
    }

    pub fn lost(&self) -> i64 {
        self.summary.lost(self.events)
    }

    /// Every event applied once, balances exact, nothing left behind on the broker.
    pub fn assert_exactly_once(&self) {
        assert_eq!(self.duplicates(), 0, "no event applied twice: {self:?}");
        assert_eq!(self.lost(), 0, "no event lost: {self:?}");
        assert!(self.summary.balances_exact, "balances exact: {self:?}");
        assert_eq!(self.summary.total_balance, self.expected_total, "{self:?}");
        assert_eq!(self.left_on_queue, 0, "nothing left on the queue: {self:?}");
        assert_eq!(self.dead_lettered, 0, "nothing dead-lettered: {self:?}");
    }
}

impl Stream {
    /// Publishes `events` credits to `direct`'s queue, then starts a consumer whose source uses
    /// `consumer` (the same queue, perhaps another URL).
    pub async fn start(
        direct: RabbitSourceBuilder,
        consumer: RabbitSourceBuilder,
        events: i64,
    ) -> Self {
        assert_eq!(direct.queue(), consumer.queue());
        let db = TestDb::new().await;
        let publisher = publisher(&direct).await;
        let mut expected_total = 0;
        for i in 0..events {
            let amount = 1 + i % 17;
            publisher
                .send(direct.queue(), &credit(1 + i % 10, amount))
                .await
                .expect("publish");
            expected_total += amount;
        }
        publisher.close().await;

        let source = consumer.connect().await.expect("the consumer connects");
        // A little work per message keeps the stream going while the test breaks things.
        let handler = Credit::new(db.pool.clone()).work(Duration::from_millis(10));
        let consumer = Consumer::new("wallet", source, db.inbox(), handler)
            .batch_size(10)
            .error_backoff(Duration::from_millis(100));
        let stats = consumer.stats();
        let (stop, mut stop_rx) = watch::channel(false);
        let task = tokio::spawn(consumer.run_until(async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        }));
        Self {
            db,
            direct,
            events,
            expected_total,
            stats,
            stop,
            task,
        }
    }

    /// Distinct events in the ledger.
    pub async fn applied(&self) -> i64 {
        wallet::summary(&self.db.pool)
            .await
            .expect("read the ledger")
            .distinct_events
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Waits until at least `n` distinct events are in the ledger; how long that took. Fails the
    /// test after `within`.
    pub async fn wait_applied(&self, n: i64, within: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let applied = self.applied().await;
            if applied >= n {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < within,
                "only {applied} of {n} events applied after {within:?}; stats {:?}",
                self.stats()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until the consumer's counters satisfy `done`; how long that took. Fails the test
    /// after `within`.
    pub async fn wait_stats(
        &self,
        what: &str,
        within: Duration,
        done: impl Fn(&StatsSnapshot) -> bool,
    ) -> Duration {
        let start = Instant::now();
        loop {
            let stats = self.stats();
            if done(&stats) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < within,
                "{what}: not after {within:?}; stats {stats:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits for every event, stops the consumer and reads the outcome; cleans up the queue and
    /// the schema.
    pub async fn finish(self, within: Duration) -> Outcome {
        self.wait_applied(self.events, within).await;
        let _ = self.stop.send(true);
        let stats = tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the consumer stops within 30 s")
            .expect("the consumer task")
            .expect("the consumer ends without error");
        let summary = wallet::summary(&self.db.pool)
            .await
            .expect("read the ledger");
        let left_on_queue = left_on(self.direct.queue()).await;
        let dead_lettered = drain(&self.direct.dead_letter_queue()).await.len();
        cleanup(&self.direct).await;
        self.db.drop().await;
        Outcome {
            events: self.events,
            summary,
            expected_total: self.expected_total,
            stats,
            left_on_queue,
            dead_lettered,
        }
    }
}
