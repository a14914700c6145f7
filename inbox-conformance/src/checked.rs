//! Every source the scenarios run is wrapped in [`Checked`], which holds the source to what it
//! reports of itself ([`MessageSource::capabilities`]) on every delivery it hands out.

use inbox_core::{Capabilities, Delivery, Message, MessageSource, SourceError};

/// The adapter's source, checked: a source that claims delivery counts sets
/// [`Metadata::delivery_count`](inbox_core::Metadata::delivery_count) (at least 1) on every
/// delivery, and one that claims lanes sets [`Metadata::lane`](inbox_core::Metadata::lane). A
/// delivery that breaks the claim fails the scenario, naming the delivery.
#[derive(Debug)]
pub struct Checked<S> {
    inner: S,
    claims: Capabilities,
}

impl<S: MessageSource> Checked<S> {
    /// Wraps `inner`, asking it once what it claims.
    pub fn new(inner: S) -> Self {
        let claims = inner.capabilities();
        Self { inner, claims }
    }

    /// What the source claims.
    pub fn claims(&self) -> Capabilities {
        self.claims
    }

    fn check(&self, message: &Message) {
        let meta = &message.meta;
        if self.claims.delivery_count() {
            assert!(
                meta.delivery_count.is_some_and(|n| n >= 1),
                "the source claims delivery counts, but delivered {} at {} with delivery_count {:?}",
                meta.source,
                meta.position,
                meta.delivery_count
            );
        }
        if self.claims.lanes() {
            assert!(
                meta.lane.is_some(),
                "the source claims lanes, but delivered {} at {} without a lane",
                meta.source,
                meta.position
            );
        }
    }
}

impl<S: MessageSource> MessageSource for Checked<S> {
    type Ack = S::Ack;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<S::Ack>>, SourceError> {
        let batch = self.inner.receive(max).await?;
        for delivery in &batch {
            self.check(&delivery.message);
        }
        Ok(batch)
    }

    inbox_testkit::forward_source!(inner: redelivery_window, system, consumer_group);

    fn capabilities(&self) -> Capabilities {
        self.claims
    }
}
