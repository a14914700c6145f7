//! The partitioned layout against a real PostgreSQL: where keys land, that every key still
//! deduplicates, which partitions the purge drops and which it keeps, and a drop under claims.
//! The conversion of a plain table is in `partition_convert.rs`.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_core::Transaction as _;
use std::time::{Duration, SystemTime};

use inbox_conformance::TestDb;
use inbox_core::{ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::{KeyMode, PartitionRange, Partitions, PgInbox};
use sqlx::AssertSqlSafe;

use crate::common_partitions;
use common_partitions::*;
use uuid::Uuid;

#[tokio::test]
async fn migrate_creates_the_current_partition_those_ahead_and_a_default() {
    let db = TestDb::new().await;
    let inbox = store(&db, "events", KeyMode::Uuid, Partitions::default().ahead(2));
    inbox.migrate().await.unwrap();
    assert!(inbox.is_partitioned().await.unwrap());

    let now = db_now_ms(&db.pool).await;
    let parts = inbox.partitions().await.unwrap();
    let ranges: Vec<(SystemTime, SystemTime)> = parts
        .iter()
        .filter_map(|p| match p.range {
            PartitionRange::Time { from, to } => Some((from, to)),
            _ => None,
        })
        .collect();
    assert_eq!(ranges.len(), 3, "{parts:?}");
    let today = now - now.rem_euclid(DAY);
    for (i, (from, to)) in ranges.iter().enumerate() {
        let start = today + i64::try_from(i).unwrap() * DAY;
        assert_eq!((*from, *to), (time(start), time(start + DAY)), "{parts:?}");
    }
    assert!(parts[0].name.starts_with("events_p"), "{parts:?}");
    let last = parts.last().unwrap();
    assert_eq!(
        (last.name.as_str(), &last.range),
        ("events_default", &PartitionRange::Default)
    );

    // Again: nothing is added. From a store configured plain, the table keeps its layout and
    // its span, with the default 3 partitions ahead.
    inbox.migrate().await.unwrap();
    assert_eq!(inbox.partitions().await.unwrap().len(), 4);
    let plain = PgInbox::new(db.pool.clone())
        .with_table(inbox.table().clone())
        .with_key_mode(KeyMode::Uuid);
    plain.migrate().await.unwrap();
    let parts = inbox.partitions().await.unwrap();
    assert_eq!(parts.len(), 5, "{parts:?}");
    assert_eq!(
        parts[3].range,
        PartitionRange::Time {
            from: time(today + 3 * DAY),
            to: time(today + 4 * DAY)
        }
    );
    // And a plain table stays plain under a store configured partitioned.
    let other = store(&db, "plain_one", KeyMode::Uuid, Partitions::default());
    PgInbox::new(db.pool.clone())
        .with_table(other.table().clone())
        .with_key_mode(KeyMode::Uuid)
        .migrate()
        .await
        .unwrap();
    other.migrate().await.unwrap();
    assert!(!other.is_partitioned().await.unwrap());
    assert!(other.partitions().await.unwrap().is_empty());
    db.drop().await;
}

#[tokio::test]
async fn keys_land_by_uuidv7_time_and_every_key_deduplicates_wherever_it_lands() {
    let db = TestDb::new().await;
    for (table, mode) in [
        ("by_uuid", KeyMode::Uuid),
        ("by_text", KeyMode::Text),
        ("by_hash", KeyMode::Hashed),
    ] {
        let inbox = store(&db, table, mode, Partitions::default().ahead(1));
        inbox.migrate().await.unwrap();
        let now = db_now_ms(&db.pool).await;
        let current = range_of(&inbox, now).await;
        let tomorrow = range_of(&inbox, now + DAY).await;
        let default = format!("{table}_default");
        let mut cases = vec![
            (v7_at(now).to_string(), current.clone()),
            (v7_at(now + DAY).to_string(), tomorrow.clone()),
            // A producer clock ten years behind or ahead, a replay of an old message.
            (v7_at(now - 3650 * DAY).to_string(), default.clone()),
            (v7_at(now + 3650 * DAY).to_string(), default.clone()),
        ];
        if mode != KeyMode::Uuid {
            cases.push(("order-42".to_owned(), default.clone()));
        }
        let ids: Vec<String> = cases.iter().map(|(id, _)| id.clone()).collect();
        // A random UUID lands wherever its bytes sort; it must deduplicate like the others.
        let mut all = ids.clone();
        all.push(Uuid::new_v4().to_string());

        assert!(
            claim(&inbox, "wallet", &all).await.iter().all(|new| *new),
            "{mode:?}"
        );
        assert!(
            claim(&inbox, "wallet", &all).await.iter().all(|new| !*new),
            "{mode:?}: every key is found again"
        );
        for id in &all {
            assert!(!claim_one(&inbox, "wallet", id).await, "{mode:?} {id}");
        }
        assert_eq!(rows(&inbox).await, i64::try_from(all.len()).unwrap());

        match mode {
            KeyMode::Hashed => {
                // Keys are not the IDs; count per partition instead.
                let per: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT tableoid::regclass::text, count(*) FROM {table} GROUP BY 1 ORDER BY 1"
                )))
                .fetch_all(&db.pool)
                .await
                .unwrap();
                let count = |name: &str| per.iter().find(|(p, _)| p == name).map(|(_, n)| *n);
                assert_eq!(count(&current), Some(1), "{per:?}");
                assert_eq!(count(&tomorrow), Some(1), "{per:?}");
                // Ten years off either way, order-42, and the random UUID (no v7 time).
                assert_eq!(count(&default), Some(4), "{per:?}");
            }
            _ => {
                let expected: Vec<String> = cases.iter().map(|(_, p)| p.clone()).collect();
                assert_eq!(partitions_of(&inbox, &ids).await, expected, "{mode:?}");
            }
        }
    }
    db.drop().await;
}

