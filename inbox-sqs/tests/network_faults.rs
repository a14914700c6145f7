//! The SQS endpoint refuses the consumer's connections for a while: the consumer's client talks
//! to it through a [`FaultProxy`]; PostgreSQL is not touched. Once the endpoint is back, every
//! event is in the ledger exactly once, every copy deleted from the queue and nothing
//! dead-lettered, without restarting the consumer. (Black holes and cut connections are in the
//! conformance suite.)
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{counts, credit, drain, plain_http_endpoint, proxied_client};
use inbox_conformance::wallet::{summary, Credit};
use inbox_conformance::TestDb;
use inbox_conformance::{wait_for_a_third, FaultProxy, FaultRun, ProxyMode, Restored};
use inbox_core::{Consumer, OutgoingMessage, Publish};
use inbox_sqs::{SqsProducer, SqsSource};
use inbox_testkit::watch_errors;
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

/// What SQS had left at the end.
#[derive(Debug)]
struct Left {
    /// Messages on the dead-letter queue.
    dead_letters: usize,
    /// Copies on the queue: visible, and in flight.
    queue: (u64, u64),
}

type Run = FaultRun<Left>;

/// Every event applied once, every copy deleted from the queue and none dead-lettered.
fn assert_exactly_once(run: &Run) {
    run.assert_exactly_once(EVENTS, (0..EVENTS).map(|n| n + 1).sum());
    assert_eq!(
        run.broker.queue,
        (0, 0),
        "copies left on the queue: {run:?}"
    );
    assert_eq!(
        run.broker.dead_letters, 0,
        "healthy messages dead-lettered: {run:?}"
    );
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
        .map(|n| OutgoingMessage::generate(credit(n % 10, n + 1)))
        .collect();
    SqsProducer::builder()
        .client(sqs.clone())
        .connect()
        .await
        .unwrap()
        .send_batch(&url, &outgoing)
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
    let stats = consumer.stats();
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let applied_at_fault = wait_for_a_third(&db.pool, EVENTS, Duration::from_secs(30)).await;
    let (fault_started, detecting) = watch_errors(Arc::clone(&stats));
    proxy.set_mode(ProxyMode::Refuse);
    tokio::time::sleep(refused).await;
    proxy.set_mode(ProxyMode::Pass);
    let Restored {
        at: restored,
        applied: applied_at_restore,
        progressed,
        first_progress,
    } = Restored::measure(&db.pool, EVENTS, Duration::from_secs(60)).await;
    let fault_lasted = restored - fault_started;
    let finished = inbox_testkit::eventually(Duration::from_secs(90), || async {
        inbox_conformance::wallet::applied(&db.pool).await >= EVENTS
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
    detecting.abort();
    let detected = detecting.await.ok().flatten();
    let broker = Left {
        dead_letters: drain(&sqs, &dlq, Duration::from_secs(1)).await.len(),
        queue: counts(&sqs, &url).await,
    };
    let run = Run {
        ledger: summary(&db.pool).await.unwrap(),
        stats,
        applied_at_fault,
        applied_at_restore,
        detected,
        fault_lasted,
        first_progress,
        all_done,
        broker,
    };
    run.report(name, EVENTS);
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
    assert_exactly_once(&run);
    assert!(
        run.stats.errors + run.stats.ack_failures > 0,
        "the refusal was not felt: {run:?}"
    );
}
