//! Per-partition bookkeeping of in-flight offsets: what may be committed, and when.
//!
//! Kafka commits a position, not a message: committing offset 8 on a partition says "everything
//! before 8 is done". With several messages in flight (a batch, a failed one retried after the
//! rest of its batch), only the contiguous finished prefix of each partition may be committed;
//! an ack of offset 7 while 5 is unfinished commits nothing yet.
//!
//! Each partition's state carries a generation, renewed when the partition is revoked and later
//! seen again, so an ack of a message received before a rebalance never commits for the new
//! assignment.
//!
//! The tracker also remembers, per partition, the end of the finished prefix and the highest
//! offset already handed to a commit request: a partition whose prefix grew past it is *dirty*,
//! and the next commit (the commit task's, a revoke's, the close's) takes it.

use std::collections::{BTreeMap, HashMap};

/// Where an acked message leaves its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tracked {
    /// The generation the message was received in.
    pub(crate) generation: u64,
    /// How often this offset was handed out in this generation, this time included.
    pub(crate) delivery_count: u32,
    /// How often this offset was handed back under a redelivery schedule, in this generation.
    pub(crate) redeliveries: u32,
}

#[derive(Debug, Default)]
struct Partition {
    generation: u64,
    /// Received offsets, `true` once finished.
    in_flight: BTreeMap<i64, bool>,
    /// Offsets handed back with a nack, and how often.
    nacked: HashMap<i64, u32>,
    /// Offsets handed back under a redelivery schedule, and their redelivery count.
    redelivered: HashMap<i64, u32>,
    /// The offset after the finished prefix: what may be committed.
    finished_to: Option<i64>,
    /// The highest offset handed to a commit request; below `finished_to`, the partition is dirty.
    sent: Option<i64>,
}

impl Partition {
    /// The offset to commit, if the finished prefix grew past what was last sent.
    fn dirty(&self) -> Option<i64> {
        self.finished_to.filter(|&to| self.sent < Some(to))
    }
}

/// One partition's offset to commit: the next offset to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Commit {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

/// In-flight offsets of every partition this consumer has received from.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    partitions: HashMap<String, HashMap<i32, Partition>>,
    next_generation: u64,
    /// Partitions paused for a delayed redelivery, and until when; kept across revokes, so a
    /// partition paused by this consumer is resumed by it whatever the assignment became.
    paused: HashMap<(String, i32), std::time::Instant>,
}

impl Tracker {
    /// Records a received message.
    pub(crate) fn received(&mut self, topic: &str, partition: i32, offset: i64) -> Tracked {
        let next_generation = &mut self.next_generation;
        let state = self
            .partitions
            .entry(topic.to_owned())
            .or_default()
            .entry(partition)
            .or_insert_with(|| {
                *next_generation += 1;
                Partition {
                    generation: *next_generation,
                    ..Partition::default()
                }
            });
        state.in_flight.insert(offset, false);
        Tracked {
            generation: state.generation,
            delivery_count: 1 + state.nacked.get(&offset).copied().unwrap_or(0),
            redeliveries: state.redelivered.get(&offset).copied().unwrap_or(0),
        }
    }

    /// Marks a message finished. Returns the offset to commit (the next one to read) when the
    /// finished prefix grew, `None` when an earlier message is still unfinished or the message
    /// belongs to an assignment that is gone.
    pub(crate) fn finish(
        &mut self,
        topic: &str,
        partition: i32,
        generation: u64,
        offset: i64,
    ) -> Option<i64> {
        let state = self.current(topic, partition, generation)?;
        let done = state.in_flight.get_mut(&offset)?;
        *done = true;
        state.nacked.remove(&offset);
        state.redelivered.remove(&offset);
        let mut commit = None;
        while let Some(entry) = state.in_flight.first_entry() {
            if !*entry.get() {
                break;
            }
            commit = Some(*entry.key() + 1);
            entry.remove();
        }
        if commit.is_some() {
            state.finished_to = commit;
        }
        commit
    }

