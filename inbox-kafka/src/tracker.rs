//! Per-partition bookkeeping of in-flight offsets: what may be committed, and when; which
//! partitions wait for a delayed redelivery, and how often each record was redelivered.
//!
//! Kafka commits a position, not a message: committing offset 8 on a partition says "everything
//! before 8 is done". With several messages in flight (a batch, a failed one retried after the
//! rest of its batch), only the contiguous finished prefix of each partition may be committed;
//! an ack of offset 7 while 5 is unfinished commits nothing yet.
//!
//! Each partition's state carries a generation, renewed when the partition is revoked and later
//! seen again, so an ack, a nack or a redelivery of a message received before a rebalance never
//! acts on the new assignment: it commits nothing, seeks nothing and pauses nothing.
//!
//! The tracker also remembers, per partition, the end of the finished prefix and the highest
//! offset already handed to a commit request: a partition whose prefix grew past it, or whose
//! redelivery marks changed, is *dirty*, and the next commit (the commit task's, a revoke's, the
//! close's) takes it. Every commit carries the partition's redelivery marks
//! ([`RedeliveryCounts`]) as its metadata, so a partition's next owner, in this process or
//! another, reads them back ([`Tracker::restore`]) and goes on with each record's schedule.
//!
//! This is plain state: no I/O, no clock of its own (the caller passes the time), so the
//! adapter drives it from librdkafka's callbacks and a simulation drives it the same way.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};

use crate::redelivery_counts::{Mark, RedeliveryCounts};

/// What the adapter learns of a message it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracked {
    /// The generation the message was received in.
    pub generation: u64,
    /// How often this offset was handed out in this generation, this time included.
    pub delivery_count: u32,
    /// How often this offset was handed back under a redelivery schedule, by any owner of the
    /// partition (restored from the committed offset's metadata).
    pub redeliveries: u32,
}

/// Where one received offset stands in its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Handed back by a rewind: read again, it is handed out again.
    Rewound,
    /// Handed out and neither finished nor handed back: read again (a seek to an earlier
    /// record passes it), it is not handed out a second time; its copy decides.
    Out,
    /// Finished: read again, it is not handed out (its outcome stands: applied, skipped or
    /// dead-lettered), only counted finished.
    Done,
}

#[derive(Debug, Default)]
struct Partition {
    generation: u64,
    /// The first offset received in this generation: the partition was read from there, so a
    /// commit of it moves nothing.
    base: Option<i64>,
    /// Received offsets not yet passed by the finished prefix.
    in_flight: BTreeMap<i64, Slot>,
    /// Offsets handed back with a nack, and how often.
    nacked: HashMap<i64, u32>,
    /// Offsets handed back under a redelivery schedule: their count and when they are due.
    marks: RedeliveryCounts,
    /// The marks changed since the last commit request.
    marks_dirty: bool,
    /// The offset after the finished prefix: what may be committed.
    finished_to: Option<i64>,
    /// The highest offset handed to a commit request; below `finished_to`, the partition is dirty.
    sent: Option<i64>,
}

impl Partition {
    /// The offset to commit, if the finished prefix grew past what was last sent or the marks
    /// changed since.
    fn dirty(&self) -> Option<i64> {
        if self.marks_dirty {
            return self.committable();
        }
        self.finished_to.filter(|&to| self.sent < Some(to))
    }

    /// Moves the end of the finished prefix past the offsets finished at its head: the offset
    /// to commit when it grew.
    fn advance(&mut self) -> Option<i64> {
        let mut commit = None;
        while let Some(entry) = self.in_flight.first_entry() {
            if *entry.get() != Slot::Done {
                break;
            }
            let finished = *entry.key();
            commit = Some(finished + 1);
            entry.remove();
            // A record's mark goes once the commit can pass it, not before: until then a
            // rebalance or a rewind reads it again, and its schedule goes on from the mark.
            if self.marks.remove(finished) {
                self.marks_dirty = true;
            }
        }
        if commit.is_some() {
            self.finished_to = commit;
        }
        commit
    }

    /// The offset a commit may carry now: the end of the finished prefix, or where the
    /// generation started reading when nothing is finished yet.
    fn committable(&self) -> Option<i64> {
        self.finished_to.or(self.base)
    }

