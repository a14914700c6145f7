//! `basic.ack` after the commit, batched with `multiple` where that is safe; delayed requeues.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use inbox_core::{async_trait, Ack, SourceError};
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{Channel, Connection};

use crate::Error;

/// One connection and its consuming channel. Deliveries keep it alive until they are settled:
/// an ack must go to the channel its delivery came on, never to a newer one.
pub(crate) struct Link {
    pub(crate) generation: u64,
    /// Held so the connection closes only when the source and every delivery from it are gone.
    pub(crate) connection: Connection,
    pub(crate) channel: Channel,
    /// Delivery tags handed to the consumer and not yet acked or nacked, so `ack_all` knows when
    /// one `multiple` ack covers exactly the tags it was given and nothing else.
    pub(crate) unsettled: Mutex<BTreeSet<u64>>,
}

impl Link {
    fn unsettled(&self) -> MutexGuard<'_, BTreeSet<u64>> {
        self.unsettled.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn track(&self, tag: u64) {
        self.unsettled().insert(tag);
    }

    pub(crate) fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    fn position(&self, tag: u64) -> String {
        format!(
            "connection {} channel {} tag {tag}",
            self.generation,
            self.channel.id()
        )
    }

    async fn ack(&self, tag: u64, multiple: bool) -> Result<(), Error> {
        // lapin accepts an ack on a channel the broker already closed and then drops it; the
        // delivery is redelivered, so the caller must hear about it.
        if !self.is_open() {
            return Err(self.closed("ack", tag));
        }
        self.channel
            .basic_ack(tag, BasicAckOptions { multiple })
            .await
            .map_err(|e| self.failed("ack", tag, e))
    }

    async fn nack(&self, tag: u64) -> Result<(), Error> {
        self.unsettled().remove(&tag);
        if !self.is_open() {
            return Err(self.closed("nack", tag));
        }
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        self.channel
            .basic_nack(tag, options)
            .await
            .map_err(|e| self.failed("nack", tag, e))
    }

    fn closed(&self, action: &'static str, tag: u64) -> Error {
        Error::ChannelClosed {
            action,
            position: self.position(tag),
        }
    }

    fn failed(&self, action: &'static str, tag: u64, e: lapin::Error) -> Error {
        match e.kind() {
            lapin::ErrorKind::InvalidChannelState(..)
            | lapin::ErrorKind::InvalidConnectionState(_)
            | lapin::ErrorKind::InvalidChannel(_) => self.closed(action, tag),
            _ => Error::amqp(format!("{action} of {}", self.position(tag)), e),
        }
    }
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("generation", &self.generation)
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

/// Acknowledges one RabbitMQ delivery: `basic.ack` on the channel it arrived on.
///
/// - [`Ack::ack`]: `basic.ack`. If the channel has closed in the meantime the ack cannot be sent;
///   the error says [`Recovery::Reconnect`](inbox_core::Recovery::Reconnect), the core logs it,
///   and the broker redelivers the message (flagged `redelivered`), which the inbox skips.
/// - [`Ack::ack_all`]: one `basic.ack` with `multiple = true` for the longest run of the batch
///   that starts at the channel's oldest unsettled delivery (so it cannot settle a delivery the
///   batch does not own, such as one waiting for a delayed requeue); the rest one by one.
/// - [`Ack::nack`]: a **delayed requeue**: a spawned task sleeps `retry_after`, then sends
///   `basic.nack` with `requeue = true`. The message keeps its prefetch slot while it waits, and
///   the other `prefetch - 1` slots keep flowing, so one failing message cannot starve the queue.
///   On a quorum queue the requeue increments `x-delivery-count` and counts toward
///   `x-delivery-limit`. If the process dies while waiting, the broker requeues it anyway.
#[derive(Debug)]
pub struct RabbitAck {
    /// `None` in [`AckMode::NoAck`](crate::AckMode::NoAck): the broker already forgot it.
    pub(crate) link: Option<Arc<Link>>,
    pub(crate) tag: u64,
}

#[async_trait]
impl Ack for RabbitAck {
    async fn ack(self) -> Result<(), SourceError> {
        let Some(link) = self.link else { return Ok(()) };
        link.unsettled().remove(&self.tag);
        Ok(link.ack(self.tag, false).await?)
    }

    async fn nack(self, retry_after: Duration) -> Result<(), SourceError> {
        let Some(link) = self.link else { return Ok(()) };
        if retry_after.is_zero() {
            return Ok(link.nack(self.tag).await?);
        }
        let tag = self.tag;
        tokio::spawn(async move {
            tokio::time::sleep(retry_after).await;
            if let Err(e) = link.nack(tag).await {
                tracing::warn!(error = %e, "delayed requeue failed; the broker redelivers the message when the channel closes");
            }
        });
        Ok(())
    }

    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        // Group by link: deliveries of a closed connection cannot be acked with the live ones.
        let mut groups: HashMap<u64, (Arc<Link>, BTreeSet<u64>)> = HashMap::new();
        for ack in acks {
            if let Some(link) = ack.link {
                groups
                    .entry(link.generation)
                    .or_insert_with(|| (link, BTreeSet::new()))
                    .1
                    .insert(ack.tag);
            }
        }
        let mut first_error = None;
        for (link, tags) in groups.into_values() {
            let (multiple_up_to, singles) = plan(&mut link.unsettled(), &tags);
            let mut result = Ok(());
            if let Some(last) = multiple_up_to {
                result = link.ack(last, true).await;
            }
            for tag in singles {
                if result.is_err() {
                    break;
                }
                result = link.ack(tag, false).await;
            }
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// Splits `tags` into one `multiple` ack (up to the returned tag) and single acks, and removes
/// them all from `unsettled`. The `multiple` ack covers the run of `tags` that begins at the
/// oldest unsettled tag, and only when that run has at least two tags.
fn plan(unsettled: &mut BTreeSet<u64>, tags: &BTreeSet<u64>) -> (Option<u64>, Vec<u64>) {
    let run: Vec<u64> = unsettled
        .iter()
        .take_while(|tag| tags.contains(tag))
        .copied()
        .collect();
    for tag in tags {
        unsettled.remove(tag);
    }
    match run.last() {
        Some(&last) if run.len() >= 2 => {
            let singles = tags.iter().copied().filter(|t| *t > last).collect();
            (Some(last), singles)
        }
        _ => (None, tags.iter().copied().collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(tags: &[u64]) -> BTreeSet<u64> {
        tags.iter().copied().collect()
    }

    #[test]
    fn a_contiguous_batch_is_one_multiple_ack() {
        let mut unsettled = set(&[1, 2, 3, 4]);
        assert_eq!(plan(&mut unsettled, &set(&[1, 2, 3])), (Some(3), vec![]));
        assert_eq!(unsettled, set(&[4]));
    }

    #[test]
    fn an_older_unsettled_delivery_forces_single_acks() {
        // Tag 1 waits for a delayed requeue: a multiple ack of 3 would settle it too.
        let mut unsettled = set(&[1, 2, 3]);
        assert_eq!(plan(&mut unsettled, &set(&[2, 3])), (None, vec![2, 3]));
        assert_eq!(unsettled, set(&[1]));
    }

    #[test]
    fn a_gap_splits_the_batch() {
        let mut unsettled = set(&[5, 6, 7, 8, 9]);
        assert_eq!(
            plan(&mut unsettled, &set(&[5, 6, 8, 9])),
            (Some(6), vec![8, 9])
        );
        assert_eq!(unsettled, set(&[7]));
    }
}
