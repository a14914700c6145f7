//! Key modes and names, against a real PostgreSQL (odd IDs are in the store suite,
//! `tests/it/store_suite.rs`).

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::Transaction as _;
use inbox_core::{Consumer, ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::{Error, KeyMode, PgInbox, TableName};
use inbox_testkit::MemoryBroker;

async fn inbox(db: &TestDb, table: &str, mode: KeyMode) -> PgInbox {
    let inbox = db.inbox_named(table, mode);
    inbox.migrate().await.unwrap();
    inbox
}

#[tokio::test]
async fn uuid_keys_refuse_ids_that_are_not_uuids() {
    let db = TestDb::new().await;
    let store = inbox(&db, "inbox_uuid", KeyMode::Uuid).await;
    let broker = MemoryBroker::new();
    let id = MessageId::generate();
    broker.publish(Some(id.as_str()), CreditEvent::new(1, 5).to_json());
    // The same UUID in capitals is the same key.
    broker.publish(
        Some(&id.as_str().to_uppercase()),
        CreditEvent::new(1, 5).to_json(),
    );
    broker.publish(Some("evt-1"), CreditEvent::new(1, 5).to_json());

    let stats = Consumer::new("wallet", broker.source(), store, Credit::new(db.clone()))
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(
        (stats.applied, stats.skipped_duplicates, stats.dead_lettered),
        (1, 1, 1)
    );
    let reason = &broker.dead_letters()[0].1;
    assert!(reason.contains("`evt-1` is not a UUID"), "{reason}");
    assert_eq!(wallet::balance(&db, 1).await, 5);
    db.drop().await;
}

#[tokio::test]
async fn spellings_of_one_uuid_in_one_batch_are_one_key() {
    let db = TestDb::new().await;
    let store = inbox(&db, "inbox_uuid", KeyMode::Uuid).await;
    let broker = MemoryBroker::new();
    let id = MessageId::generate();
    let lower = id.as_str().to_lowercase();
    for spelling in [
        lower.clone(),
        lower.to_uppercase(),
        format!("{{{lower}}}"),
        lower.replace('-', ""),
    ] {
        broker.publish(Some(&spelling), CreditEvent::new(1, 5).to_json());
    }

    let stats = Consumer::new("wallet", broker.source(), store, Credit::new(db.clone()))
        .batch_size(4)
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (1, 3),
        "{stats:?}"
    );
    assert_eq!(wallet::balance(&db, 1).await, 5);
    db.drop().await;
}

#[tokio::test]
async fn hashed_keys_deduplicate_any_id_per_consumer_in_16_bytes() {
    let db = TestDb::new().await;
    let store = inbox(&db, "inbox_hashed", KeyMode::Hashed).await;
    let broker = MemoryBroker::new();
    for id in ["order-42/credit", "order-42/credit", "order-43/credit"] {
        broker.publish(Some(id), CreditEvent::new(1, 10).to_json());
    }
    let stats = Consumer::new(
        "wallet",
        broker.source(),
        store.clone(),
        Credit::new(db.clone()),
    )
    .batch_size(3)
    .run_until_idle()
    .await
    .unwrap();
    assert_eq!((stats.applied, stats.skipped_duplicates), (2, 1));

    // Another consumer name keys the same ID differently, so it applies it too.
    let (wallet, audit) = (bound(&store, "wallet").await, bound(&store, "audit").await);
    let mut tx = wallet.begin().await.unwrap();
    let id = MessageId::new("order-42/credit").unwrap();
    assert!(!claim(&wallet, &mut tx, &id).await);
    assert!(claim(&audit, &mut tx, &id).await);
    tx.rollback().await.unwrap();

    let key_bytes: i32 =
        sqlx::query_scalar("SELECT max(pg_column_size(message_id)) FROM inbox_hashed")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(key_bytes, 16);
    db.drop().await;
}

