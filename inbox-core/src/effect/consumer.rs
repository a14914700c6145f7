//! [`EffectConsumer`]: its settings and the receive loop; each message is applied in
//! `apply.rs`.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;

use super::apply::Core;
use super::stats::EffectMetrics;
use super::{EffectHandler, EffectStats, EffectStatsSnapshot, LeaseStore};
use crate::consumer::stop::{self, Phase, Stop};
use crate::{Error, MessageSource, Recent, Result, RetryPolicy, StageHook};

/// The lease [`EffectConsumer::new`] starts with.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Runs an [`EffectHandler`] over a [`MessageSource`] so that each message's call is made once,
/// as far as the provider allows (see the [module docs](super)), with its state in a
/// [`LeaseStore`].
///
/// For each delivery, one at a time (each is a call out, and its lease is its own):
/// 1. a message without a usable ID is dead-lettered with the reason, then acked;
/// 2. [`LeaseStore::acquire`] takes a lease, committed on its own. Done: skipped and acked.
///    Another lease live: handed back with a nack delayed by the rest of that lease; neither
///    acked nor counted as an attempt. When the broker cannot delay (Kafka rewinds at once,
///    Redis leaves it pending until `claim_idle`) and the copy comes back early, the consumer
///    waits out the rest of the lease before asking again, so nothing spins;
/// 3. after an unknown outcome ([`Attempt::AfterExpiry`](super::Attempt::AfterExpiry)) the
///    handler's status lookup ([`EffectHandler::landed`]) and then its
///    [`OnUnknown`](super::OnUnknown) decide between calling again and marking done without a
///    call;
/// 4. the call runs until the lease ends at most; its outcome decides:
///    - `Ok`: the done transaction ([`LeaseStore::complete`], then [`EffectHandler::record`],
///      then commit) and the ack. A done mark refused because a newer lease took over (this
///      attempt was a zombie) rolls back and hands the delivery back: the newer holder
///      finishes it, and the copy is later skipped as done. A done transaction that fails is
///      tried again while the lease lasts; once it has run out (a `record` still running then
///      is dropped), the lease is released and the message handed back with the retry
///      backoff, for the next lease to settle;
///    - a transient error (or a panic, or the lease running out): the lease is released and the
///      message handed back with the retry backoff, to be leased again; after
///      [`RetryPolicy::max_attempts`] attempts it is dead-lettered;
///    - a permanent error: dead-lettered at once.
///
/// The budget is counted in leases, in the store: every lease is an attempt, whether it ended
/// in an error, a crash or a hang, so a message that kills the process is dead-lettered after
/// `max_attempts` leases too. A copy handed back because of a live lease takes no lease and
/// uses up nothing. The broker's own counters do not see the difference: set a broker-side
/// limit (an SQS `maxReceiveCount`, a quorum queue's delivery limit) well above `max_attempts`,
/// or a message held by a slow call elsewhere is dead-lettered by the broker.
///
/// While the store cannot be reached, the message is held and tried again with a backoff
/// doubling up to 30 s, as [`Consumer`](crate::Consumer) does.
#[derive(Debug)]
pub struct EffectConsumer<S, L, H> {
    source: S,
    core: Core<L, H>,
}

impl<S, L, H> EffectConsumer<S, L, H>
where
    S: MessageSource,
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    /// A consumer named `name`: the store scopes message IDs per name, and the name is part of
    /// every idempotency key, so instances of one scaled consumer share it and different
    /// consumers do not.
    pub fn new(name: impl Into<String>, source: S, leases: L, handler: H) -> Self {
        Self {
            source,
            core: Core {
                name: name.into(),
                leases,
                handler,
                lease: DEFAULT_LEASE,
                retry: RetryPolicy::default(),
                error_backoff: Duration::from_millis(500),
                hook: None,
                stats: Arc::new(EffectStats::default()),
                metrics: EffectMetrics::default(),
                not_before: Mutex::new(Recent::new(1024)),
            },
        }
    }

    /// How long an attempt owns its message (default 30 s): longer than the slowest call you
    /// expect, since a call is dropped when its lease ends, and short enough that a crashed
    /// attempt's message is taken over soon.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.core.lease = lease;
        self
    }

    /// The attempt budget, counted in leases, and the backoff between attempts.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.core.retry = policy;
        self
    }

    /// The first wait after a broker or store error (doubling up to 30 s while errors repeat).
    pub fn error_backoff(mut self, wait: Duration) -> Self {
        self.core.error_backoff = wait;
        self
    }

    /// Calls `hook` at each [`Stage`](crate::Stage) of each message: `Claimed` once the lease
    /// is committed, `Applied` once the call returned `Ok`, `Committed` once the done mark is,
    /// `Acked` after the ack.
    pub fn on_stage(mut self, hook: StageHook) -> Self {
        self.core.hook = Some(hook);
        self
    }

    /// Live counters, readable while the consumer runs.
    pub fn stats(&self) -> Arc<EffectStats> {
        Arc::clone(&self.core.stats)
    }

    /// Runs until SIGINT (Ctrl-C) or SIGTERM, then finishes the message in flight and returns.
    pub async fn run(self) -> Result<EffectStatsSnapshot> {
        self.run_until(async {
            std::pin::pin!(stop::signals()).next().await;
        })
        .await
    }

    /// Runs until `shutdown` completes. Shutdown is graceful: no new message is received, and
    /// the one in flight is finished (or, while the store is unreachable or between retries,
    /// handed back).
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<EffectStatsSnapshot> {
        self.run_loop(shutdown, false).await
    }

    /// Runs until a receive comes back empty, then returns. A message handed back with a delay
    /// (a live lease, a retry) may come back after that.
    pub async fn run_until_idle(self) -> Result<EffectStatsSnapshot> {
        self.run_loop(std::future::pending(), true).await
    }

    async fn run_loop(
        mut self,
        shutdown: impl Future<Output = ()> + Send,
        until_idle: bool,
    ) -> Result<EffectStatsSnapshot> {
        self.check()?;
        self.core.metrics = EffectMetrics::register(&self.core.name);
        tokio::pin!(shutdown);
        let (stop_tx, stop) = Stop::new();
        let core = &self.core;
        let source = &mut self.source;
        let mut failures = 0;
        while !stop.stopping() {
            let received = tokio::select! {
                biased;
                () = &mut shutdown => break,
                received = source.receive(1) => received,
            };
            let batch = match received {
                Ok(batch) => {
                    failures = 0;
                    batch
                }
                Err(e) => {
                    failures += 1;
                    let wait = core.source_failed(e, failures)?;
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            if batch.is_empty() && until_idle {
                break;
            }
            for delivery in batch {
                if stop.stopping() {
                    core.hand_back(delivery.ack).await;
                    continue;
                }
                let work = core.process(&mut *source, delivery, &stop);
                tokio::pin!(work);
                loop {
                    tokio::select! {
                        biased;
                        () = &mut shutdown, if !stop.stopping() => {
                            stop_tx.send_replace(Phase::Stopping);
                        }
                        result = &mut work => {
                            result?;
                            break;
                        }
                    }
                }
            }
        }
        Ok(core.stats.snapshot())
    }

    fn check(&self) -> Result<()> {
        let core = &self.core;
        crate::consumer::check_name(&core.name)?;
        if core.lease.is_zero() {
            return Err(Error::Config(
                "the lease is 0; use longer than the slowest call".into(),
            ));
        }
        if core.retry.max_attempts == 0 {
            return Err(Error::Config("max_attempts is 0; use at least 1".into()));
        }
        Ok(())
    }
}
