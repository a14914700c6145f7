//! The dead-letter path of an [`EffectConsumer`](super::EffectConsumer): parking a message on
//! the source's dead-letter destination, releasing its lease, then acking it, or handing it back
//! when parking failed.

use tracing::warn;

use super::apply::{outcome, Core};
use super::stats::Counter;
use super::{Effect, EffectHandler, LeaseStore, Release};
use crate::{Ack, Delivery, Error, MessageId, MessageSource, Recovery, Result, SourceError};

impl<L, H> Core<L, H>
where
    L: LeaseStore,
    H: EffectHandler<L::Tx>,
{
    /// Dead-letters a message this attempt holds the lease of, then releases the lease (as
    /// dead-lettered when parked, so a replay starts a fresh budget).
    pub(super) async fn dead_letter_leased<S: MessageSource>(
        &self,
        source: &mut S,
        effect: &Effect,
        delivery: Delivery<S::Ack>,
        reason: String,
        not_applied: bool,
    ) -> Result<()> {
        let parked = self
            .park(source, Some(effect.id()), &delivery, &reason)
            .await;
        let dead_lettered = matches!(parked, Ok(true));
        let release = Release {
            not_applied,
            dead_lettered,
        };
        self.release(effect, release).await;
        self.settle_dead_letter(parked, delivery.ack).await
    }

    pub(super) async fn dead_letter<S: MessageSource>(
        &self,
        source: &mut S,
        id: Option<&MessageId>,
        delivery: Delivery<S::Ack>,
        reason: String,
    ) -> Result<()> {
        let parked = self.park(source, id, &delivery, &reason).await;
        self.settle_dead_letter(parked, delivery.ack).await
    }

    /// Parks the message; `Ok(false)` when that failed and the message goes back to the broker.
    async fn park<S: MessageSource>(
        &self,
        source: &mut S,
        id: Option<&MessageId>,
        delivery: &Delivery<S::Ack>,
        reason: &str,
    ) -> Result<bool, SourceError> {
        let shown = id.map_or_else(
            || "(no ID)".to_owned(),
            |id| id.as_str().escape_debug().to_string(),
        );
        let position = &delivery.message.meta.position;
        match source.dead_letter(&delivery.message, reason).await {
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
                tracing::error!(consumer = %self.name, message_id = %shown, error = %e, %reason, "dead-letter failed; the message is handed back to the broker");
                Ok(false)
            }
        }
    }

    async fn settle_dead_letter<A: Ack>(
        &self,
        parked: Result<bool, SourceError>,
        ack: A,
    ) -> Result<()> {
        match parked {
            Ok(true) => {
                if let Err(e) = ack.ack().await {
                    self.count(Counter::AckFailure);
                    warn!(consumer = %self.name, error = %e, "ack after dead-letter failed; the copy will be dead-lettered again");
                }
                Ok(())
            }
            Ok(false) => {
                self.hand_back(ack).await;
                Ok(())
            }
            Err(e) => {
                self.count(Counter::Error);
                Err(Error::Source(e))
            }
        }
    }
}