/// A table with hourly partitions from three hours back: A (due), B, C and the current one.
struct Hours {
    db: TestDb,
    inbox: PgInbox,
    /// The start of the current hour.
    h: i64,
    /// The purge window that puts the cutoff at `h - 2h` (to the minute).
    window: Duration,
}

async fn hours(partitions: Partitions) -> Hours {
    let db = TestDb::new().await;
    let inbox = store(&db, "events", KeyMode::Uuid, partitions.ahead(1));
    inbox.migrate().await.unwrap();
    let now = db_now_ms(&db.pool).await;
    let h = now - now.rem_euclid(HOUR);
    let created = inbox
        .create_partitions(time(h - 3 * HOUR), time(h))
        .await
        .unwrap();
    assert_eq!(created.len(), 3, "{created:?}");
    let window_minutes = now / MINUTE - (h - 2 * HOUR) / MINUTE;
    let window = Duration::from_secs(u64::try_from(window_minutes).unwrap() * 60);
    Hours {
        db,
        inbox,
        h,
        window,
    }
}

#[tokio::test]
async fn the_purge_drops_due_partitions_whole_and_deletes_only_what_no_drop_takes() {
    let Hours {
        db,
        inbox,
        h,
        window,
    } = hours(Partitions::every(Duration::from_secs(3600))).await;
    let a = range_of(&inbox, h - 3 * HOUR).await;
    // A: 100 rows processed when produced, all older than the cutoff.
    let in_a: Vec<(Uuid, i64)> = (0..100)
        .map(|i| {
            let ms = h - 3 * HOUR + i * 30_000;
            (v7_at(ms), ms)
        })
        .collect();
    insert_processed(&inbox, "wallet", &in_a).await;
    // B: 50 rows, the first processed right at the cutoff.
    let in_b: Vec<(Uuid, i64)> = (0..50)
        .map(|i| {
            let ms = h - 2 * HOUR + i * MINUTE;
            (v7_at(ms), ms)
        })
        .collect();
    insert_processed(&inbox, "wallet", &in_b).await;
    // C: 5 IDs from a clock an hour and a half ahead, processed three hours ago: expired.
    let ahead: Vec<(Uuid, i64)> = (0..5)
        .map(|i| (v7_at(h - HOUR + i), h - 3 * HOUR))
        .collect();
    insert_processed(&inbox, "wallet", &ahead).await;
    // Default: 20 replayed ten-year-old IDs processed three hours ago, 10 this hour.
    let old: Vec<(Uuid, i64)> = (0..30)
        .map(|i| {
            let processed = if i < 20 { h - 3 * HOUR } else { h };
            (v7_at(h - 3650 * DAY + i), processed)
        })
        .collect();
    insert_processed(&inbox, "wallet", &old).await;

    let report = inbox.purge(window, 7).await.unwrap();
    let dropped: Vec<&str> = report.dropped().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(dropped, [a.as_str()], "{report:?}");
    assert!(report.postponed().is_empty(), "{report:?}");
    assert_eq!(report.deleted(), 25, "{report:?}");
    assert_eq!(report.batches().last(), Some(&0));
    assert!(!exists(&db.pool, &a).await, "{a} is gone");
    assert_eq!(rows(&inbox).await, 50 + 10);

    // What is left still deduplicates; a redelivery from the dropped partition is the case of
    // a purged row: older than the window, applied again, now remembered in the default.
    let kept: Vec<String> = in_b
        .iter()
        .chain(&old[20..])
        .map(|(id, _)| id.to_string())
        .collect();
    assert!(claim(&inbox, "wallet", &kept).await.iter().all(|new| !*new));
    let redelivered = in_a[0].0.to_string();
    assert!(claim_one(&inbox, "wallet", &redelivered).await);
    assert_eq!(partition_of(&inbox, &redelivered).await, "events_default");

    // The window alarm reads as on the plain layout: the oldest row is at the cutoff.
    let now = SystemTime::now();
    let windows = inbox.oldest_per_consumer().await.unwrap();
    let remembered = windows[0].window(now).unwrap();
    assert!(
        remembered.abs_diff(window) <= Duration::from_secs(120),
        "{remembered:?} vs {window:?}"
    );
    assert!(windows[0].shorter_than(window + Duration::from_secs(600), now));
    assert!(!windows[0].shorter_than(window - Duration::from_secs(600), now));
    db.drop().await;
}

