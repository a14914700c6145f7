//! The user's side effect.

use std::fmt;
use std::future::Future;

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
///
/// Implement it with an `async fn`, or build one from an async function or closure with
/// [`handler_fn`]:
///
/// ```
/// use inbox_core::{Handler, HandlerError, Message, MessageId};
/// use inbox_testkit::MemoryTx;
///
/// /// Adds the amount in each message to a balance.
/// struct Credit;
///
/// impl Handler<MemoryTx<i64>> for Credit {
///     async fn handle(&self, tx: &mut MemoryTx<i64>, _id: &MessageId, message: &Message) -> Result<(), HandlerError> {
///         *tx.state_mut() += message.json::<i64>()?;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<Tx: Send>: Send + Sync {
    /// Applies `message`, whose ID `id` has just been claimed in `tx`.
    fn handle(
        &self,
        tx: &mut Tx,
        id: &MessageId,
        message: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

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
pub trait BatchHandler<Tx: Send>: Send + Sync {
    /// What one message decodes to.
    type Item: Send + Sync;

    /// Decodes one message, before any database work.
    fn decode(&self, id: &MessageId, message: &Message) -> Result<Self::Item, HandlerError>;

    /// Applies `batch`, the new messages of one transaction in the order received (IDs already
    /// claimed, duplicates left out).
    fn handle_batch(
        &self,
        tx: &mut Tx,
        batch: &[BatchItem<'_, Self::Item>],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// A per-message [`Handler`] run as a [`BatchHandler`]: each message in turn, in one
/// transaction. [`Consumer::new`](crate::Consumer::new) wraps handlers in it.
#[derive(Debug, Clone)]
pub struct PerMessage<H>(pub H);

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
                message_id = %entry.id.escaped(),
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

/// A [`Handler`] made of an async function or closure with [`handler_fn`].
#[derive(Clone)]
pub struct HandlerFn<F>(F);

impl<F> fmt::Debug for HandlerFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerFn").finish_non_exhaustive()
    }
}

/// A [`Handler`] that calls `f` with what [`Handler::handle`] gets: the transaction, the
/// claimed ID and the message.
///
/// `f` is an async function, or an async closure with its argument types written out:
///
/// ```
/// use inbox_core::{handler_fn, Consumer, HandlerError, Message, MessageId};
/// use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), inbox_core::Error> {
/// let credit = handler_fn(async |tx: &mut MemoryTx<i64>, _id: &MessageId, message: &Message| {
///     *tx.state_mut() += message.json::<i64>()?;
///     Ok::<_, HandlerError>(())
/// });
///
/// let broker = MemoryBroker::new();
/// broker.publish(Some("evt-1"), "100");
/// let store = MemoryStore::<i64>::new();
/// Consumer::new("wallet", broker.source(), store.clone(), credit)
///     .run_until_idle()
///     .await?;
/// assert_eq!(store.state().await, 100);
///
/// // An `async fn` of that shape as well:
/// async fn audit(_: &mut MemoryTx<i64>, id: &MessageId, _: &Message) -> Result<(), HandlerError> {
///     println!("{id}");
///     Ok(())
/// }
/// # fn takes(_: impl inbox_core::Handler<MemoryTx<i64>>) {}
/// takes(handler_fn(audit));
/// # Ok(()) }
/// ```
pub fn handler_fn<F>(f: F) -> HandlerFn<F> {
    HandlerFn(f)
}

impl<Tx, F> Handler<Tx> for HandlerFn<F>
where
    Tx: Send,
    F: for<'t, 'i, 'm> HandlerCall<'t, 'i, 'm, Tx> + Send + Sync,
{
    fn handle(
        &self,
        tx: &mut Tx,
        id: &MessageId,
        message: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        (self.0)(tx, id, message)
    }
}

/// `Fn(&mut Tx, &MessageId, &Message)` returning a `Send` future that may borrow the three:
/// the bound of [`handler_fn`]'s function, which stable Rust cannot write out in a `where`
/// clause. Implemented for every such function; not to be implemented by hand.
pub trait HandlerCall<'t, 'i, 'm, Tx: 't>:
    Fn(&'t mut Tx, &'i MessageId, &'m Message) -> Self::Future
{
    /// The future the function returns.
    type Future: Future<Output = Result<(), HandlerError>> + Send;
}

impl<'t, 'i, 'm, Tx: 't, F, Fut> HandlerCall<'t, 'i, 'm, Tx> for F
where
    F: Fn(&'t mut Tx, &'i MessageId, &'m Message) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>> + Send,
{
    type Future = Fut;
}
