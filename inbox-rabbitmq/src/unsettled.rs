//! The deliveries of one channel not yet settled, as plain state: what a batch's
//! `basic.ack` may cover with `multiple`.
//!
//! A `multiple` ack of tag `t` settles every unsettled delivery of the channel up to `t`,
//! including ones the batch does not own (a delivery waiting for its delayed requeue, one whose
//! ack or nack failed and must come back). [`Unsettled::plan`] uses it only where it covers
//! exactly the batch. The channel's I/O (`RabbitAck`) tracks, plans and marks settled; nothing
//! here sends a frame, so a simulation can drive the same rules.

use std::collections::BTreeSet;

/// The delivery tags handed out on one channel and not yet acked or nacked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unsettled {
    tags: BTreeSet<u64>,
}

/// How to ack a batch: one `multiple` ack up to a tag, then single acks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AckPlan {
    /// A `basic.ack` with `multiple = true` of this tag, first.
    pub multiple_up_to: Option<u64>,
    /// Then a `basic.ack` of each of these, in order.
    pub singles: Vec<u64>,
}

impl Unsettled {
    /// No delivery out.
    pub fn new() -> Self {
        Self::default()
    }

    /// Delivery `tag` was handed to the consumer.
    pub fn track(&mut self, tag: u64) {
        self.tags.insert(tag);
    }

    /// The frames settling `tags` (single acks, nacks) are queued. Call it only then, never for
    /// a frame that failed: a tag whose frame was never sent stays unsettled, so no later
    /// `multiple` ack covers it, and the broker hands it out again when the channel closes.
    pub fn settled(&mut self, tags: impl IntoIterator<Item = u64>) {
        for tag in tags {
            self.tags.remove(&tag);
        }
    }

    /// A `multiple` ack of `tag` is queued: it settled every tag up to it.
    pub fn settled_up_to(&mut self, tag: u64) {
        self.tags.retain(|t| *t > tag);
    }

    /// Whether `tag` is out and unsettled.
    pub fn contains(&self, tag: u64) -> bool {
        self.tags.contains(&tag)
    }

    /// Splits a batch of `tags` into one `multiple` ack and single acks. The `multiple` ack
    /// covers the run of `tags` that begins at the oldest unsettled tag, and only when that run
    /// has at least two tags; so it never covers a tag some other ack or nack has yet to send.
    pub fn plan(&self, tags: &BTreeSet<u64>) -> AckPlan {
        let run: Vec<u64> = self
            .tags
            .iter()
            .take_while(|tag| tags.contains(tag))
            .copied()
            .collect();
        match run.last() {
            Some(&last) if run.len() >= 2 => AckPlan {
                multiple_up_to: Some(last),
                singles: tags.iter().copied().filter(|t| *t > last).collect(),
            },
            _ => AckPlan {
                multiple_up_to: None,
                singles: tags.iter().copied().collect(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(tags: &[u64]) -> BTreeSet<u64> {
        tags.iter().copied().collect()
    }

    fn out(tags: &[u64]) -> Unsettled {
        let mut unsettled = Unsettled::new();
        for &tag in tags {
            unsettled.track(tag);
        }
        unsettled
    }

    fn plan(multiple_up_to: Option<u64>, singles: &[u64]) -> AckPlan {
        AckPlan {
            multiple_up_to,
            singles: singles.to_vec(),
        }
    }

    #[test]
    fn a_batch_is_one_multiple_ack_only_from_the_oldest_unsettled_tag() {
        for (out_tags, batch, multiple_up_to, singles) in [
            // Contiguous from the oldest: one multiple ack.
            (&[1, 2, 3, 4][..], &[1, 2, 3][..], Some(3), &[][..]),
            // Tag 1 waits for a delayed requeue: a multiple ack of 3 would settle it too.
            (&[1, 2, 3], &[2, 3], None, &[2, 3]),
            // A gap splits the batch.
            (&[5, 6, 7, 8, 9], &[5, 6, 8, 9], Some(6), &[8, 9]),
        ] {
            assert_eq!(
                out(out_tags).plan(&set(batch)),
                plan(multiple_up_to, singles),
                "{out_tags:?} out, {batch:?} acked"
            );
        }
    }

    #[test]
    fn settling_moves_the_oldest_unsettled_tag() {
        let mut unsettled = out(&[1, 2, 3, 4, 5]);
        unsettled.settled([1]);
        assert_eq!(unsettled.plan(&set(&[2, 3])), plan(Some(3), &[]));
        unsettled.settled_up_to(3);
        assert!(!unsettled.contains(2) && !unsettled.contains(3));
        assert!(unsettled.contains(4));
        // A single tag is never a multiple ack.
        assert_eq!(unsettled.plan(&set(&[4])), plan(None, &[4]));
    }
}
