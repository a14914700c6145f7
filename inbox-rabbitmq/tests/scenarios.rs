//! The foundation's scenarios over a real RabbitMQ queue and a real PostgreSQL inbox.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use inbox_core::testkit::crash_at;
use inbox_core::{
    async_trait, Ack, Consumer, Error, Handler, HandlerError, Message, MessageId, MessageSource,
    RetryPolicy, Stage,
};
use inbox_postgres::testkit::wallet::{self, Credit, CreditEvent};
use inbox_postgres::testkit::TestDb;
use inbox_postgres::PgTx;
use inbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use inbox_rabbitmq::lapin::BasicProperties;
use inbox_rabbitmq::{RabbitSource, REASON_HEADER};

#[tokio::test]
async fn a_message_published_twice_is_credited_once() {
    let config = fresh_config("double");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    let id = MessageId::generate();
    publisher
        .publish_with_id(&id, &credit(1, 100))
        .await
        .unwrap();
    publisher
        .publish_with_id(&id, &credit(1, 100))
        .await
        .unwrap();

    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .run_until_idle()
        .await
        .unwrap();

    let summary = wallet::summary(&db.pool).await.unwrap();
    let left = left_on(config.queue()).await;
    println!("double delivery: {stats:?}, {summary:?}, left on queue {left}");
    assert_eq!(wallet::balance(&db.pool, 1).await, 100);
    assert_eq!((summary.ledger_rows, summary.distinct_events), (1, 1));
    assert_eq!((stats.applied, stats.skipped_duplicates), (1, 1));
    assert_eq!(left, 0);
    cleanup(&config).await;
    db.drop().await;
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_is_skipped_on_redelivery() {
    let config = fresh_config("crash");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    publisher.publish(&credit(7, 250)).await.unwrap();

    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let crashed = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .on_stage(crash_at(Stage::Committed))
        .run_until_idle()
        .await;
    // The consumer (and with it the source and its channel) is gone: the broker requeues.
    assert!(
        matches!(
            crashed,
            Err(Error::Crashed {
                stage: Stage::Committed,
                ..
            })
        ),
        "{crashed:?}"
    );

    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .run_until_idle()
        .await
        .unwrap();

    let summary = wallet::summary(&db.pool).await.unwrap();
    let left = left_on(config.queue()).await;
    println!("crash after commit: restarted {stats:?}, {summary:?}, left on queue {left}");
    assert_eq!(
        (stats.received, stats.applied, stats.skipped_duplicates),
        (1, 0, 1)
    );
    assert_eq!(wallet::balance(&db.pool, 7).await, 250);
    assert_eq!(summary.ledger_rows, 1);
    assert!(summary.balances_exact);
    assert_eq!(left, 0);
    cleanup(&config).await;
    db.drop().await;
}

#[tokio::test]
async fn racing_consumers_credit_one_id_once() {
    let config = fresh_config("race").prefetch(1);
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    // Both consumers are subscribed before the copies arrive, so each gets one.
    let a = RabbitSource::connect(config.clone()).await.unwrap();
    let b = RabbitSource::connect(config.clone()).await.unwrap();
    let id = MessageId::generate();
    publisher
        .publish_with_id(&id, &credit(3, 40))
        .await
        .unwrap();
    publisher
        .publish_with_id(&id, &credit(3, 40))
        .await
        .unwrap();

    let slow = Credit::new(db.pool.clone()).work(Duration::from_millis(200));
    let (sa, sb) = tokio::join!(
        Consumer::new("wallet", a, db.inbox(), slow.clone()).run_until_idle(),
        Consumer::new("wallet", b, db.inbox(), slow).run_until_idle(),
    );
    let (sa, sb) = (sa.unwrap(), sb.unwrap());

    let summary = wallet::summary(&db.pool).await.unwrap();
    let left = left_on(config.queue()).await;
    println!("racing consumers: a {sa:?}, b {sb:?}, {summary:?}, left on queue {left}");
    assert_eq!(sa.received + sb.received, 2);
    assert_eq!(sa.applied + sb.applied, 1);
    assert_eq!(sa.skipped_duplicates + sb.skipped_duplicates, 1);
    assert_eq!(wallet::balance(&db.pool, 3).await, 40);
    assert_eq!(summary.ledger_rows, 1);
    assert_eq!(left, 0);
    cleanup(&config).await;
    db.drop().await;
}

#[tokio::test]
async fn a_message_without_id_is_dead_lettered_with_a_reason() {
    let config = fresh_config("noid");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    let props = BasicProperties::default()
        .with_headers(headers)
        .with_content_type("application/json".into());
    publisher
        .publish_with_properties(&credit(9, 5), props)
        .await
        .unwrap();
    publisher.publish(&credit(9, 1)).await.unwrap();

    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .run_until_idle()
        .await
        .unwrap();

    let parked = drain(&config.dead_letter_queue()).await;
    let summary = wallet::summary(&db.pool).await.unwrap();
    let left = left_on(config.queue()).await;
    println!(
        "no ID: {stats:?}, {summary:?}, dead-lettered {}, left on queue {left}",
        parked.len()
    );
    assert_eq!(parked.len(), 1);
    let reason = parked[0].header(REASON_HEADER).unwrap_or_default();
    println!("  reason: {reason}");
    assert_eq!(reason, "message has no ID: property message_id is missing");
    assert_eq!(parked[0].body, credit(9, 5));
    assert_eq!(parked[0].header("tenant").as_deref(), Some("acme"));
    assert_eq!(
        parked[0]
            .properties
            .content_type()
            .as_ref()
            .map(|c| c.to_string())
            .as_deref(),
        Some("application/json")
    );
    assert_eq!(
        wallet::balance(&db.pool, 9).await,
        1,
        "only the message with an ID applied"
    );
    assert_eq!((stats.applied, stats.dead_lettered), (1, 1));
    assert_eq!(left, 0);
    cleanup(&config).await;
    db.drop().await;
}

/// Credits normally, except account 666, whose credits always fail (transiently).
struct FailingAccount(Credit);

#[async_trait]
impl Handler<PgTx> for FailingAccount {
    async fn handle(&self, tx: &mut PgTx, id: &MessageId, m: &Message) -> Result<(), HandlerError> {
        let event: CreditEvent = m.json()?;
        if event.account_id == 666 {
            return Err(HandlerError::transient("account 666 is locked"));
        }
        self.0.handle(tx, id, m).await
    }
}

#[tokio::test]
async fn a_poison_message_reaches_the_dlq_after_the_retry_limit_and_the_rest_is_applied() {
    let config = fresh_config("poison");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    let mut expected = 0;
    let mut poison_id = None;
    for i in 0..20 {
        if i == 7 {
            poison_id = Some(publisher.publish(&credit(666, 1)).await.unwrap());
        }
        publisher.publish(&credit(1 + i % 4, i + 1)).await.unwrap();
        expected += i + 1;
    }

    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let retry = RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(100),
    };
    let handler = FailingAccount(Credit::new(db.pool.clone()));
    let stats = Consumer::new("wallet", source, db.inbox(), handler)
        .batch_size(5)
        .retry(retry)
        .run_until_idle()
        .await
        .unwrap();

    let parked = drain(&config.dead_letter_queue()).await;
    let summary = wallet::summary(&db.pool).await.unwrap();
    let left = left_on(config.queue()).await;
    println!(
        "poison: {stats:?}, {summary:?}, dead-lettered {}, left {left}",
        parked.len()
    );
    assert_eq!(parked.len(), 1);
    let reason = parked[0].header(REASON_HEADER).unwrap_or_default();
    println!("  reason: {reason}");
    assert!(reason.contains("failed 3 time(s)"), "{reason}");
    assert_eq!(parked[0].message_id(), poison_id.map(|id| id.to_string()));
    assert_eq!((summary.ledger_rows, summary.distinct_events), (20, 20));
    assert_eq!(summary.total_balance, expected);
    assert!(summary.balances_exact);
    assert_eq!(
        (stats.applied, stats.retried, stats.dead_lettered),
        (20, 2, 1)
    );
    assert_eq!(left, 0);
    cleanup(&config).await;
    db.drop().await;
}

