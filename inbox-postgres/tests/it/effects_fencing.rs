//! Fencing tokens of `PgLeases` against a real PostgreSQL: tokens grow with every lease, the
//! database refuses a stale token's done mark and release, and a zombie consumer paused past its
//! lease cannot mark done while the newer lease is mid-call.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common_effects;

use inbox_core::Transaction as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common_effects::*;
use inbox_conformance::provider::{Behaviour, ProviderMode};
use inbox_core::effect::{Acquired, Attempt, Lease, LeaseStore, Release};
use inbox_core::{Consumer, InvalidId, MessageId, StoreError};
use inbox_postgres::{PgLeases, PgTx};
use inbox_testkit::fast_retry;
use inbox_testkit::MemoryBroker;

#[tokio::test]
async fn tokens_grow_with_every_lease_and_the_database_refuses_a_stale_one() {
    let env = Env::new(ProviderMode::Keys).await;
    let leases = &env.leases;
    let evt = id("evt-1");
    let short = Duration::from_secs(1);

    let Acquired::Leased(zombie) = leases.acquire(CONSUMER, &evt, short).await.unwrap() else {
        panic!("a new row is leased")
    };
    assert_eq!((zombie.token, zombie.attempt), (1, Attempt::First));
    let Acquired::Busy { retry_after } = leases.acquire(CONSUMER, &evt, short).await.unwrap()
    else {
        panic!("a live lease is busy")
    };
    assert!(retry_after <= short, "{retry_after:?}");

    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let Acquired::Leased(current) = leases.acquire(CONSUMER, &evt, LEASE).await.unwrap() else {
        panic!("an expired lease is taken over")
    };
    assert_eq!(
        (current.token, current.attempt, current.attempts),
        (2, Attempt::AfterExpiry, 2)
    );

    // The zombie (token 1) writes through the lease store's transaction and tries to finish.
    let mut tx = leases.begin().await.unwrap();
    sqlx::query("INSERT INTO sent (message_id, token, settled) VALUES ('evt-1', 1, 'called')")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(!leases.complete(&mut tx, CONSUMER, &evt, 1).await.unwrap());
    assert!(
        tx.commit().await.is_err(),
        "the database aborted the zombie's transaction: nothing it wrote can commit"
    );
    assert_eq!(env.sent_total().await, 0, "the zombie's write rolled back");
    assert_eq!(
        env.row("evt-1").await,
        (2, 2, false),
        "still the newer lease's"
    );
    let stale = Release {
        not_applied: true,
        dead_lettered: true,
    };
    assert!(!leases.release(CONSUMER, &evt, 1, stale).await.unwrap());
    assert_eq!(env.row("evt-1").await, (2, 2, false));

    // The current holder finishes; after that, nobody can.
    let mut tx = leases.begin().await.unwrap();
    sqlx::query("INSERT INTO sent (message_id, token, settled) VALUES ('evt-1', 2, 'called')")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(leases.complete(&mut tx, CONSUMER, &evt, 2).await.unwrap());
    tx.commit().await.unwrap();
    assert_eq!(
        env.sent("evt-1").await,
        vec![(2, "called".to_owned(), None)]
    );
    assert_eq!(
        leases.acquire(CONSUMER, &evt, LEASE).await.unwrap(),
        Acquired::Done
    );
    let mut tx = leases.begin().await.unwrap();
    assert!(!leases.complete(&mut tx, CONSUMER, &evt, 2).await.unwrap());
    tx.rollback().await.unwrap();

    // A released lease can be taken at once, and says what the release knew.
    let evt = id("evt-2");
    let lease = |acquired: Acquired| match acquired {
        Acquired::Leased(lease) => lease,
        other => panic!("not leased: {other:?}"),
    };
    let first = lease(leases.acquire(CONSUMER, &evt, LEASE).await.unwrap());
    let release = |not_applied, dead_lettered| Release {
        not_applied,
        dead_lettered,
    };
    assert!(leases
        .release(CONSUMER, &evt, first.token, release(true, false))
        .await
        .unwrap());
    let second = lease(leases.acquire(CONSUMER, &evt, LEASE).await.unwrap());
    assert_eq!(
        (second.token, second.attempt),
        (2, Attempt::AfterNotApplied)
    );
    leases
        .release(CONSUMER, &evt, second.token, release(false, true))
        .await
        .unwrap();
    let third: Lease = lease(leases.acquire(CONSUMER, &evt, LEASE).await.unwrap());
    assert_eq!(
        (third.token, third.attempt, third.attempts),
        (3, Attempt::AfterExpiry, 1),
        "unknown outcome; dead-lettered, so the count started again"
    );
    env.db.drop().await;
}

