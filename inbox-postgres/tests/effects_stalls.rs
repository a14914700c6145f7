//! An open done transaction does not stall a lease: `acquire` behind a row another transaction
//! holds (a zombie paused between its done mark and `COMMIT`) answers busy after the store's
//! lock timeout.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

mod common_effects;

use std::time::{Duration, Instant};

use common_effects::*;
use inbox_core::effect::{Acquired, LeaseStore};
use inbox_testkit::provider::ProviderMode;

/// How long an acquire may take before the test calls it hung: far above the lock timeout.
const HUNG: Duration = Duration::from_secs(10);

#[tokio::test]
async fn an_acquire_behind_an_open_done_transaction_is_busy_instead_of_waiting() {
    let env = Env::new(ProviderMode::Keys).await;
    let leases = &env.leases;
    let evt = id("evt-1");
    let short = Duration::from_millis(300);
    let Acquired::Leased(zombie) = leases.acquire(CONSUMER, &evt, short).await.unwrap() else {
        panic!("a new row is leased")
    };
    // The zombie marks done and pauses before COMMIT, past its lease.
    let mut done = leases.begin().await.unwrap();
    assert!(leases
        .complete(&mut done, CONSUMER, &evt, zombie.token)
        .await
        .unwrap());
    tokio::time::sleep(short + Duration::from_millis(100)).await;

    let started = Instant::now();
    let acquired = tokio::time::timeout(HUNG, leases.acquire(CONSUMER, &evt, LEASE)).await;
    let waited = started.elapsed();
    let Ok(acquired) = acquired else {
        panic!("acquire still waited on the open done transaction after {HUNG:?}")
    };
    let Acquired::Busy { retry_after } = acquired.unwrap() else {
        panic!("the row is not leasable while the done mark is open")
    };
    assert!(!retry_after.is_zero(), "a busy row comes back later");
    eprintln!("busy after {waited:?}, retry after {retry_after:?}");
    assert_eq!(env.row("evt-1").await, (1, 1, false), "nothing changed");

    // Once the zombie commits, the message is done: the busy answer took nothing from it.
    leases.commit(done).await.unwrap();
    assert_eq!(
        leases.acquire(CONSUMER, &evt, LEASE).await.unwrap(),
        Acquired::Done
    );

    // A row inserted by a transaction still open is busy too, not waited for.
    let consumer_id = env.db.inbox().consumer_id(CONSUMER).await.unwrap();
    let mut inserting = env.db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO inbox_effects (message_id, consumer_id, locked_until)
         VALUES ('evt-2', $1, now() + interval '1 hour')",
    )
    .bind(consumer_id)
    .execute(&mut *inserting)
    .await
    .unwrap();
    let quick = leases.clone().lock_timeout(Duration::from_millis(200));
    let acquired = tokio::time::timeout(HUNG, quick.acquire(CONSUMER, &id("evt-2"), LEASE))
        .await
        .expect("acquire waited on the uncommitted row")
        .unwrap();
    // No committed lease to wait out: it comes back after the lock timeout.
    assert_eq!(
        acquired,
        Acquired::Busy {
            retry_after: Duration::from_millis(200)
        }
    );
    inserting.rollback().await.unwrap();
    env.db.drop().await;
}
