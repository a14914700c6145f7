//! What the partition tests share: a partitioned store, claims, and where keys landed.

#![allow(dead_code, unreachable_pub)] // each test file uses its own part
#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_core::Transaction as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_conformance::TestDb;
use inbox_core::{ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::{KeyMode, PartitionRange, Partitions, PgInbox, TableName};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::{NoContext, Timestamp, Uuid};

pub const MINUTE: i64 = 60_000;
pub const HOUR: i64 = 60 * MINUTE;
pub const DAY: i64 = 24 * HOUR;

pub fn store(db: &TestDb, table: &str, mode: KeyMode, partitions: Partitions) -> PgInbox {
    PgInbox::new(db.pool.clone())
        .with_table(TableName::qualified(&db.schema, table).unwrap())
        .with_key_mode(mode)
        .partitioned(partitions)
}

pub async fn db_now_ms(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A UUIDv7 of millisecond `ms` (random otherwise).
pub fn v7_at(ms: i64) -> Uuid {
    let ms = u64::try_from(ms).unwrap();
    Uuid::new_v7(Timestamp::from_unix(
        NoContext,
        ms / 1000,
        u32::try_from(ms % 1000).unwrap() * 1_000_000,
    ))
}

pub fn time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap())
}

/// Claims `ids` for `consumer` in one committed transaction: which were new.
pub async fn claim(inbox: &PgInbox, consumer: &str, ids: &[String]) -> Vec<bool> {
    let ids: Vec<MessageId> = ids.iter().map(|id| MessageId::new(id).unwrap()).collect();
    let inbox = inbox.bind(&ConsumerBinding::new(consumer));
    let mut tx = inbox.begin().await.unwrap();
    let claimed = inbox.claim(&mut tx, &ids).await.unwrap();
    tx.commit().await.unwrap();
    claimed
}

pub async fn claim_one(inbox: &PgInbox, consumer: &str, id: &str) -> bool {
    claim(inbox, consumer, &[id.to_owned()]).await[0]
}

/// Inserts uuid keys with their processed minutes, as rows processed back then.
pub async fn insert_processed(inbox: &PgInbox, consumer: &str, rows: &[(Uuid, i64)]) {
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
pub async fn partitions_of(inbox: &PgInbox, keys: &[String]) -> Vec<String> {
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

pub async fn partition_of(inbox: &PgInbox, key: &str) -> String {
    partitions_of(inbox, &[key.to_owned()]).await.remove(0)
}

/// The name of the range partition holding UUIDv7 time `ms`.
pub async fn range_of(inbox: &PgInbox, ms: i64) -> String {
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

pub async fn rows(inbox: &PgInbox) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        inbox.table()
    )))
    .fetch_one(inbox.pool())
    .await
    .unwrap()
}

pub async fn exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}
