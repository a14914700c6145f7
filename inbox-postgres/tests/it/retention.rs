//! Retention against a real PostgreSQL: the batched purge, the single cleaner and the window
//! alarm.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::time::{Duration, SystemTime};

use inbox_conformance::TestDb;
use inbox_postgres::{PgInbox, PurgeReport};
use inbox_testkit::gauges::{gauge, DebuggingRecorder};
use sqlx::{Connection, PgConnection};

const DAY: Duration = Duration::from_secs(24 * 3600);

#[tokio::test]
async fn purge_deletes_expired_rows_in_batches_and_keeps_recent_ones() {
    let db = TestDb::new().await;
    let inbox = db.inbox();
    db.insert_aged_rows("old", 25_000, 20 * DAY).await;
    db.insert_aged_rows("fresh", 100, Duration::ZERO).await;

    let report = inbox.purge(14 * DAY, 10_000).await.unwrap();
    assert_eq!(report.batches(), &[10_000, 10_000, 5_000, 0]);
    assert_eq!(report.deleted(), 25_000);
    assert_eq!(db.inbox_rows().await, 100);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inbox WHERE message_id LIKE 'fresh-%'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, 100);

    // Nothing left to purge: one empty batch.
    let again = inbox.purge(14 * DAY, 10_000).await.unwrap();
    assert_eq!(again.batches(), &[0]);
    db.drop().await;
}

#[tokio::test]
async fn a_second_cleaner_skips_while_one_holds_the_lock() {
    let db = TestDb::new().await;
    let inbox = db.inbox();
    db.insert_aged_rows("old", 50, 20 * DAY).await;

    // Another instance's cleaner, mid-purge.
    let mut other = PgConnection::connect(&inbox_conformance::database_url())
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(inbox.purge_lock_key().await.unwrap())
        .execute(&mut other)
        .await
        .unwrap();

    let (a, b) = tokio::join!(inbox.purge(14 * DAY, 10_000), inbox.purge(14 * DAY, 10_000));
    assert_eq!(a.unwrap(), PurgeReport::SkippedOtherCleaner);
    assert_eq!(b.unwrap(), PurgeReport::SkippedOtherCleaner);
    assert_eq!(db.inbox_rows().await, 50, "a skipped purge deletes nothing");

    // Once the other cleaner is done, a purge runs. (It unlocks before it leaves, as `purge`
    // does: the server ends a closed session a moment after the client, so a bare close could
    // leave the lock held for the next line.)
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(inbox.purge_lock_key().await.unwrap())
        .execute(&mut other)
        .await
        .unwrap();
    other.close().await.unwrap();
    let report = inbox.purge(14 * DAY, 10_000).await.unwrap();
    assert_eq!(report.batches(), &[50, 0]);

    // Two purges started together: exactly one cleaner at a time; whichever ran deleted all.
    db.insert_aged_rows("old2", 30, 20 * DAY).await;
    let (a, b) = tokio::join!(inbox.purge(14 * DAY, 7), inbox.purge(14 * DAY, 7));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.deleted() + b.deleted(), 30, "{a:?} {b:?}");
    assert_eq!(db.inbox_rows().await, 0);

    // Inboxes in other tables, or of the same name in other schemas, purge independently.
    let other_table = inbox_postgres::TableName::qualified(&db.schema, "inbox2").unwrap();
    let other = PgInbox::new(db.pool.clone()).with_table(other_table);
    other.migrate().await.unwrap();
    let key = inbox.purge_lock_key().await.unwrap();
    assert_ne!(other.purge_lock_key().await.unwrap(), key);
    let elsewhere = TestDb::new().await;
    assert_ne!(elsewhere.inbox().purge_lock_key().await.unwrap(), key);
    elsewhere.drop().await;
    db.drop().await;
}

#[tokio::test]
async fn oldest_per_consumer_reports_each_consumers_window_and_the_alarm() {
    let db = TestDb::new().await;
    let inbox = db.inbox();
    db.insert_aged_rows("billing", 10, 20 * DAY).await;
    db.insert_aged_rows("billing", 5, DAY).await;
    db.insert_aged_rows("shipping", 3, 2 * DAY).await;
    inbox.consumer_id("idle").await.unwrap();

    let now = SystemTime::now();
    let windows = inbox.oldest_per_consumer().await.unwrap();
    let names: Vec<&str> = windows.iter().map(|w| w.consumer.as_str()).collect();
    assert_eq!(names, ["billing", "idle", "shipping"]);
    let rows: Vec<i64> = windows.iter().map(|w| w.rows).collect();
    assert_eq!(rows, [15, 0, 3]);

    let close_to = |w: Option<Duration>, expected: Duration| {
        let w = w.unwrap();
        let diff = w.abs_diff(expected);
        assert!(diff <= Duration::from_secs(120), "{w:?} vs {expected:?}");
    };
    close_to(windows[0].window(now), 20 * DAY);
    assert_eq!(windows[1].oldest, None);
    close_to(windows[2].window(now), 2 * DAY);

    // The alarm: a 7-day requirement is met by billing (20 days), not by shipping (2 days);
    // a consumer remembering nothing has no window to alarm on.
    assert!(!windows[0].shorter_than(7 * DAY, now));
    assert!(!windows[1].shorter_than(7 * DAY, now));
    assert!(windows[2].shorter_than(7 * DAY, now));

    // After a 14-day purge billing remembers one day only.
    inbox.purge(14 * DAY, 10_000).await.unwrap();
    let windows = inbox.oldest_per_consumer().await.unwrap();
    assert_eq!(windows[0].rows, 5);
    close_to(windows[0].window(SystemTime::now()), DAY);
    assert!(windows[0].shorter_than(7 * DAY, SystemTime::now()));
    db.drop().await;
}

#[tokio::test]
async fn storage_counts_rows_heap_and_indexes() {
    let db = TestDb::new().await;
    let inbox = db.inbox();
    let empty = inbox.storage().await.unwrap();
    assert_eq!(empty.rows, 0);
    assert_eq!(empty.bytes_per_row(), None);
    db.insert_aged_rows("c", 1_000, Duration::ZERO).await;
    let s = inbox.storage().await.unwrap();
    assert_eq!(s.rows, 1_000);
    assert!(s.heap_bytes >= 8192 && s.index_bytes >= 8192, "{s:?}");
    assert!(s.bytes_per_row().unwrap() > 16.0);
    db.drop().await;
}

#[tokio::test]
async fn the_background_purger_purges_and_says_when() {
    let recorder = DebuggingRecorder::new();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let gauges = recorder.snapshotter();
    let db = TestDb::new().await;
    let inbox = db.inbox();
    db.insert_aged_rows("old", 20, 20 * DAY).await;
    let handle = inbox_postgres::spawn_purger(inbox.clone(), 14 * DAY, Duration::from_secs(3600));
    let label = format!(
        "{}{{table={}}}",
        inbox_postgres::PURGE_LAST_SUCCESS_GAUGE,
        inbox.table()
    );
    // The rows go with the purge's statements; its time is set once the purge has returned.
    // The time as first read: a read (a snapshot) sets the gauge back to 0.
    let (mut rows, mut last) = (db.inbox_rows().await, None);
    for _ in 0..100 {
        last = last.or(gauge(&gauges, &label));
        if rows == 0 && last.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        rows = db.inbox_rows().await;
    }
    handle.abort();
    assert_eq!(rows, 0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let last = last.expect("the purge's time");
    assert!((now - 60.0..=now).contains(&last), "{last} against {now}");
    db.drop().await;
}
