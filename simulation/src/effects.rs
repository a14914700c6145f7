//! The effect step ([`Consumer::effects`]) under every schedule: a lease store with
//! `PgLeases`' rules ([`leases`]) and a provider behind an
//! [`EffectHandler`](inbox_core::effect::EffectHandler) ([`provider`]), both failing as the seed
//! says, and the invariants a user of effects cares about.
//!
//! In a fifth of the seeds the consumers run as [`Consumer::effects`] over these instead of
//! [`Consumer::new`](inbox_core::Consumer::new) over the inbox store, on the same broker, with
//! the same crashes, stops, two consumers at once, dead-letter replay and fault-free drain. A
//! done mark that commits counts as the message's claim and its application, so the broker's
//! "no ack before the commit" and the "nothing lost" checks hold the effect step to the same
//! rules. On top, checked after each seed:
//! - every call to the provider carries its message's one idempotency key, and starts under the
//!   message's current lease;
//! - a done mark and its `record` writes commit only under the current token, once per message,
//!   the writes with their own mark;
//! - a message marked done as called or landed has its effect at the provider;
//! - with a status lookup that answers, no call is made after the effect landed: the provider
//!   deduplicates on the key, and such a call is what a provider without keys would apply twice.
//!
//! Counted and reported in the schedule, not broken rules: calls that land after a newer lease
//! was taken (zombie calls, which the key makes harmless), calls the key deduplicated, done
//! marks fenced out, and effects skipped under `OnUnknown::Skip` that never landed (the rare
//! loss that choice accepts).

mod leases;
mod provider;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use inbox_core::effect::{OnUnknown, Settled};
use inbox_core::{Consumer, RetryPolicy, StatsSnapshot};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::broker::SimSource;
use crate::life::{CrashAfter, End, Life};
use crate::world::{world, Core, Shared, World};

pub(crate) use leases::SimLeases;
pub(crate) use provider::SimProvider;

/// The consumer name: part of every idempotency key.
const CONSUMER: &str = "sim";

/// Whether seed `seed` runs the effect step: a fifth of the seeds, drawn apart from the seed's
/// own stream, so the other seeds draw what they drew before effects were simulated.
pub(crate) fn drawn(seed: u64) -> bool {
    StdRng::seed_from_u64(seed ^ 0xEFFE_C75E_ED00_0000).random_bool(0.2)
}

/// What the provider's status lookup ([`EffectHandler::landed`](inbox_core::effect::EffectHandler::landed)) can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// None: the default `Landed::Unknown`, and `OnUnknown` decides.
    None,
    /// Yes, no, or pending while a call is still in flight; now and then the lookup fails.
    Status,
    /// As `Status`, but a third of the answers are `Unknown`.
    Unsure,
}

/// What a seed draws for its effect consumers: one configuration, as the instances of one
/// deployed consumer share it.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) lease: Duration,
    /// How long a statement waits for a row another transaction keeps locked (`PgLeases::lock_timeout`).
    pub(crate) lock_timeout: Duration,
    pub(crate) lookup: Lookup,
    pub(crate) on_unknown: OnUnknown,
}

/// A lease row, as committed.
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) token: u64,
    /// The last token whose call surely did not apply.
    pub(crate) clean_token: u64,
    pub(crate) attempts: u32,
    pub(crate) locked_until: Instant,
    pub(crate) first_leased: Instant,
    pub(crate) done: bool,
    /// The open transaction holding the row lock (a done mark not yet committed).
    pub(crate) locked_by: Option<u64>,
}

/// The provider's side: what it applied, by idempotency key, and the calls still in flight.
#[derive(Debug, Default)]
pub(crate) struct Provider {
    /// Keys applied.
    pub(crate) applied: BTreeSet<String>,
    /// The key each message's first call carried.
    pub(crate) keys: BTreeMap<String, String>,
    /// Calls dropped by the consumer that still land: when, message ID, key, token.
    pub(crate) in_flight: Vec<(Instant, String, String, u64)>,
    /// Calls that reached the provider with a key it had applied, per message ID.
    pub(crate) again: BTreeMap<String, u32>,
}

/// What the effect consumers did, for the schedule's last line.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) leases: u32,
    pub(crate) fenced: u32,
    pub(crate) zombie_calls: u32,
    pub(crate) deduplicated: u32,
    pub(crate) skipped_missing: u32,
}

/// The lease table, the provider, and what the invariants need.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) rows: BTreeMap<String, Row>,
    pub(crate) next_tx: u64,
    /// The lease store is unreachable until then.
    pub(crate) down_until: Option<Instant>,
    pub(crate) provider: Provider,
    /// How each committed done mark was settled.
    pub(crate) done: BTreeMap<String, Settled>,
    pub(crate) counts: Counts,
}

impl State {
    /// Lands the call of `id` under `token` at the provider, which applies a key once.
    pub(crate) fn land(&mut self, core: &mut Core, id: &str, key: &str, token: u64) {
        let current = self.rows.get(id).map_or(0, |r| r.token);
        if token < current {
            self.counts.zombie_calls += 1;
            core.note(format!(
                "provider: a call for {id} under token {token} lands after lease {current} was taken (a zombie call)"
            ));
        }
        if self.provider.applied.insert(key.to_owned()) {
            core.note(format!("provider: {key} applied (token {token})"));
        } else {
            self.counts.deduplicated += 1;
            *self.provider.again.entry(id.to_owned()).or_default() += 1;
            core.note(format!(
                "provider: {key} applied before; answered with the first result (token {token})"
            ));
        }
    }

