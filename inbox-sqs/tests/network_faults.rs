//! The SQS endpoint refuses the consumer's connections for a while: the consumer's client talks
//! to it through a [`FaultProxy`]; PostgreSQL is not touched. Once the endpoint is back, every
//! event is in the ledger exactly once, every copy deleted from the queue and nothing
//! dead-lettered, without restarting the consumer. (Black holes and cut connections are in the
//! conformance suite.)
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{counts, credit, drain, plain_http_endpoint, proxied_client};
use inbox_core::{Consumer, StatsSnapshot};
use inbox_sqs::{Outgoing, SqsProducer, SqsSource};
use inbox_testkit::wallet::{summary, Credit, Summary};
use inbox_testkit::TestDb;
use inbox_testkit::{FaultProxy, ProxyMode};
use tokio::sync::oneshot;

const EVENTS: i64 = 300;
const SECOND: Duration = Duration::from_secs(1);
/// The long-poll wait, shorter than the proxied client's attempt timeout as the source requires.
const WAIT: Duration = Duration::from_secs(1);
/// The queue's visibility timeout: what a lost receive or a failed delete had in flight comes
/// back after this.
const VISIBILITY_SECS: u32 = 3;
/// SQS's own redrive: far more receives than any fault here should cost a message.
const MAX_RECEIVES: u32 = 10;

/// What one run under a fault came to.
#[derive(Debug)]
struct Run {
    ledger: Summary,
    stats: StatsSnapshot,
    dead_letters: usize,
    left: (u64, u64),
    /// Events in the ledger when the fault started and when the network came back.
    applied_at_fault: i64,
    applied_at_restore: i64,
    /// From the network's return to the next event applied (or to the end, when nothing was
    /// left to apply), and to every event applied with the queue empty.
    first_progress: Duration,
    all_done: Duration,
    fault_lasted: Duration,
}

impl Run {
    fn report(&self, name: &str) {
        println!(
            "{name}: {EVENTS} events; duplicates {}, lost {}, balances exact {}; \
             fault lasted {:?} from {} applied events to {}; after restore: next event applied \
             in {:?}, all applied and queue empty in {:?}; dead letters {}; queue {:?}; {:?}",
            self.ledger.duplicates(),
            self.ledger.lost(EVENTS),
            self.ledger.balances_exact,
            self.fault_lasted,
            self.applied_at_fault,
            self.applied_at_restore,
            self.first_progress,
            self.all_done,
            self.dead_letters,
            self.left,
            self.stats,
        );
    }

    fn assert_exactly_once(&self) {
        let expected: i64 = (0..EVENTS).map(|n| n + 1).sum();
        assert_eq!(self.ledger.duplicates(), 0, "applied twice: {self:?}");
        assert_eq!(self.ledger.lost(EVENTS), 0, "lost: {self:?}");
        assert!(self.ledger.balances_exact, "{self:?}");
        assert_eq!(self.ledger.total_balance, expected, "{self:?}");
        assert_eq!(self.left, (0, 0), "copies left on the queue: {self:?}");
        assert_eq!(self.stats.dead_lettered, 0, "{self:?}");
        assert_eq!(
            self.dead_letters, 0,
            "healthy messages dead-lettered: {self:?}"
        );
    }
}

/// Publishes [`EVENTS`] credits, consumes them through a proxy, applies `fault` once a third is
/// applied, and waits for the consumer to finish the queue by itself once the network is back.
async fn consume_through(name: &str, refused: Duration) -> Option<Run> {
    let Some(upstream) = plain_http_endpoint().await else {
        println!("{name}: skipped, the SQS endpoint is not plain HTTP so no proxy can sit in front of it");
        return None;
    };
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let sqs = common::client().await;
    let (url, dlq) = common::queue_with_redrive(&sqs, name, VISIBILITY_SECS, MAX_RECEIVES).await;
    let db = TestDb::new().await;
    let outgoing: Vec<_> = (0..EVENTS)
        .map(|n| Outgoing::new(credit(n % 10, n + 1)))
        .collect();
    SqsProducer::builder()
        .client(sqs.clone())
        .connect()
        .await
        .unwrap()
        .send_messages(&url, &outgoing)
        .await
        .unwrap();

    let source = SqsSource::builder(&url)
        .client(proxied_client(&proxy).await)
        .poll_timeout(WAIT)
        .connect()
        .await
        .unwrap();
    // Resolved through the proxy, so with the proxy's address: compare the queue names.
    let dlq_name = dlq.rsplit('/').next().unwrap();
    assert!(
        source.dead_letter_queue().unwrap().ends_with(dlq_name),
        "{:?} is not {dlq}",
        source.dead_letter_queue()
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let consumer = Consumer::new(
        "wallet",
        source,
        db.inbox(),
        Credit::new(db.pool.clone()).work(Duration::from_millis(5)),
    )
    .batch_size(10)
    .error_backoff(Duration::from_millis(200));
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let started = inbox_testkit::eventually(Duration::from_secs(30), || async {
        inbox_testkit::wallet::applied(&db.pool).await >= EVENTS / 3
    })
    .await;
    assert!(started, "the consumer applied too little before the fault");
    let applied_at_fault = inbox_testkit::wallet::applied(&db.pool).await;
    let fault_started = Instant::now();
    proxy.set_mode(ProxyMode::Refuse);
    tokio::time::sleep(refused).await;
    proxy.set_mode(ProxyMode::Pass);
    let restored = Instant::now();
    let fault_lasted = restored - fault_started;
    let applied_at_restore = inbox_testkit::wallet::applied(&db.pool).await;

    let progressed = inbox_testkit::eventually(Duration::from_secs(60), || async {
        let now = inbox_testkit::wallet::applied(&db.pool).await;
        now > applied_at_restore || now >= EVENTS
    })
    .await;
    let first_progress = restored.elapsed();
    let finished = inbox_testkit::eventually(Duration::from_secs(90), || async {
        inbox_testkit::wallet::applied(&db.pool).await >= EVENTS
            && counts(&sqs, &url).await == (0, 0)
    })
    .await;
    let all_done = restored.elapsed();

    let _ = stop.send(());
    let stats = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the consumer did not stop within 30 s of shutdown")
        .unwrap()
        .expect("the consumer stopped with an error");
    let run = Run {
        ledger: summary(&db.pool).await.unwrap(),
        stats,
        dead_letters: drain(&sqs, &dlq, Duration::from_secs(1)).await.len(),
        left: counts(&sqs, &url).await,
        applied_at_fault,
        applied_at_restore,
        first_progress,
        all_done,
        fault_lasted,
    };
    run.report(name);
    assert!(
        progressed,
        "no progress within 60 s of the network's return: {run:?}"
    );
    assert!(
        finished,
        "the queue was not finished within 90 s of the network's return: {run:?}"
    );
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
    db.drop().await;
    Some(run)
}

#[tokio::test]
async fn a_refused_endpoint_dead_letters_nothing_and_recovers() {
    let Some(run) = consume_through("refused", 5 * SECOND).await else {
        return;
    };
    run.assert_exactly_once();
    assert!(
        run.stats.errors + run.stats.ack_failures > 0,
        "the refusal was not felt: {run:?}"
    );
}
