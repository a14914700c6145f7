//! Converting a plain inbox table to the partitioned layout in place: every key stays
//! deduplicated, and names a person chose (read back from the catalog) are quoted.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_core::Transaction as _;
use std::time::Duration;

use inbox_conformance::TestDb;
use inbox_core::{ConsumerBinding, InboxStore, MessageId};
use inbox_postgres::{
    Conversion, KeyMode, PartitionRange, Partitions, PgInbox, PurgeReport, TableName,
};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use crate::common_partitions;
use common_partitions::*;

async fn claim_all(inbox: &PgInbox, ids: &[MessageId]) -> Vec<bool> {
    let inbox = inbox.bind(&ConsumerBinding::new("wallet"));
    let mut tx = inbox.begin().await.unwrap();
    let new = inbox.claim(&mut tx, ids).await.unwrap();
    tx.commit().await.unwrap();
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
