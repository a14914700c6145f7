//! The outbox table of a [`TestDb`], for relay tests.

use inbox_postgres::Outbox;

use crate::wallet::CreditEvent;
use crate::TestDb;

/// The outbox on `db`'s schema, its table created.
///
/// # Panics
/// When the table cannot be created.
pub async fn migrated(db: &TestDb) -> Outbox {
    let outbox = Outbox::new(db.pool.clone());
    outbox
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("cannot create the outbox table: {e}"));
    outbox
}

/// Rows of `db`'s outbox not yet sent.
///
/// # Panics
/// When the rows cannot be counted.
pub async fn unsent(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap_or_else(|e| panic!("cannot count the unsent outbox rows: {e}"))
}

/// Writes `n` wallet credits (to accounts 1 to 7, amounts 1 to `n`) to `outbox` for
/// `destination`, in transactions of 100; returns the sum of the amounts.
///
/// # Panics
/// When a row cannot be written.
pub async fn write_credits(db: &TestDb, outbox: &Outbox, destination: &str, n: i64) -> i64 {
    let written = async {
        let mut total = 0;
        for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
            let mut tx = db.pool.begin().await?;
            for i in chunk {
                let event = CreditEvent::new(1 + i % 7, i + 1);
                total += event.amount;
                outbox.write(&mut tx, destination, event.to_json()).await?;
            }
            tx.commit().await?;
        }
        Ok::<_, inbox_core::BoxError>(total)
    };
    written
        .await
        .unwrap_or_else(|e| panic!("cannot write the outbox rows: {e}"))
}
