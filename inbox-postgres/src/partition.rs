//! The partitioned layout: the inbox table range-partitioned by its message key, so that cleanup
//! is dropping a partition; see [`Partitions`].

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inbox_core::sql::hashed_key;
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use uuid::Uuid;

use crate::error::db;
use crate::{KeyMode, Result, TableName};

mod convert;
mod upkeep;

pub(crate) use upkeep::DropOutcome;

const MINUTE_MS: i64 = 60_000;
/// The last millisecond a UUIDv7 can hold.
const MAX_MS: i64 = (1 << 48) - 1;
/// The longest table name whose partition names (`_p20250301_0000`) still fit in 63 bytes.
const LONGEST_PREFIX: usize = 48;

/// The partitioned layout of the inbox table ([`PgInbox::partitioned`](crate::PgInbox::partitioned)): range-partitioned by
/// its message key, so that cleanup is dropping a partition instead of deleting its rows.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> inbox_postgres::Result<()> {
/// use std::time::Duration;
/// use inbox_postgres::{KeyMode, Partitions, PgInbox};
///
/// let inbox = PgInbox::new(pool)
///     .with_key_mode(KeyMode::Uuid)
///     .partitioned(Partitions::every(Duration::from_secs(86_400)).ahead(3));
/// inbox.migrate().await?; // the partitioned table, today's partition and 3 more
/// let _purger = inbox_postgres::spawn_purger(inbox, Duration::from_secs(14 * 86_400), Duration::from_secs(3600));
/// # Ok(()) }
/// ```
///
/// ## Layout
/// PostgreSQL wants the partition key inside the primary key, and the primary key is (consumer,
/// message key), or the key alone in [`KeyMode::Hashed`]. So the table is partitioned by the
/// message key itself, `PARTITION BY RANGE (message_id)`: no extra column, no extra byte per
/// row. With UUIDv7 IDs a range of keys is a range of time, since a UUIDv7 starts with its
/// millisecond timestamp (48 bits, big-endian); each partition holds the keys of one
/// [`Partitions::every`] span (default a day), named after its start in UTC
/// (`inbox_p20250301_0000`), and a `DEFAULT` partition (`inbox_default`) takes every key outside
/// them. Per key mode:
///
/// - [`KeyMode::Uuid`]: the bounds are UUIDs (`'0195...-0000-0000-000000000000'`).
/// - [`KeyMode::Text`]: the bounds are the first 13 characters of a UUIDv7 string
///   (`'01954a00-0000'`). A UUIDv7 written as the producer helpers write it (lowercase, with
///   hyphens) sorts by time under the C collation and the usual locales; any other text ID
///   (`order-42`) sorts elsewhere, mostly into the default partition.
/// - [`KeyMode::Hashed`]: the key keeps 16 bytes, but for a UUIDv7 ID its first 6 bytes are the
///   ID's timestamp and the other 10 are SHA-256 over consumer, a zero byte and the ID (about
///   n²/2⁸¹ collisions among n IDs of the same millisecond); other IDs get 2 zero bytes and 14
///   bytes of the hash (n²/2¹¹³), which sorts them below every range, into the default
///   partition. A hashed key is thus a function of the ID alone, as in the plain layout, but not
///   the same function: a plain hashed table cannot be converted (its IDs are not stored).
///
/// A time column in the primary key would not do: the same ID claimed at two times would be two
/// rows, in two partitions. Every key here is a function of the message ID alone, so an ID has
/// exactly one partition and one row, whatever the time it arrives.
///
/// ## Retention
/// A row is kept at least the purge window after it was processed, on both layouts. The purge
/// ([`PgInbox::purge`](crate::PgInbox::purge)) sorts the range partitions by how their key range stands to the cutoff
/// (now − window, on the database clock):
///
/// - Due (the whole range older than the cutoff): dropped whole, unless a row in it was processed
///   after the cutoff. The check and the detach run in one transaction that holds the partition
///   in `SHARE` mode, so no row can slip in between. Such late rows come from replays and redrives
///   of old messages and from a producer whose clock runs behind; the partition then loses its
///   expired rows by `DELETE`, keeps the late ones, and is dropped once they expire too.
/// - Straddling the cutoff: left alone, dropped whole once due. A row therefore stays up to one
///   partition span longer than the window.
/// - Newer: its rows processed before the cutoff (an ID from a producer whose clock runs ahead)
///   are deleted, found through the BRIN index.
/// - The default partition: purged by `DELETE`, like the plain table.
///
/// So on both layouts everything processed within the window is remembered, and the oldest
/// remembered row ([`PgInbox::oldest_per_consumer`](crate::PgInbox::oldest_per_consumer)) is at
/// most about one partition span older than the cutoff.
///
/// A message redelivered after its partition was dropped is the case of a purged row: it was
/// processed longer ago than the window, its key now falls in no range and goes to the default
/// partition, and it is applied again, exactly as on the plain layout after a purge. A message
/// whose UUIDv7 time is far in the past or the future (clock skew, a replay) lands in the range
/// of that time if one exists, else in the default partition; in either place the primary key
/// deduplicates it like any other, and the rules above keep it for the window after it was
/// processed. A non-v7 UUID lands wherever its bytes sort, which is just as correct.
///
/// ## Maintenance and locks
/// Partitions are created ahead ([`Partitions::ahead`]) by [`PgInbox::migrate`](crate::PgInbox::migrate) and by every
/// purge, as a table of their own attached with `ATTACH PARTITION`, which takes `SHARE UPDATE
/// EXCLUSIVE` on the inbox table and so does not block claims. Rows of the new range already in
/// the default partition (keys from a clock far ahead) are moved into it in the same transaction;
/// keeping the default small keeps that and its scan short. A claim of such a key racing the
/// creation fails once (PostgreSQL rechecks the default partition's bounds) and is retried.
///
/// Detaching a partition needs `ACCESS EXCLUSIVE` on the inbox table for a moment (`DETACH
/// CONCURRENTLY` is not allowed beside a default partition): the request waits for the claims in
/// flight, and claims arriving meanwhile wait behind it. The purge asks with a short
/// `lock_timeout` ([`Partitions::lock_timeout`], default 200 ms) and tries again a few times, so
/// no claim waits longer than that; the table is dropped after the detach, without the inbox
/// table's lock. A partition not detached after [`Partitions::attempts`] tries is postponed to
/// the next purge.
///
/// ## Converting a plain table
/// [`PgInbox::migrate_to_partitioned`](crate::PgInbox::migrate_to_partitioned) (`inbox-admin
/// partition --window 14d`) does it in place, while consumers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitions {
    width_minutes: i64,
    ahead: u32,
    lock_timeout: Duration,
    attempts: u32,
}

