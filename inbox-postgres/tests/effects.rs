//! Side effects outside the database, with the effect consumer and `PgLeases` against a real
//! PostgreSQL, a real HTTP provider on loopback (`inbox_core::testkit::provider`) and, for the
//! call that outlives its lease, a real Redis stream. Effects are counted at the provider: with
//! idempotency keys or a status lookup there is no duplicate and no loss at any crash point;
//! with neither, the handler's choice shows as a duplicate (retry) or a missing effect (skip).

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_core::effect::{
    not_applied, Acquired, Attempt, Effect, EffectConsumer, EffectHandler, EffectStatsSnapshot,
    Landed, Lease, LeaseStore, OnUnknown, Release, Settled,
};
use inbox_core::testkit::provider::{
    Behaviour, CallStatus, ProviderClient, ProviderMode, TestProvider,
};
use inbox_core::testkit::{crash_at_ids, MemoryAck, MemoryBroker, MemorySource};
use inbox_core::{
    async_trait, Ack, Delivery, Error, HandlerError, InvalidId, Message, MessageId, MessageSource,
    SourceError, Stage, StoreError,
};
use inbox_postgres::testkit::{fast_retry, TestDb};
use inbox_postgres::{Error as PgError, KeyMode, PgInbox, PgLeases, PgTx, TableName};
use inbox_redis_streams::redis::{self, Value};
use inbox_redis_streams::{RedisStreamProducer, RedisStreamSource};

const CONSUMER: &str = "mailer";
/// Long enough for any normal call on a busy 2-core machine; short enough to wait out.
const LEASE: Duration = Duration::from_secs(1);
/// For the tests that count hand-backs during a dead consumer's lease: long enough that the
/// next consumer surely starts inside it.
const LONG_LEASE: Duration = Duration::from_secs(3);
/// How long a test waits for its consumers before failing instead of hanging.
const PATIENCE: Duration = Duration::from_secs(60);

/// The provider and the handler's choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// The provider deduplicates on the idempotency key; the handler retries unknowns.
    Keys,
    /// The provider answers a status lookup; the handler would skip unknowns, but the lookup
    /// leaves none.
    Lookup,
    /// Neither; the handler retries unknowns (a rare duplicate).
    BlindRetry,
    /// Neither; the handler skips unknowns (a rare loss).
    BlindSkip,
}

const SETUPS: [Setup; 4] = [
    Setup::Keys,
    Setup::Lookup,
    Setup::BlindRetry,
    Setup::BlindSkip,
];

impl Setup {
    fn mode(self) -> ProviderMode {
        match self {
            Setup::Keys => ProviderMode::Keys,
            Setup::Lookup => ProviderMode::StatusLookup,
            Setup::BlindRetry | Setup::BlindSkip => ProviderMode::Neither,
        }
    }

    fn handler(self, provider: &TestProvider) -> Notify {
        Notify {
            client: provider.client(),
            lookup: self == Setup::Lookup,
            on_unknown: match self {
                Setup::Keys | Setup::BlindRetry => OnUnknown::Retry,
                Setup::Lookup | Setup::BlindSkip => OnUnknown::Skip,
            },
        }
    }
}

/// Sends a notification per message through the test provider and records it in `sent`.
#[derive(Debug, Clone)]
struct Notify {
    client: ProviderClient,
    lookup: bool,
    on_unknown: OnUnknown,
}

#[async_trait]
impl EffectHandler<PgTx> for Notify {
    fn on_unknown(&self) -> OnUnknown {
        self.on_unknown
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        let reply = self
            .client
            .call(effect.idempotency_key(), effect.token(), &message.payload)
            .await?;
        match reply.status {
            200 => Ok(()),
            503 => Err(not_applied("provider unavailable")),
            422 => Err(HandlerError::permanent("provider refused the notification")),
            status => Err(HandlerError::transient(format!(
                "provider answered {status}: {}",
                reply.body
            ))),
        }
    }

    async fn landed(&self, effect: &Effect, _message: &Message) -> Result<Landed, HandlerError> {
        if !self.lookup {
            return Ok(Landed::Unknown);
        }
        Ok(match self.client.status(effect.idempotency_key()).await? {
            CallStatus::Applied => Landed::Yes,
            CallStatus::Pending => Landed::Pending,
            CallStatus::NotApplied => Landed::No,
        })
    }

