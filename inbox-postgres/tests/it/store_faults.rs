//! Faults that come from the database rather than the broker, beyond the store suite's
//! (`tests/it/store_suite.rs`: a swallowed SQL error, an outage, connections cut around commit):
//! a swallowed error inside a batch, errors that recur at `COMMIT`, a one-connection pool, a
//! worn consumer-id sequence.
//! Each must end with every message applied once or dead-lettered, never acked unapplied and
//! never looping for ever.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::time::Duration;

use inbox_conformance::wallet::publish_credit;
use inbox_conformance::wallet::{self, balance, Credit};
use inbox_conformance::TestDb;
use inbox_core::{
    Consumer, ConsumerBinding, Handler, HandlerError, InboxStore, Message, MessageId, Transaction,
};
use inbox_postgres::{PgInbox, PgTx, TableName};
use inbox_testkit::fast_retry;
use inbox_testkit::MemoryBroker;
use sqlx::postgres::PgPoolOptions;
use sqlx::AssertSqlSafe;

/// Runs a consumer to idle, failing the test instead of hanging when it loops for ever.
async fn within<T>(run: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the consumer did not get through the queue: it loops or stalls")
}

/// Credits, then writes a "best-effort" audit row and ignores its failure, as handlers that
/// "ignore the unique violation" do. For IDs in `swallow_for`, the audit insert violates the
/// audit table's key, which aborts the PostgreSQL transaction.
struct AuditIgnoringErrors {
    credit: Credit,
}

impl Handler<PgTx> for AuditIgnoringErrors {
    async fn handle(
        &self,
        tx: &mut PgTx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        self.credit.handle(tx, id, message).await?;
        let audit = sqlx::query("INSERT INTO audit (event_id) VALUES ($1)")
            .bind(id.as_str())
            .execute(&mut **tx)
            .await;
        if let Err(e) = audit {
            eprintln!("audit insert failed, ignored: {e}");
        }
        Ok(())
    }
}