/// A message that is only ever requeued (as one that crashes its consumer would be) is moved to
/// the DLQ by the quorum queue's `x-delivery-limit`, while the messages behind it are consumed.
#[tokio::test]
async fn a_requeue_loop_ends_in_the_dlq_without_starving_the_rest() {
    let config = fresh_config("requeue").delivery_limit(2).prefetch(4);
    let publisher = publisher(&config).await;
    let poison = publisher.publish(b"poison").await.unwrap();
    for i in 0..6 {
        publisher
            .publish(format!("good {i}").as_bytes())
            .await
            .unwrap();
    }

    let mut source = RabbitSource::connect(config.clone()).await.unwrap();
    let mut good = 0;
    let mut poison_counts = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline && (good < 6 || left_ready(&config).await) {
        for delivery in source.receive(4).await.unwrap() {
            if delivery.message.id.as_ref().ok() == Some(&poison) {
                poison_counts.push(delivery.message.meta.delivery_count);
                delivery.ack.nack(Duration::from_millis(50)).await.unwrap();
            } else {
                good += 1;
                delivery.ack.ack().await.unwrap();
            }
        }
    }
    source.close().await;
    let parked = drain(&config.dead_letter_queue()).await;
    println!(
        "requeue loop: good acked {good}, poison delivery counts {poison_counts:?}, dead-lettered {}",
        parked.len()
    );
    assert_eq!(good, 6);
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].body, b"poison");
    assert!(
        parked[0].header("x-death").is_some(),
        "the broker dead-lettered it"
    );
    assert_eq!(poison_counts.first(), Some(&Some(1)));
    assert!(
        poison_counts.windows(2).all(|w| w[0] < w[1]),
        "{poison_counts:?}"
    );
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
}