impl Default for Partitions {
    /// A partition per UTC day, 3 days ahead, 200 ms lock timeout, 5 attempts.
    fn default() -> Self {
        Self {
            width_minutes: 24 * 60,
            ahead: 3,
            lock_timeout: Duration::from_millis(200),
            attempts: 5,
        }
    }
}

impl Partitions {
    /// A partition per `width` of ID time (whole minutes, at least one), aligned to the Unix
    /// epoch, so a day starts at 00:00 UTC. A partition is dropped once its whole span is older
    /// than the purge window, so a row stays up to one `width` longer than the window: take a
    /// small fraction of the window (a day for a 14-day window).
    pub fn every(width: Duration) -> Self {
        let minutes = i64::try_from(width.as_secs() / 60).unwrap_or(i64::MAX / MINUTE_MS);
        Self {
            width_minutes: minutes.clamp(1, MAX_MS / MINUTE_MS),
            ..Self::default()
        }
    }

    /// Keeps `partitions` partitions ready after the current one (default 3), so that IDs from
    /// a clock somewhat ahead, or a purger that stopped for a while, still find their range.
    pub fn ahead(mut self, partitions: u32) -> Self {
        self.ahead = partitions;
        self
    }

    /// How long one attempt to detach (or create) a partition waits for its locks (default
    /// 200 ms): the longest a claim waits behind a drop.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Attempts per partition and purge before it is postponed to the next purge (default 5, at
    /// least 1), a `lock_timeout` apart.
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The span of ID time per partition.
    pub fn width(&self) -> Duration {
        Duration::from_secs(u64::try_from(self.width_minutes).unwrap_or(1) * 60)
    }

