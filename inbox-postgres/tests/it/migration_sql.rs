//! `PgInbox::migration_sql` applied the way a migration tool applies it, against a real
//! PostgreSQL: it makes what `migrate` makes, the inbox claims on it, and `migrate` afterwards
//! has nothing left to do.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::Transaction as _;
use inbox_core::{Consumer, ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::{KeyMode, Partitions, PgInbox, TableName};
use inbox_testkit::MemoryBroker;
use sqlx::AssertSqlSafe;

const MODES: [KeyMode; 3] = [KeyMode::Text, KeyMode::Uuid, KeyMode::Hashed];

/// An inbox in table `owned_inbox` of `db`'s schema, configured and not migrated.
fn owned_inbox(db: &TestDb, mode: KeyMode, partitioned: bool) -> PgInbox {
    let table = TableName::qualified(&db.schema, "owned_inbox").unwrap();
    let inbox = PgInbox::new(db.pool.clone())
        .with_table(table)
        .with_key_mode(mode);
    if partitioned {
        inbox.partitioned(Partitions::default())
    } else {
        inbox
    }
}

/// What the catalog holds for `owned_inbox` and its siblings in `db`'s schema (the range
/// partitions left out, and listed on their own): relations with their kind, index definitions
/// and partition bounds, columns with type, nullability, default and identity, and
/// constraints. The schema's name reads `S`, so two schemas compare.
async fn shape(db: &TestDb) -> (Vec<String>, Vec<String>) {
    let rows: Vec<(String, bool)> = sqlx::query_as(
        r"WITH rel AS (
            SELECT c.oid, c.relname, c.relkind, c.relpartbound,
                   c.relname ~ '^owned_inbox_p[0-9]{8}_[0-9]{4}' AS range_partition
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = current_schema() AND c.relname LIKE 'owned\_inbox%')
        SELECT format('%s %s %s %s', relname, relkind, coalesce(pg_get_indexdef(oid), ''),
                      coalesce(pg_get_expr(relpartbound, oid), '')), range_partition
        FROM rel
        UNION ALL
        SELECT format('%s.%s %s notnull=%s default=%s identity=%s', relname, a.attname,
                      format_type(a.atttypid, a.atttypmod), a.attnotnull,
                      coalesce(pg_get_expr(d.adbin, d.adrelid), ''), a.attidentity),
               range_partition
        FROM rel JOIN pg_attribute a ON a.attrelid = rel.oid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attnum > 0 AND NOT a.attisdropped
        UNION ALL
        SELECT format('%s %s %s', relname, con.conname, pg_get_constraintdef(con.oid)),
               range_partition
        FROM rel JOIN pg_constraint con ON con.conrelid = rel.oid
        ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let schema = format!("{}.", db.schema);
    let (ranges, rest): (Vec<_>, Vec<_>) = rows.into_iter().partition(|(_, range)| *range);
    let text = |rows: Vec<(String, bool)>| -> Vec<String> {
        rows.into_iter()
            .map(|(row, _)| row.replace(&schema, "S."))
            .collect()
    };
    (text(rest), text(ranges))
}

/// Claims `id` for `consumer` in a transaction of its own; whether it was new.
async fn claim(inbox: &PgInbox, consumer: &str, id: &MessageId) -> bool {
    let inbox = inbox.bind(&ConsumerBinding::new(consumer));
    let mut tx = inbox.begin().await.unwrap();
    let claimed = inbox
        .claim(&mut tx, std::slice::from_ref(id))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    claimed == [true]
}

async fn printed_sql_is_a_migration(mode: KeyMode, partitioned: bool) {
    let case = format!("{mode:?} keys, partitioned: {partitioned}");
    let by_sql = TestDb::new().await;
    let by_migrate = TestDb::new().await;
    let sql = owned_inbox(&by_sql, mode, partitioned).migration_sql();
    sqlx::raw_sql(AssertSqlSafe(sql.as_str()))
        .execute(&by_sql.pool)
        .await
        .unwrap_or_else(|e| panic!("{case}: the printed SQL fails: {e}\n{sql}"));
    owned_inbox(&by_migrate, mode, partitioned)
        .migrate()
        .await
        .unwrap();
    let (made, ranges) = shape(&by_sql).await;
    let (migrated, migrated_ranges) = shape(&by_migrate).await;
    assert!(
        made.iter().any(|row| row.starts_with("owned_inbox ")),
        "{case}: {made:#?}"
    );
    assert_eq!(
        made, migrated,
        "{case}: the SQL made other tables than migrate:\n{sql}"
    );
    assert!(ranges.is_empty(), "{case}: {ranges:#?}");
    // Range partitions follow the clock: `migrate` adds them, the SQL leaves them out.
    assert_eq!(!migrated_ranges.is_empty(), partitioned, "{case}");

    // The application's inbox, not migrated: it claims on the table as it is.
    let inbox = owned_inbox(&by_sql, mode, partitioned);
    let id = MessageId::generate();
    assert!(claim(&inbox, "billing", &id).await, "{case}: first claim");
    assert!(!claim(&inbox, "billing", &id).await, "{case}: second claim");

    // `migrate` afterwards succeeds and has nothing to create but the range partitions.
    inbox.migrate().await.unwrap();
    let (after, ranges_after) = shape(&by_sql).await;
    assert_eq!(
        after, made,
        "{case}: migrate changed the tables the SQL made"
    );
    assert_eq!(!ranges_after.is_empty(), partitioned, "{case}");
    assert!(
        !claim(&inbox, "billing", &id).await,
        "{case}: the claim survived migrate"
    );
    assert!(
        claim(&inbox, "billing", &MessageId::generate()).await,
        "{case}"
    );

    if !partitioned {
        // Every statement says IF NOT EXISTS: running the SQL again changes nothing.
        sqlx::raw_sql(AssertSqlSafe(sql.as_str()))
            .execute(&by_sql.pool)
            .await
            .unwrap();
        assert_eq!(shape(&by_sql).await.0, made, "{case}");
    }
    by_sql.drop().await;
    by_migrate.drop().await;
}

#[tokio::test]
async fn the_plain_layout_sql_makes_what_migrate_makes() {
    for mode in MODES {
        printed_sql_is_a_migration(mode, false).await;
    }
}

#[tokio::test]
async fn the_partitioned_layout_sql_makes_what_migrate_makes_but_the_ranges() {
    for mode in MODES {
        printed_sql_is_a_migration(mode, true).await;
    }
}

#[tokio::test]
async fn the_sql_names_the_table_key_mode_and_layout() {
    let db = TestDb::new().await;
    let plain = owned_inbox(&db, KeyMode::Uuid, false).migration_sql();
    let table = format!("\"{}\".\"owned_inbox\"", db.schema);
    assert!(plain.starts_with("-- "), "{plain}");
    for expected in [
        format!(
            "CREATE TABLE IF NOT EXISTS \"{}\".\"owned_inbox_consumers\" (",
            db.schema
        ),
        format!("CREATE TABLE IF NOT EXISTS {table} ("),
        "message_id uuid NOT NULL".to_owned(),
        "PRIMARY KEY (consumer_id, message_id)".to_owned(),
        format!("CREATE INDEX IF NOT EXISTS \"owned_inbox_processed\" ON {table} USING brin"),
    ] {
        assert!(plain.contains(&expected), "`{expected}` missing:\n{plain}");
    }
    let hashed = owned_inbox(&db, KeyMode::Hashed, true).migration_sql();
    for expected in [
        "PRIMARY KEY (message_id))\n    PARTITION BY RANGE (message_id);".to_owned(),
        format!("PARTITION OF {table} DEFAULT;"),
    ] {
        assert!(
            hashed.contains(&expected),
            "`{expected}` missing:\n{hashed}"
        );
    }
    db.drop().await;
}

/// Hashed keys on the partitioned layout start with the ID's time, so they differ from the plain
/// layout's: a store must key by the table it finds, not by its configuration, or a deploy that
/// adds (or drops) `.partitioned()` before anyone runs `migrate` applies every redelivery again.
#[tokio::test]
async fn hashed_keys_follow_the_table_layout_not_the_configuration() {
    for table_partitioned in [false, true] {
        let case = format!("a table made partitioned: {table_partitioned}");
        let db = TestDb::new().await;
        let sql = owned_inbox(&db, KeyMode::Hashed, table_partitioned).migration_sql();
        sqlx::raw_sql(AssertSqlSafe(sql.as_str()))
            .execute(&db.pool)
            .await
            .unwrap();
        let id = MessageId::generate();
        let credit = CreditEvent::new(1, 5).to_json();

        // The release before the deploy, configured as the table is; neither migrates.
        let broker = MemoryBroker::new();
        broker.publish(Some(id.as_str()), credit.clone());
        let before = Consumer::new(
            "wallet",
            broker.source(),
            owned_inbox(&db, KeyMode::Hashed, table_partitioned),
            Credit::new(db.clone()),
        )
        .run_until_idle()
        .await
        .unwrap();
        assert_eq!(before.applied, 1, "{case}: {before:?}");

        // The release after it, configured the other way, gets the message redelivered.
        broker.publish(Some(id.as_str()), credit);
        let after = Consumer::new(
            "wallet",
            broker.source(),
            owned_inbox(&db, KeyMode::Hashed, !table_partitioned),
            Credit::new(db.clone()),
        )
        .run_until_idle()
        .await
        .unwrap();

        let summary = wallet::summary(&db).await.unwrap();
        assert_eq!(
            (summary.ledger_rows, summary.distinct_events),
            (1, 1),
            "{case}: the redelivery was applied again: {after:?}"
        );
        assert_eq!(after.skipped_duplicates, 1, "{case}: {after:?}");
        db.drop().await;
    }
}
