//! Received messages waiting to be applied, by lane.

use std::collections::VecDeque;

use crate::Delivery;

/// Received messages waiting to be applied, by lane, each lane in received order; a lane with
/// a chunk being applied is busy and gives out nothing until that chunk is done.
pub(super) struct Lanes<A> {
    lanes: Vec<(Option<String>, VecDeque<Delivery<A>>, bool)>,
    held: usize,
}

impl<A> Default for Lanes<A> {
    fn default() -> Self {
        Self {
            lanes: Vec::new(),
            held: 0,
        }
    }
}

impl<A> Lanes<A> {
    pub(super) fn add(&mut self, batch: Vec<Delivery<A>>) {
        self.held += batch.len();
        for delivery in batch {
            let lane = &delivery.message.meta.lane;
            match self.lanes.iter_mut().find(|(l, _, _)| l == lane) {
                Some((_, queue, _)) => queue.push_back(delivery),
                None => self
                    .lanes
                    .push((lane.clone(), VecDeque::from([delivery]), false)),
            }
        }
    }

    /// Up to `max` messages of the first lane that has some and is not busy; that lane is busy
    /// until [`Lanes::done`].
    pub(super) fn take(&mut self, max: usize) -> Option<(Option<String>, Vec<Delivery<A>>)> {
        let (lane, queue, busy) = self
            .lanes
            .iter_mut()
            .find(|(_, queue, busy)| !*busy && !queue.is_empty())?;
        *busy = true;
        let n = queue.len().min(max);
        self.held -= n;
        let chunk: Vec<Delivery<A>> = queue.drain(..n).collect();
        let lane = lane.clone();
        // Round robin: the lane goes to the back, so the others get their turn first.
        if let Some(i) = self.lanes.iter().position(|(l, _, _)| *l == lane) {
            let entry = self.lanes.remove(i);
            self.lanes.push(entry);
        }
        Some((lane, chunk))
    }

    pub(super) fn done(&mut self, lane: &Option<String>) {
        if let Some(i) = self.lanes.iter().position(|(l, _, _)| l == lane) {
            if self.lanes[i].1.is_empty() {
                self.lanes.remove(i);
            } else {
                self.lanes[i].2 = false;
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.held
    }

    /// Everything not yet given out, lanes left as they are.
    pub(super) fn drain(&mut self) -> Vec<A> {
        self.held = 0;
        self.lanes
            .iter_mut()
            .flat_map(|(_, queue, _)| queue.drain(..))
            .map(|d| d.ack)
            .collect()
    }
}