    fn width_ms(&self) -> i64 {
        self.width_minutes * MINUTE_MS
    }

    /// The attempts at one change of the partitioned table.
    fn retries(&self) -> Retries<'_> {
        Retries {
            p: self,
            attempt: 0,
            started: Instant::now(),
            waited: Duration::ZERO,
        }
    }
}

/// The attempts at one change of the partitioned table: each a transaction under
/// [`Partitions::lock_timeout`], up to [`Partitions::attempts`] while its locks are contended
/// ([`lock_contended`]), a lock timeout apart.
struct Retries<'p> {
    p: &'p Partitions,
    attempt: u32,
    started: Instant,
    /// The time spent in the attempts that committed or were contended: how long claims could
    /// have waited behind them.
    waited: Duration,
}

impl Retries<'_> {
    /// Opens the next attempt's transaction, under the lock timeout.
    async fn begin<'c>(
        &mut self,
        conn: &'c mut PgConnection,
    ) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
        self.attempt += 1;
        self.started = Instant::now();
        let mut tx = conn.begin().await?;
        let timeout = format!(
            "SET LOCAL lock_timeout = {}",
            self.p.lock_timeout.as_millis()
        );
        sqlx::raw_sql(AssertSqlSafe(timeout))
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// Ends the attempt's transaction after `result`: its `Some` commits, its `None` or an error
    /// rolls back. `None` when the locks were contended and attempts are left (the pause before
    /// the next one taken); else how it ended, the last contended error when no attempt got the
    /// locks.
    async fn end<T>(
        &mut self,
        tx: sqlx::Transaction<'_, sqlx::Postgres>,
        result: Result<Option<T>, sqlx::Error>,
    ) -> Option<Result<Option<T>, sqlx::Error>> {
        let ended = match result {
            Ok(Some(value)) => tx.commit().await.map(|()| Some(value)),
            Ok(None) => return Some(tx.rollback().await.map(|()| None)),
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        };
        self.waited += self.started.elapsed();
        match ended {
            Err(e) if lock_contended(&e) && self.attempt < self.p.attempts => {
                tokio::time::sleep(self.p.lock_timeout).await;
                None
            }
            ended => Some(ended),
        }
    }
}

/// One partition of a partitioned inbox ([`PgInbox::partitions`](crate::PgInbox::partitions)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionInfo {
    /// The table's name (without the schema).
    pub name: String,
    /// The keys it holds.
    pub range: PartitionRange,
    /// Rows as of its last `VACUUM` or `ANALYZE` (`pg_class.reltuples`; 0 before the first).
    pub approx_rows: i64,
    /// Heap and indexes, on disk.
    pub bytes: i64,
}

/// Which keys a partition holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartitionRange {
    /// Keys whose UUIDv7 time is in `[from, to)`.
    Time {
        /// The first instant of the range.
        from: SystemTime,
        /// The first instant after it.
        to: SystemTime,
    },
    /// Every key no other partition takes.
    Default,
    /// Bounds this crate did not write (`pg_get_expr` of them): never dropped by the purge,
    /// whose expired rows it deletes instead.
    Other(String),
}

/// A partition the purge detached and dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DroppedPartition {
    /// Its name.
    pub name: String,
    /// Its rows as of its last `VACUUM` or `ANALYZE`.
    pub approx_rows: i64,
    /// The detaching transaction, from its first lock request to its commit, summed over the
    /// attempts: how long claims could have waited behind it at most.
    pub lock_wait: Duration,
}

/// What [`PgInbox::migrate_to_partitioned`](crate::PgInbox::migrate_to_partitioned) did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Conversion {
    /// The table was partitioned already; nothing changed.
    AlreadyPartitioned,
    /// The plain table is now the default partition of a partitioned table of the same name.
    Converted {
        /// The range partitions created, from `ranges_from` on.
        created: Vec<String>,
        /// The first instant of the first range: IDs of an earlier time keep going to the
        /// default partition (the former table), purged by `DELETE` until they expire.
        ranges_from: SystemTime,
        /// Rows of the plain table with keys in the new ranges, moved into them.
        moved_rows: u64,
    },
    /// Not converted; nothing changed.
    Refused {
        /// Why, and what to do instead.
        reason: String,
    },
}

