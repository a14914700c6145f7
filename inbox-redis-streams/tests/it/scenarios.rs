//! What is Redis's own, over a real stream and a real PostgreSQL inbox: another consumer taking
//! a crashed one's entry with `XAUTOCLAIM`, and the dead-letter entry's fields. The scenarios
//! every adapter shares are in `conformance.rs`.

use crate::common;

use std::time::Duration;

use common::*;
use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Consumer, Publish, Stage};
use inbox_testkit::Crash;

fn credit(account: i64, amount: i64) -> Vec<u8> {
    CreditEvent::new(account, amount).to_json()
}

/// Crash after the commit; a consumer with another name takes the entry over with `XAUTOCLAIM`.
#[tokio::test]
async fn a_crash_between_commit_and_ack_is_claimed_and_skipped_by_another_consumer() {
    let db = TestDb::new().await;
    let stream = stream_key("crash-other");
    let producer = producer().await;
    for amount in [10, 20, 30] {
        producer
            .send(&stream, &credit(1, amount))
            .await
            .expect("send");
    }
    let handler = Credit::new(db.clone());
    let crash = Crash::at(Stage::Committed);
    let consumer = Consumer::new(
        "wallet",
        crash.source(source(&stream, "c1").await),
        db.inbox(),
        handler.clone(),
    );
    let crashed = crash.run(consumer.run_until_idle()).await;
    assert!(crashed.is_err(), "{crashed:?}");

    let claim_idle = Duration::from_millis(300);
    let other = builder(&stream, "c2")
        .claim_idle(claim_idle)
        .connect()
        .await
        .expect("connect");
    tokio::time::sleep(claim_idle + Duration::from_millis(200)).await;
    let stats = Consumer::new("wallet", other, db.inbox(), handler)
        .run_until_idle()
        .await
        .expect("run");
    let summary = wallet::summary(&db).await.expect("summary");
    let left = pending(&stream).await;
    println!(
        "crash after commit, other consumer: {summary:?}, skipped {}, pending {left}",
        stats.skipped_duplicates
    );
    assert_eq!(stats.skipped_duplicates, 1);
    assert_eq!((summary.ledger_rows, summary.distinct_events), (3, 3));
    assert_eq!(wallet::balance(&db, 1).await, 60);
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
        Credit::new(db.clone()),
    )
    .run_until_idle()
    .await
    .expect("run");

    let dead = dead_letters(&stream).await;
    let summary = wallet::summary(&db).await.expect("summary");
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
    assert_eq!(field(&dead[0], ORIGINAL_POSITION), Some(no_id));
    assert_eq!(field(&dead[0], ORIGINAL_SOURCE), Some(stream.clone()));
    assert_eq!(
        field(&dead[0], REASON).as_deref(),
        Some("message has no ID: field event_id is missing")
    );
    assert_eq!(field(&dead[0], "payload"), Some(payload.clone()));
    assert_eq!(
        field(&dead[0], "trace").as_deref(),
        Some("t-1"),
        "the original fields are kept"
    );
    assert_eq!(field(&dead[1], ORIGINAL_POSITION), Some(empty_id));
    assert_eq!(
        field(&dead[1], "event_id").as_deref(),
        Some(""),
        "kept as sent"
    );
    assert!(field(&dead[1], REASON).is_some_and(|r| r.contains("empty")));
    assert_eq!(field(&dead[2], ORIGINAL_POSITION), Some(not_json));
    assert!(field(&dead[2], REASON).is_some_and(|r| r.contains("not valid JSON")));
    assert_eq!(summary.ledger_rows, 0);
    assert_eq!(db.inbox_rows().await, 0, "no ID was recorded");
    assert_eq!(left, 0, "dead-lettered entries are acked");
    cleanup(&stream).await;
    db.drop().await;
}