    /// A commit request of `offset` with the current marks.
    fn send(&mut self, topic: &str, partition: i32, offset: i64) -> Commit {
        self.sent = self.sent.max(Some(offset));
        self.marks_dirty = false;
        Commit {
            topic: topic.to_owned(),
            partition,
            offset,
            metadata: self.marks.to_metadata(),
        }
    }
}

/// One partition's offset to commit: the next offset to read, and the redelivery marks of the
/// partition's unfinished records as the commit's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The next offset to read.
    pub offset: i64,
    /// [`RedeliveryCounts::to_metadata`] of the partition; empty when no record has a mark.
    pub metadata: String,
}

/// When an assigned partition may be read, once its marks are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Now: the caller resumes it, since a pause of it may be left over (librdkafka keeps a
    /// pause across a revoke and a re-assignment, and the resume that was to lift it may have
    /// come while the marks were still to be read: [`Tracker::pause_over`] said no then).
    Now,
    /// At this instant: the caller pauses it and resumes it then, after asking
    /// [`Tracker::pause_over`].
    At(Instant),
}

/// In-flight offsets of every partition this consumer has received from.
#[derive(Debug, Default)]
pub struct Tracker {
    partitions: HashMap<String, HashMap<i32, Partition>>,
    next_generation: u64,
    /// Partitions paused for a delayed redelivery, and until when; kept across revokes, so a
    /// partition paused by this consumer is resumed by it whatever the assignment became.
    paused: HashMap<(String, i32), Instant>,
    /// Partitions assigned and paused until their marks are read back from the committed
    /// offsets.
    awaiting: HashSet<(String, i32)>,
    /// The marks of revoked partitions as this consumer last knew them: a commit that carried
    /// them may have been refused (a rebalance in progress), so when a partition comes back they
    /// are merged with what the broker kept ([`Tracker::restore`]).
    kept: HashMap<(String, i32), RedeliveryCounts>,
}

impl Tracker {
    /// Records a received message. `None`: the caller does not hand it out, since it is read
    /// again only because a rewind went back past it, and in this generation it was finished
    /// (its outcome stands) or its copy from before the rewind is still out (that copy decides:
    /// two copies at once would each take a budget, and a copy of a dead-lettered message could
    /// start its budget anew and rewind the partition in its turn, for ever).
    pub fn received(&mut self, topic: &str, partition: i32, offset: i64) -> Option<Tracked> {
        let state = self.state(topic, partition);
        state.base.get_or_insert(offset);
        if state.finished_to.is_some_and(|to| offset < to) {
            return None;
        }
        if matches!(state.in_flight.get(&offset), Some(Slot::Out | Slot::Done)) {
            return None;
        }
        state.in_flight.insert(offset, Slot::Out);
        Some(Tracked {
            generation: state.generation,
            delivery_count: 1 + state.nacked.get(&offset).copied().unwrap_or(0),
            redeliveries: state.marks.count(offset),
        })
    }

    /// Marks a message finished. Returns the offset to commit (the next one to read) when the
    /// finished prefix grew, `None` when an earlier message is still unfinished or the message
    /// belongs to an assignment that is gone.
    pub fn finish(
        &mut self,
        topic: &str,
        partition: i32,
        generation: u64,
        offset: i64,
    ) -> Option<i64> {
        let state = self.current(topic, partition, generation)?;
        // Only a copy that is out: one handed back is to be read again.
        let slot = state
            .in_flight
            .get_mut(&offset)
            .filter(|s| **s == Slot::Out)?;
        *slot = Slot::Done;
        state.nacked.remove(&offset);
        state.advance()
    }

    /// Takes every dirty partition's offset for one commit request; they count as sent.
    pub fn take_dirty(&mut self) -> Vec<Commit> {
        let mut out = Vec::new();
        for (topic, partitions) in &mut self.partitions {
            for (&partition, state) in partitions.iter_mut() {
                if let Some(offset) = state.dirty() {
                    out.push(state.send(topic, partition, offset));
                }
            }
        }
        out
    }

