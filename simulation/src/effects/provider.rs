//! A provider behind an [`EffectHandler`]: calls that land, fail, or time out past the lease
//! before or after landing, a status lookup answering as the seed's [`Lookup`] can, and a
//! `record` that fails or hangs. The provider deduplicates on the idempotency key, as one with
//! keys does, and counts what it would have applied twice without them.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::effect::{not_applied, Effect, EffectHandler, Landed, OnUnknown, Settled};
use inbox_core::{HandlerError, Message};
use rand::RngExt;
use tokio::time::Instant;

use super::leases::LeaseTx;
use super::{Lab, Lookup, CONSUMER};
use crate::handler::HANDLER_PANIC;

/// What a call does, drawn per call.
#[derive(Debug, Clone, Copy)]
enum Call {
    /// Lands after a while and answers `Ok`.
    Lands,
    /// Refused before doing anything (a `429`): not applied, and the consumer is told so.
    Refused,
    /// Refused for good (a `400`): not applied.
    Rejected,
    /// Cut before it reached the provider, and the consumer cannot tell: outcome unknown.
    LostBefore,
    /// Landed, but the answer was lost: outcome unknown.
    LostAfter,
    /// Landed, then hangs past the lease: dropped by the consumer, outcome unknown.
    HangsAfter,
    /// Hangs past the lease, and lands after the consumer dropped it.
    HangsBefore,
    /// Panics before it sends anything.
    Panics,
}

/// The seed's provider and the handler that calls it.
#[derive(Debug, Clone)]
pub(crate) struct SimProvider {
    lab: Arc<Lab>,
}

impl SimProvider {
    pub(crate) fn new(lab: &Arc<Lab>) -> Self {
        Self {
            lab: Arc::clone(lab),
        }
    }

    /// Checks the call's key and lease, lands the calls in flight that are due, and draws what
    /// this call does and how long it takes.
    fn start(&self, effect: &Effect, message: &Message) -> (Call, Duration) {
        let (mut w, mut s) = self.lab.lock();
        let (core, s) = (&mut w.core, &mut *s);
        s.land_due(core, Some(Instant::now()));
        let id = effect.id().as_str();
        let key = effect.idempotency_key();
        if message.id.as_ref().ok() != Some(effect.id()) {
            core.violation(format!(
                "a call for {id} made with the effect of another message ({:?})",
                message.id
            ));
        }
        let expected = effect.id().idempotency_key(CONSUMER);
        let first = s
            .provider
            .keys
            .entry(id.to_owned())
            .or_insert_with(|| key.to_owned());
        if key != expected || key != first {
            core.violation(format!(
                "a call for {id} carries the key {key:?}, not its one key {expected:?} (first call: {first:?})"
            ));
        }
        let row = s.rows.get(id).map(|r| (r.token, r.done));
        if row != Some((effect.token(), false)) {
            core.violation(format!(
                "a call for {id} starts under token {}, but the row is at (token, done) {row:?}",
                effect.token()
            ));
        }
        let roll: f64 = if core.faults { core.rng.random() } else { 1.0 };
        let call = if core.poison.contains(id) {
            Call::LostBefore
        } else if roll < 0.06 {
            Call::Refused
        } else if roll < 0.07 {
            Call::Rejected
        } else if roll < 0.11 {
            Call::LostBefore
        } else if roll < 0.15 {
            Call::LostAfter
        } else if roll < 0.17 {
            Call::HangsAfter
        } else if roll < 0.20 {
            Call::HangsBefore
        } else if roll < 0.205 {
            Call::Panics
        } else {
            Call::Lands
        };
        let lease = self.lab.settings.lease.as_millis() as u64;
        let took = Duration::from_millis(core.rng.random_range(1..=(lease / 4).max(2)));
        core.note(format!(
            "call {id} token {} ({:?}): {call:?} after {took:?}",
            effect.token(),
            effect.attempt()
        ));
        (call, took)
    }