    async fn record(
        &self,
        tx: &mut PgTx,
        effect: &Effect,
        settled: Settled,
        message: &Message,
    ) -> Result<(), HandlerError> {
        sqlx::query(
            "INSERT INTO sent (message_id, token, settled, deliveries) VALUES ($1, $2, $3, $4)",
        )
        .bind(effect.id().as_str())
        .bind(i64::try_from(effect.token()).unwrap())
        .bind(settled.as_str())
        .bind(message.meta.delivery_count.map(i64::from))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

struct Env {
    db: TestDb,
    leases: PgLeases,
    provider: TestProvider,
}

impl Env {
    async fn new(mode: ProviderMode) -> Self {
        let db = TestDb::new().await;
        sqlx::query(
            "CREATE TABLE sent (
                message_id text NOT NULL, token bigint NOT NULL, settled text NOT NULL,
                deliveries bigint)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let leases = PgLeases::new(db.inbox()).unwrap();
        leases.migrate().await.unwrap();
        let provider = TestProvider::start(mode).await.unwrap();
        Self {
            db,
            leases,
            provider,
        }
    }

    fn consumer<S: MessageSource>(
        &self,
        source: S,
        handler: Notify,
    ) -> EffectConsumer<S, PgLeases, Notify> {
        EffectConsumer::new(CONSUMER, source, self.leases.clone(), handler)
            .lease(LEASE)
            .retry(fast_retry(5))
    }

    /// `sent` rows of `id`: (token, settled, deliveries), in token order.
    async fn sent(&self, id: &str) -> Vec<(i64, String, Option<i64>)> {
        sqlx::query_as(
            "SELECT token, settled, deliveries FROM sent WHERE message_id = $1 ORDER BY token",
        )
        .bind(id)
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }

    async fn sent_total(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM sent")
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// The lease row of `id`: (token, attempts, done).
    async fn row(&self, id: &str) -> (i64, i32, bool) {
        sqlx::query_as(
            "SELECT token, attempts, done_at IS NOT NULL FROM inbox_effects WHERE message_id = $1",
        )
        .bind(id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }
}

fn id(text: &str) -> MessageId {
    MessageId::new(text).unwrap()
}

fn key(text: &str) -> String {
    id(text).idempotency_key(CONSUMER)
}

/// Completes once the broker holds nothing unacked.
fn drained(broker: &MemoryBroker) -> impl Future<Output = ()> + Send + 'static {
    let broker = broker.clone();
    async move {
        while broker.pending() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn patiently<T>(work: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, work)
        .await
        .expect("the consumers did not finish in time")
}

// --- Crash points: a consumer dies at each step for evt-2 and a fresh one takes over. ---

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    /// The processing row (the lease) committed; the call not made yet.
    AfterLease,
    /// The provider applied the call but never answered, and the consumer died waiting.
    DuringCall,
    /// The call returned `Ok`; the done mark not committed yet.
    AfterCall,
    /// The done mark committed; the broker not acked yet.
    AfterDone,
}

/// What the provider and the database hold for the crashed message at the end.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// Effects applied at the provider: 1 is right, 2 a duplicate, 0 a loss.
    effects: usize,
    /// Calls the provider received.
    calls: usize,
    /// How the done mark was reached.
    settled: &'static str,
}

fn seen(effects: usize, calls: usize, settled: &'static str) -> Seen {
    Seen {
        effects,
        calls,
        settled,
    }
}

/// Runs evt-1..3 through a consumer that dies at `crash` on evt-2, then redelivers to a fresh
/// consumer until the broker is drained; checks what must hold in every setup and returns what
/// differs between them.
async fn crash_then_redeliver(setup: Setup, crash: Crash) -> Seen {
    let env = Env::new(setup.mode()).await;
    let broker = MemoryBroker::new();
    for evt in ["evt-1", "evt-2", "evt-3"] {
        broker.publish(Some(evt), format!("notify {evt}"));
    }
    let handler = setup.handler(&env.provider);
    let target = id("evt-2");
    match crash {
        Crash::DuringCall => {
            env.provider
                .next_call(&key("evt-2"), Behaviour::ApplyThenHang);
            let first = env.consumer(broker.source(), handler.clone());
            let first = tokio::spawn(first.run_until(std::future::pending()));
            assert!(
                env.provider
                    .wait_for_calls(&key("evt-2"), 1, PATIENCE)
                    .await
            );
            first.abort(); // the process dies mid-call; its connection to the broker closes
            assert!(first.await.unwrap_err().is_cancelled());
        }
        _ => {
            let stage = match crash {
                Crash::AfterLease => Stage::Claimed,
                Crash::AfterCall => Stage::Applied,
                _ => Stage::Committed,
            };
            let crashed = env
                .consumer(broker.source(), handler.clone())
                .on_stage(crash_at_ids(stage, [target.clone()]))
                .run_until(std::future::pending())
                .await;
            assert!(
                matches!(crashed, Err(Error::Crashed { stage: s, .. }) if s == stage),
                "{crashed:?}"
            );
        }
    }
    assert_eq!(broker.pending(), 2, "evt-2 unacked, evt-3 not yet received");

    let stats = patiently(
        env.consumer(broker.source(), handler)
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();
    assert!(env.provider.wait_settled(PATIENCE).await);

    // In every setup: the others applied once, one done mark and one `sent` row per message,
    // nothing dead-lettered, nothing left on the broker.
    for other in ["evt-1", "evt-3"] {
        assert_eq!(env.provider.effects(&key(other)), 1, "{setup:?} {other}");
        assert_eq!(env.sent(other).await.len(), 1, "{setup:?} {other}");
    }
    let sent = env.sent("evt-2").await;
    assert_eq!(sent.len(), 1, "{setup:?}: one done mark, one set of writes");
    assert_eq!(env.sent_total().await, 3);
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending(), 0);
    let (token, _, done) = env.row("evt-2").await;
    assert!(done);
    assert_eq!(sent[0].0, token, "the writes committed with the done mark");
    let calls = env.provider.calls(&key("evt-2"));
    assert!(
        calls.windows(2).all(|w| w[0].token < w[1].token),
        "every new call carries a higher fencing token: {calls:?}"
    );
    if crash == Crash::AfterDone {
        assert_eq!(token, 1);
        assert_eq!(
            stats.skipped_duplicates, 1,
            "the redelivered copy finds done"
        );
    } else {
        assert_eq!(token, 2, "the second lease took over");
        assert!(
            stats.busy <= 1,
            "handed back at most once while the dead consumer's lease was live: {stats:?}"
        );
    }
    let settled = match sent[0].1.as_str() {
        "called" => "called",
        "landed" => "landed",
        "skipped" => "skipped",
        other => panic!("settled {other}"),
    };
    let seen = Seen {
        effects: env.provider.effects(&key("evt-2")),
        calls: calls.len(),
        settled,
    };
    env.db.drop().await;
    seen
}

async fn crash_table(crash: Crash, expected: [Seen; 4]) {
    for (setup, expected) in SETUPS.into_iter().zip(expected) {
        let seen = crash_then_redeliver(setup, crash).await;
        assert_eq!(seen, expected, "{setup:?} after a crash {crash:?}");
    }
}

#[tokio::test]
async fn crash_after_the_processing_row_commits() {
    // The call was never made: whoever calls after the lease ran out makes the only call. A
    // blind skip cannot know that: the effect is missing.
    crash_table(
        Crash::AfterLease,
        [
            seen(1, 1, "called"),  // keys
            seen(1, 1, "called"),  // lookup: "none", so it calls
            seen(1, 1, "called"),  // blind retry
            seen(0, 0, "skipped"), // blind skip: lost
        ],
    )
    .await;
}

#[tokio::test]
async fn crash_during_the_call() {
    // The provider applied the call but never answered.
    crash_table(
        Crash::DuringCall,
        [
            seen(1, 2, "called"), // keys: called again, the provider answered the first result
            seen(1, 1, "landed"), // lookup: "applied", not called again
            seen(2, 2, "called"), // blind retry: a duplicate
            seen(1, 1, "skipped"), // blind skip: kept, by luck of where it died
        ],
    )
    .await;
}

#[tokio::test]
async fn crash_after_the_call_returns_before_done_commits() {
    crash_table(
        Crash::AfterCall,
        [
            seen(1, 2, "called"),
            seen(1, 1, "landed"),
            seen(2, 2, "called"),
            seen(1, 1, "skipped"),
        ],
    )
    .await;
}

#[tokio::test]
async fn crash_after_done_commits_before_the_ack() {
    // Done is done: the redelivered copy is skipped and acked whatever the provider offers.
    crash_table(
        Crash::AfterDone,
        [
            seen(1, 1, "called"),
            seen(1, 1, "called"),
            seen(1, 1, "called"),
            seen(1, 1, "called"),
        ],
    )
    .await;
}

// --- Leases, budgets and fencing. ---

#[tokio::test]
async fn a_live_lease_hands_the_message_back_without_using_its_attempts() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    let handler = Setup::Keys.handler(&env.provider);
    // Two attempts allowed: the dead consumer's lease and the one after it.
    let crashed = env
        .consumer(broker.source(), handler.clone())
        .lease(LONG_LEASE)
        .retry(fast_retry(2))
        .on_stage(crash_at_ids(Stage::Claimed, [id("evt-1")]))
        .run_until(std::future::pending())
        .await;
    assert!(matches!(crashed, Err(Error::Crashed { .. })));

    let stats = patiently(
        env.consumer(broker.source(), handler)
            .lease(LONG_LEASE)
            .retry(fast_retry(2))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    assert_eq!(env.provider.effects(&key("evt-1")), 1);
    assert!(
        broker.dead_letters().is_empty(),
        "the hand-back used up no attempt"
    );
    assert_eq!(
        stats.busy, 1,
        "handed back once, delayed by the rest of the lease: no busy loop"
    );
    assert_eq!(broker.acked(), 1, "acked once, after the done mark");
    let sent = env.sent("evt-1").await;
    assert_eq!(
        sent[0].2,
        Some(3),
        "the broker handed it out 3 times, one more than the 2 attempts allowed"
    );
    assert_eq!(env.row("evt-1").await, (2, 2, true));
    env.db.drop().await;
}

/// A source whose nack cannot delay, like a Kafka rewind: a handed-back message comes straight
/// back.
struct NoDelay(MemorySource);

#[derive(Debug)]
struct NoDelayAck(MemoryAck);

#[async_trait]
impl Ack for NoDelayAck {
    async fn ack(self) -> Result<(), SourceError> {
        self.0.ack().await
    }
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        self.0.nack(Duration::ZERO).await
    }
}

#[async_trait]
impl MessageSource for NoDelay {
    type Ack = NoDelayAck;
    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<NoDelayAck>>, SourceError> {
        let batch = self.0.receive(max).await?;
        Ok(batch
            .into_iter()
            .map(|d| Delivery {
                message: d.message,
                ack: NoDelayAck(d.ack),
            })
            .collect())
    }
    async fn dead_letter(&mut self, message: &Message, reason: &str) -> Result<(), SourceError> {
        self.0.dead_letter(message, reason).await
    }
}

#[tokio::test]
async fn a_broker_that_cannot_delay_a_hand_back_does_not_make_a_busy_loop() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    let handler = Setup::Keys.handler(&env.provider);
    let crashed = env
        .consumer(broker.source(), handler.clone())
        .lease(LONG_LEASE)
        .on_stage(crash_at_ids(Stage::Claimed, [id("evt-1")]))
        .run_until(std::future::pending())
        .await;
    assert!(matches!(crashed, Err(Error::Crashed { .. })));

