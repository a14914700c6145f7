//! Crash points: wrappers around a consumer's store, handler and source that stop it dead at a
//! stage of the algorithm, as a process that dies there would.
//!
//! Wrap the parts of a consumer with one [`Crash`] and run the consumer under [`Crash::run`].
//! When a message reaches the crash point, the wrapper never returns and `run` drops the
//! consumer's future there: no rollback call, no ack, no further message, as after a `SIGKILL`.
//! The store rolls the open transaction back when it is dropped (the database does when the
//! connection goes), and the broker hands the unacked messages out again.
//!
//! | [`Stage`] | the wrapper that stops | where |
//! |---|---|---|
//! | `Claimed` | [`Crash::store`], [`Crash::leases`] | the claim returned `true`, its transaction open; for effects, the lease committed |
//! | `Applied` | [`Crash::handler`] | the handler returned `Ok`, the transaction open |
//! | `Committed` | [`Crash::source`] | the ack was asked for (after the commit, or for a skipped duplicate): the broker is not told |
//! | `Acked` | [`Crash::source`] | the broker ack returned |
//!
//! ```
//! use inbox_core::{Consumer, Stage};
//! use inbox_testkit::{Crash, MemoryBroker, MemoryStore, Sum};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let broker = MemoryBroker::new();
//! broker.publish(Some("evt-1"), "100");
//! let store = MemoryStore::<i64>::new();
//!
//! // Dies once the first message's transaction committed, before the ack.
//! let crash = Crash::at(Stage::Committed);
//! let consumer = Consumer::new("sum", crash.source(broker.source()), store.clone(), Sum);
//! let crashed = crash.run(consumer.run_until_idle()).await.unwrap_err();
//! assert_eq!(crashed.stage, Stage::Committed);
//! assert_eq!(store.state().await, 100); // committed, but never acked
//!
//! // The message comes back; the restarted consumer skips it.
//! let consumer = Consumer::new("sum", crash.source(broker.source()), store.clone(), Sum);
//! let stats = crash.run(consumer.run_until_idle()).await.unwrap().unwrap();
//! assert_eq!((stats.applied, stats.skipped_duplicates), (0, 1));
//! assert_eq!(store.state().await, 100);
//! # }
//! ```

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::effect::{
    Acquired, Effect, EffectHandler, Landed, LeaseStore, OnUnknown, Release, Settled,
};
use inbox_core::{
    Ack, BatchHandler, BatchItem, ConsumerBinding, Delivery, Handler, HandlerError, InboxStore,
    InvalidId, Message, MessageId, MessageSource, SourceError, Stage, StoreError,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::Notify;

use crate::lock;

/// Where a [`Crash`] stopped the consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crashed {
    /// The stage the message had reached.
    pub stage: Stage,
    /// The message.
    pub id: MessageId,
}

impl fmt::Display for Crashed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "crashed on purpose after {:?} of message {}",
            self.stage, self.id
        )
    }
}

impl std::error::Error for Crashed {}

/// Which messages crash, where.
#[derive(Debug)]
enum Armed {
    /// The first message to reach the stage, once.
    First { stage: Stage, fired: bool },
    /// Each of these, once, at the stage.
    Ids {
        stage: Stage,
        ids: HashSet<MessageId>,
    },
    /// Any message at any stage, with this probability each time.
    Anywhere { probability: f64, rng: Box<StdRng> },
}

#[derive(Debug)]
struct Inner {
    armed: Mutex<Armed>,
    fired: Mutex<Option<Crashed>>,
    notify: Notify,
}

/// A crash point, shared by the wrappers it makes ([`Crashing`], [`CrashingAck`]): it stops
/// the consumer dead at one [`Stage`] of a message, as a crash there would.
///
/// Clones share the crash point, so a consumer restarted with freshly wrapped parts runs on
/// past a point that already fired.
#[derive(Debug, Clone)]
pub struct Crash(Arc<Inner>);

impl Crash {
    /// Crashes the first time any message reaches `stage`, then lets every later one pass.
    pub fn at(stage: Stage) -> Self {
        Self::armed(Armed::First {
            stage,
            fired: false,
        })
    }