async fn audit_table(db: &TestDb, taken: &[&str]) {
    sqlx::query("CREATE TABLE audit (event_id text PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    for id in taken {
        sqlx::query("INSERT INTO audit VALUES ($1)")
            .bind(id)
            .execute(&db.pool)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_swallowed_sql_error_inside_a_batch_fails_only_its_own_message() {
    let db = TestDb::new().await;
    audit_table(&db, &["evt-3"]).await;
    let broker = MemoryBroker::new();
    for i in 1..=5 {
        publish_credit(&broker, &format!("evt-{i}"), i, 10);
    }

    let handler = AuditIgnoringErrors {
        credit: Credit::new(db.clone()),
    };
    let stats = Consumer::new("wallet", broker.source(), db.inbox(), handler)
        .batch_size(5)
        .retry(fast_retry(2))
        .run_until_idle();
    let stats = within(stats).await.unwrap();

    assert_eq!(stats.applied, 4, "{stats:?}");
    for account in [1, 2, 4, 5] {
        assert_eq!(balance(&db, account).await, 10, "account {account}");
    }
    assert_eq!(balance(&db, 3).await, 0);
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0.id.as_ref().unwrap().as_str(), "evt-3");
    assert_eq!(db.inbox_rows().await, 4);
    assert_eq!(broker.pending(), 0);
    db.drop().await;
}

#[tokio::test]
async fn a_constraint_failing_at_commit_dead_letters_its_message_and_spares_the_batch() {
    let db = TestDb::new().await;
    // A deferred check: credits of account 13 fail only at COMMIT, for ever.
    sqlx::query(
        "ALTER TABLE ledger ADD CONSTRAINT no_account_13
         EXCLUDE USING btree (account_id WITH =) WHERE (account_id = 13)
         DEFERRABLE INITIALLY DEFERRED",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO ledger (event_id, account_id, amount) VALUES ('seed', 13, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new();
    publish_credit(&broker, "evt-1", 1, 10);
    publish_credit(&broker, "evt-13", 13, 10);
    publish_credit(&broker, "evt-2", 2, 10);

    let stats = Consumer::new(
        "wallet",
        broker.source(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(3)
    .retry(fast_retry(3))
    .error_backoff(Duration::from_millis(10))
    .run_until_idle();
    let stats = within(stats).await.unwrap();

    assert_eq!(stats.applied, 2, "{stats:?}");
    assert_eq!(balance(&db, 1).await, 10);
    assert_eq!(balance(&db, 2).await, 10);
    let dead = broker.dead_letters();
    assert_eq!(
        dead.len(),
        1,
        "the failing message is isolated and dead-lettered"
    );
    assert_eq!(dead[0].0.id.as_ref().unwrap().as_str(), "evt-13");
    assert_eq!(broker.pending(), 0);
    db.drop().await;
}

#[tokio::test]
async fn a_one_connection_pool_does_not_stall() {
    let db = TestDb::new().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&inbox_conformance::database_url())
        .await
        .unwrap();
    let table = TableName::qualified(&db.schema, "inbox").unwrap();
    let inbox = PgInbox::new(pool.clone()).with_table(table);
    let broker = MemoryBroker::new();
    for i in 1..=3 {
        publish_credit(&broker, &format!("evt-{i}"), 1, 1);
    }

    let started = std::time::Instant::now();
    let run = Consumer::new("wallet", broker.source(), inbox, Noop)
        .batch_size(3)
        .run_until_idle();
    let stats = within(run).await.unwrap();

    assert_eq!(stats.applied, 3, "{stats:?}");
    assert_eq!(stats.errors, 0, "no acquire timed out: {stats:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    pool.close().await;
    db.drop().await;
}

/// A lane never waits for a second connection while its transaction holds one: lanes that each
/// did (registering the consumer name inside the claim), from a pool sized for them all,
/// stalled a consumer at start with every lane idle in its transaction. The bound store reads
/// the name's id once, before its first transaction opens, and the claim takes no connection.
#[tokio::test]
async fn a_claim_takes_no_second_connection() {
    let db = TestDb::new().await;
    db.inbox().consumer_id("wallet").await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&inbox_conformance::database_url())
        .await
        .unwrap();
    let table = TableName::qualified(&db.schema, "inbox").unwrap();
    let inbox = PgInbox::new(pool.clone())
        .with_table(table)
        .bind(&ConsumerBinding::new("wallet"));

    let mut tx = inbox.begin().await.unwrap();
    let before = pool.size();
    let id = MessageId::new("evt-1").unwrap();
    let claimed = inbox.claim(&mut tx, std::slice::from_ref(&id)).await;
    assert_eq!(claimed.unwrap(), [true]);
    assert_eq!(
        pool.size(),
        before,
        "the claim opened another connection while its transaction held one"
    );
    tx.commit().await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    let claimed = inbox.claim(&mut tx, std::slice::from_ref(&id)).await;
    assert_eq!(claimed.unwrap(), [false]);
    tx.rollback().await.unwrap();
    pool.close().await;
    db.drop().await;
}

/// Applies nothing but the claim.
struct Noop;

impl Handler<PgTx> for Noop {
    async fn handle(&self, _: &mut PgTx, _: &MessageId, _: &Message) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test]
async fn registering_a_known_consumer_burns_no_id() {
    let db = TestDb::new().await;
    db.inbox().consumer_id("wallet").await.unwrap();
    // Wind the id sequence to its last value: one more value drawn and registration fails.
    let sequence: String =
        sqlx::query_scalar("SELECT pg_get_serial_sequence('inbox_consumers', 'id')")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "ALTER SEQUENCE {sequence} RESTART WITH 32767"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let last = db.inbox().consumer_id("last").await.unwrap();
    assert_eq!(last, 32767);

    // Every process start registers its name on a cold cache: a known name must draw nothing.
    for _ in 0..3 {
        let id = db.inbox().consumer_id("wallet").await.unwrap();
        assert_eq!(id, 1);
        let broker = MemoryBroker::new();
        publish_credit(&broker, &format!("evt-{}", rand::random::<u64>()), 1, 1);
        let stats = Consumer::new(
            "wallet",
            broker.source(),
            db.inbox(),
            Credit::new(db.clone()),
        )
        .run_until_idle()
        .await
        .unwrap();
        assert_eq!((stats.applied, stats.errors), (1, 0), "{stats:?}");
    }
    assert_eq!(wallet::summary(&db).await.unwrap().ledger_rows, 3);
    db.drop().await;
}
