//! The store through PgBouncer in transaction mode, which hands each transaction to whichever
//! server session is free: `INBOX_PGBOUNCER_URL`, which `cargo xtask services` starts in front
//! of the test PostgreSQL. The checks read through a direct connection.
//!
//! A pool that caches prepared statements is refused at the consumer's start, unless PgBouncer
//! carries prepared statements between server sessions (1.21 and later,
//! `INBOX_PGBOUNCER_PREPARED_URL`); with the cache off the consumer (per message and batched,
//! in lanes) applies each message once. Through either pooler ([`POOLERS`]), the second with
//! the cache on: two purges at once leave no lock behind for a purge on a direct connection;
//! the partition conversion and the partitioned purge leave no setting behind in the pooled
//! sessions; leases fence and finish; the outbox relay publishes each row once.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::TestDb;
use inbox_core::effect::{Acquired, Attempt, LeaseStore, Release};
use inbox_core::{
    BatchHandler, BatchItem, Consumer, ConsumerBinding, Handler, HandlerError, InboxStore, Message,
    MessageId, Recovery, StatsSnapshot, Transaction,
};
use inbox_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use inbox_postgres::sqlx::{self, AssertSqlSafe, PgPool};
use inbox_postgres::{Conversion, Outbox, PgInbox, PgLeases, PgTx, PurgeReport, TableName};
use inbox_testkit::MemoryBroker;

use crate::outbox::Recorder;

/// Connections through PgBouncer; `cache`: sqlx's default statement cache, else none.
async fn through_pgbouncer(cache: bool) -> PgPool {
    pool_at("INBOX_PGBOUNCER_URL", cache).await
}

/// Connections through the PgBouncer that `var` names.
async fn pool_at(var: &str, cache: bool) -> PgPool {
    let url = std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} names PgBouncer in front of the test database; `cargo xtask services` starts it"
        )
    });
    let mut options: PgConnectOptions = url.parse().unwrap();
    if !cache {
        options = options.statement_cache_capacity(0);
    }
    PgPoolOptions::new()
        .max_connections(8)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap()
}

/// The two poolers each path is tried through: PgBouncer 1.18, with sqlx's statement cache
/// off, and PgBouncer 1.21 or later carrying prepared statements, with the cache on.
const POOLERS: [(&str, bool); 2] = [
    ("INBOX_PGBOUNCER_URL", false),
    ("INBOX_PGBOUNCER_PREPARED_URL", true),
];

/// The test schema's inbox, reached through `pool`.
fn inbox(db: &TestDb, pool: PgPool, table: &str) -> PgInbox {
    PgInbox::new(pool).with_table(TableName::qualified(&db.schema, table).unwrap())
}

#[tokio::test]
async fn a_pool_that_caches_statements_is_refused_at_the_start() {
    let db = TestDb::new().await;
    let binding = ConsumerBinding::new("wallet");
    let cached = inbox(&db, through_pgbouncer(true).await, "inbox").bind(&binding);
    let refused = cached.begin().await.expect_err("a caching pool is refused");
    assert_eq!(refused.recovery(), Recovery::Fatal, "{refused}");
    assert!(
        refused.to_string().contains("statement-cache-capacity=0"),
        "the error says what to set: {refused}"
    );
    // The same pool without the cache, and a caching pool on a direct connection, start.
    let uncached = inbox(&db, through_pgbouncer(false).await, "inbox").bind(&binding);
    uncached.begin().await.unwrap().rollback().await.unwrap();
    db.inbox().bind(&binding).begin().await.unwrap();
}

/// PgBouncer 1.21 and later, with `max_prepared_statements`, carry a prepared statement to
/// whichever server session runs it: there sqlx's default statement cache works, and the
/// consumer takes it (`INBOX_PGBOUNCER_PREPARED_URL`).
#[tokio::test]
async fn a_caching_pool_runs_behind_a_pooler_that_carries_prepared_statements() {
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE applied (id text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let messages = 500;
    let broker = publish_twice(messages);
    let stats = Consumer::new(
        "one",
        broker.source(),
        inbox(
            &db,
            pool_at("INBOX_PGBOUNCER_PREPARED_URL", true).await,
            "inbox",
        ),
        Record(format!("\"{}\".applied", db.schema)),
    )
    .parallel_lanes(4)
    .run_until_idle()
    .await
    .unwrap();
    applied_once(&db, &broker, &stats, messages, messages).await;
    db.drop().await;
}

/// Records each message it applies in `<schema>.applied`, which has no unique key: a message
/// applied twice shows as two rows.
struct Record(String);

impl Handler<PgTx> for Record {
    async fn handle(&self, tx: &mut PgTx, id: &MessageId, _: &Message) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (id) VALUES ($1)",
            self.0
        )))
        .bind(id.as_str())
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl BatchHandler<PgTx> for Record {
    type Item = ();

    fn decode(&self, _: &MessageId, _: &Message) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut PgTx,
        batch: &[BatchItem<'_, ()>],
    ) -> Result<(), HandlerError> {
        let ids: Vec<&str> = batch.iter().map(|b| b.id.as_str()).collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (id) SELECT unnest($1::text[])",
            self.0
        )))
        .bind(ids)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// `messages` messages in 4 lanes, each published twice.