#[tokio::test]
async fn a_due_partition_holding_a_row_processed_in_the_window_is_kept_until_it_expires() {
    let Hours {
        db,
        inbox,
        h,
        window,
    } = hours(Partitions::every(Duration::from_secs(3600))).await;
    let a = range_of(&inbox, h - 3 * HOUR).await;
    let expired: Vec<(Uuid, i64)> = (0..40)
        .map(|i| {
            let ms = h - 3 * HOUR + i * MINUTE;
            (v7_at(ms), ms)
        })
        .collect();
    insert_processed(&inbox, "wallet", &expired).await;
    // A message produced three hours ago by a slow clock, or replayed: processed just now.
    let late = v7_at(h - 3 * HOUR + 30 * MINUTE);
    assert!(claim_one(&inbox, "wallet", &late.to_string()).await);

    let report = inbox.purge(window, 10_000).await.unwrap();
    assert!(report.dropped().is_empty(), "{report:?}");
    assert_eq!(report.batches(), &[40, 0], "its expired rows go by DELETE");
    assert!(exists(&db.pool, &a).await);
    assert!(!claim_one(&inbox, "wallet", &late.to_string()).await);
    assert_eq!(partition_of(&inbox, &late.to_string()).await, a);

    // Once the late row is older than the window too, the partition goes whole.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET processed_minute = processed_minute - 600",
        inbox.table()
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let report = inbox.purge(window, 10_000).await.unwrap();
    let dropped: Vec<&str> = report.dropped().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(dropped, [a.as_str()], "{report:?}");
    assert!(!exists(&db.pool, &a).await);
    db.drop().await;
}

