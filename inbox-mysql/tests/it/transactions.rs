//! What the MySQL store's transaction promises beyond the store suite: its isolation level,
//! connections handed back to the pool as they were taken, lock waits that end as retryable
//! errors, and a migration that refuses a table of another key mode.

use std::time::{Duration, Instant};

use inbox_conformance::store::MySqlDb;
use inbox_core::{ConsumerBinding, InboxStore, MessageId, Recovery, Transaction};
use inbox_mysql::{Error, KeyMode, MySqlInbox, MySqlTx, PurgeReport, TableName};
use sqlx::mysql::MySqlPoolOptions;

async fn db_with(table: &str, mode: KeyMode) -> (MySqlDb, MySqlInbox) {
    let db = MySqlDb::new().await;
    let inbox = db.inbox(table, mode).bind(&ConsumerBinding::new("c"));
    inbox.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE notes (n int NOT NULL) ENGINE=InnoDB")
        .execute(&db.pool)
        .await
        .expect("notes");
    (db, inbox)
}

/// Under READ COMMITTED a statement sees what others committed after the transaction's first
/// read; under InnoDB's default REPEATABLE READ it would not.
#[tokio::test]
async fn the_inbox_transaction_reads_committed_rows() {
    let (db, inbox) = db_with("inbox", KeyMode::Text).await;
    let count = "SELECT count(*) FROM notes";
    let mut tx = inbox.begin().await.expect("begin");
    let before: i64 = sqlx::query_scalar(count)
        .fetch_one(&mut *tx)
        .await
        .expect("count");
    sqlx::query("INSERT INTO notes VALUES (1)")
        .execute(&db.pool)
        .await
        .expect("insert elsewhere");
    let after: i64 = sqlx::query_scalar(count)
        .fetch_one(&mut *tx)
        .await
        .expect("count");
    tx.rollback().await.expect("rollback");
    assert_eq!((before, after), (0, 1));
    db.drop().await;
}

/// The store turns `autocommit` off for its transactions: after a commit, a rollback and a
/// transaction dropped mid-way, the pool's connection commits a plain statement at once again,
/// and the dropped transaction left nothing.
#[tokio::test]
async fn connections_go_back_to_the_pool_as_they_came() {
    let (db, _) = db_with("inbox", KeyMode::Text).await;
    // One connection, so each step reuses the one before's.
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options().clone())
        .await
        .expect("pool");
    let inbox = MySqlInbox::new(pool.clone()).bind(&ConsumerBinding::new("c"));
    let notes = |pool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM notes")
            .fetch_one(&pool)
            .await
            .expect("count")
    };
    let dropped = MessageId::generate();
    for (step, end) in ["commit", "rollback", "drop"].into_iter().enumerate() {
        let mut tx = inbox.begin().await.expect("begin");
        let id = if end == "drop" {
            dropped.clone()
        } else {
            MessageId::generate()
        };
        assert!(claim(&inbox, &mut tx, &id).await);
        match end {
            "commit" => tx.commit().await.expect("commit"),
            "rollback" => tx.rollback().await.expect("rollback"),
            _ => drop(tx),
        }
        sqlx::query("INSERT INTO notes VALUES (1)")
            .execute(&pool)
            .await
            .expect("a plain insert");
        // Seen from another connection: committed on its own.
        assert_eq!(notes(db.pool.clone()).await, step as i64 + 1, "after {end}");
    }
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        claim(&inbox, &mut tx, &dropped).await,
        "the dropped transaction's claim is gone"
    );
    tx.rollback().await.expect("rollback");
    pool.close().await;
    db.drop().await;
}

/// A lane never waits for a second connection while its transaction holds one: lanes that each
/// did, from a pool sized for them all, would stall a consumer at start with every lane idle in
/// its transaction. A process starting with a name registered before reads its id through the
/// transaction.
#[tokio::test]
async fn a_claim_of_a_known_consumer_takes_no_second_connection() {
    let (db, registered) = db_with("inbox", KeyMode::Text).await;
    registered.consumer_id("wallet").await.expect("register");
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options().clone())
        .await
        .expect("pool");
    let inbox = MySqlInbox::new(pool.clone()).bind(&ConsumerBinding::new("wallet"));

    let mut tx = inbox.begin().await.expect("begin");
    let id = MessageId::new("evt-1").expect("id");
    assert!(claim(&inbox, &mut tx, &id).await);
    assert_eq!(
        pool.size(),
        1,
        "the claim opened another connection while its transaction held one"
    );
    tx.commit().await.expect("commit");
    let mut tx = inbox.begin().await.expect("begin");
    assert!(!claim(&inbox, &mut tx, &id).await);
    tx.rollback().await.expect("rollback");
    pool.close().await;
    db.drop().await;
}