fn publish_twice(messages: usize) -> MemoryBroker {
    let broker = MemoryBroker::with_lanes();
    for copy in 0..2 {
        for i in 0..messages {
            let id = MessageId::new(format!("evt-{i}")).unwrap();
            let mut message = Message::new(Ok(id), format!("{i} {copy}"));
            message.meta.lane = Some(format!("partition {}", i % 4));
            broker.publish_message(message);
        }
    }
    broker
}

/// Each of `messages` messages published twice was applied once and skipped once,
/// `<schema>.applied` holds `rows` rows of `messages` IDs, and nothing is left on the broker.
async fn applied_once(
    db: &TestDb,
    broker: &MemoryBroker,
    stats: &StatsSnapshot,
    messages: usize,
    rows: usize,
) {
    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (messages as u64, messages as u64),
        "{stats:?}"
    );
    assert_eq!(applied(db).await, (rows as i64, messages as i64));
    assert_eq!(broker.pending() + broker.dead_letters().len(), 0);
}

/// Rows in `<schema>.applied`, and how many distinct IDs they hold, read directly.
async fn applied(db: &TestDb) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT id) FROM applied")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_consumer_applies_each_message_once_per_message_and_batched_in_lanes() {
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE applied (id text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let table = format!("\"{}\".applied", db.schema);
    let pool = through_pgbouncer(false).await;
    let messages = 1000;

    let broker = publish_twice(messages);
    let stats = Consumer::new(
        "one",
        broker.source(),
        inbox(&db, pool.clone(), "inbox"),
        Record(table.clone()),
    )
    .batch_size(20)
    .parallel_lanes(4)
    .run_until_idle()
    .await
    .unwrap();
    applied_once(&db, &broker, &stats, messages, messages).await;

    // Another consumer name applies each message once more, a batch at a time.
    let broker = publish_twice(messages);
    let stats = Consumer::batched(
        "many",
        broker.source(),
        inbox(&db, pool, "inbox"),
        Record(table),
    )
    .batch_size(100)
    .parallel_lanes(4)
    .run_until_idle()
    .await
    .unwrap();
    applied_once(&db, &broker, &stats, messages, 2 * messages).await;
    db.drop().await;
}

/// Adds `rows` inbox rows of consumer `c`, processed long before any purge window.
async fn old_rows(db: &TestDb, table: &str, rows: i64) {
    let consumer = db.inbox().consumer_id("c").await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (message_id, processed_minute, consumer_id)
         SELECT 'old-' || g || '-' || gen_random_uuid(), 1000, $1 FROM generate_series(1, $2) g"
    )))
    .bind(consumer)
    .bind(rows)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// `enable_seqscan` as each of `n` connections at once through PgBouncer finds it.
async fn seqscan_settings(pool: &PgPool, n: usize) -> Vec<String> {
    let mut txs = Vec::new();
    for _ in 0..n {
        txs.push(pool.begin().await.unwrap());
    }
    let mut settings = Vec::new();
    for tx in &mut txs {
        settings.push(
            sqlx::query_scalar("SELECT current_setting('enable_seqscan')")
                .fetch_one(&mut **tx)
                .await
                .unwrap(),
        );
    }
    settings
}

#[tokio::test]
async fn purges_through_pgbouncer_leave_no_lock_behind_for_a_direct_one() {
    for (var, cache) in POOLERS {
        println!("through {var}, statement cache {cache}");
        let db = TestDb::new().await;
        let pool = pool_at(var, cache).await;
        let through = inbox(&db, pool.clone(), "inbox");
        let table = format!("\"{}\".inbox", db.schema);
        let window = Duration::from_secs(3600);
        for round in 0..5 {
            old_rows(&db, &table, 3000).await;
            // Two at once, beside claims of other connections that take the pooled sessions.
            let load = async {
                for _ in 0..20 {
                    seqscan_settings(&pool, 4).await;
                }
            };
            let (a, b, ()) =
                tokio::join!(through.purge(window, 100), through.purge(window, 100), load);
            let (a, b) = (a.unwrap(), b.unwrap());
            assert_eq!(
                a.deleted() + b.deleted(),
                3000,
                "round {round}: {a:?} {b:?}"
            );
            old_rows(&db, &table, 10).await;
            let direct = db.inbox().purge(window, 100).await.unwrap();
            assert!(
                matches!(direct, PurgeReport::Purged { .. }) && direct.deleted() == 10,
                "round {round}: a direct purge after purges through PgBouncer found the cleaner lock taken: {direct:?}"
            );
        }
        db.drop().await;
    }
}

