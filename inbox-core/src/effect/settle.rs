//! How an [`Effects`] step settles a message outside the happy path: the lease released, the
//! ack, a hand-back (with the delay remembered), a dead letter.

use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::apply::{outcome, Effects};
use super::{Effect, EffectHandler, LeaseStore, Release};
use crate::{Ack, Delivery, MessageId, Result};

impl<L, H> Effects<L, H>
where
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    pub(super) async fn release(&self, effect: &Effect, release: Release) {
        match self
            .leases
            .release(&self.common.name, effect.id(), effect.token(), release)
            .await
        {
            Ok(true) => {}
            Ok(false) => debug!(
                token = effect.token(),
                "lease already taken over; nothing to release"
            ),
            Err(e) => {
                warn!(error = %e, "releasing the lease failed; the next copy waits for it to run out")
            }
        }
    }

    pub(super) async fn ack<A: Ack>(&self, id: &MessageId, ack: A) {
        self.common.ack_all(vec![(id.clone(), ack)]).await;
    }

    pub(super) async fn hand_back<A: Ack>(&self, ack: A) {
        self.common.hand_back(vec![ack]).await;
    }

    /// Gives a message back for redelivery after `wait`, and remembers not to try it sooner.
    pub(super) async fn hand_back_for<A: Ack>(&self, id: &MessageId, ack: A, wait: Duration) {
        self.not_before
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), Instant::now() + wait);
        self.common.nack(ack, wait).await;
    }

    /// How much longer a message handed back with a delay must wait, if it came back early.
    pub(super) fn too_early(&self, id: &MessageId) -> Option<Duration> {
        let not_before = self.not_before.lock().unwrap_or_else(|e| e.into_inner());
        let wait = not_before
            .get(id.as_str())?
            .saturating_duration_since(Instant::now());
        (!wait.is_zero()).then_some(wait)
    }

    /// Dead-letters a message this attempt holds the lease of, then releases the lease (as
    /// dead-lettered when parked, so a replay starts a fresh budget).
    pub(super) async fn dead_letter_leased<A: Ack>(
        &self,
        effect: &Effect,
        delivery: Delivery<A>,
        reason: String,
        not_applied: bool,
    ) -> Result<()> {
        let parked = self.park(Some(effect.id()), delivery, reason).await;
        let release = Release {
            not_applied,
            dead_lettered: matches!(parked, Ok(true)),
        };
        self.release(effect, release).await;
        parked.map(drop)
    }

    /// Parks and acks the message; `Ok(false)` when that failed and the message comes back.
    pub(super) async fn park<A: Ack>(
        &self,
        id: Option<&MessageId>,
        delivery: Delivery<A>,
        reason: String,
    ) -> Result<bool> {
        let parked = self.common.dead_letter(id, delivery, reason).await;
        if let Ok(parked) = parked {
            outcome(if parked {
                "dead_lettered"
            } else {
                "handed_back"
            });
        }
        parked
    }
}

impl Release {
    /// A lease given up with its call's outcome unknown.
    pub(super) fn unknown() -> Self {
        Release {
            not_applied: false,
            dead_lettered: false,
        }
    }
}
