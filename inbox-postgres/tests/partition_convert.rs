//! Converting a plain inbox table whose names a person chose: the conversion quotes what it
//! reads back from the catalog.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::time::Duration;

use inbox_core::{InboxStore, MessageId};
use inbox_postgres::testkit::TestDb;
use inbox_postgres::{Conversion, KeyMode, Partitions, PgInbox, TableName};
use sqlx::AssertSqlSafe;

async fn claim_all(inbox: &PgInbox, ids: &[MessageId]) -> Vec<bool> {
    let mut tx = inbox.begin().await.unwrap();
    let new = inbox.claim_many(&mut tx, "wallet", ids).await.unwrap();
    inbox.commit(tx).await.unwrap();
    new
}

/// A primary key renamed by hand to a name holding a double quote (legal in PostgreSQL) is
/// carried over, not pasted into the SQL as it stands.
#[tokio::test]
async fn a_primary_key_whose_name_holds_a_quote_is_converted() {
    let db = TestDb::new().await;
    let table = TableName::qualified(&db.schema, "conv_quoted").unwrap();
    let plain = PgInbox::new(db.pool.clone())
        .with_table(table.clone())
        .with_key_mode(KeyMode::Uuid);
    plain.migrate().await.unwrap();
    let pkey: String = sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'p'",
    )
    .bind(table.to_string())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {table} RENAME CONSTRAINT \"{pkey}\" TO \"pk \"\"of\"\" conv\""
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let ids: Vec<MessageId> = (0..10).map(|_| MessageId::generate()).collect();
    assert!(claim_all(&plain, &ids).await.iter().all(|new| *new));

    let partitioned = plain
        .clone()
        .partitioned(Partitions::every(Duration::from_secs(60)).ahead(2));
    let conversion = partitioned
        .migrate_to_partitioned(Duration::from_secs(300))
        .await;
    println!("conversion: {conversion:?}");
    assert!(
        matches!(conversion, Ok(Conversion::Converted { .. })),
        "{conversion:?}"
    );
    assert!(partitioned.is_partitioned().await.unwrap());
    assert!(
        claim_all(&partitioned, &ids).await.iter().all(|new| !*new),
        "every key is still deduplicated"
    );
    db.drop().await;
}