#[tokio::test]
async fn a_conversion_and_a_partitioned_purge_leave_no_setting_in_pooled_sessions() {
    for (var, cache) in POOLERS {
        println!("through {var}, statement cache {cache}");
        let db = TestDb::new().await;
        let pool = pool_at(var, cache).await;
        let plain = inbox(&db, pool.clone(), "conv");
        plain.migrate().await.unwrap();
        let table = format!("\"{}\".conv", db.schema);
        old_rows(&db, &table, 500).await;

        let partitioned = plain.partitioned(inbox_postgres::Partitions::default());
        let converted = partitioned
            .migrate_to_partitioned(Duration::from_secs(7 * 24 * 3600))
            .await
            .unwrap();
        assert!(
            matches!(converted, Conversion::Converted { .. }),
            "{converted:?}"
        );
        assert!(partitioned.is_partitioned().await.unwrap());

        let report = partitioned
            .purge(Duration::from_secs(3600), 100)
            .await
            .unwrap();
        assert_eq!(report.deleted(), 500, "{report:?}");
        assert!(
            seqscan_settings(&pool, 4).await.iter().all(|s| s == "on"),
            "the purge's enable_seqscan = off stayed in a pooled session"
        );
        // Its cleaner lock is gone too.
        let direct = inbox(&db, db.pool.clone(), "conv")
            .purge(Duration::from_secs(3600), 100)
            .await
            .unwrap();
        assert!(matches!(direct, PurgeReport::Purged { .. }), "{direct:?}");
        db.drop().await;
    }
}

#[tokio::test]
async fn leases_fence_and_finish_through_pgbouncer() {
    for (var, cache) in POOLERS {
        println!("through {var}, statement cache {cache}");
        let db = TestDb::new().await;
        let through = inbox(&db, pool_at(var, cache).await, "inbox");
        let leases = PgLeases::with_table(
            through,
            TableName::qualified(&db.schema, "effects").unwrap(),
        );
        leases.migrate().await.unwrap();
        let lease = Duration::from_secs(30);

        // Eight callers at once for each of 50 IDs: one lease per ID, the others told it is busy.
        let ids: Vec<MessageId> = (0..50)
            .map(|i| MessageId::new(format!("evt-{i}")).unwrap())
            .collect();
        let mut calls = tokio::task::JoinSet::new();
        for id in &ids {
            for _ in 0..8 {
                let (leases, id) = (leases.clone(), id.clone());
                calls.spawn(async move { leases.acquire("c", &id, lease).await.unwrap() });
            }
        }
        let mut leased = Vec::new();
        while let Some(outcome) = calls.join_next().await {
            if let Acquired::Leased(l) = outcome.unwrap() {
                leased.push(l.token);
            }
        }
        assert_eq!(leased, vec![1; 50], "one lease of token 1 per ID");

        // Released as not applied, the next lease has a higher token and finishes; then it is done.
        let evt = &ids[0];
        let not_applied = Release {
            not_applied: true,
            dead_lettered: false,
        };
        assert!(leases.release("c", evt, 1, not_applied).await.unwrap());
        let Acquired::Leased(next) = leases.acquire("c", evt, lease).await.unwrap() else {
            panic!("a released lease is taken again")
        };
        assert_eq!((next.token, next.attempt), (2, Attempt::AfterNotApplied));
        let mut tx = leases.begin().await.unwrap();
        assert!(
            !leases.complete(&mut tx, "c", evt, 1).await.unwrap(),
            "a stale token is fenced out"
        );
        tx.rollback().await.unwrap();
        let mut tx = leases.begin().await.unwrap();
        assert!(leases.complete(&mut tx, "c", evt, 2).await.unwrap());
        tx.commit().await.unwrap();
        assert!(matches!(
            leases.acquire("c", evt, lease).await.unwrap(),
            Acquired::Done
        ));
        assert_eq!(leases.purge(Duration::ZERO, 10).await.unwrap(), 1);
        db.drop().await;
    }
}

#[tokio::test]
async fn the_outbox_relay_publishes_each_row_once_through_pgbouncer() {
    for (var, cache) in POOLERS {
        println!("through {var}, statement cache {cache}");
        let db = TestDb::new().await;
        let pool = pool_at(var, cache).await;
        let outbox = Outbox::new(pool.clone())
            .with_table(TableName::qualified(&db.schema, "outbox").unwrap());
        outbox.migrate().await.unwrap();
        let mut written = Vec::new();
        for i in 0..200 {
            let mut tx = pool.begin().await.unwrap();
            written.push(
                outbox
                    .write(&mut tx, "orders", format!("{i}").as_bytes())
                    .await
                    .unwrap()
                    .to_string(),
            );
            tx.commit().await.unwrap();
        }

        let kept = Arc::new(Recorder::default());
        let stats = outbox
            .relay(Arc::clone(&kept))
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!(stats.published, 200, "{stats:?}");
        let published: Vec<String> = kept.to("orders").iter().map(|m| m.id.to_string()).collect();
        assert_eq!(published, written, "each row once, in the order written");
        assert_eq!(outbox.oldest_unsent().await.unwrap(), None);
        assert_eq!(outbox.purge_sent(Duration::ZERO, 50).await.unwrap(), 200);
        db.drop().await;
    }
}
