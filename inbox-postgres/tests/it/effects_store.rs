//! The `PgLeases` store itself against a real PostgreSQL: purging old done rows, UUID and hashed
//! key modes leasing and fencing like text (and a mismatched table refused at migrate), and the
//! effect consumer and its future being `Send`.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common_effects;

use inbox_core::Transaction as _;
use std::time::Duration;

use common_effects::*;
use inbox_conformance::provider::{ProviderClient, ProviderMode};
use inbox_conformance::TestDb;
use inbox_core::effect::{Acquired, Lease, LeaseStore, OnUnknown};
use inbox_core::{Consumer, MessageId, StatsSnapshot};
use inbox_postgres::{Error as PgError, KeyMode, PgInbox, PgLeases, TableName};
use inbox_testkit::MemoryBroker;

#[tokio::test]
async fn purge_deletes_old_done_rows_and_keeps_unsettled_ones() {
    let env = Env::new(ProviderMode::Keys).await;
    let leases = &env.leases;
    for evt in ["old-done", "new-done", "old-processing"] {
        let Acquired::Leased(lease) = leases.acquire(CONSUMER, &id(evt), LEASE).await.unwrap()
        else {
            panic!("leased")
        };
        if evt.ends_with("done") {
            let mut tx = leases.begin().await.unwrap();
            assert!(leases
                .complete(&mut tx, CONSUMER, &id(evt), lease.token)
                .await
                .unwrap());
            tx.commit().await.unwrap();
        }
    }
    sqlx::query(
        "UPDATE inbox_effects SET done_at = done_at - interval '3 days',
             first_leased_at = first_leased_at - interval '3 days'
         WHERE message_id LIKE 'old-%'",
    )
    .execute(&env.db.pool)
    .await
    .unwrap();

    let deleted = leases
        .purge(Duration::from_secs(2 * 24 * 3600), 1)
        .await
        .unwrap();

    assert_eq!(deleted, 1);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM inbox_effects ORDER BY message_id")
            .fetch_all(&env.db.pool)
            .await
            .unwrap();
    assert_eq!(left, ["new-done", "old-processing"]);
    env.db.drop().await;
}

#[tokio::test]
async fn uuid_and_hashed_keys_lease_and_fence_like_text() {
    let db = TestDb::new().await;
    let table = |name: &str| TableName::qualified(&db.schema, name).unwrap();
    let uuids = PgLeases::new(db.inbox_named("inbox_u", KeyMode::Uuid)).unwrap();
    let hashed = PgLeases::new(db.inbox_named("inbox_h", KeyMode::Hashed)).unwrap();
    uuids.migrate().await.unwrap();
    hashed.migrate().await.unwrap();

    assert!(uuids.check_id(&id("evt-1")).is_err(), "not a UUID");
    let evt = MessageId::generate();
    for leases in [&uuids, &hashed] {
        let Acquired::Leased(lease) = leases.acquire(CONSUMER, &evt, LEASE).await.unwrap() else {
            panic!("leased")
        };
        assert!(matches!(
            leases.acquire(CONSUMER, &evt, LEASE).await.unwrap(),
            Acquired::Busy { .. }
        ));
        let mut tx = leases.begin().await.unwrap();
        assert!(!leases
            .complete(&mut tx, CONSUMER, &evt, lease.token + 1)
            .await
            .unwrap());
        tx.rollback().await.unwrap();
        let mut tx = leases.begin().await.unwrap();
        assert!(leases
            .complete(&mut tx, CONSUMER, &evt, lease.token)
            .await
            .unwrap());
        tx.commit().await.unwrap();
        assert_eq!(
            leases.acquire(CONSUMER, &evt, LEASE).await.unwrap(),
            Acquired::Done
        );
        // Another consumer's row for the same message is its own.
        assert!(matches!(
            leases.acquire("biller", &evt, LEASE).await.unwrap(),
            Acquired::Leased(Lease { token: 1, .. })
        ));
    }

    // A text store pointed at the uuid table is refused at migrate, not at the first message.
    let wrong = PgLeases::with_table(
        PgInbox::new(db.pool.clone()).with_table(table("inbox_t")),
        table("inbox_u_effects"),
    );
    assert!(matches!(
        wrong.migrate().await,
        Err(PgError::KeyModeMismatch { .. })
    ));
    db.drop().await;
}

#[tokio::test]
async fn the_effect_consumer_and_its_future_are_send() {
    fn send<T: Send>(_: &T) {}
    fn send_sync<T: Send + Sync>() {}
    send_sync::<PgLeases>();
    send_sync::<StatsSnapshot>();
    let broker = MemoryBroker::new();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://unused@127.0.0.1/unused")
        .unwrap();
    let leases = PgLeases::new(PgInbox::new(pool)).unwrap();
    let provider_client = ProviderClient::new(([127, 0, 0, 1], 9).into());
    let handler = Notify {
        client: provider_client,
        lookup: false,
        on_unknown: OnUnknown::Retry,
    };
    let consumer = Consumer::effects(CONSUMER, broker.source(), leases, handler);
    send(&consumer);
    let run = consumer.run_until(async {});
    send(&run);
}