/// A leaf of the partitioned table as the catalog has it.
#[derive(Debug, Clone)]
pub(crate) struct Leaf {
    pub(crate) name: String,
    /// Its name as SQL (`oid::regclass`): quoted and schema-qualified as needed.
    pub(crate) sql: String,
    pub(crate) bound: Bound,
    pub(crate) approx_rows: i64,
    pub(crate) bytes: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Bound {
    /// Key times `[from, to)` in milliseconds since the Unix epoch.
    Range(i64, i64),
    Default,
    Other(String),
}

/// The key of `id` for `consumer` in hashed mode on the partitioned layout: the UUIDv7 time first
/// when `id` is a UUIDv7, else two zero bytes (see the module docs).
pub(crate) fn hashed_key_with_time(consumer: &str, id: &str) -> Uuid {
    let hashed = hashed_key(consumer, id);
    let mut bytes = [0u8; 16];
    match Uuid::parse_str(id)
        .ok()
        .filter(|u| u.get_version_num() == 7)
    {
        Some(v7) => {
            bytes[..6].copy_from_slice(&v7.as_bytes()[..6]);
            bytes[6..].copy_from_slice(&hashed[..10]);
        }
        None => bytes[2..].copy_from_slice(&hashed[..14]),
    }
    Uuid::from_bytes(bytes)
}

/// The SQL literal of the key bound at `ms` for `mode` (unquoted).
pub(crate) fn bound_literal(mode: KeyMode, ms: i64) -> String {
    let ms = ms.clamp(0, MAX_MS);
    let prefix = format!("{:08x}-{:04x}", ms >> 16, ms & 0xffff);
    match mode {
        KeyMode::Text => prefix,
        KeyMode::Uuid | KeyMode::Hashed => format!("{prefix}-0000-0000-000000000000"),
    }
}

/// The bounds of `FOR VALUES FROM ('…') TO ('…')` when this crate wrote them for `mode`.
fn parse_bound(expr: &str, mode: KeyMode) -> Bound {
    if expr == "DEFAULT" {
        return Bound::Default;
    }
    let ms = |literal: &str| {
        let hex: String = literal.chars().filter(|c| *c != '-').take(12).collect();
        i64::from_str_radix(&hex, 16)
            .ok()
            .filter(|&ms| hex.len() == 12 && bound_literal(mode, ms) == literal)
    };
    let range = expr
        .strip_prefix("FOR VALUES FROM ('")
        .and_then(|rest| rest.split_once("') TO ('"))
        .and_then(|(from, rest)| Some((from, rest.strip_suffix("')")?)))
        .and_then(|(from, to)| Some((ms(from)?, ms(to)?)));
    match range {
        Some((from, to)) => Bound::Range(from, to),
        None => Bound::Other(expr.to_owned()),
    }
}

/// What partition names start with: the table's name, or for names too long to take the
/// suffixes, its first 39 bytes and 8 hex digits of a hash of it.
pub(crate) fn name_prefix(table: &str) -> String {
    if table.len() <= LONGEST_PREFIX {
        return table.to_owned();
    }
    let digest = Sha256::digest(table.as_bytes());
    format!(
        "{}_{:02x}{:02x}{:02x}{:02x}",
        &table[..LONGEST_PREFIX - 9],
        digest[0],
        digest[1],
        digest[2],
        digest[3]
    )
}

/// `<prefix>_pYYYYMMDD_HHMM`, after the UTC start of the range.
pub(crate) fn partition_name(table: &str, from_ms: i64) -> String {
    let minutes = from_ms.div_euclid(MINUTE_MS);
    let (year, month, day) = civil_date(minutes.div_euclid(1440));
    let minute_of_day = minutes.rem_euclid(1440);
    format!(
        "{}_p{year:04}{month:02}{day:02}_{:02}{:02}",
        name_prefix(table),
        minute_of_day / 60,
        minute_of_day % 60
    )
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

pub(crate) fn ms_to_time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// The statement moving the rows with keys in `['from', 'to')` (bound literals) from `source`
/// to `target`.
fn move_rows_sql(source: &str, target: &str, from: &str, to: &str) -> String {
    format!(
        "WITH moved AS (
            DELETE FROM {source} WHERE message_id >= '{from}' AND message_id < '{to}'
            RETURNING message_id, processed_minute, consumer_id)
         INSERT INTO {target} (message_id, processed_minute, consumer_id)
         SELECT message_id, processed_minute, consumer_id FROM moved"
    )
}

/// A lock wait that ran out (`lock_timeout`) or a deadlock the server broke: try again later.
fn lock_contended(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("55P03" | "40P01")))
}

