//! The user's side effect.

use async_trait::async_trait;

use crate::{HandlerError, Message, MessageId};

/// Applies one message's side effect inside the store's open transaction.
///
/// The handler gets the transaction and the message, and nothing that could acknowledge the
/// message early: the consumer acks only after the transaction commits. Return an error (or panic)
/// and everything the handler wrote rolls back together with the inbox claim.
///
/// Write only through `tx`. A side effect outside the transaction (an HTTP call, an email) is not
/// covered: pass the provider an idempotency key derived from `id` instead.
#[async_trait]
pub trait Handler<Tx: Send>: Send + Sync {
    /// Applies `message`, whose ID `id` has just been claimed in `tx`.
    async fn handle(
        &self,
        tx: &mut Tx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError>;
}

#[async_trait]
impl<Tx: Send, H: Handler<Tx> + ?Sized> Handler<Tx> for std::sync::Arc<H> {
    async fn handle(
        &self,
        tx: &mut Tx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        (**self).handle(tx, id, message).await
    }
}
