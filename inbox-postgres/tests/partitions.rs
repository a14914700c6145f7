//! The partitioned layout against a real PostgreSQL: where keys land, that every key still
//! deduplicates, which partitions the purge drops and which it keeps, a drop under claims, and
//! the conversion of a plain table.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_core::{InboxStore, MessageId};
use inbox_postgres::testkit::TestDb;
use inbox_postgres::{
    Conversion, KeyMode, PartitionRange, Partitions, PgInbox, PurgeReport, TableName,
};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::{NoContext, Timestamp, Uuid};

const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;
const DAY: i64 = 24 * HOUR;

fn store(db: &TestDb, table: &str, mode: KeyMode, partitions: Partitions) -> PgInbox {
    PgInbox::new(db.pool.clone())
        .with_table(TableName::qualified(&db.schema, table).unwrap())
        .with_key_mode(mode)
        .partitioned(partitions)
}

async fn db_now_ms(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A UUIDv7 of millisecond `ms` (random otherwise).
fn v7_at(ms: i64) -> Uuid {
    let ms = u64::try_from(ms).unwrap();
    Uuid::new_v7(Timestamp::from_unix(
        NoContext,
        ms / 1000,
        u32::try_from(ms % 1000).unwrap() * 1_000_000,
    ))
}

fn time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap())
}

/// Claims `ids` for `consumer` in one committed transaction: which were new.
async fn claim(inbox: &PgInbox, consumer: &str, ids: &[String]) -> Vec<bool> {
    let ids: Vec<MessageId> = ids.iter().map(|id| MessageId::new(id).unwrap()).collect();
    let mut tx = inbox.begin().await.unwrap();
    let claimed = inbox.claim_many(&mut tx, consumer, &ids).await.unwrap();
    inbox.commit(tx).await.unwrap();
    claimed
}

async fn claim_one(inbox: &PgInbox, consumer: &str, id: &str) -> bool {
    claim(inbox, consumer, &[id.to_owned()]).await[0]
}

/// Inserts uuid keys with their processed minutes, as rows processed back then.
async fn insert_processed(inbox: &PgInbox, consumer: &str, rows: &[(Uuid, i64)]) {
    let consumer = inbox.consumer_id(consumer).await.unwrap();
    let (ids, minutes): (Vec<Uuid>, Vec<i32>) = rows
        .iter()
        .map(|&(id, ms)| (id, i32::try_from(ms / MINUTE).unwrap()))
        .unzip();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (message_id, processed_minute, consumer_id)
         SELECT unnest($1::uuid[]), unnest($2::int[]), $3",
        inbox.table()
    )))
    .bind(ids)
    .bind(minutes)
    .bind(consumer)
    .execute(inbox.pool())
    .await
    .unwrap();
}

/// The partition holding each uuid or text key.
async fn partitions_of(inbox: &PgInbox, keys: &[String]) -> Vec<String> {
    let cast = match inbox.key_mode() {
        KeyMode::Text => "",
        _ => "::uuid",
    };
    let mut found = Vec::new();
    for key in keys {
        let name: String = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT tableoid::regclass::text FROM {} WHERE message_id = $1{cast}",
            inbox.table()
        )))
        .bind(key)
        .fetch_one(inbox.pool())
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}"));
        found.push(name);
    }
    found
}

async fn partition_of(inbox: &PgInbox, key: &str) -> String {
    partitions_of(inbox, &[key.to_owned()]).await.remove(0)
}

/// The name of the range partition holding UUIDv7 time `ms`.
async fn range_of(inbox: &PgInbox, ms: i64) -> String {
    let at = time(ms);
    inbox
        .partitions()
        .await
        .unwrap()
        .into_iter()
        .find(|p| matches!(p.range, PartitionRange::Time { from, to } if from <= at && at < to))
        .unwrap_or_else(|| panic!("no range holds {ms}"))
        .name
}

async fn rows(inbox: &PgInbox) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        inbox.table()
    )))
    .fetch_one(inbox.pool())
    .await
    .unwrap()
}

async fn exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

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
    let mut tx = inbox.begin().await.unwrap();
    assert!(inbox.claim(&mut tx, "wallet", &open).await.unwrap());
    let report = inbox.purge(window, 10_000).await.unwrap();
    assert_eq!(report.postponed(), std::slice::from_ref(&a), "{report:?}");
    assert!(report.dropped().is_empty());
    assert!(exists(&db.pool, &a).await);
    assert_eq!(
        rows(&inbox).await,
        10,
        "a postponed partition keeps its rows"
    );
    inbox.commit(tx).await.unwrap();

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