    /// Crashes when one of `ids` reaches `stage`, once per ID.
    pub fn at_ids(stage: Stage, ids: impl IntoIterator<Item = MessageId>) -> Self {
        Self::armed(Armed::Ids {
            stage,
            ids: ids.into_iter().collect(),
        })
    }

    /// Crashes at any stage of any message, each time one is reached with `probability`,
    /// drawn from a generator seeded with `seed`.
    pub fn anywhere(probability: f64, seed: u64) -> Self {
        Self::armed(Armed::Anywhere {
            probability,
            rng: Box::new(StdRng::seed_from_u64(seed)),
        })
    }

    fn armed(armed: Armed) -> Self {
        Self(Arc::new(Inner {
            armed: Mutex::new(armed),
            fired: Mutex::new(None),
            notify: Notify::new(),
        }))
    }

    /// Wraps an inbox store: stops at `Claimed`.
    pub fn store<S>(&self, store: S) -> Crashing<S> {
        self.wrap(store)
    }

    /// Wraps an effect consumer's lease store: stops at `Claimed` (a lease taken).
    pub fn leases<L>(&self, leases: L) -> Crashing<L> {
        self.wrap(leases)
    }

    /// Wraps a handler, batch handler or effect handler: stops at `Applied`.
    pub fn handler<H>(&self, handler: H) -> Crashing<H> {
        self.wrap(handler)
    }

    /// Wraps a message source, whose acks stop at `Committed` (before the broker is told) and
    /// at `Acked` (after).
    pub fn source<S>(&self, source: S) -> Crashing<S> {
        self.wrap(source)
    }

    fn wrap<T>(&self, inner: T) -> Crashing<T> {
        Crashing {
            inner,
            crash: self.clone(),
        }
    }

    /// Runs `consumer` (a consumer's `run_until_idle()`, say) until it ends, or until a crash
    /// point fires: then the future is dropped where it stood, and the answer says where.
    pub async fn run<F: Future>(&self, consumer: F) -> Result<F::Output, Crashed> {
        tokio::select! {
            biased;
            crashed = self.fired() => Err(crashed),
            out = consumer => Ok(out),
        }
    }

    async fn fired(&self) -> Crashed {
        loop {
            if let Some(crashed) = lock(&self.0.fired).take() {
                return crashed;
            }
            self.0.notify.notified().await;
        }
    }

    /// Whether `id` reaching `stage` crashes (and, if so, disarms it for that ID).
    fn reached(&self, stage: Stage, id: &MessageId) -> bool {
        match &mut *lock(&self.0.armed) {
            Armed::First { stage: at, fired } => *at == stage && !std::mem::replace(fired, true),
            Armed::Ids { stage: at, ids } => *at == stage && ids.remove(id),
            Armed::Anywhere { probability, rng } => rng.random_bool(*probability),
        }
    }

    /// Never returns once the first of `ids` crashes at `stage`.
    async fn point<'a>(&self, stage: Stage, ids: impl IntoIterator<Item = &'a MessageId>) {
        let Some(id) = ids.into_iter().find(|id| self.reached(stage, id)) else {
            return;
        };
        *lock(&self.0.fired) = Some(Crashed {
            stage,
            id: id.clone(),
        });
        self.0.notify.notify_one();
        std::future::pending::<()>().await;
    }
}

/// A store, handler or source wrapped by a [`Crash`]; it does what the wrapped one does until
/// its crash point fires.
#[derive(Debug, Clone)]
pub struct Crashing<T> {
    inner: T,
    crash: Crash,
}

impl<T> Crashing<T> {
    /// The wrapped part.
    pub fn inner(&self) -> &T {
        &self.inner
    }
}

impl<S: InboxStore> InboxStore for Crashing<S> {
    type Tx = S::Tx;

    fn bind(&self, binding: &ConsumerBinding) -> Self {
        self.crash.wrap(self.inner.bind(binding))
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.inner.begin().await
    }

    async fn claim(&self, tx: &mut Self::Tx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        let new = self.inner.claim(tx, ids).await?;
        let claimed = ids.iter().zip(&new).filter(|(_, new)| **new);
        self.crash
            .point(Stage::Claimed, claimed.map(|(id, _)| id))
            .await;
        Ok(new)
    }
}