    /// `offset` is to be committed for the partition by a request made elsewhere (a synchronous
    /// ack): the commit to send, with the partition's marks, or `None` when the assignment is
    /// gone.
    pub fn sending(
        &mut self,
        topic: &str,
        partition: i32,
        generation: u64,
        offset: i64,
    ) -> Option<Commit> {
        let state = self.current(topic, partition, generation)?;
        Some(state.send(topic, partition, offset))
    }

    /// A commit of `offset` failed: unless a later request covers the partition, it is dirty
    /// again and the next commit retries it (with the marks as they are then).
    pub fn commit_failed(&mut self, topic: &str, partition: i32, offset: i64) {
        let state = self.partition(topic, partition);
        if let Some(state) = state.filter(|state| state.sent <= Some(offset)) {
            state.sent = None;
            state.marks_dirty = true;
        }
    }

    /// A message is handed back: it and everything received after it on its partition will be
    /// read again. Returns `true` when the caller must seek the partition back to `offset`;
    /// `false` when an earlier rewind already covers it or the assignment is gone.
    pub fn rewind(&mut self, topic: &str, partition: i32, generation: u64, offset: i64) -> bool {
        let Some(state) = self.current(topic, partition, generation) else {
            return false;
        };
        if state.in_flight.get(&offset) != Some(&Slot::Out) {
            return false;
        }
        // The offset stays, unfinished, until it is read again: a later record fetched before
        // the seek and received after this rewind must not let the commit pass it. Later
        // offsets keep their slots: read again after the seek, they are handed out only if they
        // were handed back themselves.
        state.in_flight.insert(offset, Slot::Rewound);
        // A seek to an earlier record handed back and not read again yet reads this one too;
        // handed back behind it, this record is not counted as delivered again.
        let covered = state
            .in_flight
            .range(..offset)
            .any(|(_, slot)| *slot == Slot::Rewound);
        if !covered {
            *state.nacked.entry(offset).or_insert(0) += 1;
        }
        !covered
    }

    /// The message at `offset` is handed back as redelivery `count` of a schedule, to come back
    /// after `delay` (`now` and `wall` are the time on the two clocks).
    ///
    /// Returns `None` when the message belongs to an assignment that is gone: then the caller
    /// does nothing to the partition (neither pause, nor seek, nor commit), since whoever holds
    /// it now reads the message again from the last commit. Otherwise the caller pauses the
    /// partition until [`Tracker::pause_over`], commits the returned [`Commit`] (which carries
    /// the new count, so a rebalance or a restart does not lose it) and seeks back as for a
    /// [`Tracker::rewind`].
    #[allow(clippy::too_many_arguments)]
    pub fn delay(
        &mut self,
        topic: &str,
        partition: i32,
        generation: u64,
        offset: i64,
        count: u32,
        delay: Duration,
        now: Instant,
        wall: SystemTime,
    ) -> Option<Commit> {
        let state = self.current(topic, partition, generation)?;
        state.marks.set(
            offset,
            Mark {
                count,
                due: wall + delay,
            },
        );
        let to = state.committable()?;
        let commit = state.send(topic, partition, to);
        self.pause_until(topic, partition, now + delay);
        Some(commit)
    }

    /// Whether the partition's pause has run out at `now` (or there is none): then it is taken
    /// off the list and the caller resumes it. Never while the partition's marks are still to
    /// be read: [`Tracker::restore`] decides then.
    pub fn pause_over(&mut self, topic: &str, partition: i32, now: Instant) -> bool {
        let key = (topic.to_owned(), partition);
        if self.awaiting.contains(&key) {
            return false;
        }
        match self.paused.get(&key) {
            Some(until) if *until > now => false,
            _ => {
                self.paused.remove(&key);
                true
            }
        }
    }

    /// The partition was assigned: none of its records is handed out until its marks are read
    /// back from its committed offset ([`Tracker::restore`]).
    pub fn assigned(&mut self, topic: &str, partition: i32) {
        self.awaiting.insert((topic.to_owned(), partition));
    }

    /// Whether the partition's marks are still to be read: its records are not handed out
    /// before (the caller seeks back to the first one and reads the marks).
    pub fn is_awaiting(&self, topic: &str, partition: i32) -> bool {
        self.awaiting.contains(&(topic.to_owned(), partition))
    }

