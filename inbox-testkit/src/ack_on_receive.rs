//! The at-most-once anti-pattern over any source: every delivery acked as it is received.

use std::time::Duration;

use inbox_core::{Ack, Capabilities, Delivery, Message, MessageSource, Recovery, SourceError};

/// Wraps a source and acks each delivery the moment it is received, before the consumer sees
/// it: "ack first", the at-most-once anti-pattern the inbox exists to avoid, kept to show what
/// it loses. Never use it in production.
///
/// The broker forgets a message once it is received, so a consumer that dies, or a handler that
/// fails, before the commit loses it for good. The deliveries handed on carry
/// [`AckedOnReceive`] handles, which settle nothing.
///
/// One receive's deliveries are acked together ([`Ack::ack_all`]: one round-trip where the
/// broker allows). What an ack does is the inner source's: over a Kafka source the offsets are
/// committed at its `commit_interval`, so with a 5 s interval this is `enable.auto.commit` with
/// its 5 s timer (a kill re-reads up to 5 s of messages, and loses those received but not
/// applied). RabbitMQ's `no_ack` and Redis's `NOACK` forget a message as the broker sends it;
/// here it is acked once it reached the process, so a kill loses what the source had received
/// (about one batch), not everything the broker had pushed into the client's buffers.
///
/// When the ack fails, the receive fails with its error and hands nothing on: the messages come
/// back as unacked ones do.
///
/// ```
/// use inbox_core::Consumer;
/// use inbox_testkit::{AckOnReceive, MemoryBroker, MemoryStore, Sum};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let broker = MemoryBroker::new();
/// broker.publish(Some("evt-1"), "oops");
/// let store = MemoryStore::<i64>::new();
///
/// // The handler refuses the message; there is nowhere to park it, the broker forgot it.
/// let consumer = Consumer::new("sum", AckOnReceive::new(broker.source()), store.clone(), Sum);
/// assert!(consumer.run_until_idle().await.is_err());
/// assert_eq!(broker.pending(), 0, "gone from the broker");
/// assert!(broker.dead_letters().is_empty(), "and parked nowhere");
/// # }
/// ```
///
/// # Cancel safety
///
/// Dropped while the inner source receives, it loses what the inner source would; dropped while
/// it acks, the deliveries not yet acked come back and the others are lost.
#[derive(Debug)]
pub struct AckOnReceive<S>(S);

impl<S> AckOnReceive<S> {
    /// Wraps `source`.
    pub fn new(source: S) -> Self {
        Self(source)
    }

    /// The wrapped source.
    pub fn inner(&self) -> &S {
        &self.0
    }
}

impl<S: MessageSource> MessageSource for AckOnReceive<S> {
    type Ack = AckedOnReceive;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<AckedOnReceive>>, SourceError> {
        let (messages, acks): (Vec<_>, Vec<_>) = self
            .0
            .receive(max)
            .await?
            .into_iter()
            .map(|d| (d.message, d.ack))
            .unzip();
        if !acks.is_empty() {
            S::Ack::ack_all(acks).await?;
        }
        Ok(messages
            .into_iter()
            .map(|message| Delivery {
                message,
                ack: AckedOnReceive(()),
            })
            .collect())
    }

    crate::forward_source!(0: redelivery_window, system, consumer_group);

    /// The inner source's delivery count and lanes; no delayed nack, as a nack does nothing.
    fn capabilities(&self) -> Capabilities {
        let inner = self.0.capabilities();
        let mut capabilities = Capabilities::NONE;
        if inner.delivery_count() {
            capabilities = capabilities.with_delivery_count();
        }
        if inner.lanes() {
            capabilities = capabilities.with_lanes();
        }
        capabilities
    }
}

/// The handle of a delivery [`AckOnReceive`] acked as it was received: the broker has forgotten
/// the message, so nothing is left to settle.
#[derive(Debug)]
pub struct AckedOnReceive(());

impl Ack for AckedOnReceive {
    /// Does nothing: acked on receive.
    async fn ack(self) -> Result<(), SourceError> {
        Ok(())
    }

    /// Does nothing: the message cannot be handed back, it is lost.
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        Ok(())
    }

    /// Fails with [`Recovery::Fatal`]: the message is gone from the broker, so there is nowhere
    /// to park it and nothing to come back.
    async fn dead_letter(self, _message: &Message, reason: &str) -> Result<(), SourceError> {
        Err(SourceError::new(
            Recovery::Fatal,
            "dead letter",
            format!(
                "the message was acked on receive (AckOnReceive), so the broker forgot it and \
                 there is nowhere to park it ({reason})"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use inbox_core::{Consumer, Stage};

    use super::*;
    use crate::{Crash, MemoryBroker, MemoryStore, Sum};

    #[tokio::test]
    async fn a_message_acked_on_receive_is_lost_when_its_consumer_dies_before_the_commit() {
        let broker = MemoryBroker::new();
        broker.publish(Some("evt-1"), "100");
        broker.publish(Some("evt-2"), "5");
        let store = MemoryStore::<i64>::new();

        let crash = Crash::at(Stage::Applied);
        let consumer = Consumer::new(
            "sum",
            AckOnReceive::new(broker.source()),
            store.clone(),
            crash.handler(Sum),
        )
        .batch_size(10);
        assert!(crash.run(consumer.run_until_idle()).await.is_err());
        assert_eq!(broker.acked(), 2, "both acked as the batch was received");

        let stats = Consumer::new("sum", broker.source(), store.clone(), Sum)
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!(stats.received, 0, "nothing comes back");
        assert_eq!(store.state().await, 0, "both lost");
    }

    #[tokio::test]
    async fn a_nack_hands_nothing_back() {
        let broker = MemoryBroker::new();
        broker.publish(Some("evt-1"), "1");
        let mut source = AckOnReceive::new(broker.source());

        let delivery = source.receive(10).await.unwrap().pop().unwrap();
        assert_eq!((broker.acked(), broker.pending()), (1, 0));
        delivery.ack.nack(Duration::ZERO).await.unwrap();
        assert!(source.receive(10).await.unwrap().is_empty(), "lost");
        assert_eq!(broker.pending(), 0);
    }

    #[tokio::test]
    async fn a_refused_message_is_neither_parked_nor_redelivered() {
        let broker = MemoryBroker::new();
        broker.publish(Some("evt-1"), "not a number");
        let store = MemoryStore::<i64>::new();

        let consumer = Consumer::new(
            "sum",
            AckOnReceive::new(broker.source()),
            store.clone(),
            Sum,
        );
        let error = consumer.run_until_idle().await.unwrap_err();
        assert!(error.to_string().contains("acked on receive"), "{error}");
        assert!(broker.dead_letters().is_empty());
        assert_eq!(broker.pending(), 0);
        assert!(broker.source().receive(10).await.unwrap().is_empty());
    }

    #[test]
    fn capabilities_are_the_inner_ones_but_a_delayed_nack() {
        let broker = MemoryBroker::new();
        let inner = broker.source().capabilities();
        assert!(inner.delivery_count() && inner.delayed_nack());
        let wrapped = AckOnReceive::new(broker.source()).capabilities();
        assert!(wrapped.delivery_count());
        assert!(!wrapped.delayed_nack());
    }
}