/// Pauses the first done transaction, as a process stalled (a GC pause, a frozen VM) right
/// after its call returned.
#[derive(Debug, Clone)]
struct PausedBeforeDone {
    inner: PgLeases,
    pause: Duration,
    paused: Arc<AtomicBool>,
}

impl LeaseStore for PausedBeforeDone {
    type Tx = PgTx;

    async fn acquire(
        &self,
        consumer: &str,
        id: &MessageId,
        lease: Duration,
    ) -> Result<Acquired, StoreError> {
        self.inner.acquire(consumer, id, lease).await
    }
    async fn release(
        &self,
        consumer: &str,
        id: &MessageId,
        token: u64,
        release: Release,
    ) -> Result<bool, StoreError> {
        self.inner.release(consumer, id, token, release).await
    }
    async fn begin(&self) -> Result<PgTx, StoreError> {
        if !self.paused.swap(true, Ordering::SeqCst) {
            tokio::time::sleep(self.pause).await;
        }
        self.inner.begin().await
    }
    async fn complete(
        &self,
        tx: &mut PgTx,
        consumer: &str,
        id: &MessageId,
        token: u64,
    ) -> Result<bool, StoreError> {
        self.inner.complete(tx, consumer, id, token).await
    }
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        self.inner.check_id(id)
    }
}

#[tokio::test]
async fn a_zombie_paused_past_its_lease_cannot_mark_done() {
    // The zombie calls, then stalls for 2.8 s on a 2 s lease. The other consumer takes the
    // lease at about 2.05 s and its call (answered from the first result, since the key was
    // applied) takes 1.4 s, so the zombie wakes while the newer lease is mid-call and the row
    // is not done yet: only the token can keep the zombie out.
    let lease = Duration::from_secs(2);
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    broker.publish(Some("evt-1"), "notify"); // the producer sent it twice
    env.provider.next_call(&key("evt-1"), Behaviour::Normal);
    env.provider
        .next_call(&key("evt-1"), Behaviour::Slow(Duration::from_millis(1400)));
    let handler = Setup::Keys.handler(&env.provider);
    let zombie = Consumer::effects(
        CONSUMER,
        broker.source(),
        PausedBeforeDone {
            inner: env.leases.clone(),
            pause: Duration::from_millis(2800),
            paused: Arc::default(),
        },
        handler.clone(),
    )
    .lease(lease)
    .retry(fast_retry(5));
    let zombie_stats = zombie.stats();
    let zombie = tokio::spawn(zombie.run_until(drained(&broker)));
    // The zombie has called; the other consumer takes the second copy.
    assert!(
        env.provider
            .wait_for_calls(&key("evt-1"), 1, PATIENCE)
            .await
    );
    let other = patiently(
        env.consumer(broker.source(), handler)
            .lease(lease)
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();
    patiently(zombie).await.unwrap().unwrap();

    assert_eq!(
        env.provider.effects(&key("evt-1")),
        1,
        "the takeover's call used the same key"
    );
    assert_eq!(
        zombie_stats.snapshot().fenced,
        1,
        "the zombie's done mark was refused"
    );
    assert_eq!(other.applied, 1);
    assert_eq!(
        env.sent("evt-1").await,
        vec![(2, "called".to_owned(), Some(2))],
        "only the newer lease's writes committed"
    );
    assert_eq!(
        env.row("evt-1").await,
        (2, 2, true),
        "done by the newer lease"
    );
    assert_eq!(
        broker.pending(),
        0,
        "the zombie's copy was handed back, then skipped as done"
    );
    assert!(broker.dead_letters().is_empty());
    env.db.drop().await;
}
