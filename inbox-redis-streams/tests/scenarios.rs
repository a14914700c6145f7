//! The foundation's scenarios over a real Redis stream and a real PostgreSQL inbox.

mod common;

use std::time::Duration;

use common::*;
use inbox_core::testkit::{crash_at, crash_at_ids};
use inbox_core::{Consumer, Error, MessageId, Stage};
use inbox_postgres::testkit::wallet::{self, Credit, CreditEvent};
use inbox_postgres::testkit::TestDb;

fn credit(account: i64, amount: i64) -> Vec<u8> {
    CreditEvent::new(account, amount).to_json()
}

#[tokio::test]
async fn the_same_id_added_twice_is_credited_once() {
    let db = TestDb::new().await;
    let stream = stream_key("double");
    let producer = producer(&stream).await;
    let twice = MessageId::generate();
    producer
        .send_with_id(&twice, credit(1, 100))
        .await
        .expect("send");
    producer.send(credit(1, 5)).await.expect("send");
    producer
        .send_with_id(&twice, credit(1, 100))
        .await
        .expect("send"); // the producer retried

    let stats = Consumer::new(
        "wallet",
        source(&stream, "c1").await,
        db.inbox(),
        Credit::new(db.pool.clone()),
    )
    .run_until_idle()
    .await
    .expect("run");

    let summary = wallet::summary(&db.pool).await.expect("summary");
    let balance = wallet::balance(&db.pool, 1).await;
    let left = pending(&stream).await;
    println!(
        "double delivery: {summary:?}, balance {balance}, skipped {}, pending {left}",
        stats.skipped_duplicates
    );
    assert_eq!(balance, 105);
    assert_eq!((summary.ledger_rows, summary.distinct_events), (2, 2));
    assert_eq!(stats.skipped_duplicates, 1);
    assert_eq!(left, 0, "the duplicate was acked too");
    cleanup(&stream).await;
    db.drop().await;
}

/// Crash after the commit, before the `XACK`; the same consumer name restarts and rereads its
/// own pending entry first.
#[tokio::test]
async fn a_crash_between_commit_and_ack_is_skipped_on_restart() {
    let db = TestDb::new().await;
    let stream = stream_key("crash-same");
    let producer = producer(&stream).await;
    for amount in [10, 20, 30] {
        producer.send(credit(1, amount)).await.expect("send");
    }
    let handler = Credit::new(db.pool.clone());
    let crashed = Consumer::new(
        "wallet",
        source(&stream, "c1").await,
        db.inbox(),
        handler.clone(),
    )
    .on_stage(crash_at(Stage::Committed))
    .run_until_idle()
    .await;
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
    let after_crash = pending(&stream).await;
    assert_eq!(after_crash, 1, "committed but not acked");

    let stats = Consumer::new("wallet", source(&stream, "c1").await, db.inbox(), handler)
        .run_until_idle()
        .await
        .expect("run");
    let summary = wallet::summary(&db.pool).await.expect("summary");
    let left = pending(&stream).await;
    println!("crash after commit, same name: pending after crash {after_crash}, {summary:?}, skipped {}, pending {left}", stats.skipped_duplicates);
    assert_eq!(
        stats.skipped_duplicates, 1,
        "the redelivered entry was skipped"
    );
    assert_eq!((summary.ledger_rows, summary.distinct_events), (3, 3));
    assert_eq!(wallet::balance(&db.pool, 1).await, 60);
    assert!(summary.balances_exact);
    assert_eq!(left, 0);
    cleanup(&stream).await;
    db.drop().await;
}

