//! Received messages waiting to be applied, by lane and shard.

use std::collections::{BTreeSet, VecDeque};

use crate::{Delivery, Message};

/// A source's lane ([`Metadata::lane`](crate::Metadata::lane)) and the store's shard
/// ([`Sharded`](crate::Sharded)): a chunk holds messages of one of each, so it commits in one
/// shard's transaction.
pub(super) type LaneKey = (Option<String>, usize);

/// Received messages waiting to be applied, by lane and shard, each in received order.
///
/// A lane gives out at most `per_lane` chunks at a time: 1 keeps its order (the next chunk of a
/// Kafka partition waits until the one before is done); a source without lanes has no order to
/// keep, and its one lane gives out a chunk to every free slot.
///
/// A store shard in an outage (in `down`) gives out one chunk at a time whatever its lanes: the
/// chunk that finds out when it is back. Its other messages wait ([`Lanes::waiting_in`]), so
/// the healthy shards keep the other lanes.
pub(super) struct Lanes<A> {
    lanes: Vec<Lane<A>>,
    held: usize,
    per_lane: usize,
}

struct Lane<A> {
    key: LaneKey,
    queue: VecDeque<Delivery<A>>,
    /// Chunks of this lane being applied.
    out: usize,
}

impl<A> Lanes<A> {
    pub(super) fn new(per_lane: usize) -> Self {
        Self {
            lanes: Vec::new(),
            held: 0,
            per_lane: per_lane.max(1),
        }
    }

    /// Queues `batch`, each message in the lane of its source lane and `shard_of` it.
    pub(super) fn add(&mut self, batch: Vec<Delivery<A>>, shard_of: impl Fn(&Message) -> usize) {
        self.held += batch.len();
        for delivery in batch {
            let shard = shard_of(&delivery.message);
            let lane = &delivery.message.meta.lane;
            match self
                .lanes
                .iter_mut()
                .find(|l| l.key.1 == shard && l.key.0 == *lane)
            {
                Some(lane) => lane.queue.push_back(delivery),
                None => self.lanes.push(Lane {
                    key: (lane.clone(), shard),
                    queue: VecDeque::from([delivery]),
                    out: 0,
                }),
            }
        }
    }

    /// Whether lane `i` may give out a chunk now, with the shards in `down` in an outage.
    fn may_take(&self, i: usize, down: &BTreeSet<usize>) -> bool {
        let lane = &self.lanes[i];
        let shard = lane.key.1;
        lane.out < self.per_lane
            && !lane.queue.is_empty()
            && !(down.contains(&shard) && self.lanes.iter().any(|l| l.key.1 == shard && l.out > 0))
    }

    /// Whether [`Lanes::take`] would give out a chunk.
    pub(super) fn ready(&self, down: &BTreeSet<usize>) -> bool {
        (0..self.lanes.len()).any(|i| self.may_take(i, down))
    }

    /// Up to `max` messages of the first lane that has some and a chunk to spare (one chunk in
    /// all for a shard in `down`); the chunk is out until [`Lanes::done`].
    pub(super) fn take(
        &mut self,
        max: usize,
        down: &BTreeSet<usize>,
    ) -> Option<(LaneKey, Vec<Delivery<A>>)> {
        let i = (0..self.lanes.len()).find(|&i| self.may_take(i, down))?;
        // Round robin: the lane goes to the back, so the others get their turn first.
        let mut lane = self.lanes.remove(i);
        lane.out += 1;
        let n = lane.queue.len().min(max);
        self.held -= n;
        let chunk: Vec<Delivery<A>> = lane.queue.drain(..n).collect();
        let key = lane.key.clone();
        self.lanes.push(lane);
        Some((key, chunk))
    }

    /// How many messages of the shards in `down` wait to be given out.
    pub(super) fn waiting_in(&self, down: &BTreeSet<usize>) -> usize {
        self.lanes
            .iter()
            .filter(|l| down.contains(&l.key.1))
            .map(|l| l.queue.len())
            .sum()
    }

    pub(super) fn done(&mut self, key: &LaneKey) {
        if let Some(i) = self.lanes.iter().position(|l| l.key == *key) {
            let lane = &mut self.lanes[i];
            lane.out = lane.out.saturating_sub(1);
            if lane.out == 0 && lane.queue.is_empty() {
                self.lanes.remove(i);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.held
    }

    /// The messages of lane `key` not yet given out, in order.
    pub(super) fn drain_lane(&mut self, key: &LaneKey) -> Vec<A> {
        let Some(lane) = self.lanes.iter_mut().find(|l| l.key == *key) else {
            return Vec::new();
        };
        let back: Vec<A> = lane.queue.drain(..).map(|d| d.ack).collect();
        self.held -= back.len();
        back
    }

    /// Everything not yet given out, lanes left as they are.
    pub(super) fn drain(&mut self) -> Vec<A> {
        self.held = 0;
        self.lanes
            .iter_mut()
            .flat_map(|l| l.queue.drain(..))
            .map(|d| d.ack)
            .collect()
    }
}