    /// The assigned partitions whose marks are still to be read.
    pub fn awaiting(&self) -> Vec<(String, i32)> {
        self.awaiting.iter().cloned().collect()
    }

    /// The committed offset (`committed`, `None` when the group has none) and its `metadata`
    /// of an assigned partition were read (at `now` and `wall` on the two clocks): its marks,
    /// with those this consumer kept from a revoke, count for the records read next, and the
    /// partition is to be paused until the latest of them is due ([`Resume::At`]). `None` when
    /// the partition is no longer awaited (revoked since, or restored already): the caller
    /// leaves it as it is.
    pub fn restore(
        &mut self,
        topic: &str,
        partition: i32,
        committed: Option<i64>,
        metadata: &str,
        now: Instant,
        wall: SystemTime,
    ) -> Option<Resume> {
        let key = (topic.to_owned(), partition);
        if !self.awaiting.remove(&key) {
            return None;
        }
        // Whatever the last commit of the partition carried, by any owner, and the counts this
        // consumer handed out before a revoke, in case the commit that carried them was refused.
        let mut marks = RedeliveryCounts::from_metadata(metadata);
        if let Some(kept) = self.kept.remove(&key) {
            marks.merge(kept);
        }
        // Records before the committed offset were finished by whoever held the partition.
        if let Some(committed) = committed {
            marks.retain_from(committed);
        }
        // The partition waits for its latest mark, and for nothing else: a pause left from
        // before the revoke was for a record that may be finished now.
        self.paused.remove(&key);
        if let Some(wait) = marks
            .latest_due()
            .and_then(|due| due.duration_since(wall).ok())
        {
            self.pause_until(topic, partition, now + wait);
        }
        self.state(topic, partition).marks.merge(marks);
        if self.pause_over(topic, partition, now) {
            return Some(Resume::Now);
        }
        self.paused.get(&key).map(|&until| Resume::At(until))
    }

    /// The partition was revoked: forget its in-flight messages (late acks for them are
    /// ignored) and return its finished prefix and marks if they were not committed yet, for a
    /// last commit. Its marks are kept, for when it comes back ([`Tracker::restore`]).
    pub fn revoke(&mut self, topic: &str, partition: i32) -> Option<Commit> {
        self.awaiting.remove(&(topic.to_owned(), partition));
        let mut state = self.partitions.get_mut(topic)?.remove(&partition)?;
        if state.marks.is_empty() {
            self.kept.remove(&(topic.to_owned(), partition));
        } else {
            self.kept
                .insert((topic.to_owned(), partition), state.marks.clone());
        }
        let offset = state.dirty()?;
        Some(state.send(topic, partition, offset))
    }

    /// Whether a message received in `generation` still belongs to the partition's current
    /// assignment; after a revoke its acks do nothing and the partition is read again.
    pub fn is_current(&self, topic: &str, partition: i32, generation: u64) -> bool {
        self.partitions
            .get(topic)
            .and_then(|partitions| partitions.get(&partition))
            .is_some_and(|state| state.generation == generation)
    }

    /// The number of unfinished messages, for logs.
    pub fn unfinished(&self) -> usize {
        self.partitions
            .values()
            .flat_map(HashMap::values)
            .map(|p| p.in_flight.values().filter(|s| **s != Slot::Done).count())
            .sum()
    }

    fn pause_until(&mut self, topic: &str, partition: i32, until: Instant) {
        let paused = self
            .paused
            .entry((topic.to_owned(), partition))
            .or_insert(until);
        *paused = (*paused).max(until);
    }

    /// The partition's state, a new generation if there is none.
    fn state(&mut self, topic: &str, partition: i32) -> &mut Partition {
        let next_generation = &mut self.next_generation;
        self.partitions
            .entry(topic.to_owned())
            .or_default()
            .entry(partition)
            .or_insert_with(|| {
                *next_generation += 1;
                Partition {
                    generation: *next_generation,
                    ..Partition::default()
                }
            })
    }

    fn partition(&mut self, topic: &str, partition: i32) -> Option<&mut Partition> {
        self.partitions.get_mut(topic)?.get_mut(&partition)
    }