/// Crash after the commit; a consumer with another name takes the entry over with `XAUTOCLAIM`.
#[tokio::test]
async fn a_crash_between_commit_and_ack_is_claimed_and_skipped_by_another_consumer() {
    let db = TestDb::new().await;
    let stream = stream_key("crash-other");
    let producer = producer(&stream).await;
    for amount in [10, 20, 30] {
        producer.send(credit(1, amount)).await.expect("send");
    }
    let handler = Credit::new(db.pool.clone());
    let crashed = Consumer::new(
        "wallet",
        source(&stream, "c1").await,
        db.inbox(),
        handler.clone(),
    )
    .on_stage(crash_at(Stage::Committed))
    .run_until_idle()
    .await;
    assert!(crashed.is_err());

    let claim_idle = Duration::from_millis(300);
    let other = builder(&stream, "c2")
        .claim_idle(claim_idle)
        .connect(&redis_url())
        .await
        .expect("connect");
    tokio::time::sleep(claim_idle + Duration::from_millis(200)).await;
    let stats = Consumer::new("wallet", other, db.inbox(), handler)
        .run_until_idle()
        .await
        .expect("run");
    let summary = wallet::summary(&db.pool).await.expect("summary");
    let left = pending(&stream).await;
    println!(
        "crash after commit, other consumer: {summary:?}, skipped {}, pending {left}",
        stats.skipped_duplicates
    );
    assert_eq!(stats.skipped_duplicates, 1);
    assert_eq!((summary.ledger_rows, summary.distinct_events), (3, 3));
    assert_eq!(wallet::balance(&db.pool, 1).await, 60);
    assert_eq!(left, 0);
    cleanup(&stream).await;
    db.drop().await;
}

/// Two consumers of one group; every ID is added twice, so copies land on both and race.
#[tokio::test]
async fn racing_consumers_credit_each_id_once() {
    let db = TestDb::new().await;
    let stream = stream_key("race");
    let producer = producer(&stream).await;
    let events = 30;
    for i in 0..events {
        let id = MessageId::generate();
        let payload = credit(1 + i % 3, 1);
        producer.send_with_id(&id, &payload).await.expect("send");
        producer.send_with_id(&id, &payload).await.expect("send");
    }
    let run = |name: &'static str| {
        let handler = Credit::new(db.pool.clone()).work(Duration::from_millis(2));
        let inbox = db.inbox();
        let stream = stream.clone();
        tokio::spawn(async move {
            Consumer::new("wallet", source(&stream, name).await, inbox, handler)
                .run_until_idle()
                .await
        })
    };
    let (a, b) = (run("c1"), run("c2"));
    let a = a.await.expect("join").expect("run");
    let b = b.await.expect("join").expect("run");

    let summary = wallet::summary(&db.pool).await.expect("summary");
    let left = pending(&stream).await;
    println!(
        "racing consumers: c1 received {} applied {} skipped {}; c2 received {} applied {} skipped {}; {summary:?}; pending {left}",
        a.received, a.applied, a.skipped_duplicates, b.received, b.applied, b.skipped_duplicates
    );
    assert_eq!(a.received + b.received, 2 * events as u64);
    assert_eq!(a.applied + b.applied, events as u64);
    assert_eq!(
        (summary.ledger_rows, summary.distinct_events),
        (events, events)
    );
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, events);
    assert_eq!(left, 0);
    cleanup(&stream).await;
    db.drop().await;
}

