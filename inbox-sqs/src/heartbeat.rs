//! The visibility heartbeat: keeps a message invisible to other consumers while it is handled.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::Error;

/// A running heartbeat for one received message. Dropping it stops the task at its next tick
/// (a crashed consumer's messages then come back after one visibility timeout);
/// [`Heartbeat::stop`] stops it and waits, so that no extension lands after a nack's own
/// visibility change.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Heartbeat {
    /// Starts extending the visibility of the message received with `receipt_handle` to
    /// `visibility` every third of it, so two extensions may fail before it runs out.
    pub(crate) fn start(
        client: Client,
        queue_url: Arc<str>,
        receipt_handle: Arc<str>,
        visibility: Duration,
    ) -> Self {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let period = (visibility / 3).max(Duration::from_millis(200));
        let seconds = i32::try_from(visibility.as_secs()).unwrap_or(i32::MAX);
        let task = tokio::spawn(async move {
            loop {
                // A stop (or the Ack being dropped) is only seen between calls, never during
                // one: `stop` then knows no extension is still on its way.
                tokio::select! {
                    _ = &mut stopped => return,
                    () = tokio::time::sleep(period) => {}
                }
                let result = client
                    .change_message_visibility()
                    .queue_url(&*queue_url)
                    .receipt_handle(&*receipt_handle)
                    .visibility_timeout(seconds)
                    .send()
                    .await;
                match result {
                    Ok(_) => debug!(%queue_url, seconds, "extended message visibility"),
                    Err(e) => {
                        let e = Error::sdk("ChangeMessageVisibility (heartbeat)", &queue_url, e);
                        if e.is_stale_receipt() {
                            // The message was deleted or handed out again: its other copy
                            // finds the ID claimed and is skipped, so this is only wasted work.
                            warn!(error = %e, "visibility heartbeat lost the message (receipt handle stale); a redelivered copy will be skipped by the inbox");
                            return;
                        }
                        warn!(error = %e, "visibility heartbeat failed; trying again on the next tick");
                    }
                }
            }
        });
        Self { stop, task }
    }

    /// Stops the heartbeat and waits until any extension in flight has returned.
    pub(crate) async fn stop(self) {
        // The task may have ended already (stale handle); then there is nobody to tell.
        let _ = self.stop.send(());
        if let Err(e) = self.task.await {
            if e.is_panic() {
                warn!(error = %e, "visibility heartbeat task panicked");
            }
        }
    }
}
