//! Visibility timeouts: the heartbeat, nack delays, and the zombie consumer whose message is
//! handed to another consumer while it still works on it.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::{client, counts, credit, producer, queue, stalling_credit};
use inbox_conformance::wallet::{summary, Credit, Summary};
use inbox_conformance::TestDb;
use inbox_core::{Ack, Consumer, InboxStore, MessageSource, Publish, StatsSnapshot};
use inbox_postgres::PgTx;
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::SqsConnection;
use inbox_testkit::WithoutInbox;

const SECOND: Duration = Duration::from_secs(1);

/// A receive on the raw client, as another consumer would: how many messages it got.
async fn steal(sqs: &Client, url: &str) -> usize {
    let out = sqs
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(10)
        .wait_time_seconds(0)
        .send()
        .await
        .unwrap();
    out.messages().len()
}

#[tokio::test]
async fn heartbeat_keeps_a_slow_message_invisible_until_acked() {
    let sqs = client().await;
    let url = queue(&sqs, "hb", 2).await;
    producer(&sqs)
        .await
        .send(&url, credit(1, 1).as_bytes())
        .await
        .unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let mut batch = source.receive(10).await.unwrap();
    assert_eq!(batch.len(), 1);
    assert_eq!(batch[0].message.meta.delivery_count, Some(1));
    assert!(!batch[0].message.meta.redelivered);

    // Three visibility timeouts pass while the "handler" works; nobody else gets the message.
    let mut stolen = 0;
    for _ in 0..6 {
        tokio::time::sleep(SECOND).await;
        stolen += steal(&sqs, &url).await;
    }
    let delivery = batch.remove(0);
    delivery.ack.ack().await.unwrap();
    let left = counts(&sqs, &url).await;
    println!("heartbeat: stolen {stolen}, queue after ack {left:?}");
    assert_eq!(stolen, 0);
    assert_eq!(left, (0, 0));
    common::delete_queue(&sqs, &url).await;
}

#[tokio::test]
async fn a_dropped_delivery_comes_back_after_the_visibility_timeout() {
    let sqs = client().await;
    let url = queue(&sqs, "drop", 2).await;
    producer(&sqs)
        .await
        .send(&url, credit(1, 1).as_bytes())
        .await
        .unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let batch = source.receive(10).await.unwrap();
    assert_eq!(batch.len(), 1);
    // The consumer "crashed": its ack is dropped unused, and the heartbeat with it.
    drop(batch);
    let started = Instant::now();
    let mut again = source.receive(10).await.unwrap();
    while again.is_empty() && started.elapsed() < Duration::from_secs(10) {
        again = source.receive(10).await.unwrap();
    }
    println!("dropped delivery back after {:?}", started.elapsed());
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].message.meta.delivery_count, Some(2));
    assert!(again[0].message.meta.redelivered);
    <inbox_sqs::SqsAck as Ack>::ack_all(again.into_iter().map(|d| d.ack).collect())
        .await
        .unwrap();
    assert_eq!(counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
}

#[tokio::test]
async fn nack_makes_the_message_visible_after_the_delay() {
    let sqs = client().await;
    let url = queue(&sqs, "nack", 30).await;
    producer(&sqs)
        .await
        .send(&url, credit(1, 1).as_bytes())
        .await
        .unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let mut batch = source.receive(10).await.unwrap();
    batch
        .remove(0)
        .ack
        .nack(Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(steal(&sqs, &url).await, 0, "not visible before the delay");
    let started = Instant::now();
    let again = source.receive(10).await.unwrap();
    println!(
        "nacked message back after {:?} (visibility timeout 30 s)",
        started.elapsed()
    );
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].message.meta.delivery_count, Some(2));
    assert!(started.elapsed() < Duration::from_secs(10));
    common::delete_queue(&sqs, &url).await;
}