    let stats = patiently(
        env.consumer(NoDelay(broker.source()), handler)
            .lease(LONG_LEASE)
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    assert_eq!(env.provider.effects(&key("evt-1")), 1);
    assert_eq!(
        stats.busy, 1,
        "the copy that came straight back waited out the lease instead of asking again"
    );
    assert_eq!(
        env.sent("evt-1").await[0].2,
        Some(3),
        "handed out once more, not hundreds of times"
    );
    env.db.drop().await;
}

#[tokio::test]
async fn tokens_grow_with_every_lease_and_the_database_refuses_a_stale_one() {
    let env = Env::new(ProviderMode::Keys).await;
    let leases = &env.leases;
    let evt = id("evt-1");
    let short = Duration::from_millis(200);

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
        leases.commit(tx).await.is_err(),
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
    leases.commit(tx).await.unwrap();
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
    leases.rollback(tx).await.unwrap();

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

#[async_trait]
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
    async fn commit(&self, tx: PgTx) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: PgTx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
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
    let zombie = EffectConsumer::new(
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

#[tokio::test]
async fn a_call_that_surely_did_not_apply_is_retried_even_when_unknowns_are_skipped() {
    let env = Env::new(ProviderMode::Neither).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    broker.publish(Some("evt-2"), "notify");
    // evt-1: "503, not applied" (the handler says `not_applied`); evt-2: "500", which could
    // mean anything, so its outcome is unknown.
    env.provider
        .next_call(&key("evt-1"), Behaviour::Refuse(503));
    env.provider
        .next_call(&key("evt-2"), Behaviour::Refuse(500));
    let stats = patiently(
        env.consumer(broker.source(), Setup::BlindSkip.handler(&env.provider))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    assert_eq!(env.provider.effects(&key("evt-1")), 1, "retried: no loss");
    assert_eq!(env.sent("evt-1").await[0].1, "called");
    assert_eq!(
        env.provider.effects(&key("evt-2")),
        0,
        "skipped after an unknown outcome: the documented loss"
    );
    assert_eq!(env.sent("evt-2").await[0].1, "skipped");
    assert_eq!(
        (stats.applied, stats.skipped_unknown, stats.retried),
        (1, 1, 2)
    );
    env.db.drop().await;
}

#[tokio::test]
async fn failed_messages_are_dead_lettered_and_a_replay_gets_a_fresh_budget() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    broker.publish(Some("evt-2"), "notify");
    broker.publish(None, "notify"); // no ID
    for _ in 0..3 {
        env.provider
            .next_call(&key("evt-1"), Behaviour::Refuse(503));
    }
    env.provider
        .next_call(&key("evt-2"), Behaviour::Refuse(422));
    let handler = Setup::Keys.handler(&env.provider);
    let stats = patiently(
        env.consumer(broker.source(), handler.clone())
            .retry(fast_retry(3))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    let dead = broker.dead_letters();
    let reason = |evt: Option<&str>| {
        dead.iter()
            .find(|(m, _)| m.id.as_ref().ok().map(MessageId::as_str) == evt)
            .map(|(_, reason)| reason.clone())
            .unwrap_or_default()
    };
    assert_eq!((dead.len(), stats.dead_lettered), (3, 3));
    assert!(reason(Some("evt-1")).contains("failed 3 time(s)"));
    assert!(reason(Some("evt-2")).contains("refused"));
    assert!(reason(None).contains("no ID"));
    assert_eq!(env.provider.calls(&key("evt-1")).len(), 3);
    assert_eq!(
        env.provider.calls(&key("evt-2")).len(),
        1,
        "permanent: not retried"
    );
    assert_eq!(env.provider.applied().len(), 0);
    assert_eq!(env.sent_total().await, 0);
    assert_eq!(
        env.row("evt-1").await,
        (3, 0, false),
        "unsettled, count reset"
    );

    // An operator replays the dead letter: it is applied, within a fresh budget of 3.
    let (replay, _) = dead
        .into_iter()
        .find(|(m, _)| m.id.as_ref().is_ok_and(|i| i.as_str() == "evt-1"))
        .unwrap();
    broker.publish_message(replay);
    patiently(
        env.consumer(broker.source(), handler)
            .retry(fast_retry(3))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();
    assert_eq!(env.provider.effects(&key("evt-1")), 1);
    assert_eq!(env.row("evt-1").await, (4, 1, true));
    env.db.drop().await;
}

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
            leases.commit(tx).await.unwrap();
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
        leases.rollback(tx).await.unwrap();
        let mut tx = leases.begin().await.unwrap();
        assert!(leases
            .complete(&mut tx, CONSUMER, &evt, lease.token)
            .await
            .unwrap());
        leases.commit(tx).await.unwrap();
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
    send_sync::<EffectStatsSnapshot>();
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
    let consumer = EffectConsumer::new(CONSUMER, broker.source(), leases, handler);
    send(&consumer);
    let run = consumer.run_until(async {});
    send(&run);
}

// --- A call that outlives its lease, on a real Redis stream. ---

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

async fn redis_pending(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> i64 {
    let v: Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(CONSUMER)
        .query_async(conn)
        .await
        .unwrap();
    match v {
        Value::Array(parts) => match parts.first() {
            Some(Value::Int(n)) => *n,
            other => panic!("XPENDING {other:?}"),
        },
        other => panic!("XPENDING {other:?}"),
    }
}

struct RedisRun {
    effects: usize,
    calls: usize,
    settled: String,
    stats: [EffectStatsSnapshot; 2],
}

/// Consumer `a` takes the message and calls a provider that takes three leases to apply; its
/// call is dropped when its lease ends, but the provider applies it anyway, late. Consumer `b`
/// (or `a` again) reclaims the entry with `XAUTOCLAIM` and takes the next lease.
async fn call_outliving_its_lease_on_redis(setup: Setup) -> RedisRun {
    let env = Env::new(setup.mode()).await;
    let stream = format!("inbox-test:effects:{}", uuid::Uuid::new_v4().simple());
    let producer = RedisStreamProducer::connect(&redis_url(), stream.as_str())
        .await
        .unwrap();
    let evt = MessageId::generate();
    let evt_key = evt.idempotency_key(CONSUMER);
    env.provider.next_call(&evt_key, Behaviour::Slow(LEASE * 3));
    producer.send_with_id(&evt, "notify").await.unwrap();

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let start = |name: &'static str| {
        let (handler, leases, stream, mut stop) = (
            setup.handler(&env.provider),
            env.leases.clone(),
            stream.clone(),
            stop_rx.clone(),
        );
        tokio::spawn(async move {
            let source = RedisStreamSource::builder(stream, CONSUMER)
                .consumer_name(name)
                .block(Duration::from_millis(100))
                .claim_idle(Duration::from_millis(300))
                .claim_interval(Duration::from_millis(100))
                .connect(&redis_url())
                .await
                .unwrap();
            EffectConsumer::new(CONSUMER, source, leases, handler)
                .lease(LEASE)
                .retry(fast_retry(20))
                .run_until(async move {
                    let _ = stop.wait_for(|stop| *stop).await;
                })
                .await
        })
    };
    let a = start("a");
    assert!(env.provider.wait_for_calls(&evt_key, 1, PATIENCE).await);
    let b = start("b");

    let mut conn = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    patiently(async {
        loop {
            let done: Option<bool> = sqlx::query_scalar(
                "SELECT done_at IS NOT NULL FROM inbox_effects WHERE message_id = $1",
            )
            .bind(evt.as_str())
            .fetch_optional(&env.db.pool)
            .await
            .unwrap();
            if done == Some(true) && redis_pending(&mut conn, &stream).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    stop_tx.send_replace(true);
    let stats = [a.await.unwrap().unwrap(), b.await.unwrap().unwrap()];
    assert!(
        env.provider.wait_settled(PATIENCE).await,
        "the late call has landed"
    );

    let sent = env.sent(evt.as_str()).await;
    assert_eq!(sent.len(), 1, "one done mark, one set of writes");
    let calls = env.provider.calls(&evt_key);
    assert!(calls.windows(2).all(|w| w[0].token < w[1].token));
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .arg(format!("{stream}:dlq"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let run = RedisRun {
        effects: env.provider.effects(&evt_key),
        calls: calls.len(),
        settled: sent[0].1.clone(),
        stats,
    };
    env.db.drop().await;
    run
}

#[tokio::test]
async fn a_call_outliving_its_lease_lands_once_with_keys_or_a_lookup_on_redis() {
    let keys = call_outliving_its_lease_on_redis(Setup::Keys).await;
    assert_eq!(
        keys.effects, 1,
        "the late call and the retry were one effect"
    );
    assert!(
        keys.calls >= 2,
        "retried with the same key while the first was still in progress"
    );
    assert_eq!(keys.settled, "called");

    let lookup = call_outliving_its_lease_on_redis(Setup::Lookup).await;
    assert_eq!(lookup.effects, 1);
    assert_eq!(
        lookup.calls, 1,
        "the lookup said pending, then applied: never called again"
    );
    assert_eq!(lookup.settled, "landed");
    let confirmed: u64 = lookup.stats.iter().map(|s| s.confirmed).sum();
    assert_eq!(confirmed, 1);
}

#[tokio::test]
async fn a_call_outliving_its_lease_without_keys_or_lookup_duplicates_or_is_skipped_on_redis() {
    let retry = call_outliving_its_lease_on_redis(Setup::BlindRetry).await;
    assert_eq!(
        retry.effects, 2,
        "retry: the late call and the retry both applied"
    );

    let skip = call_outliving_its_lease_on_redis(Setup::BlindSkip).await;
    assert_eq!(
        (skip.effects, skip.calls),
        (1, 1),
        "skip: not called again; the late call is the only effect (it could have been none)"
    );
    assert_eq!(skip.settled, "skipped");
    let skipped: u64 = skip.stats.iter().map(|s| s.skipped_unknown).sum();
    assert_eq!(skipped, 1);
}
