//! The outbox relay on Redis Streams, read on the stream itself: a relay SIGKILLed between the
//! broker's confirm and its commit leaves the rows to be published again under the same IDs, and
//! the downstream inbox skips the copies. (Forwarding through the outbox, a lost confirm and two
//! relays at once are in the conformance suite.)

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::outbox_table::{migrated, unsent, write_credits};
use inbox_conformance::wallet::{self, Credit};
use inbox_conformance::{child, TestDb};
use inbox_core::{Consumer, OutgoingMessage, Publish, PublishError};
use inbox_postgres::Outbox;
use inbox_redis_streams::redis::{self, Value};

/// Publishes through the real producer, then waits forever: the window between the broker's
/// confirm and the relay's commit, held open.
struct HoldAfterPublish<P>(P);

impl<P: Publish> Publish for HoldAfterPublish<P> {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        self.0.send_batch(destination, messages).await?;
        std::future::pending().await
    }
}

/// A stream entry: its ID and its fields.
type Entry = (String, Vec<(String, Vec<u8>)>);

/// The `event_id` field of every entry of `stream`, in stream order.
async fn stream_ids(stream: &str) -> Vec<String> {
    let entries: Vec<Entry> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut raw().await)
        .await
        .unwrap();
    entries
        .into_iter()
        .map(|(_, fields)| {
            let (_, id) = fields.into_iter().find(|(k, _)| k == "event_id").unwrap();
            String::from_utf8(id).unwrap()
        })
        .collect()
}

async fn stream_len(stream: &str) -> usize {
    let v: Value = redis::cmd("XLEN")
        .arg(stream)
        .query_async(&mut raw().await)
        .await
        .unwrap();
    match v {
        Value::Int(n) => n as usize,
        other => panic!("XLEN: {other:?}"),
    }
}

async fn outbox_ids(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar("SELECT message_id FROM outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn until(what: &str, deadline: Duration, mut done: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !done().await {
        assert!(
            Instant::now() < end,
            "{what} did not happen within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The relay process of `a_relay_killed_after_the_confirm_leaves_its_rows_to_be_published_again`:
/// publishes one batch for real, then holds the transaction open until it is killed.
#[tokio::test]
#[ignore = "the relay process of a kill test; runs only as its child"]
async fn killed_relay_child() {
    if !child::is_child() {
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let db = TestDb::attach(&var("INBOX_SCHEMA")).await;
    let publisher = HoldAfterPublish(producer().await);
    Outbox::new(db.pool.clone())
        .relay(publisher)
        .batch_size(1000)
        .run_until_idle()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_relay_killed_after_the_confirm_leaves_its_rows_to_be_published_again_under_the_same_ids()
{
    if child::is_child() {
        return;
    }
    const ROWS: i64 = 80;
    let db = TestDb::new().await;
    let outbox = migrated(&db).await;
    let stream = stream_key("outbox-killed-relay");
    let total = write_credits(&db, &outbox, &stream, ROWS).await;

    let mut process = child::spawn(
        "killed_relay_child",
        &[
            ("INBOX_SCHEMA", db.schema.clone()),
            ("INBOX_STREAM", stream.clone()),
        ],
    );
    until(
        "the child publishing",
        Duration::from_secs(60),
        async || stream_len(&stream).await == ROWS as usize,
    )
    .await;
    process.kill().unwrap(); // SIGKILL: no rollback sent, no destructor run
    process.wait().unwrap();
    // The server aborts the dead session's transaction, which frees its row locks.
    let mut locks = db.pool.begin().await.unwrap();
    let locked: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox FOR UPDATE")
        .fetch_all(&mut *locks)
        .await
        .unwrap();
    locks.rollback().await.unwrap();
    assert_eq!(locked.len(), ROWS as usize);
    assert_eq!(
        unsent(&db).await,
        ROWS,
        "the killed relay marked nothing sent"
    );

    let stats = outbox
        .relay(producer().await)
        .run_until_idle()
        .await
        .unwrap();
    let downstream = Consumer::new(
        "wallet",
        source(&stream, "c1").await,
        db.inbox(),
        Credit::new(db.clone()),
    )
    .batch_size(50)
    .run_until_idle()
    .await
    .unwrap();

    assert_eq!(stats.published, ROWS as u64);
    assert_eq!(unsent(&db).await, 0);
    let ids = stream_ids(&stream).await;
    assert_eq!(ids.len(), 2 * ROWS as usize, "every row published twice");
    assert_eq!(
        ids[..ROWS as usize],
        ids[ROWS as usize..],
        "under the same IDs"
    );
    assert_eq!(ids[..ROWS as usize], outbox_ids(&db).await[..]);
    assert_eq!(
        (downstream.applied, downstream.skipped_duplicates),
        (ROWS as u64, ROWS as u64)
    );
    let summary = wallet::summary(&db).await.unwrap();
    assert_eq!(summary.duplicates(), 0);
    assert_eq!(summary.ledger_rows, ROWS);
    assert_eq!(summary.total_balance, total);
    cleanup(&stream).await;
    db.drop().await;
}
