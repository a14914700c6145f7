//! The visibility heartbeat: keeps a message invisible to other consumers while it is handled.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::ack::Shared;
use crate::delivery::Ownership;

/// A running heartbeat for one received message. Dropping it cancels the task at once, an extension in flight included (a crashed consumer's messages then come
/// back after one visibility timeout).
///
/// Stopping never waits for an extension in flight: with a stalled connection that would hold
/// the ack (and the consumer) for as long as the call hangs. The price: an extension already on
/// the wire may still land after a nack's own visibility change, and the message then comes
/// back after one visibility timeout instead of the nack's delay. Later, never lost; after an
/// ack's delete it only fails on the stale receipt handle.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    task: JoinHandle<()>,
}

impl Heartbeat {
    /// Starts extending the visibility of the message received with `receipt_handle` to
    /// `visibility` every third of it, so two extensions may fail before it runs out. When SQS
    /// refuses the handle as stale, it marks `ownership` lost and stops.
    pub(crate) fn start(
        shared: Arc<Shared>,
        receipt_handle: Arc<str>,
        visibility: Duration,
        ownership: Arc<Ownership>,
    ) -> Self {
        let period = (visibility / 3).max(Duration::from_millis(200));
        let seconds = i32::try_from(visibility.as_secs()).unwrap_or(i32::MAX);
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let operation = "ChangeMessageVisibility (heartbeat)";
                match shared
                    .change_visibility(&receipt_handle, seconds, operation)
                    .await
                {
                    Ok(()) => {
                        debug!(queue_url = %shared.queue_url, seconds, "extended message visibility")
                    }
                    Err(e) => {
                        if e.is_stale_receipt() {
                            // The message was deleted or handed out again: the delivery is
                            // stale, and the consumer drops it unless it is already applying
                            // it (then its other copy finds the ID claimed and is skipped).
                            ownership.lose();
                            warn!(error = %e, "visibility heartbeat lost the message (receipt handle stale); the delivery is stale, its other copy is the one to apply");
                            return;
                        }
                        warn!(error = %e, "visibility heartbeat failed; trying again on the next tick");
                    }
                }
            }
        });
        Self { task }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        // Aborting a task that already ended (stale handle) does nothing.
        self.task.abort();
    }
}
