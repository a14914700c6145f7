//! Shared helpers of the effect-consumer tests (`effects_*.rs`): the effect consumer and
//! `PgLeases` against a real PostgreSQL, with a real HTTP provider on loopback
//! (`inbox_conformance::provider`). Effects are counted at the provider: with idempotency keys
//! or a status lookup there is no duplicate and no loss at any crash point; with neither, the
//! handler's choice shows as a duplicate (retry) or a missing effect (skip).
#![allow(dead_code, unreachable_pub)]
#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::future::Future;
use std::time::Duration;

use inbox_conformance::provider::{CallStatus, ProviderClient, ProviderMode, TestProvider};
use inbox_conformance::TestDb;
use inbox_core::effect::{not_applied, Effect, EffectHandler, Effects, Landed, OnUnknown, Settled};
use inbox_core::{Consumer, HandlerError, Message, MessageId, MessageSource};
use inbox_postgres::{PgLeases, PgTx};
use inbox_testkit::fast_retry;
use inbox_testkit::{Crash, Crashing, MemoryBroker};

pub const CONSUMER: &str = "mailer";
/// Long enough for any normal call on a busy 2-core machine; short enough to wait out.
pub const LEASE: Duration = Duration::from_secs(1);
/// How long a test waits for its consumers before failing instead of hanging.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The provider and the handler's choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
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

impl Setup {
    pub fn mode(self) -> ProviderMode {
        match self {
            Setup::Keys => ProviderMode::Keys,
            Setup::Lookup => ProviderMode::StatusLookup,
            Setup::BlindRetry | Setup::BlindSkip => ProviderMode::Neither,
        }
    }

    pub fn handler(self, provider: &TestProvider) -> Notify {
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
pub struct Notify {
    pub client: ProviderClient,
    pub lookup: bool,
    pub on_unknown: OnUnknown,
}

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

pub struct Env {
    pub db: TestDb,
    pub leases: PgLeases,
    pub provider: TestProvider,
}

impl Env {
    pub async fn new(mode: ProviderMode) -> Self {
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

    pub fn consumer<S: MessageSource>(
        &self,
        source: S,
        handler: Notify,
    ) -> Consumer<S, Effects<PgLeases, Notify>> {
        Consumer::effects(CONSUMER, source, self.leases.clone(), handler)
            .lease(LEASE)
            .retry(fast_retry(5))
    }

    /// [`Env::consumer`] with its source, leases and handler wrapped by `crash`.
    pub fn crashing_consumer<S: MessageSource>(
        &self,
        crash: &Crash,
        source: S,
        handler: Notify,
    ) -> Consumer<Crashing<S>, Effects<Crashing<PgLeases>, Crashing<Notify>>> {
        Consumer::effects(
            CONSUMER,
            crash.source(source),
            crash.leases(self.leases.clone()),
            crash.handler(handler),
        )
        .lease(LEASE)
        .retry(fast_retry(5))
    }

    /// `sent` rows of `id`: (token, settled, deliveries), in token order.
    pub async fn sent(&self, id: &str) -> Vec<(i64, String, Option<i64>)> {
        sqlx::query_as(
            "SELECT token, settled, deliveries FROM sent WHERE message_id = $1 ORDER BY token",
        )
        .bind(id)
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }

    pub async fn sent_total(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM sent")
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// The lease row of `id`: (token, attempts, done).
    pub async fn row(&self, id: &str) -> (i64, i32, bool) {
        sqlx::query_as(
            "SELECT token, attempts, done_at IS NOT NULL FROM inbox_effects WHERE message_id = $1",
        )
        .bind(id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }
}

pub fn id(text: &str) -> MessageId {
    MessageId::new(text).unwrap()
}

pub fn key(text: &str) -> String {
    id(text).idempotency_key(CONSUMER)
}

/// Completes once the broker holds nothing unacked.
pub fn drained(broker: &MemoryBroker) -> impl Future<Output = ()> + Send + 'static {
    let broker = broker.clone();
    async move {
        while broker.pending() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub async fn patiently<T>(work: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, work)
        .await
        .expect("the consumers did not finish in time")
}