#[tokio::test]
async fn names_that_are_not_plain_identifiers_are_refused_and_key_modes_checked() {
    let err = TableName::qualified("public", "inbox; DROP TABLE accounts").unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidIdentifier { what: "table", .. }
    ));
    assert!(TableName::qualified("bad schema", "inbox").is_err());

    let db = TestDb::new().await;
    // The test schema's `inbox` table keeps text; opening it as uuid is refused, not mixed up.
    let wrong = PgInbox::new(db.pool.clone())
        .with_table(TableName::qualified(&db.schema, "inbox").unwrap())
        .with_key_mode(KeyMode::Uuid);
    let err = wrong.migrate().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("keeps message IDs as `text`, but the store is configured for Uuid"),
        "{err}"
    );
    // Migrating twice is harmless.
    db.inbox().migrate().await.unwrap();
    db.drop().await;
}

#[tokio::test]
async fn table_names_too_long_for_their_derived_names_are_refused_at_construction() {
    // `<table>_consumers` and `<table>_processed` add 10 bytes: PostgreSQL would cut a longer
    // name to 63 bytes without an error, and the cut name can be another table's.
    let longest = format!("i{}", "x".repeat(52));
    let too_long = format!("{longest}y");
    let err = TableName::new(&too_long).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "table name `{too_long}` is too long for the names derived from it: \
             `{too_long}_consumers` would be 64 bytes, over PostgreSQL's limit of 63 for \
             identifiers (it would be cut short silently); use a table name of at most 53 bytes"
        )
    );
    assert!(TableName::qualified("public", &too_long).is_err());
    assert!(TableName::new(&"t".repeat(63)).is_err());

    // At 53 bytes every derived name is whole, and the inbox and its outbox work.
    let db = TestDb::new().await;
    let table = TableName::qualified(&db.schema, &longest).unwrap();
    let store = PgInbox::new(db.pool.clone())
        .with_table(table.clone())
        .with_key_mode(KeyMode::Hashed);
    store.migrate().await.unwrap();
    let id = MessageId::generate();
    let partitioned_name = format!("p{}", "x".repeat(52));
    let partitioned = PgInbox::new(db.pool.clone())
        .with_table(TableName::qualified(&db.schema, &partitioned_name).unwrap())
        .partitioned(inbox_postgres::Partitions::default());
    partitioned.migrate().await.unwrap();
    let partitioned = bound(&partitioned, "audit").await;
    let mut tx = partitioned.begin().await.unwrap();
    assert!(claim(&partitioned, &mut tx, &id).await);
    tx.commit().await.unwrap();
    let outbox_name = format!("o{}", "x".repeat(52));
    let outbox = inbox_postgres::Outbox::new(db.pool.clone())
        .with_table(TableName::qualified(&db.schema, &outbox_name).unwrap());
    outbox.migrate().await.unwrap();
    let store = bound(&store, "audit").await;
    for new in [true, false] {
        let mut tx = store.begin().await.unwrap();
        assert_eq!(claim(&store, &mut tx, &id).await, new);
        tx.commit().await.unwrap();
    }
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND relname LIKE '_xxxx%' ORDER BY 1",
    )
    .bind(&db.schema)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for name in [
        format!("{longest}_consumers"),
        format!("{longest}_processed"),
        format!("{partitioned_name}_consumers"),
        format!("{partitioned_name}_processed"),
        format!("{outbox_name}_unsent"),
    ] {
        assert!(names.contains(&name), "{name}: {names:?}");
    }
    // Partition names take a shortened prefix, the default partition's too.
    let default = names
        .iter()
        .find(|n| n.starts_with('p') && n.ends_with("_default"));
    assert!(default.is_some_and(|n| n.len() <= 63), "{names:?}");
    // The lease table `<inbox>_effects` is a table name too: 61 bytes leave no room.
    let err = inbox_postgres::PgLeases::new(store).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("`{longest}_effects_consumers` would be 71 bytes")),
        "{err}"
    );
    db.drop().await;
}

/// `store` bound to `consumer`, its name's id read as a consumer's first transaction reads it.
async fn bound(store: &PgInbox, consumer: &str) -> PgInbox {
    let bound = store.bind(&ConsumerBinding::new(consumer));
    bound.begin().await.unwrap().rollback().await.unwrap();
    bound
}

/// Whether `id` was new, claimed in `tx` through `store`.
async fn claim(store: &PgInbox, tx: &mut inbox_postgres::PgTx, id: &MessageId) -> bool {
    store.claim(tx, std::slice::from_ref(id)).await.unwrap() == [true]
}