    fn current(&mut self, topic: &str, partition: i32, generation: u64) -> Option<&mut Partition> {
        let state = self.partition(topic, partition);
        state.filter(|state| state.generation == generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redelivery_counts::METADATA_TAG;

    /// A tracker that received `offsets` of `t[0]`, and their generation.
    fn reading(offsets: &[i64]) -> (Tracker, u64) {
        let mut t = Tracker::default();
        let tracked = offsets.iter().map(|&o| t.received0(o).expect("new"));
        let generation = tracked.last().expect("an offset").generation;
        (t, generation)
    }

    /// The commit of `t[0]` at `offset`, without marks.
    fn commit(offset: i64) -> Commit {
        Commit {
            topic: "t".into(),
            partition: 0,
            offset,
            metadata: String::new(),
        }
    }

    /// The calls the tests make most, on partition `t[0]`.
    impl Tracker {
        fn received0(&mut self, offset: i64) -> Option<Tracked> {
            self.received("t", 0, offset)
        }

        fn finish0(&mut self, generation: u64, offset: i64) -> Option<i64> {
            self.finish("t", 0, generation, offset)
        }

        fn rewind0(&mut self, generation: u64, offset: i64) -> bool {
            self.rewind("t", 0, generation, offset)
        }

        fn restore0(
            &mut self,
            committed: Option<i64>,
            metadata: &str,
            now: Instant,
            wall: SystemTime,
        ) -> Option<Resume> {
            self.restore("t", 0, committed, metadata, now, wall)
        }

        /// A redelivery due in a minute.
        fn delay0(
            &mut self,
            g: u64,
            offset: i64,
            count: u32,
            now: Instant,
            wall: SystemTime,
        ) -> Option<Commit> {
            self.delay("t", 0, g, offset, count, MINUTE, now, wall)
        }
    }

    #[test]
    fn commits_only_the_contiguous_finished_prefix() {
        let (mut t, g) = reading(&[5, 6, 7]);
        assert_eq!(t.finish0(g, 7), None, "5 is unfinished");
        assert_eq!(t.finish0(g, 6), None);
        assert_eq!(t.finish0(g, 5), Some(8));
        assert_eq!(t.unfinished(), 0);
    }

    #[test]
    fn partitions_are_independent() {
        let (mut t, g0) = reading(&[10]);
        let g1 = t.received("t", 1, 3).unwrap().generation;
        t.received0(11);
        assert_eq!(t.finish("t", 1, g1, 3), Some(4));
        assert_eq!(t.finish0(g0, 11), None);
        assert_eq!(t.finish0(g0, 10), Some(12));
    }

    #[test]
    fn acks_from_a_revoked_assignment_commit_nothing() {
        let (mut t, old) = reading(&[5]);
        t.revoke("t", 0);
        assert_eq!(t.finish0(old, 5), None);
        // The partition comes back and offset 5 is read again.
        let new = t.received0(5).unwrap().generation;
        assert_ne!(old, new);
        assert_eq!(t.finish0(old, 5), None);
        assert_eq!(t.finish0(new, 5), Some(6));
    }

    #[test]
    fn finished_prefixes_are_taken_once_and_again_after_a_failed_commit() {
        let (mut t, g) = reading(&[5, 6]);
        t.received("t", 1, 0);
        assert!(t.take_dirty().is_empty(), "nothing finished");
        t.finish0(g, 6);
        assert!(t.take_dirty().is_empty(), "5 is unfinished");
        t.finish0(g, 5);
        let commit = commit(7);
        assert_eq!(t.take_dirty(), vec![commit.clone()]);
        assert!(t.take_dirty().is_empty(), "already sent");
        t.commit_failed("t", 0, 7);
        assert_eq!(
            t.take_dirty(),
            vec![commit.clone()],
            "retried after the failure"
        );
        t.received0(7);
        t.finish0(g, 7);
        t.sending("t", 0, g, 8);
        t.commit_failed("t", 0, 7);
        assert!(
            t.take_dirty().is_empty(),
            "a later commit covers the failed one"
        );
    }

    #[test]
    fn a_revoke_hands_over_the_uncommitted_prefix_only() {
        let (mut t, g) = reading(&[5, 6]);
        t.received("t", 1, 0);
        t.finish0(g, 5);
        assert_eq!(t.revoke("t", 0), Some(commit(6)), "5 is finished, 6 is not");
        assert_eq!(t.revoke("t", 0), None, "gone");
        let g1 = t.received("t", 1, 1).unwrap().generation;
        t.finish("t", 1, g1, 0);
        t.finish("t", 1, g1, 1);
        assert_eq!(t.take_dirty().len(), 1);
        assert_eq!(t.revoke("t", 1), None, "already committed");
    }

    #[test]
    fn a_rewind_drops_later_offsets_and_counts_the_redelivery() {
        let (mut t, g) = reading(&[5, 6, 7]);
        assert!(t.rewind0(g, 6));
        assert!(!t.rewind0(g, 7), "already covered by the rewind to 6");
        assert_eq!(t.finish0(g, 7), None, "7 will be read again");
        assert_eq!(t.finish0(g, 5), Some(6));
        assert_eq!(t.received0(6).unwrap().delivery_count, 2);
        assert_eq!(t.finish0(g, 6), Some(7));
        assert_eq!(t.received0(7).unwrap().delivery_count, 1);
    }

    #[test]
    fn a_record_finished_past_a_rewind_is_not_handed_out_again() {
        let (mut t, g) = reading(&[5, 6, 7]);
        assert_eq!(t.finish0(g, 7), None, "6 is unfinished");
        assert!(t.rewind0(g, 5));
        assert_eq!(t.received0(5).unwrap().delivery_count, 2);
        assert_eq!(t.received0(6), None, "its first copy is still out");
        assert_eq!(t.received0(7), None, "finished: its outcome stands");
        assert_eq!(t.finish0(g, 5), Some(6));
        assert_eq!(t.finish0(g, 6), Some(8), "the commit passes 7 too");
        // Once past, a rewind reads it as any other record.
        let g = t.received0(8).unwrap().generation;
        assert!(t.rewind0(g, 8));
        assert_eq!(t.received0(8).unwrap().delivery_count, 2);
    }

    /// Two copies of one poison message on a partition, at 2 and 12 (a replay of its dead
    /// letter): 12 is handed back, read again, then 2 is handed back. Read again after the seek
    /// to 2, 12 was handed out a second time while its first copy was still out; that copy was
    /// dead-lettered, the second started the message's budget anew and handed 12 back, and the
    /// partition went back to 2 for ever (simulation seed 172975).
    #[test]
    fn a_record_is_never_out_twice_and_a_finished_one_is_not_handed_out_again() {
        let (mut t, g) = reading(&[2, 12]);
        assert!(t.rewind0(g, 12));
        assert!(t.received0(12).is_some(), "handed back: read again");
        assert!(t.rewind0(g, 2));
        assert!(t.received0(2).is_some());
        assert_eq!(
            t.received0(12),
            None,
            "its copy from before the seek is still out"
        );
        assert_eq!(t.finish0(g, 12), None, "2 is still to finish");
        assert!(t.rewind0(g, 2), "2 handed back again");
        assert!(t.received0(2).is_some());
        assert_eq!(t.received0(12), None, "finished: its outcome stands");
        assert_eq!(t.finish0(g, 2), Some(13));
        assert_eq!(t.received0(12), None, "behind the finished prefix");
    }

    /// A record handed back while an earlier one waits to be read again is read by that seek;
    /// once the earlier one was read again, the later one needs a seek of its own.
    #[test]
    fn a_rewind_seeks_unless_an_earlier_one_still_reads_the_record_again() {
        let (mut t, g) = reading(&[5, 6, 7]);
        assert!(t.rewind0(g, 5));
        assert!(!t.rewind0(g, 6), "the seek to 5 reads 6 again");
        assert!(t.received0(5).is_some());
        assert_eq!(
            t.received0(6).unwrap().delivery_count,
            1,
            "handed back behind 5: not counted"
        );
        assert_eq!(t.received0(7), None, "still out");
        assert!(t.rewind0(g, 7), "5 was read again: 7 needs its own seek");
        assert_eq!(t.received0(7).unwrap().delivery_count, 2);
        assert_eq!(t.finish0(g, 7), None, "6 is still out");
        assert_eq!(t.finish0(g, 6), None);
        assert_eq!(t.finish0(g, 5), Some(8));
    }

    #[test]
    fn a_record_fetched_before_the_seek_does_not_let_the_commit_pass_the_rewound_one() {
        let (mut t, g) = reading(&[5, 6, 7]);
        assert_eq!(t.finish0(g, 6), None);
        assert!(t.rewind0(g, 5));
        // Received again before 5 is, as a fetch from before the seek can be.
        assert_eq!(t.received0(6), None);
        assert_eq!(t.received0(7), None, "its first copy is still out");
        assert_eq!(t.finish0(g, 7), None, "5 is still to come");
        assert!(
            t.take_dirty().iter().all(|c| c.offset <= 5),
            "nothing past the rewound record is committed"
        );
        t.received0(5);
        assert_eq!(t.finish0(g, 5), Some(8));
    }

    const MINUTE: Duration = Duration::from_secs(60);

    /// A wall-clock time in whole milliseconds, as commit metadata keeps it.
    fn wall() -> SystemTime {
        std::time::UNIX_EPOCH + Duration::from_millis(1_800_000_000_000)
    }

    #[test]
    fn a_redelivery_from_a_revoked_generation_leaves_the_partition_alone() {
        let (now, wall) = (Instant::now(), wall());
        let (mut t, old) = reading(&[5]);
        t.revoke("t", 0);
        let new = t.received0(5).unwrap().generation;
        assert_eq!(
            t.delay0(old, 5, 1, now, wall),
            None,
            "nothing to pause, seek or commit"
        );
        assert!(
            t.pause_over("t", 0, now),
            "the new generation's partition must not be paused by a stale redelivery"
        );
        assert!(!t.rewind0(old, 5), "nor sought back by a stale nack");
        assert_eq!(t.received0(6).unwrap().redeliveries, 0);
        assert_eq!(t.finish0(new, 5), Some(6));
    }

    #[test]
    fn a_redelivery_pauses_and_commits_its_count_with_the_offset() {
        let (now, wall) = (Instant::now(), wall());
        let (mut t, g) = reading(&[4, 5]);
        t.finish0(g, 4);
        let commit = t.delay0(g, 5, 1, now, wall).expect("current");
        assert_eq!(commit.offset, 5, "the finished prefix, not past the record");
        let marks = RedeliveryCounts::from_metadata(&commit.metadata);
        assert_eq!(marks.count(5), 1);
        assert_eq!(marks.latest_due(), Some(wall + MINUTE));
        assert!(!t.pause_over("t", 0, now), "paused for the delay");
        assert!(t.pause_over("t", 0, now + MINUTE));
        assert!(
            t.take_dirty().is_empty(),
            "the redelivery's commit covers it"
        );

        // A commit that fails is retried with the marks; so is a revoke's last commit.
        t.commit_failed("t", 0, 5);
        assert_eq!(t.take_dirty(), vec![commit.clone()]);
        t.commit_failed("t", 0, 5);
        assert_eq!(t.revoke("t", 0), Some(commit));
    }

    #[test]
    fn a_redelivery_before_anything_finished_commits_where_the_generation_started() {
        let (now, wall) = (Instant::now(), wall());
        let (mut t, g) = reading(&[10, 11]);
        let commit = t.delay0(g, 11, 2, now, wall).expect("current");
        assert_eq!(commit.offset, 10, "10 is unfinished: nothing moves");
        assert_eq!(
            RedeliveryCounts::from_metadata(&commit.metadata).count(11),
            2
        );
    }

    #[test]
    fn the_next_owner_goes_on_with_the_schedule_and_waits_out_the_delay() {
        let (now, wall) = (Instant::now(), wall());
        let (mut old_owner, g) = reading(&[5]);
        let commit = old_owner.delay0(g, 5, 2, now, wall).expect("current");

        // Another member (or this one after a restart) is assigned the partition.
        let mut t = Tracker::default();
        let later = now + Duration::from_secs(20);
        assert_eq!(
            t.restore0(Some(5), &commit.metadata, later, wall),
            None,
            "not assigned"
        );
        t.assigned("t", 0);
        assert_eq!(t.awaiting(), vec![("t".to_owned(), 0)]);
        let resume = t.restore0(
            Some(5),
            &commit.metadata,
            later,
            wall + Duration::from_secs(20),
        );
        assert_eq!(
            resume,
            Some(Resume::At(later + Duration::from_secs(40))),
            "paused for what is left of the delay"
        );
        assert!(t.awaiting().is_empty());
        assert!(!t.pause_over("t", 0, later));
        let tracked = t.received0(5).unwrap();
        assert_eq!(tracked.redeliveries, 2, "the count survived the rebalance");

        // Parked at the end of the schedule: the commit past it drops the mark.
        assert_eq!(t.finish0(tracked.generation, 5), Some(6));
        let dirty = t.take_dirty();
        assert_eq!(dirty.len(), 1);
        assert_eq!((dirty[0].offset, dirty[0].metadata.as_str()), (6, ""));
    }

    #[test]
    fn a_finished_record_keeps_its_count_until_the_commit_passes_it() {
        let (now, wall) = (Instant::now(), wall());
        let (mut t, g) = reading(&[4, 5]);
        let mut committed = t.delay0(g, 5, 1, now, wall).expect("current");
        assert!(t.rewind0(g, 5));
        assert_eq!(t.received0(5).unwrap().redeliveries, 1);
        // Dead-lettered at its next failure, while 4 is still unfinished: the commit cannot
        // pass 5 yet, so 5 is read again by the partition's next owner.
        assert_eq!(t.finish0(g, 5), None, "4 is unfinished");
        committed = t.take_dirty().pop().unwrap_or(committed);
        committed = t.revoke("t", 0).unwrap_or(committed);
        assert_eq!(committed.offset, 4);

        let mut next = Tracker::default();
        next.assigned("t", 0);
        next.restore0(Some(committed.offset), &committed.metadata, now, wall);
        next.received0(4);
        assert_eq!(
            next.received0(5).unwrap().redeliveries,
            1,
            "the count of a record read again goes on where it was"
        );
    }

    #[test]
    fn a_count_whose_commit_was_refused_survives_the_partition_coming_back() {
        let (now, wall) = (Instant::now(), wall());
        let (mut t, g) = reading(&[5]);
        let commit = t.delay0(g, 5, 2, now, wall).expect("current");
        // Refused (a rebalance was in progress), and revoked before any retry.
        t.commit_failed("t", 0, commit.offset);
        let last = t.revoke("t", 0).expect("the revoke retries it");
        assert_eq!(RedeliveryCounts::from_metadata(&last.metadata).count(5), 2);
        // The revoke's commit is refused too: the broker keeps the count of before, 1.
        let older = format!("{METADATA_TAG} 5:1:1800000000000");

        // Back with this member, which reads the older count from the broker.
        t.assigned("t", 0);
        t.restore0(Some(5), &older, now, wall);
        assert_eq!(
            t.received0(5).unwrap().redeliveries,
            2,
            "the count this member handed out stands"
        );
    }

    #[test]
    fn a_count_kept_from_a_revoke_is_dropped_once_the_commit_passed_its_record() {
        let (now, wall) = (Instant::now(), wall());
        let (mut t, g) = reading(&[5]);
        t.delay0(g, 5, 1, now, wall);
        t.revoke("t", 0);
        // Another member finished 5 and committed past it, then the partition came back.
        t.assigned("t", 0);
        assert_eq!(
            t.restore0(Some(6), "", now, wall),
            Some(Resume::Now),
            "no pause for a record another member finished"
        );
        t.revoke("t", 0);
        t.assigned("t", 0);
        t.restore0(Some(5), "", now, wall);
        assert_eq!(
            t.received0(5).unwrap().redeliveries,
            0,
            "forgotten once the commit passed it"
        );
    }

    #[test]
    fn a_partition_without_marks_resumes_at_once_and_a_revoked_one_is_not_restored() {
        let mut t = Tracker::default();
        let (now, wall) = (Instant::now(), wall());
        t.assigned("t", 0);
        t.assigned("t", 1);
        assert_eq!(t.restore0(None, "", now, wall), Some(Resume::Now));
        assert_eq!(t.restore0(None, "", now, wall), None, "restored already");
        t.revoke("t", 1);
        assert_eq!(
            t.restore("t", 1, None, "", now, wall),
            None,
            "revoked meanwhile"
        );
        assert!(t.take_dirty().is_empty(), "reading marks commits nothing");
    }
}