    /// Takes every dirty partition's offset for one commit request; they count as sent.
    pub(crate) fn take_dirty(&mut self) -> Vec<Commit> {
        let mut out = Vec::new();
        for (topic, partitions) in &mut self.partitions {
            for (&partition, state) in partitions.iter_mut() {
                if let Some(offset) = state.dirty() {
                    state.sent = Some(offset);
                    out.push(Commit {
                        topic: topic.clone(),
                        partition,
                        offset,
                    });
                }
            }
        }
        out
    }

    /// `offset` is being committed for the partition by a request made elsewhere (a synchronous
    /// ack).
    pub(crate) fn sending(&mut self, topic: &str, partition: i32, generation: u64, offset: i64) {
        if let Some(state) = self.current(topic, partition, generation) {
            state.sent = state.sent.max(Some(offset));
        }
    }

    /// A commit of `offset` failed: unless a later request covers the partition, it is dirty
    /// again and the next commit retries it.
    pub(crate) fn commit_failed(&mut self, topic: &str, partition: i32, offset: i64) {
        let state = self
            .partitions
            .get_mut(topic)
            .and_then(|partitions| partitions.get_mut(&partition));
        if let Some(state) = state {
            if state.sent <= Some(offset) {
                state.sent = None;
            }
        }
    }

    /// A message is handed back: it and everything received after it on its partition will be
    /// read again. Returns `true` when the caller must seek the partition back to `offset`;
    /// `false` when an earlier rewind already covers it or the assignment is gone.
    pub(crate) fn rewind(
        &mut self,
        topic: &str,
        partition: i32,
        generation: u64,
        offset: i64,
    ) -> bool {
        let Some(state) = self.current(topic, partition, generation) else {
            return false;
        };
        if !state.in_flight.contains_key(&offset) {
            return false;
        }
        // Later offsets come again after the seek; their acks from this round must not commit.
        drop(state.in_flight.split_off(&offset));
        *state.nacked.entry(offset).or_insert(0) += 1;
        true
    }

    /// Notes that `offset` comes back as redelivery `count` of a schedule, and that its
    /// partition is paused until `until` (or later, when another delay already reaches further).
    pub(crate) fn delay(
        &mut self,
        topic: &str,
        partition: i32,
        generation: u64,
        offset: i64,
        count: u32,
        until: std::time::Instant,
    ) {
        if let Some(state) = self.current(topic, partition, generation) {
            state.redelivered.insert(offset, count);
        }
        let paused = self
            .paused
            .entry((topic.to_owned(), partition))
            .or_insert(until);
        *paused = (*paused).max(until);
    }

    /// Whether the partition's pause has run out (or there is none): then it is taken off the
    /// list and the caller resumes it.
    pub(crate) fn pause_over(&mut self, topic: &str, partition: i32) -> bool {
        let key = (topic.to_owned(), partition);
        match self.paused.get(&key) {
            Some(until) if *until > std::time::Instant::now() => false,
            _ => {
                self.paused.remove(&key);
                true
            }
        }
    }

    /// The partition was revoked: forget its in-flight messages (late acks for them are
    /// ignored) and return its finished prefix if it was not committed yet, for a last commit.
    pub(crate) fn revoke(&mut self, topic: &str, partition: i32) -> Option<Commit> {
        let state = self.partitions.get_mut(topic)?.remove(&partition)?;
        state.dirty().map(|offset| Commit {
            topic: topic.to_owned(),
            partition,
            offset,
        })
    }

    /// Whether a message received in `generation` still belongs to the partition's current
    /// assignment; after a revoke its acks do nothing and the partition is read again.
    pub(crate) fn is_current(&mut self, topic: &str, partition: i32, generation: u64) -> bool {
        self.current(topic, partition, generation).is_some()
    }

    /// The number of unfinished messages, for logs.
    pub(crate) fn unfinished(&self) -> usize {
        self.partitions
            .values()
            .flat_map(HashMap::values)
            .map(|p| p.in_flight.values().filter(|done| !**done).count())
            .sum()
    }