#[tokio::test]
async fn a_sub_second_nack_is_not_visible_at_once() {
    let sqs = client().await;
    let url = queue(&sqs, "nack-ms", 30).await;
    producer(&sqs)
        .await
        .send(&url, credit(1, 1).as_bytes())
        .await
        .unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let mut batch = source.receive(10).await.unwrap();
    assert_eq!(batch.len(), 1);
    batch
        .remove(0)
        .ack
        .nack(Duration::from_millis(300))
        .await
        .unwrap();
    // Whole seconds only: 300 ms must become 1 s, not 0 s (visible at once).
    assert_eq!(
        steal(&sqs, &url).await,
        0,
        "not visible right after the nack"
    );
    let again = source.receive(10).await.unwrap();
    assert_eq!(again.len(), 1, "back after the delay");
    assert_eq!(again[0].message.meta.delivery_count, Some(2));
    common::delete_queue(&sqs, &url).await;
}

/// Sends `stalling` events whose first handling stalls for 5 s and `plain` ones, then runs
/// three consumers on the queue (visibility timeout 2 s) until everything is applied and every
/// stall is over. Returns each consumer's counters and the ledger.
async fn zombie<St>(
    store: St,
    db: &TestDb,
    heartbeat: bool,
    stalling: i64,
    plain: i64,
) -> (Vec<StatsSnapshot>, Summary)
where
    St: InboxStore<Tx = PgTx> + Clone,
{
    const STALL: Duration = Duration::from_secs(5);
    let sqs = client().await;
    let url = queue(&sqs, "zombie", 2).await;
    let sender = producer(&sqs).await;
    for n in 0..stalling {
        sender
            .send(&url, stalling_credit(n, 100).as_bytes())
            .await
            .unwrap();
    }
    for n in 0..plain {
        sender.send(&url, credit(n, 1).as_bytes()).await.unwrap();
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut consumers = Vec::new();
    for _ in 0..3 {
        let source = SqsConnection::new(sqs.clone())
            .source(&url)
            .poll_timeout(SECOND)
            .heartbeat(heartbeat)
            .connect()
            .await
            .unwrap();
        let consumer = Consumer::new(
            "wallet",
            source,
            store.clone(),
            Credit::new(db.clone()).stall(STALL),
        );
        let mut stopped = stopped.clone();
        consumers.push(tokio::spawn(consumer.run_until(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })));
    }
    let started = Instant::now();
    let events = stalling + plain;
    let done = inbox_testkit::eventually(Duration::from_secs(60), || async {
        let ledger = summary(db).await.unwrap();
        ledger.distinct_events == events
            && counts(&sqs, &url).await == (0, 0)
            && started.elapsed() > STALL + SECOND
    })
    .await;
    // Graceful: every consumer finishes the message it is on (a zombie included) first.
    stop.send_replace(true);
    let mut stats = Vec::new();
    for consumer in consumers {
        stats.push(consumer.await.unwrap().unwrap());
    }
    assert!(done, "not all events applied in time");
    let ledger = summary(db).await.unwrap();
    common::delete_queue(&sqs, &url).await;
    (stats, ledger)
}