/// A claim waiting on a peer's uncommitted claim of the same ID gives up after the lock wait
/// timeout with a retryable error (1205), instead of waiting for the peer for ever.
#[tokio::test]
async fn a_claim_stuck_behind_a_hung_peer_ends_as_a_retryable_error() {
    let (db, inbox) = db_with("inbox", KeyMode::Uuid).await;
    let waiting = inbox.clone().lock_wait_timeout(Duration::from_millis(1500));
    let id = MessageId::generate();
    let mut hung = inbox.begin().await.expect("begin");
    assert!(claim(&inbox, &mut hung, &id).await);
    let mut tx = waiting.begin().await.expect("begin");
    let start = Instant::now();
    let err = waiting
        .claim(&mut tx, std::slice::from_ref(&id))
        .await
        .expect_err("the lock wait times out");
    let waited = start.elapsed();
    assert_eq!(err.recovery(), Recovery::Retry, "{err}");
    assert!(err.to_string().contains("1205"), "{err}");
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(10),
        "rounded up to 2 s: {waited:?}"
    );
    tx.rollback().await.expect("rollback");
    hung.rollback().await.expect("rollback");
    db.drop().await;
}

/// Migrating twice changes nothing; a store of another key mode on the same table is refused
/// with the types named; the printed SQL makes a table `migrate` accepts.
#[tokio::test]
async fn migrations_are_repeatable_and_refuse_another_key_mode() {
    let (db, inbox) = db_with("inbox", KeyMode::Text).await;
    inbox.migrate().await.expect("again");
    let err = db
        .inbox("inbox", KeyMode::Hashed)
        .migrate()
        .await
        .expect_err("another key mode");
    assert!(
        matches!(&err, Error::KeyModeMismatch { found, .. } if found == "varbinary(1024)"),
        "{err}"
    );
    let printed = MySqlInbox::new(db.pool.clone())
        .with_table(TableName::new("printed").expect("name"))
        .with_key_mode(KeyMode::Uuid);
    for statement in printed.migration_sql().split(";\n") {
        let statement: String = statement
            .lines()
            .filter(|l| !l.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        if !statement.trim().is_empty() {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(&db.pool)
                .await
                .expect("printed SQL runs");
        }
    }
    printed
        .migrate()
        .await
        .expect("migrate accepts the printed tables");
    db.drop().await;
}

/// The purge deletes expired claims in batches of the size asked, keeps recent ones, and
/// leaves the work to a cleaner that holds the table's purge lock.
#[tokio::test]
async fn the_purge_goes_in_batches_under_one_cleaner() {
    let (db, inbox) = db_with("inbox", KeyMode::Hashed).await;
    let mut tx = inbox.begin().await.expect("begin");
    let ids: Vec<MessageId> = (0..30).map(|_| MessageId::generate()).collect();
    let claimed = inbox.claim(&mut tx, &ids).await.expect("claim");
    assert_eq!(claimed, vec![true; 30]);
    tx.commit().await.expect("commit");
    // 25 claims a day old, 5 recent.
    sqlx::query(
        "UPDATE inbox SET processed_minute = processed_minute - 1440 ORDER BY message_id LIMIT 25",
    )
    .execute(&db.pool)
    .await
    .expect("age");
    let keep = Duration::from_secs(3600);

    let mut holder = db.pool.acquire().await.expect("a connection");
    let held: i64 = sqlx::query_scalar("SELECT GET_LOCK('inbox purge `inbox`', 0)")
        .fetch_one(&mut *holder)
        .await
        .expect("take the purge lock");
    assert_eq!(held, 1);
    let skipped = inbox.purge(keep, 10).await.expect("purge");
    assert_eq!(skipped, PurgeReport::SkippedOtherCleaner);
    sqlx::query("SELECT RELEASE_LOCK('inbox purge `inbox`')")
        .execute(&mut *holder)
        .await
        .expect("release");
    drop(holder);

    let report = inbox.purge(keep, 10).await.expect("purge");
    assert_eq!(report.batches(), &[10, 10, 5]);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(left, 5, "the recent claims are kept");
    db.drop().await;
}

/// A claim waiting on a peer's uncommitted row (the broker handed the message out again after a
/// visibility expiry or a rebalance while the peer still works on it) waits as long as the
/// store's own lock wait timeout allows, not the handler timeout: it is not the handler's
/// statement. Cut off by the handler's bound, it would count as the message's failure and
/// dead-letter it while the peer goes on: here "freed" would never be applied, and "taken",
/// which the peer commits, would be both applied and parked.
#[tokio::test]
async fn a_claim_waiting_on_a_peer_is_not_cut_off_by_the_handler_timeout() {
    use inbox_conformance::mysql_wallet;
    use inbox_conformance::wallet::{self, Credit};
    use inbox_core::Consumer;
    use inbox_testkit::MemoryBroker;

    const HELD: Duration = Duration::from_secs(4);
    let db = mysql_wallet::wallet_db().await;
    let peer_store = mysql_wallet::inbox(&db).bind(&ConsumerBinding::new("wallet"));
    let mut freed_by = peer_store.begin().await.expect("begin");
    let freed = MessageId::new("freed").expect("id");
    assert!(claim(&peer_store, &mut freed_by, &freed).await);
    let mut taken_by = peer_store.begin().await.expect("begin");
    let taken = MessageId::new("taken").expect("id");
    assert!(claim(&peer_store, &mut taken_by, &taken).await);

    let broker = MemoryBroker::new();
    wallet::publish_credit(&broker, "freed", 1, 1);
    wallet::publish_credit(&broker, "taken", 1, 1);
    let run = tokio::spawn(
        Consumer::new(
            "wallet",
            broker.source(),
            mysql_wallet::inbox(&db),
            Credit::new(db.clone()),
        )
        .handler_timeout(Duration::from_millis(300))
        .run_until_idle(),
    );
    tokio::time::sleep(HELD).await;
    // The one peer gives up its claim, the other commits it.
    freed_by.rollback().await.expect("rollback");
    taken_by.commit().await.expect("commit");
    let stats = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the run ends once the rows are free")
        .expect("join")
        .expect("run");

    let dead = broker.dead_letters();
    assert!(
        dead.is_empty(),
        "dead-lettered while a peer held the row: {:?}",
        dead.iter()
            .map(|(m, reason)| (m.id.as_ref().ok().map(MessageId::as_str), reason))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (1, 1),
        "{stats:?}"
    );
    let summary = wallet::summary(&db).await.expect("summary");
    assert_eq!(
        (summary.distinct_events, summary.total_balance),
        (1, 1),
        "freed applied once, taken by its peer"
    );
    db.drop().await;
}

/// With a handler timeout the claim waits under the connection's own lock wait timeout and the
/// handler's statements after it under the handler's (in whole seconds), whichever way the
/// claim went (all new, or a duplicate among them); the next transaction on the connection
/// claims under the connection's own again.
#[tokio::test]
async fn the_handler_bound_starts_after_the_claim() {
    let (db, _) = db_with("inbox", KeyMode::Text).await;
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options().clone())
        .await
        .expect("pool");
    let binding = ConsumerBinding::new("c").handler_timeout(Duration::from_millis(300));
    let inbox = MySqlInbox::new(pool.clone()).bind(&binding);
    let lock_wait = "SELECT @@SESSION.innodb_lock_wait_timeout";
    let own: u64 = sqlx::query_scalar(lock_wait)
        .fetch_one(&pool)
        .await
        .expect("read");
    assert!(own > 1, "the server's default is {own}");
    let seen = MessageId::generate();
    for batch in [vec![seen.clone()], vec![MessageId::generate(), seen]] {
        let mut tx = inbox.begin().await.expect("begin");
        let before: u64 = sqlx::query_scalar(lock_wait)
            .fetch_one(&mut *tx)
            .await
            .expect("read");
        assert_eq!(before, own, "the claim waits under the connection's own");
        let claimed = inbox.claim(&mut tx, &batch).await.expect("claim");
        assert!(claimed[0], "{claimed:?}");
        let after: u64 = sqlx::query_scalar(lock_wait)
            .fetch_one(&mut *tx)
            .await
            .expect("read");
        assert_eq!(after, 1, "the handler waits under its own bound");
        tx.commit().await.expect("commit");
    }
    pool.close().await;
    db.drop().await;
}