impl<L: LeaseStore> LeaseStore for Crashing<L> {
    type Tx = L::Tx;

    async fn acquire(
        &self,
        consumer: &str,
        id: &MessageId,
        lease: Duration,
    ) -> Result<Acquired, StoreError> {
        let acquired = self.inner.acquire(consumer, id, lease).await?;
        if matches!(acquired, Acquired::Leased(_)) {
            self.crash.point(Stage::Claimed, [id]).await;
        }
        Ok(acquired)
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

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.inner.begin().await
    }

    async fn complete(
        &self,
        tx: &mut Self::Tx,
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

impl<Tx: Send, H: Handler<Tx>> Handler<Tx> for Crashing<H> {
    async fn handle(
        &self,
        tx: &mut Tx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        self.inner.handle(tx, id, message).await?;
        self.crash.point(Stage::Applied, [id]).await;
        Ok(())
    }
}

impl<Tx: Send, H: BatchHandler<Tx>> BatchHandler<Tx> for Crashing<H> {
    type Item = H::Item;

    fn decode(&self, id: &MessageId, message: &Message) -> Result<Self::Item, HandlerError> {
        self.inner.decode(id, message)
    }

    async fn handle_batch(
        &self,
        tx: &mut Tx,
        batch: &[BatchItem<'_, Self::Item>],
    ) -> Result<(), HandlerError> {
        self.inner.handle_batch(tx, batch).await?;
        self.crash
            .point(Stage::Applied, batch.iter().map(|item| item.id))
            .await;
        Ok(())
    }
}

impl<Tx: Send + 'static, H: EffectHandler<Tx>> EffectHandler<Tx> for Crashing<H> {
    fn on_unknown(&self) -> OnUnknown {
        self.inner.on_unknown()
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        self.inner.call(effect, message).await?;
        self.crash.point(Stage::Applied, [effect.id()]).await;
        Ok(())
    }

    async fn landed(&self, effect: &Effect, message: &Message) -> Result<Landed, HandlerError> {
        self.inner.landed(effect, message).await
    }

    async fn record(
        &self,
        tx: &mut Tx,
        effect: &Effect,
        settled: Settled,
        message: &Message,
    ) -> Result<(), HandlerError> {
        self.inner.record(tx, effect, settled, message).await
    }
}

impl<S: MessageSource> MessageSource for Crashing<S> {
    type Ack = CrashingAck<S::Ack>;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<Self::Ack>>, SourceError> {
        let batch = self.inner.receive(max).await?;
        Ok(batch
            .into_iter()
            .map(|Delivery { message, ack }| Delivery {
                ack: CrashingAck {
                    inner: ack,
                    id: message.id.clone().ok(),
                    crash: self.crash.clone(),
                },
                message,
            })
            .collect())
    }

    crate::forward_source!(inner: redelivery_window, system, consumer_group, capabilities);
}

/// The ack handle of a [`Crashing`] source.
#[derive(Debug)]
pub struct CrashingAck<A> {
    inner: A,
    /// The message's ID; `None` for a message without one (never claimed, so never crashes).
    id: Option<MessageId>,
    crash: Crash,
}

impl<A: Ack> Ack for CrashingAck<A> {
    async fn ack(self) -> Result<(), SourceError> {
        self.crash.point(Stage::Committed, &self.id).await;
        self.inner.ack().await?;
        self.crash.point(Stage::Acked, &self.id).await;
        Ok(())
    }

    crate::forward_ack!(inner: nack, dead_letter, redeliver, is_stale);

    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let Some(crash) = acks.first().map(|a| a.crash.clone()) else {
            return Ok(());
        };
        let ids: Vec<Option<MessageId>> = acks.iter().map(|a| a.id.clone()).collect();
        crash.point(Stage::Committed, ids.iter().flatten()).await;
        A::ack_all(acks.into_iter().map(|a| a.inner).collect()).await?;
        crash.point(Stage::Acked, ids.iter().flatten()).await;
        Ok(())
    }
}