    fn current(&mut self, topic: &str, partition: i32, generation: u64) -> Option<&mut Partition> {
        self.partitions
            .get_mut(topic)?
            .get_mut(&partition)
            .filter(|state| state.generation == generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_only_the_contiguous_finished_prefix() {
        let mut t = Tracker::default();
        let g = t.received("t", 0, 5).generation;
        t.received("t", 0, 6);
        t.received("t", 0, 7);
        assert_eq!(t.finish("t", 0, g, 7), None, "5 is unfinished");
        assert_eq!(t.finish("t", 0, g, 6), None);
        assert_eq!(t.finish("t", 0, g, 5), Some(8));
        assert_eq!(t.unfinished(), 0);
    }

    #[test]
    fn partitions_are_independent() {
        let mut t = Tracker::default();
        let g0 = t.received("t", 0, 10).generation;
        let g1 = t.received("t", 1, 3).generation;
        t.received("t", 0, 11);
        assert_eq!(t.finish("t", 1, g1, 3), Some(4));
        assert_eq!(t.finish("t", 0, g0, 11), None);
        assert_eq!(t.finish("t", 0, g0, 10), Some(12));
    }

    #[test]
    fn acks_from_a_revoked_assignment_commit_nothing() {
        let mut t = Tracker::default();
        let old = t.received("t", 0, 5).generation;
        t.revoke("t", 0);
        assert_eq!(t.finish("t", 0, old, 5), None);
        // The partition comes back and offset 5 is read again.
        let new = t.received("t", 0, 5).generation;
        assert_ne!(old, new);
        assert_eq!(t.finish("t", 0, old, 5), None);
        assert_eq!(t.finish("t", 0, new, 5), Some(6));
    }

    #[test]
    fn finished_prefixes_are_taken_once_and_again_after_a_failed_commit() {
        let mut t = Tracker::default();
        let g = t.received("t", 0, 5).generation;
        t.received("t", 0, 6);
        t.received("t", 1, 0);
        assert!(t.take_dirty().is_empty(), "nothing finished");
        t.finish("t", 0, g, 6);
        assert!(t.take_dirty().is_empty(), "5 is unfinished");
        t.finish("t", 0, g, 5);
        let commit = Commit {
            topic: "t".into(),
            partition: 0,
            offset: 7,
        };
        assert_eq!(t.take_dirty(), vec![commit.clone()]);
        assert!(t.take_dirty().is_empty(), "already sent");
        t.commit_failed("t", 0, 7);
        assert_eq!(
            t.take_dirty(),
            vec![commit.clone()],
            "retried after the failure"
        );
        t.received("t", 0, 7);
        t.finish("t", 0, g, 7);
        t.sending("t", 0, g, 8);
        t.commit_failed("t", 0, 7);
        assert!(
            t.take_dirty().is_empty(),
            "a later commit covers the failed one"
        );
    }

    #[test]
    fn a_revoke_hands_over_the_uncommitted_prefix_only() {
        let mut t = Tracker::default();
        let g = t.received("t", 0, 5).generation;
        t.received("t", 0, 6);
        t.received("t", 1, 0);
        t.finish("t", 0, g, 5);
        assert_eq!(
            t.revoke("t", 0),
            Some(Commit {
                topic: "t".into(),
                partition: 0,
                offset: 6
            }),
            "5 is finished, 6 is not"
        );
        assert_eq!(t.revoke("t", 0), None, "gone");
        let g1 = t.received("t", 1, 1).generation;
        t.finish("t", 1, g1, 0);
        t.finish("t", 1, g1, 1);
        assert_eq!(t.take_dirty().len(), 1);
        assert_eq!(t.revoke("t", 1), None, "already committed");
    }

    #[test]
    fn a_rewind_drops_later_offsets_and_counts_the_redelivery() {
        let mut t = Tracker::default();
        let g = t.received("t", 0, 5).generation;
        t.received("t", 0, 6);
        t.received("t", 0, 7);
        assert!(t.rewind("t", 0, g, 6));
        assert!(
            !t.rewind("t", 0, g, 7),
            "already covered by the rewind to 6"
        );
        assert_eq!(t.finish("t", 0, g, 7), None, "7 will be read again");
        assert_eq!(t.finish("t", 0, g, 5), Some(6));
        assert_eq!(t.received("t", 0, 6).delivery_count, 2);
        assert_eq!(t.finish("t", 0, g, 6), Some(7));
        assert_eq!(t.received("t", 0, 7).delivery_count, 1);
    }
}