fn total(stats: &[StatsSnapshot], field: fn(&StatsSnapshot) -> u64) -> u64 {
    stats.iter().map(field).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_without_heartbeat_is_harmless_with_the_inbox() {
    let db = TestDb::new().await;
    let (stats, ledger) = zombie(db.inbox(), &db, false, 2, 4).await;
    println!(
        "zombie, heartbeat off, inbox: received {}, applied {}, skipped duplicates {}, ack failures {}; {ledger:?}",
        total(&stats, |s| s.received),
        total(&stats, |s| s.applied),
        total(&stats, |s| s.skipped_duplicates),
        total(&stats, |s| s.ack_failures),
    );
    assert!(
        total(&stats, |s| s.received) > 6,
        "the stalled messages were handed out again"
    );
    assert!(total(&stats, |s| s.skipped_duplicates) > 0);
    assert_eq!(ledger.ledger_rows, 6, "one ledger row per event");
    assert_eq!(ledger.duplicates(), 0);
    assert!(ledger.balances_exact);
    assert_eq!(ledger.total_balance, 2 * 100 + 4);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_without_heartbeat_duplicates_without_the_inbox() {
    let db = TestDb::new().await;
    let (stats, ledger) = zombie(WithoutInbox(db.inbox()), &db, false, 2, 4).await;
    println!(
        "zombie, heartbeat off, WITHOUT inbox: received {}, applied {}; {ledger:?}, duplicates {}",
        total(&stats, |s| s.received),
        total(&stats, |s| s.applied),
        ledger.duplicates(),
    );
    assert_eq!(ledger.distinct_events, 6);
    assert!(
        ledger.duplicates() > 0,
        "the test can see the duplicates the inbox prevents"
    );
    assert!(ledger.total_balance > 2 * 100 + 4);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_cannot_happen_with_the_heartbeat() {
    let db = TestDb::new().await;
    let (stats, ledger) = zombie(db.inbox(), &db, true, 2, 4).await;
    println!(
        "zombie, heartbeat on: received {}, applied {}, skipped duplicates {}; {ledger:?}",
        total(&stats, |s| s.received),
        total(&stats, |s| s.applied),
        total(&stats, |s| s.skipped_duplicates),
    );
    assert_eq!(
        total(&stats, |s| s.received),
        6,
        "no message was handed out twice"
    );
    assert_eq!(total(&stats, |s| s.skipped_duplicates), 0);
    assert_eq!(ledger.ledger_rows, 6);
    assert_eq!(ledger.total_balance, 2 * 100 + 4);
    db.drop().await;
}

/// A copy handed out again under a new receipt handle while the first delivery waited (its
/// visibility ran out, here made to) and settled there is reported stale once the heartbeat
/// finds the first handle refused, so the consumer drops the first delivery before its claim
/// instead of applying it under a handle that can no longer delete it.
#[tokio::test]
async fn a_delivery_whose_message_was_handed_out_again_is_stale() {
    let sqs = client().await;
    let url = queue(&sqs, "stale", 3).await;
    let sender = producer(&sqs).await;
    sender.send(&url, credit(1, 5).as_bytes()).await.unwrap();
    let mut source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(SECOND)
        .connect()
        .await
        .unwrap();
    let mut first = source.receive(1).await.unwrap();
    let first = first.pop().unwrap();
    assert!(!first.ack.is_stale(), "a fresh delivery is not stale");
    // Its visibility runs out (made to, at once) and another consumer receives it.
    sqs.change_message_visibility()
        .queue_url(&url)
        .receipt_handle(first.ack.receipt_handle())
        .visibility_timeout(0)
        .send()
        .await
        .unwrap();
    // Another consumer receives it under a new handle, applies it and deletes it. (moto
    // refuses an old handle only once the message is gone; AWS as soon as it was handed out
    // again.)
    let started = Instant::now();
    let other = loop {
        let out = sqs
            .receive_message()
            .queue_url(&url)
            .wait_time_seconds(1)
            .send()
            .await
            .unwrap();
        if let Some(message) = out.messages().first() {
            break message.receipt_handle().unwrap().to_owned();
        }
        assert!(
            started.elapsed() < 5 * SECOND,
            "the message never came back"
        );
    };
    assert_ne!(other, first.ack.receipt_handle());
    sqs.delete_message()
        .queue_url(&url)
        .receipt_handle(other)
        .send()
        .await
        .unwrap();
    // The heartbeat extends every second (a third of 3 s): its next extension finds the
    // receipt handle stale.
    let started = Instant::now();
    while !first.ack.is_stale() && started.elapsed() < 5 * SECOND {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        first.ack.is_stale(),
        "the first delivery is not reported stale after its message was handed out again"
    );
    common::delete_queue(&sqs, &url).await;
}
