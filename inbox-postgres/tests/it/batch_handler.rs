//! The set-based batch handler against a real PostgreSQL: one transaction per batch, decoding
//! before the database, and a failing message found and dead-lettered without its neighbours.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_conformance::wallet::publish_credit;
use inbox_conformance::wallet::{self, balance, BatchCredit};
use inbox_conformance::TestDb;
use inbox_core::Consumer;
use inbox_testkit::fast_retry;
use inbox_testkit::MemoryBroker;

#[tokio::test]
async fn a_batch_is_applied_set_based_in_one_transaction_and_duplicates_skipped() {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    for i in 0..100 {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 10);
    }
    // Redelivered copies inside the batch.
    publish_credit(&broker, "evt-3", 3, 10);
    publish_credit(&broker, "evt-50", 50 % 7, 10);

    let stats = Consumer::batched("wallet", broker.source(), db.inbox(), BatchCredit)
        .batch_size(200)
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (100, 2),
        "{stats:?}"
    );
    assert_eq!(stats.commits, 1, "one transaction for the batch");
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!((summary.ledger_rows, summary.duplicates()), (100, 0));
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, 1000);

    // The same events again, as after a crash before the ack: all skipped, nothing written.
    for i in 0..100 {
        publish_credit(&broker, &format!("evt-{i}"), i % 7, 10);
    }
    let again = Consumer::batched("wallet", broker.source(), db.inbox(), BatchCredit)
        .batch_size(200)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!((again.applied, again.skipped_duplicates), (0, 100));
    assert_eq!(wallet::summary(&db).await.unwrap().ledger_rows, 100);
    db.drop().await;
}

#[tokio::test]
async fn an_unparsable_message_is_dead_lettered_before_the_transaction() {
    let db = TestDb::new().await;
    let broker = MemoryBroker::new();
    for i in 0..10 {
        if i == 4 {
            broker.publish(Some("evt-poison"), "{not json");
        } else {
            publish_credit(&broker, &format!("evt-{i}"), i, 10);
        }
    }

    let stats = Consumer::batched("wallet", broker.source(), db.inbox(), BatchCredit)
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!((stats.applied, stats.dead_lettered), (9, 1), "{stats:?}");
    assert_eq!(stats.commits, 1, "the poison never entered the transaction");
    let dead = broker.dead_letters();
    assert!(
        dead[0]
            .1
            .starts_with("handler refused the message: payload is not valid JSON"),
        "{}",
        dead[0].1
    );
    assert_eq!(db.inbox_rows().await, 9);
    db.drop().await;
}

#[tokio::test]
async fn a_message_the_database_refuses_is_found_and_dead_lettered_alone() {
    let db = TestDb::new().await;
    sqlx::query("ALTER TABLE ledger ADD CONSTRAINT no_13 CHECK (amount <> 13)")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new();
    for i in 0..64 {
        let amount = if i == 37 { 13 } else { 1 };
        publish_credit(&broker, &format!("evt-{i}"), i % 5, amount);
    }

    let stats = Consumer::batched("wallet", broker.source(), db.inbox(), BatchCredit)
        .batch_size(64)
        .retry(fast_retry(2))
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!((stats.applied, stats.dead_lettered), (63, 1), "{stats:?}");
    // Halving pins one message in 64 in log2(64) = 6 levels, committing what passes on the way.
    assert!(stats.commits <= 7, "{stats:?}");
    let dead = broker.dead_letters();
    assert_eq!(dead[0].0.id.as_ref().unwrap().as_str(), "evt-37");
    assert!(dead[0].1.contains("no_13"), "{}", dead[0].1);
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!((summary.ledger_rows, summary.duplicates()), (63, 0));
    assert!(summary.balances_exact);
    assert_eq!(balance(&db, 37 % 5).await, 12);
    assert_eq!(broker.pending(), 0);
    db.drop().await;
}
