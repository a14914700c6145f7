//! An open done transaction stalls neither a lease nor the effect consumer: `acquire` behind a
//! row another transaction holds (a zombie paused between its done mark and `COMMIT`) answers
//! busy after the store's lock timeout, and a `record` that hangs is cut off when its lease ends.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common_effects;

use inbox_core::Transaction as _;
use std::time::{Duration, Instant};

use common_effects::*;
use inbox_conformance::provider::ProviderMode;
use inbox_core::effect::{
    Acquired, Effect, EffectHandler, Landed, LeaseStore, OnUnknown, Release, Settled,
};
use inbox_core::{Consumer, HandlerError, Message, Recovery};
use inbox_postgres::PgTx;
use inbox_testkit::{eventually, fast_retry, MemoryBroker};

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
    done.commit().await.unwrap();
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

/// [`Notify`], whose `record` for message `stuck` first updates the row of table `hold` that
/// another session keeps locked.
struct RecordWaitsOnALock(Notify);

impl EffectHandler<PgTx> for RecordWaitsOnALock {
    fn on_unknown(&self) -> OnUnknown {
        self.0.on_unknown()
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        self.0.call(effect, message).await
    }

    async fn landed(&self, effect: &Effect, message: &Message) -> Result<Landed, HandlerError> {
        self.0.landed(effect, message).await
    }

    async fn record(
        &self,
        tx: &mut PgTx,
        effect: &Effect,
        settled: Settled,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if effect.id().as_str() == "stuck" {
            sqlx::query("UPDATE hold SET id = id WHERE id = 1")
                .execute(&mut **tx)
                .await?;
        }
        self.0.record(tx, effect, settled, message).await
    }
}

#[tokio::test]
async fn a_record_waiting_on_a_row_lock_is_cut_off_when_its_lease_ends() {
    let env = Env::new(ProviderMode::Keys).await;
    sqlx::raw_sql("CREATE TABLE hold (id int PRIMARY KEY); INSERT INTO hold VALUES (1)")
        .execute(&env.db.pool)
        .await
        .unwrap();
    let mut holder = env.db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM hold WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let broker = MemoryBroker::new();
    for evt in ["stuck", "a", "b"] {
        broker.publish(Some(evt), "notify");
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handler = RecordWaitsOnALock(Setup::Keys.handler(&env.provider));
    let consumer = Consumer::effects(CONSUMER, broker.source(), env.leases.clone(), handler)
        .lease(LEASE)
        .retry(fast_retry(5));
    let started = Instant::now();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    // `stuck` comes first; the messages after it are done while its record still waits.
    let watched = &env;
    let done = eventually(Duration::from_secs(15), || async move {
        !watched.sent("a").await.is_empty() && !watched.sent("b").await.is_empty()
    })
    .await;
    assert!(
        done,
        "a and b not done after {:?}: the consumer waits in stuck's record",
        started.elapsed()
    );
    eprintln!(
        "a and b done past the hung record in {:?}",
        started.elapsed()
    );
    assert!(env.sent("stuck").await.is_empty());
    assert!(!env.row("stuck").await.2, "stuck is not marked done");

    // Stopping does not wait for the lock either.
    let stopping = Instant::now();
    stop.send(()).unwrap();
    tokio::time::timeout(HUNG, run)
        .await
        .expect("the consumer did not stop while a record waited on the lock")
        .unwrap()
        .unwrap();
    eprintln!("stopped in {:?}", stopping.elapsed());
    assert!(env.sent("stuck").await.is_empty());
    assert!(!env.row("stuck").await.2, "stuck is not marked done");
    holder.rollback().await.unwrap();
    env.db.drop().await;
}

/// `release` and `complete` behind a lease row another session keeps locked (a zombie's done
/// transaction paused before `COMMIT`, an operator's open `SELECT … FOR UPDATE`) end with a
/// retryable error after the lease store's lock timeout, instead of holding the consumer until
/// that session ends; once the row is free they work.
#[tokio::test]
async fn release_and_complete_behind_a_locked_row_fail_retryably_instead_of_waiting() {
    let env = Env::new(ProviderMode::Keys).await;
    let leases = &env.leases;
    let evt = id("evt-1");
    let Acquired::Leased(lease) = leases.acquire(CONSUMER, &evt, LEASE).await.unwrap() else {
        panic!("a new row is leased")
    };
    let mut holder = env.db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM inbox_effects WHERE message_id = 'evt-1' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let release = Release {
        not_applied: true,
        dead_lettered: false,
    };

    let started = Instant::now();
    let released =
        tokio::time::timeout(HUNG, leases.release(CONSUMER, &evt, lease.token, release)).await;
    let Ok(released) = released else {
        panic!("release still waited on the locked row after {HUNG:?}")
    };
    let err = released.expect_err("the row stays locked");
    assert_eq!(err.recovery(), Recovery::Retry, "{err}");
    eprintln!("release gave up after {:?}: {err}", started.elapsed());

    let mut done = leases.begin().await.unwrap();
    let started = Instant::now();
    let completed = tokio::time::timeout(
        HUNG,
        leases.complete(&mut done, CONSUMER, &evt, lease.token),
    )
    .await;
    let Ok(completed) = completed else {
        panic!("complete still waited on the locked row after {HUNG:?}")
    };
    let err = completed.expect_err("the row stays locked");
    assert_eq!(err.recovery(), Recovery::Retry, "{err}");
    eprintln!("complete gave up after {:?}: {err}", started.elapsed());
    done.rollback().await.unwrap();
    assert_eq!(env.row("evt-1").await, (1, 1, false), "nothing changed");

    holder.rollback().await.unwrap();
    assert!(leases
        .release(CONSUMER, &evt, lease.token, release)
        .await
        .unwrap());
    let Acquired::Leased(next) = leases.acquire(CONSUMER, &evt, LEASE).await.unwrap() else {
        panic!("a released row is leased again")
    };
    let mut done = leases.begin().await.unwrap();
    assert!(leases
        .complete(&mut done, CONSUMER, &evt, next.token)
        .await
        .unwrap());
    let after: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *done)
        .await
        .unwrap();
    assert_eq!(
        after, "0",
        "the handler's record keeps the transaction's lock timeout"
    );
    done.commit().await.unwrap();
    assert_eq!(env.row("evt-1").await, (2, 2, true));
    env.db.drop().await;
}