#[tokio::test]
async fn a_plain_table_is_converted_in_place_and_every_key_stays_deduplicated() {
    let db = TestDb::new().await;
    for (table, mode) in [("conv_uuid", KeyMode::Uuid), ("conv_text", KeyMode::Text)] {
        let plain = PgInbox::new(db.pool.clone())
            .with_table(TableName::qualified(&db.schema, table).unwrap())
            .with_key_mode(mode);
        plain.migrate().await.unwrap();
        let now = db_now_ms(&db.pool).await;
        let mut ids: Vec<String> = (0..20).map(|_| Uuid::now_v7().to_string()).collect();
        // Keys from a clock 3 minutes ahead (inside the ranges to come) and 30 (beyond them).
        let inside: Vec<String> = (0..5)
            .map(|i| v7_at(now + 3 * MINUTE + i).to_string())
            .collect();
        ids.extend(inside.iter().cloned());
        ids.extend((0..3).map(|i| v7_at(now + 30 * MINUTE + i).to_string()));
        ids.extend((0..10).map(|_| Uuid::new_v4().to_string()));
        if mode == KeyMode::Text {
            ids.push("order-42".to_owned());
        }
        assert!(claim(&plain, "wallet", &ids).await.iter().all(|new| *new));

        let partitioned = plain
            .clone()
            .partitioned(Partitions::every(Duration::from_secs(60)).ahead(2));
        let conversion = partitioned
            .migrate_to_partitioned(Duration::from_secs(5 * 60))
            .await
            .unwrap();
        let Conversion::Converted {
            created,
            ranges_from,
            moved_rows,
        } = conversion
        else {
            panic!("{mode:?}: not converted: {conversion:?}")
        };
        assert_eq!(created.len(), 5 + 2 + 1, "{created:?}");
        assert!(ranges_from >= time(now + MINUTE), "{ranges_from:?}");
        assert!(partitioned.is_partitioned().await.unwrap());
        let parts = partitioned.partitions().await.unwrap();
        let default = parts.last().unwrap();
        assert_eq!(
            (default.name.clone(), &default.range),
            (format!("{table}_default"), &PartitionRange::Default)
        );
        let in_ranges: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE tableoid <> '{table}_default'::regclass"
        )))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(i64::try_from(moved_rows).unwrap(), in_ranges);
        assert!(moved_rows >= 5, "{moved_rows}");
        for id in &inside {
            assert_ne!(
                partition_of(&partitioned, id).await,
                format!("{table}_default")
            );
        }

        // Every key is found again, through the old store (its connections prepared the claim
        // against the plain table) and a new one; a new key goes to its range.
        assert!(
            claim(&plain, "wallet", &ids).await.iter().all(|new| !*new),
            "{mode:?}"
        );
        assert!(claim(&partitioned, "wallet", &ids)
            .await
            .iter()
            .all(|new| !*new));
        let fresh = v7_at(now + 3 * MINUTE + 99).to_string();
        assert!(claim_one(&plain, "wallet", &fresh).await);
        assert_eq!(
            partition_of(&partitioned, &fresh).await,
            range_of(&partitioned, now + 3 * MINUTE + 99).await
        );
        assert_eq!(
            partitioned
                .migrate_to_partitioned(Duration::from_secs(300))
                .await
                .unwrap(),
            Conversion::AlreadyPartitioned
        );
        // The purge runs on it, and `migrate` leaves it as it is.
        partitioned.migrate().await.unwrap();
        let report = partitioned
            .purge(Duration::from_secs(7 * 86_400), 1000)
            .await
            .unwrap();
        assert!(matches!(report, PurgeReport::Purged { .. }), "{report:?}");
        assert_eq!(
            rows(&partitioned).await,
            i64::try_from(ids.len()).unwrap() + 1
        );
    }

    // Hashed keys cannot be recomputed: refused, nothing changed.
    let hashed = db.inbox_named("conv_hashed", KeyMode::Hashed);
    PgInbox::new(db.pool.clone())
        .with_table(hashed.table().clone())
        .with_key_mode(KeyMode::Hashed)
        .migrate()
        .await
        .unwrap();
    let refused = hashed
        .clone()
        .partitioned(Partitions::default())
        .migrate_to_partitioned(Duration::from_secs(86_400))
        .await
        .unwrap();
    assert!(
        matches!(&refused, Conversion::Refused { reason } if reason.contains("not stored")),
        "{refused:?}"
    );
    assert!(!hashed.is_partitioned().await.unwrap());
    db.drop().await;
}