/// Entries without a usable ID, or whose payload no handler can apply, go to `<stream>:dlq`
/// with their fields and a reason; nothing is applied, nothing stays pending.
#[tokio::test]
async fn entries_without_an_id_are_dead_lettered_with_a_reason() {
    let db = TestDb::new().await;
    let stream = stream_key("no-id");
    let payload = String::from_utf8(credit(1, 7)).expect("json is text");
    let no_id = xadd_raw(&stream, &[("payload", &payload), ("trace", "t-1")]).await;
    let empty_id = xadd_raw(&stream, &[("event_id", ""), ("payload", &payload)]).await;
    let not_json = xadd_raw(&stream, &[("event_id", "evt-bad"), ("payload", "not json")]).await;

    let stats = Consumer::new(
        "wallet",
        source(&stream, "c1").await,
        db.inbox(),
        Credit::new(db.pool.clone()),
    )
    .run_until_idle()
    .await
    .expect("run");

    let dead = dead_letters(&stream).await;
    let summary = wallet::summary(&db.pool).await.expect("summary");
    let left = pending(&stream).await;
    println!("dead letters ({}): {dead:?}", dead.len());
    println!(
        "no ID: dead-lettered {}, {summary:?}, pending {left}",
        stats.dead_lettered
    );
    let field = |entry: &Vec<(String, String)>, name: &str| {
        entry
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(dead.len(), 3);
    assert_eq!(field(&dead[0], "original_id"), Some(no_id));
    assert_eq!(
        field(&dead[0], "reason").as_deref(),
        Some("message has no ID: field event_id is missing")
    );
    assert_eq!(field(&dead[0], "payload"), Some(payload.clone()));
    assert_eq!(
        field(&dead[0], "trace").as_deref(),
        Some("t-1"),
        "the original fields are kept"
    );
    assert_eq!(field(&dead[1], "original_id"), Some(empty_id));
    assert_eq!(
        field(&dead[1], "event_id").as_deref(),
        Some(""),
        "kept as sent"
    );
    assert!(field(&dead[1], "reason").is_some_and(|r| r.contains("empty")));
    assert_eq!(field(&dead[2], "original_id"), Some(not_json));
    assert!(field(&dead[2], "reason").is_some_and(|r| r.contains("not valid JSON")));
    assert_eq!(summary.ledger_rows, 0);
    assert_eq!(db.inbox_rows().await, 0, "no ID was recorded");
    assert_eq!(left, 0, "dead-lettered entries are acked");
    cleanup(&stream).await;
    db.drop().await;
}

/// An entry that kills its consumer every time (the process dies before the commit) comes back
/// with a rising delivery count until `max_deliveries` parks it.
#[tokio::test]
async fn a_poison_entry_is_dead_lettered_by_its_delivery_count() {
    let db = TestDb::new().await;
    let stream = stream_key("poison");
    let producer = producer(&stream).await;
    producer.send(credit(1, 1)).await.expect("send");
    let poison = producer.send(credit(1, 1000)).await.expect("send");
    producer.send(credit(1, 2)).await.expect("send");

    let limit = 3;
    let handler = Credit::new(db.pool.clone());
    let mut crashes = 0;
    let mut last = None;
    for _ in 0..10 {
        // Each run is a restart of the same process (same consumer name), so the poison entry
        // comes back first, from the consumer's own pending list.
        let run = Consumer::new(
            "wallet",
            source(&stream, "c1").await,
            db.inbox(),
            handler.clone(),
        )
        .max_deliveries(limit)
        .on_stage(crash_at_ids(Stage::Applied, [poison.message_id.clone()]))
        .run_until_idle()
        .await;
        match run {
            Err(Error::Crashed { .. }) => crashes += 1,
            other => {
                last = Some(other.expect("run"));
                break;
            }
        }
    }
    let last = last.expect("the poison entry stopped crashing the consumer");
    let dead = dead_letters(&stream).await;
    let summary = wallet::summary(&db.pool).await.expect("summary");
    let left = pending(&stream).await;
    let reason = dead
        .first()
        .and_then(|e| e.iter().find(|(k, _)| k == "reason"))
        .map(|(_, v)| v.clone());
    println!("poison: {crashes} crashes, dead-lettered {} with reason {reason:?}, {summary:?}, pending {left}", last.dead_lettered);
    assert_eq!(crashes, limit);
    assert_eq!(dead.len(), 1);
    assert_eq!(
        reason.as_deref(),
        Some("delivered 4 times, more than the limit of 3")
    );
    assert_eq!((summary.ledger_rows, summary.distinct_events), (2, 2));
    assert_eq!(
        wallet::balance(&db.pool, 1).await,
        3,
        "the poison credit was never applied"
    );
    assert_eq!(left, 0);
    cleanup(&stream).await;
    db.drop().await;
}
