//! The dead-letter path of an [`EffectConsumer`](super::EffectConsumer): parking a message on
//! the source's dead-letter destination and acking it, through its handle, then releasing its
//! lease; when parking failed the handle has left the message to come back.

use tracing::warn;

use super::apply::{outcome, Core};
use super::stats::Counter;
use super::{escaped, Effect, EffectHandler, LeaseStore, Release};
use crate::{Ack, Delivery, Error, MessageId, Recovery, Result, SourceError};

impl<L, H> Core<L, H>
where
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    /// Dead-letters a message this attempt holds the lease of, then releases the lease (as
    /// dead-lettered when parked, so a replay starts a fresh budget).
    pub(super) async fn dead_letter_leased<A: Ack>(
        &self,
        effect: &Effect,
        delivery: Delivery<A>,
        reason: String,
        not_applied: bool,
    ) -> Result<()> {
        let parked = self.park(Some(effect.id()), delivery, &reason).await;
        let release = Release {
            not_applied,
            dead_lettered: matches!(parked, Ok(true)),
        };
        self.release(effect, release).await;
        self.settle_dead_letter(parked)
    }

    pub(super) async fn dead_letter<A: Ack>(
        &self,
        id: Option<&MessageId>,
        delivery: Delivery<A>,
        reason: String,
    ) -> Result<()> {
        let parked = self.park(id, delivery, &reason).await;
        self.settle_dead_letter(parked)
    }

    /// Parks and acks the message; `Ok(false)` when that failed and the message comes back.
    async fn park<A: Ack>(
        &self,
        id: Option<&MessageId>,
        delivery: Delivery<A>,
        reason: &str,
    ) -> Result<bool, SourceError> {
        let shown = id.map_or_else(|| "(no ID)".to_owned(), |id| escaped(id).to_string());
        let Delivery { message, ack } = delivery;
        let position = message.meta.position.escape_debug();
        match ack.dead_letter(&message, reason).await {
            Ok(()) => {
                self.count(Counter::DeadLettered);
                outcome("dead_lettered");
                warn!(consumer = %self.name, message_id = %shown, %position, outcome = "dead_lettered", %reason, "dead-lettered {shown}");
                Ok(true)
            }
            Err(e) if e.recovery() == Recovery::Fatal => Err(e),
            Err(e) => {
                self.count(Counter::Error);
                outcome("handed_back");
                tracing::error!(consumer = %self.name, message_id = %shown, error = %e, %reason, "dead-letter failed; the message is not acked and comes back from the broker");
                Ok(false)
            }
        }
    }

    fn settle_dead_letter(&self, parked: Result<bool, SourceError>) -> Result<()> {
        match parked {
            Ok(_) => Ok(()),
            Err(e) => {
                self.count(Counter::Error);
                Err(Error::Source(e))
            }
        }
    }
}