    /// Lands the calls in flight due by `now` (all of them, with `None`).
    pub(crate) fn land_due(&mut self, core: &mut Core, now: Option<Instant>) {
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.provider.in_flight)
            .into_iter()
            .partition(|(at, ..)| now.is_none_or(|now| *at <= now));
        self.provider.in_flight = later;
        for (_, id, key, token) in due {
            self.land(core, &id, &key, token);
        }
    }
}

/// Everything the effect consumers of one seed share.
#[derive(Debug)]
pub(crate) struct Lab {
    world: Shared,
    pub(crate) settings: Settings,
    state: Mutex<State>,
    /// Told when a transaction ends and its row lock is free.
    freed: Notify,
}

impl Lab {
    /// Draws the seed's settings from its stream.
    pub(crate) fn new(shared: &Shared) -> Arc<Self> {
        let mut w = world(shared);
        let rng = &mut w.core.rng;
        let settings = Settings {
            lease: Duration::from_millis(rng.random_range(200..2_000)),
            lock_timeout: Duration::from_millis(rng.random_range(50..1_000)),
            lookup: [Lookup::None, Lookup::Status, Lookup::Unsure][rng.random_range(0..3)],
            on_unknown: if rng.random_bool(0.5) {
                OnUnknown::Retry
            } else {
                OnUnknown::Skip
            },
        };
        w.core.note(format!("effects: {settings:?}"));
        Arc::new(Self {
            world: Arc::clone(shared),
            settings,
            state: Mutex::default(),
            freed: Notify::new(),
        })
    }

    /// The world, then the effect state: always in this order.
    fn lock(&self) -> (MutexGuard<'_, World>, MutexGuard<'_, State>) {
        let w = world(&self.world);
        (w, self.state())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A round trip's time, drawn from the seed.
    async fn latency(&self) {
        let ms = world(&self.world).core.rng.random_range(0..5);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// Whether a call to the provider may be made again after its effect landed, in this
    /// seed's settings, without breaking what the docs promise.
    fn calls_again_allowed(&self) -> bool {
        self.settings.lookup != Lookup::Status && self.settings.on_unknown == OnUnknown::Retry
    }

    /// The checks after the drain; `core` is the world's, locked by the caller.
    pub(crate) fn check(&self, core: &mut Core, ids: &BTreeSet<String>) {
        let mut s = self.state();
        let s = &mut *s;
        // Whatever is still in flight lands in the end.
        s.land_due(core, None);
        for id in ids {
            let key = inbox_core::MessageId::new(id.clone())
                .unwrap()
                .idempotency_key(CONSUMER);
            let landed = s.provider.applied.contains(&key);
            match s.done.get(id) {
                Some(Settled::Skipped) if !landed => {
                    s.counts.skipped_missing += 1;
                    core.note(format!(
                        "{id} marked done without a call after an unknown outcome, and its effect never landed (OnUnknown::Skip's loss)"
                    ));
                }
                Some(settled @ (Settled::Called | Settled::Landed)) if !landed => {
                    core.violation(format!(
                        "{id} marked done as {} but its effect never landed at the provider",
                        settled.as_str()
                    ));
                }
                _ => {}
            }
            let again = s.provider.again.get(id).copied().unwrap_or(0);
            if again > 0 && !self.calls_again_allowed() {
                core.violation(format!(
                    "{id} called {again} more time(s) after its effect landed, with {:?} and \
                     {:?}: a provider without idempotency keys would have applied it again",
                    self.settings.lookup, self.settings.on_unknown
                ));
            }
        }
        let c = &s.counts;
        core.note(format!(
            "effects: {} leases, {} done marks fenced, {} zombie calls, {} calls deduplicated by key, {} skipped and missing",
            c.leases, c.fenced, c.zombie_calls, c.deduplicated, c.skipped_missing
        ));
    }
}

/// Runs an effect consumer with `life`'s settings until its life ends: `None` when it crashed.
/// The inbox's own settings (a redelivery schedule, a delivery limit, a handler timeout, the
/// order) have no effect counterpart and are left out.
pub(crate) async fn live(
    lab: &Arc<Lab>,
    source: SimSource,
    life: Life,
) -> Option<inbox_core::Result<StatsSnapshot>> {
    let consumer = Consumer::effects(CONSUMER, source, SimLeases::new(lab), SimProvider::new(lab))
        .lease(lab.settings.lease)
        .batch_size(life.batch)
        .parallel_lanes(life.lanes)
        .retry(
            RetryPolicy::default()
                .max_attempts(life.attempts)
                .backoff(Duration::from_millis(20), Duration::from_millis(200)),
        )
        .error_backoff(Duration::from_millis(20))
        .shutdown_timeout(life.shutdown);
    match life.end {
        End::Idle => Some(consumer.run_until_idle().await),
        End::Crash { polls } => CrashAfter::new(consumer.run_until_idle(), polls).await,
        End::Stop { after } => Some(consumer.run_until(tokio::time::sleep(after)).await),
    }
}
