//! The article's scenarios on the wallet domain, against a real PostgreSQL: the conformance
//! suite on the in-memory broker (duplicates, crashes at each stage, racing members, bad input,
//! retries, delivery counts, batches over lanes, a zombie, the outbox relay), then what is the
//! store's own: a rollback taking the claim with it, a poison message in a batch, a panicking
//! handler, shutdown mid-batch, consumer names. The two anti-pattern tests show the harness can
//! see the failures the inbox prevents.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

inbox_conformance::suite!(inbox_conformance::memory::Memory);

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::wallet::publish_credit;
use inbox_conformance::wallet::{self, balance, Credit};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Stage};
use inbox_postgres::PgTx;
use inbox_testkit::fast_retry;
use inbox_testkit::{AckOnReceive, Crash, MemoryBroker, WithoutInbox};

#[tokio::test]
async fn ack_before_the_database_loses_the_message_on_a_crash() {
    // The anti-pattern ("offset first"): the broker forgets the message on receipt.
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    publish_credit(&broker, "evt-1", 1, 100);

    let crash = Crash::at(Stage::Applied);
    let crashed = Consumer::new(
        "wallet",
        AckOnReceive::new(broker.source()),
        db.inbox(),
        crash.handler(Credit::new(db.clone())),
    );
    let crashed = crash.run(crashed.run_until_idle()).await;
    assert!(crashed.is_err(), "{crashed:?}");

    let restarted = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .run_until_idle()
    .await
    .unwrap();

    assert_eq!(restarted.received, 0, "nothing comes back");
    assert_eq!(balance(&db, 1).await, 0, "evt-1 is lost for good");
    assert_eq!(broker.pending(), 0);
    db.drop().await;
}

#[tokio::test]
async fn without_the_inbox_a_crash_after_commit_credits_twice() {
    // The anti-pattern "commit after the database, no inbox" (the article's variant b).
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    publish_credit(&broker, "evt-2", 1, 100);
    let no_inbox = WithoutInbox(db.inbox());

    let crash = Crash::at(Stage::Committed);
    let crashed = Consumer::new(
        "wallet",
        crash.source(broker.source()),
        no_inbox.clone(),
        Credit::new(db.clone()),
    );
    let crashed = crash.run(crashed.run_until_idle()).await;
    assert!(crashed.is_err(), "{crashed:?}");
    Consumer::new("wallet", broker.source(), no_inbox, Credit::new(db.clone()))
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(balance(&db, 1).await, 200, "credited twice: 200, not 100");
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!(summary.duplicates(), 1);
    db.drop().await;
}

/// Fails the first `failures` calls, then credits.
struct Flaky {
    inner: Credit,
    failures: AtomicU32,
}