/// Milliseconds since the Unix epoch on the database clock, the one rows are stamped by.
pub(crate) async fn db_now_ms(conn: &mut PgConnection) -> Result<i64> {
    sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(conn)
        .await
        .map_err(db("reading the database clock"))
}

pub(crate) async fn is_partitioned(conn: &mut PgConnection, table: &TableName) -> Result<bool> {
    sqlx::query_scalar("SELECT relkind = 'p' FROM pg_class WHERE oid = $1::regclass")
        .bind(table.to_string())
        .fetch_one(conn)
        .await
        .map_err(db("reading the table's layout"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_names_follow_utc() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(19_723), (2024, 1, 1));
        assert_eq!(civil_date(19_782), (2024, 2, 29));
        assert_eq!(civil_date(-1), (1969, 12, 31));
        // 2025-03-01 12:34 UTC.
        let ms = 1_740_832_440_000;
        assert_eq!(partition_name("inbox", ms), "inbox_p20250301_1234");
        let long = "a".repeat(63);
        let name = partition_name(&long, ms);
        assert!(name.len() <= 63, "{name}");
        assert_ne!(name_prefix(&long), name_prefix(&"a".repeat(62)));
    }

    #[test]
    fn bounds_round_trip_and_foreign_ones_are_recognised() {
        let ms = 1_740_832_440_000;
        let uuid = bound_literal(KeyMode::Uuid, ms);
        assert_eq!(uuid, "019551b2-fec0-0000-0000-000000000000");
        assert!(Uuid::parse_str(&uuid).is_ok());
        assert_eq!(bound_literal(KeyMode::Text, ms), "019551b2-fec0");
        let expr = format!(
            "FOR VALUES FROM ('{uuid}') TO ('{}')",
            bound_literal(KeyMode::Uuid, ms + 1)
        );
        assert_eq!(parse_bound(&expr, KeyMode::Uuid), Bound::Range(ms, ms + 1));
        assert_eq!(parse_bound("DEFAULT", KeyMode::Text), Bound::Default);
        for foreign in [
            "FOR VALUES FROM (MINVALUE) TO ('01955054-f7c0')",
            "FOR VALUES FROM ('01955054-f7c0-0000-0000-000000000001') TO ('01955054-f7c1-0000-0000-000000000000')",
            "FOR VALUES FROM ('a') TO ('b')",
        ] {
            assert!(matches!(parse_bound(foreign, KeyMode::Uuid), Bound::Other(_)), "{foreign}");
        }
        // A v7 UUID of that millisecond sorts inside its range, as text and as uuid.
        let id = Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            1_740_832_440,
            500_000,
        ));
        assert!(id.to_string().as_str() >= bound_literal(KeyMode::Text, ms).as_str());
        assert!(id.to_string().as_str() < bound_literal(KeyMode::Text, ms + 1).as_str());
        assert!(id >= Uuid::parse_str(&uuid).unwrap_or_default());
    }

    #[test]
    fn hashed_keys_with_time_carry_the_v7_time_and_separate_consumers() {
        let id = Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            1_740_832_440,
            0,
        ));
        let key = hashed_key_with_time("c", &id.to_string());
        assert_eq!(key.as_bytes()[..6], id.as_bytes()[..6]);
        assert_ne!(key, hashed_key_with_time("d", &id.to_string()));
        assert_eq!(key, hashed_key_with_time("c", &id.to_string()));
        let other = hashed_key_with_time("c", "order-42");
        assert_eq!(other.as_bytes()[..2], [0, 0]);
        assert_ne!(other, hashed_key_with_time("c", "order-43"));
        // A v4 UUID has no time: below every range too.
        let v4 = hashed_key_with_time("c", &Uuid::new_v4().to_string());
        assert_eq!(v4.as_bytes()[..2], [0, 0]);
    }
}
