//! Inbox, then outbox, on RabbitMQ: an inbox consumer's handler writes outbox rows in its
//! transaction, `OutboxRelay` publishes them with `RabbitProducer`, and a downstream inbox
//! consumer applies them once, also when a lost confirm makes the relay publish a batch again.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use inbox_core::{
    async_trait, Consumer, Handler, HandlerError, Message, MessageId, OutgoingMessage, Publish,
    PublishError, Recovery,
};
use inbox_postgres::{Outbox, PgTx, RelayError};
use inbox_rabbitmq::RabbitProducer;
use inbox_testkit::wallet::{self, Credit, CreditEvent};
use inbox_testkit::TestDb;

/// The upstream handler: forwards each credit to another queue through the outbox, in the
/// inbox transaction.
struct Forward {
    outbox: Outbox,
    to: String,
}

#[async_trait]
impl Handler<PgTx> for Forward {
    async fn handle(
        &self,
        tx: &mut PgTx,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        self.outbox.write(tx, &self.to, &message.payload).await?;
        Ok(())
    }
}

/// Publishes for real, and the first time reports the confirm as lost.
struct LoseFirstConfirm {
    inner: RabbitProducer,
    lost: AtomicBool,
}

#[async_trait]
impl Publish for LoseFirstConfirm {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        self.inner.send_batch(destination, messages).await?;
        if !self.lost.swap(true, Ordering::SeqCst) {
            return Err(PublishError::new(
                Recovery::Reconnect,
                format!("publishing to `{destination}`"),
                "connection lost before the confirms arrived",
            ));
        }
        Ok(())
    }
}

async fn outbox(db: &TestDb) -> Outbox {
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    outbox
}

async fn outbox_ids(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar("SELECT message_id FROM outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn unsent(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_handler_writes_the_outbox_the_relay_publishes_and_the_downstream_inbox_applies_each_once(
) {
    const EVENTS: i64 = 200;
    let (upstream, downstream) = (fresh_config("outbox-in"), fresh_config("outbox-out"));
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let producer = publisher(&upstream).await;
    let relay_publisher = publisher(&downstream).await;
    let mut total = 0;
    for i in 0..EVENTS {
        let event = CreditEvent::new(1 + i % 5, i + 1);
        total += event.amount;
        let id = MessageId::generate();
        producer
            .send_with_id(upstream.queue(), &id, &event.to_json())
            .await
            .unwrap();
        if i < 20 {
            // Published twice upstream: forwarded once.
            producer
                .send_with_id(upstream.queue(), &id, &event.to_json())
                .await
                .unwrap();
        }
    }

    let forward = Forward {
        outbox: outbox.clone(),
        to: downstream.queue().to_owned(),
    };
    let source = upstream.clone().connect().await.unwrap();
    let forwarded = Consumer::new("forward", source, db.inbox(), forward)
        .batch_size(50)
        .run_until_idle()
        .await
        .unwrap();
    let relayed = outbox
        .relay(relay_publisher)
        .batch_size(64)
        .run_until_idle()
        .await
        .unwrap();
    let source = downstream.clone().connect().await.unwrap();
    let applied = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .batch_size(50)
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(forwarded.skipped_duplicates, 20);
    assert_eq!(relayed.published, EVENTS as u64);
    assert_eq!(unsent(&db).await, 0);
    assert_eq!(
        (
            applied.received,
            applied.applied,
            applied.skipped_duplicates
        ),
        (EVENTS as u64, EVENTS as u64, 0),
        "each row reached the queue once"
    );
    let ledger: Vec<String> = sqlx::query_scalar("SELECT event_id FROM ledger ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        ledger,
        outbox_ids(&db).await,
        "under the rows' IDs, in their order"
    );
    let summary = wallet::summary(&db.pool).await.unwrap();
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(left_on(downstream.queue()).await, 0);
    cleanup(&upstream).await;
    cleanup(&downstream).await;
    db.drop().await;
}

#[tokio::test]
async fn a_lost_confirm_publishes_the_batch_again_under_the_same_ids_and_the_inbox_skips_it() {
    const ROWS: i64 = 40;
    let config = fresh_config("outbox-lost-confirm");
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..ROWS {
        let event = CreditEvent::new(1, i + 1);
        outbox
            .write(&mut tx, config.queue(), event.to_json())
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let publisher = LoseFirstConfirm {
        inner: publisher(&config).await,
        lost: AtomicBool::new(false),
    };
    let relayed = outbox
        .relay(publisher)
        .batch_size(100)
        .error_backoff(Duration::from_millis(20))
        .run_until_idle()
        .await
        .unwrap();
    let source = config.clone().connect().await.unwrap();
    let applied = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .batch_size(50)
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!((relayed.published, relayed.errors), (ROWS as u64, 1));
    assert_eq!(
        (
            applied.received,
            applied.applied,
            applied.skipped_duplicates
        ),
        (2 * ROWS as u64, ROWS as u64, ROWS as u64),
        "the batch went out twice, the second time under the same IDs"
    );
    let ledger: Vec<String> = sqlx::query_scalar("SELECT event_id FROM ledger ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(ledger, outbox_ids(&db).await);
    assert_eq!(wallet::summary(&db.pool).await.unwrap().duplicates(), 0);
    cleanup(&config).await;
    db.drop().await;
}

#[tokio::test]
async fn a_queue_that_does_not_exist_stops_the_relay_and_leaves_the_rows_unsent() {
    let config = fresh_config("outbox-missing"); // never declared
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox.write(&mut tx, config.queue(), b"x").await.unwrap();
    tx.commit().await.unwrap();

    let publisher = RabbitProducer::builder().connect().await.unwrap();
    let error = outbox.relay(publisher).run_until_idle().await.unwrap_err();

    assert!(
        matches!(error, RelayError::Publish { row: 1, .. }),
        "{error}"
    );
    assert_eq!(error.recovery(), Recovery::Fatal);
    assert!(
        error.to_string().contains("declare the topology"),
        "{error}"
    );
    assert_eq!(unsent(&db).await, 1);
    db.drop().await;
}