impl Handler<PgTx> for Flaky {
    async fn handle(&self, tx: &mut PgTx, id: &MessageId, m: &Message) -> Result<(), HandlerError> {
        // Write first, then fail: the rollback must take the credit and the inbox row with it.
        self.inner.handle(tx, id, m).await?;
        let left = self.failures.load(Ordering::SeqCst);
        if left > 0 {
            self.failures.store(left - 1, Ordering::SeqCst);
            return Err(HandlerError::transient("downstream timeout"));
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_handler_error_rolls_back_the_inbox_row_and_the_retry_applies_once() {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    publish_credit(&broker, "evt-1", 1, 100);
    let flaky = Flaky {
        inner: Credit::new(db.clone()),
        failures: AtomicU32::new(2),
    };

    let stats = Consumer::new("wallet", broker.source(), db.inbox(), flaky)
        .retry(fast_retry(3))
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(
        (stats.retried, stats.applied, stats.dead_lettered),
        (2, 1, 0)
    );
    assert_eq!(balance(&db, 1).await, 100);
    assert_eq!(wallet::summary(&db).await.unwrap().ledger_rows, 1);
    assert_eq!(db.inbox_rows().await, 1);

    // Past the limit it is dead-lettered, and neither the credit nor the inbox row stays, so a
    // replay from the dead-letter queue would still be applied.
    publish_credit(&broker, "evt-2", 1, 7);
    let always = Flaky {
        inner: Credit::new(db.clone()),
        failures: AtomicU32::new(u32::MAX),
    };
    let stats = Consumer::new("wallet", broker.source(), db.inbox(), always)
        .retry(fast_retry(2))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!((stats.retried, stats.dead_lettered), (1, 1));
    assert_eq!(
        broker.dead_letters()[0].1,
        "handler failed 2 time(s), last error: downstream timeout"
    );
    assert_eq!(balance(&db, 1).await, 100);
    assert_eq!(db.inbox_rows().await, 1, "evt-2 left no inbox row");
    db.drop().await;
}

#[tokio::test]
async fn a_poison_message_in_a_batch_is_dead_lettered_and_the_rest_commits_once() {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    for i in 0..10 {
        if i == 4 {
            broker.publish(Some("evt-poison"), "{not json");
        } else {
            publish_credit(&broker, &format!("evt-{i}"), i, 10);
        }
    }

    let stats = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(10)
    .run_until_idle()
    .await
    .unwrap();

    // No savepoints: the failure rolls back the batch, then the messages before the poison
    // commit together, the poison fails alone, and the messages after it commit together.
    assert_eq!(
        stats.commits, 2,
        "two transactions for the nine good messages, around the poison"
    );
    assert_eq!((stats.applied, stats.dead_lettered), (9, 1));
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0]
            .1
            .starts_with("handler refused the message: payload is not valid JSON"),
        "{}",
        dead[0].1
    );
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!(
        (
            summary.ledger_rows,
            summary.distinct_events,
            summary.total_balance
        ),
        (9, 9, 90)
    );
    assert_eq!(
        db.inbox_rows().await,
        9,
        "the poison message's claim was undone"
    );
    assert_eq!(broker.pending(), 0);
    db.drop().await;
}

#[tokio::test]
async fn a_panicking_handler_does_not_take_the_consumer_down() {
    struct PanicsOnce(AtomicU32, Credit);
    impl Handler<PgTx> for PanicsOnce {
        async fn handle(
            &self,
            tx: &mut PgTx,
            id: &MessageId,
            m: &Message,
        ) -> Result<(), HandlerError> {
            if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("boom");
            }
            self.1.handle(tx, id, m).await
        }
    }
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    publish_credit(&broker, "evt-1", 1, 100);
    publish_credit(&broker, "evt-2", 1, 1);

    let stats = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        PanicsOnce(AtomicU32::new(0), Credit::new(db.clone())),
    )
    .retry(fast_retry(3))
    .run_until_idle()
    .await
    .unwrap();

    assert_eq!((stats.applied, stats.retried), (2, 1));
    assert_eq!(balance(&db, 1).await, 101);
    db.drop().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_the_batch_in_flight() {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    for i in 0..5 {
        publish_credit(&broker, &format!("evt-{i}"), 1, 1);
    }
    let consumer = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()).work(Duration::from_millis(100)),
    )
    .batch_size(5);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    // Ask to stop while the batch of five (500 ms of work) is being applied.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let _ = stop.send(());
    let stats = run.await.unwrap().unwrap();

    assert_eq!(stats.applied, 5);
    assert_eq!(balance(&db, 1).await, 5);
    assert_eq!(
        broker.pending(),
        0,
        "the batch in flight was acked before returning"
    );
    db.drop().await;
}

#[tokio::test]
async fn consumers_with_different_names_each_apply_once() {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    publish_credit(&broker, "evt-1", 1, 100);
    publish_credit(&broker, "evt-1", 1, 100);
    publish_credit(&broker, "evt-1", 1, 100);
    let handler = Arc::new(Credit::new(db.clone()));
    for name in ["wallet", "audit", "wallet"] {
        let source = broker.source();
        Consumer::new(name, source, db.inbox(), Arc::clone(&handler))
            .batch_size(1)
            .run_until_idle()
            .await
            .unwrap();
        // Re-publish so every consumer sees a copy.
        publish_credit(&broker, "evt-1", 1, 100);
    }
    // "wallet" applied once, "audit" applied once: two credits in all.
    assert_eq!(balance(&db, 1).await, 200);
    db.drop().await;
}