#[tokio::test]
async fn a_drop_behind_an_open_claim_is_postponed_and_claims_around_it_all_succeed() {
    let partitions = Partitions::every(Duration::from_secs(3600))
        .lock_timeout(Duration::from_millis(50))
        .attempts(2);
    let Hours {
        db,
        inbox,
        h,
        window,
    } = hours(partitions).await;
    let a = range_of(&inbox, h - 3 * HOUR).await;
    let in_a: Vec<(Uuid, i64)> = (0..10)
        .map(|i| (v7_at(h - 3 * HOUR + i), h - 3 * HOUR))
        .collect();
    insert_processed(&inbox, "wallet", &in_a).await;

    // A consumer's transaction, open: it holds the inbox table until it commits.
    let open = MessageId::new(v7_at(db_now_ms(&db.pool).await).to_string()).unwrap();
    let bound = inbox.bind(&ConsumerBinding::new("wallet"));
    let mut tx = bound.begin().await.unwrap();
    let claimed = bound.claim(&mut tx, std::slice::from_ref(&open)).await;
    assert_eq!(claimed.unwrap(), [true]);
    let report = inbox.purge(window, 10_000).await.unwrap();
    assert_eq!(report.postponed(), std::slice::from_ref(&a), "{report:?}");
    assert!(report.dropped().is_empty());
    assert!(exists(&db.pool, &a).await);
    assert_eq!(
        rows(&inbox).await,
        10,
        "a postponed partition keeps its rows"
    );
    tx.commit().await.unwrap();

    // Claims from two connections the whole time the next purge runs: none fails, none is
    // lost, and the partition goes.
    let claimer = |inbox: PgInbox, n: usize| {
        tokio::spawn(async move {
            let mut new = 0;
            for _ in 0..n {
                let id = Uuid::now_v7().to_string();
                let ids = [id.clone(), id];
                let claimed = claim(&inbox, "wallet", &ids).await;
                assert_eq!(claimed, [true, false]);
                new += 1;
            }
            new
        })
    };
    let (one, two) = (claimer(inbox.clone(), 200), claimer(inbox.clone(), 200));
    let report = inbox.purge(window, 10_000).await.unwrap();
    let claimed = one.await.unwrap() + two.await.unwrap();
    let dropped: Vec<&str> = report.dropped().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(dropped, [a.as_str()], "{report:?}");
    assert_eq!(rows(&inbox).await, 1 + claimed);
    db.drop().await;
}

#[tokio::test]
async fn a_new_range_takes_over_the_rows_the_default_partition_held_for_it() {
    let db = TestDb::new().await;
    let inbox = store(&db, "events", KeyMode::Uuid, Partitions::default().ahead(1));
    inbox.migrate().await.unwrap();
    let now = db_now_ms(&db.pool).await;
    // From a clock ten days ahead: beyond the ranges, so into the default partition.
    let ahead: Vec<String> = (0..3)
        .map(|i| v7_at(now + 10 * DAY + i).to_string())
        .collect();
    assert_eq!(claim(&inbox, "wallet", &ahead).await, [true; 3]);
    assert_eq!(partitions_of(&inbox, &ahead).await, ["events_default"; 3]);

    let created = inbox
        .create_partitions(time(now + 10 * DAY), time(now + 10 * DAY + 1))
        .await
        .unwrap();
    assert_eq!(created.len(), 1);
    assert_eq!(
        partitions_of(&inbox, &ahead).await,
        vec![created[0].clone(); 3]
    );
    assert_eq!(claim(&inbox, "wallet", &ahead).await, [false; 3]);
    // Asked again: it exists.
    let again = inbox
        .create_partitions(time(now + 10 * DAY), time(now + 10 * DAY + 1))
        .await
        .unwrap();
    assert!(again.is_empty());
    db.drop().await;
}