    fn land(&self, effect: &Effect) {
        let (mut w, mut s) = self.lab.lock();
        let key = effect.idempotency_key();
        s.land(&mut w.core, effect.id().as_str(), key, effect.token());
    }
}

impl EffectHandler<LeaseTx> for SimProvider {
    fn on_unknown(&self) -> OnUnknown {
        self.lab.settings.on_unknown
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        let (call, took) = self.start(effect, message);
        // Past the lease: the consumer drops the call first.
        let past_lease = effect.remaining() + Duration::from_secs(5);
        match call {
            Call::Lands => {
                tokio::time::sleep(took).await;
                self.land(effect);
                Ok(())
            }
            Call::Refused => {
                tokio::time::sleep(took).await;
                Err(not_applied("429: rate limited"))
            }
            Call::Rejected => {
                tokio::time::sleep(took).await;
                Err(HandlerError::permanent("400: refused"))
            }
            Call::LostBefore => {
                tokio::time::sleep(took).await;
                Err(HandlerError::transient("timed out"))
            }
            Call::LostAfter => {
                tokio::time::sleep(took).await;
                self.land(effect);
                Err(HandlerError::transient("connection reset after sending"))
            }
            Call::HangsAfter => {
                tokio::time::sleep(took).await;
                self.land(effect);
                tokio::time::sleep(past_lease).await;
                Ok(())
            }
            Call::HangsBefore => {
                {
                    let lands = Instant::now() + effect.remaining() + took;
                    let mut s = self.lab.state();
                    let (id, key) = (effect.id().to_string(), effect.idempotency_key());
                    s.provider
                        .in_flight
                        .push((lands, id, key.to_owned(), effect.token()));
                }
                tokio::time::sleep(past_lease).await;
                Ok(())
            }
            Call::Panics => panic!("{}", HANDLER_PANIC),
        }
    }

    async fn landed(&self, effect: &Effect, _message: &Message) -> Result<Landed, HandlerError> {
        let lookup = self.lab.settings.lookup;
        if lookup == Lookup::None {
            return Ok(Landed::Unknown);
        }
        self.lab.latency().await;
        let (mut w, mut s) = self.lab.lock();
        let core = &mut w.core;
        s.land_due(core, Some(Instant::now()));
        let (id, key) = (effect.id().as_str(), effect.idempotency_key());
        let answer = if core.fault(0.05) {
            Err(HandlerError::transient("status lookup timed out"))
        } else if lookup == Lookup::Unsure && core.rng.random_bool(0.3) {
            Ok(Landed::Unknown)
        } else if s.provider.applied.contains(key) {
            Ok(Landed::Yes)
        } else if s.provider.in_flight.iter().any(|(_, _, k, _)| k == key) {
            Ok(Landed::Pending)
        } else {
            Ok(Landed::No)
        };
        core.note(format!(
            "status of {id} token {}: {answer:?}",
            effect.token()
        ));
        answer
    }

    async fn record(
        &self,
        tx: &mut LeaseTx,
        effect: &Effect,
        settled: Settled,
        _message: &Message,
    ) -> Result<(), HandlerError> {
        let id = effect.id().as_str();
        let roll: f64 = {
            let mut w = crate::world::world(&self.lab.world);
            let core = &mut w.core;
            if tx.marked() != Some((id, effect.token())) {
                core.violation(format!(
                    "record of {id} token {} runs without its done mark in the transaction ({:?})",
                    effect.token(),
                    tx.marked()
                ));
            }
            if core.faults {
                core.rng.random()
            } else {
                1.0
            }
        };
        if roll < 0.03 {
            return Err(HandlerError::transient("the ledger table is locked"));
        }
        if roll < 0.04 {
            return Err(HandlerError::permanent("the ledger refuses the row"));
        }
        if roll < 0.06 {
            tokio::time::sleep(effect.remaining() + Duration::from_millis(100)).await;
        }
        tx.writes.push((id.to_owned(), effect.token(), settled));
        Ok(())
    }
}
