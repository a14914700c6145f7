//! The rdkafka consumer shared by a source, its acks and its commit task, closed off the async
//! workers by whoever lets go of it last.
//!
//! Dropping an rdkafka consumer closes it: librdkafka revokes the assignment (the revoke commits
//! what was acked, see [`InboxContext`]), waits for outstanding commits, leaves the group, and
//! the dropping thread polls until all that is done. That waits on the network, so it must not
//! run on a tokio worker: on a current-thread runtime it would also stall every task, a local
//! proxy between the client and the broker included.

use std::ops::Deref;
use std::sync::{Arc, Weak};

use rdkafka::consumer::StreamConsumer;

use crate::context::InboxContext;

pub(crate) type Client = StreamConsumer<InboxContext>;

/// A shared handle on the consumer; the last one dropped closes it on tokio's blocking pool (or
/// in place outside a runtime).
#[derive(Clone)]
pub(crate) struct SharedConsumer {
    consumer: Arc<Client>,
    /// Declared after `consumer`, so dropped after it: when the last handle goes, this holds
    /// the only reference left and gets the consumer out. Only its `Drop` reads it.
    _last: LastRef,
}

impl SharedConsumer {
    pub(crate) fn new(consumer: Arc<Client>) -> Self {
        Self {
            _last: LastRef(Some(Arc::clone(&consumer))),
            consumer,
        }
    }

    /// A reference that does not keep the consumer open.
    pub(crate) fn downgrade(&self) -> Weak<Client> {
        Arc::downgrade(&self.consumer)
    }

    /// The consumer, unless every handle is gone.
    pub(crate) fn upgrade(weak: &Weak<Client>) -> Option<Self> {
        weak.upgrade().map(Self::new)
    }
}

impl Deref for SharedConsumer {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.consumer
    }
}

#[derive(Clone)]
struct LastRef(Option<Arc<Client>>);

impl Drop for LastRef {
    fn drop(&mut self) {
        // Every handle drops its plain reference before this one, so the last reference left is
        // always a `LastRef`, and `into_inner` hands the consumer to exactly one of them.
        let Some(consumer) = self.0.take().and_then(Arc::into_inner) else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            // If the runtime is shutting down, the task is dropped unrun, closing the consumer
            // right here, which is then the only choice left.
            Ok(runtime) => drop(runtime.spawn_blocking(move || drop(consumer))),
            Err(_) => drop(consumer),
        }
    }
}