async fn left_ready(config: &inbox_rabbitmq::RabbitConfig) -> bool {
    drain_count(config.dead_letter_queue()).await == 0
}

async fn drain_count(queue: String) -> u32 {
    use inbox_rabbitmq::lapin::options::QueueDeclareOptions;
    let (_c, channel) = admin_channel().await;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.as_str().into(), options, FieldTable::default())
        .await
        .map(|q| q.message_count())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_batch_is_acked_in_one_multiple_ack_and_nothing_is_left() {
    let config = fresh_config("batch").prefetch(10);
    let publisher = publisher(&config).await;
    for i in 0..8 {
        publisher.publish(format!("m{i}").as_bytes()).await.unwrap();
    }
    let mut source = RabbitSource::connect(config.clone()).await.unwrap();
    let mut seen = 0;
    while seen < 8 {
        let batch = source.receive(8).await.unwrap();
        assert!(!batch.is_empty(), "the queue ran dry after {seen}");
        seen += batch.len();
        let acks = batch.into_iter().map(|d| d.ack).collect();
        inbox_rabbitmq::RabbitAck::ack_all(acks).await.unwrap();
    }
    source.close().await;
    let left = left_on(config.queue()).await;
    println!("batch ack: received {seen}, left on queue {left}");
    assert_eq!(left, 0);
    cleanup(&config).await;
}

#[tokio::test]
async fn the_default_prefetch_follows_the_batch_size() {
    // No prefetch set: a consumer asking for batches of 100 must be able to get 100 at once.
    let config = fresh_config("prefetch");
    let publisher = publisher(&config).await;
    for i in 0..300 {
        publisher.publish(format!("m{i}").as_bytes()).await.unwrap();
    }
    let mut source = RabbitSource::connect(config.clone()).await.unwrap();
    let mut largest = 0;
    for _ in 0..5 {
        let batch = source.receive(100).await.unwrap();
        largest = largest.max(batch.len());
        let acks = batch.into_iter().map(|d| d.ack).collect();
        inbox_rabbitmq::RabbitAck::ack_all(acks).await.unwrap();
        // Let the broker refill the prefetch window before the next receive.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    source.close().await;
    assert_eq!(largest, 100, "the largest batch received");
    cleanup(&config).await;
}

#[tokio::test]
async fn the_id_can_come_from_a_header() {
    let config = fresh_config("header").id_header("event_id");
    let db = TestDb::new().await;
    let publisher = publisher(&config).await;
    for _ in 0..2 {
        let mut headers = FieldTable::default();
        headers.insert("event_id".into(), AMQPValue::LongString("order-17".into()));
        let props = BasicProperties::default().with_headers(headers);
        publisher
            .publish_with_properties(&credit(2, 30), props)
            .await
            .unwrap();
    }
    let source = RabbitSource::connect(config.clone()).await.unwrap();
    let stats = Consumer::new("wallet", source, db.inbox(), Credit::new(db.pool.clone()))
        .run_until_idle()
        .await
        .unwrap();
    println!("header ID: {stats:?}");
    assert_eq!((stats.applied, stats.skipped_duplicates), (1, 1));
    assert_eq!(wallet::balance(&db.pool, 2).await, 30);
    cleanup(&config).await;
    db.drop().await;
}
