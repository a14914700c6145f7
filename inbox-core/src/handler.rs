//! The user's side effect.

use async_trait::async_trait;
use tracing::Instrument;

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

/// One new message of a batch, as a [`BatchHandler`] sees it.
#[derive(Debug)]
pub struct BatchItem<'a, T> {
    /// The message ID, claimed in the transaction.
    pub id: &'a MessageId,
    /// The message as received.
    pub message: &'a Message,
    /// What [`BatchHandler::decode`] made of it.
    pub item: &'a T,
}

/// Applies all new messages of a batch at once, inside the store's open transaction, so the
/// side effect can be written set-based: one `UPDATE … FROM (SELECT … unnest(…))` or
/// `INSERT … SELECT unnest(…)` (or a `COPY`) for the whole batch instead of statements per
/// message.
///
/// Each message is decoded first, before any database work: a message that does not decode is
/// dealt with on its own (a permanent error dead-letters it at once, without opening a
/// transaction) and never reaches [`BatchHandler::handle_batch`].
///
/// An error from `handle_batch` rolls back the whole transaction, claims included. The consumer
/// cannot tell which message caused it, so it applies the batch again in halves until the
/// failure is pinned on one message, which is then retried alone and dead-lettered after the
/// retry budget: `handle_batch` must give the same effect for any subset of a batch, in order,
/// as for the whole (which set-based SQL over the given items does).
///
/// Like [`Handler`], it gets nothing that could ack early, and should write only through `tx`.
#[async_trait]
pub trait BatchHandler<Tx: Send>: Send + Sync {
    /// What one message decodes to.
    type Item: Send + Sync;

    /// Decodes one message, before any database work.
    fn decode(&self, id: &MessageId, message: &Message) -> Result<Self::Item, HandlerError>;

    /// Applies `batch`, the new messages of one transaction in the order received (IDs already
    /// claimed, duplicates left out).
    async fn handle_batch(
        &self,
        tx: &mut Tx,
        batch: &[BatchItem<'_, Self::Item>],
    ) -> Result<(), HandlerError>;
}

/// A per-message [`Handler`] run as a [`BatchHandler`]: each message in turn, in one
/// transaction. [`Consumer::new`](crate::Consumer::new) wraps handlers in it.
#[derive(Debug, Clone)]
pub struct PerMessage<H>(pub H);

#[async_trait]
impl<Tx: Send, H: Handler<Tx>> BatchHandler<Tx> for PerMessage<H> {
    type Item = ();

    fn decode(&self, _id: &MessageId, _message: &Message) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut Tx,
        batch: &[BatchItem<'_, ()>],
    ) -> Result<(), HandlerError> {
        for (index, entry) in batch.iter().enumerate() {
            let span = tracing::debug_span!(
                "inbox.message",
                message_id = %entry.id.as_str().escape_debug(),
                position = %entry.message.meta.position,
            );
            self.0
                .handle(tx, entry.id, entry.message)
                .instrument(span)
                .await
                .map_err(|e| e.at(index))?;
        }
        Ok(())
    }
}