/// Two text IDs that share all but their last byte, at the longest length accepted, are two
/// keys, also on a server that is not in strict mode (where a value too long for its column is
/// cut short with a warning instead of refused). Longer IDs never reach the store: the core
/// refuses them, and the store's claim would too.
#[tokio::test]
async fn the_longest_text_ids_are_never_cut_to_one_key() {
    let (db, _) = db_with("inbox", KeyMode::Text).await;
    let lax = MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION sql_mode = ''")
                    .execute(&mut *conn)
                    .await
                    .map(|_| ())
            })
        })
        .connect_with(db.options().clone())
        .await
        .expect("pool");
    let inbox = MySqlInbox::new(lax.clone()).bind(&ConsumerBinding::new("c"));
    let prefix = "x".repeat(MessageId::MAX_LEN - 1);
    let ids = [
        MessageId::new(format!("{prefix}a")).expect("id"),
        MessageId::new(format!("{prefix}b")).expect("id"),
    ];
    assert!(
        MessageId::new(format!("{prefix}ab")).is_err(),
        "the core's limit"
    );
    let mut tx = inbox.begin().await.expect("begin");
    assert!(claim(&inbox, &mut tx, &ids[0]).await);
    assert!(
        claim(&inbox, &mut tx, &ids[1]).await,
        "a second ID sharing the first {} bytes is new",
        MessageId::MAX_LEN - 1
    );
    tx.commit().await.expect("commit");
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox.claim(&mut tx, &ids).await.expect("claim"),
        [false, false],
        "both were kept whole"
    );
    tx.rollback().await.expect("rollback");
    let longest: i64 = sqlx::query_scalar("SELECT max(length(message_id)) FROM inbox")
        .fetch_one(&db.pool)
        .await
        .expect("read");
    assert_eq!(longest, MessageId::MAX_LEN as i64);
    lax.close().await;
    db.drop().await;
}

/// Whether `id` was new, claimed in `tx` through `store` (bound).
async fn claim(store: &MySqlInbox, tx: &mut MySqlTx, id: &MessageId) -> bool {
    let claimed = store.claim(tx, std::slice::from_ref(id));
    claimed.await.expect("claim") == [true]
}
