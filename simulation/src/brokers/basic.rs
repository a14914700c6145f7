//! The brokers' redelivery rules as the consumer can tell them apart, for the brokers whose
//! adapter keeps no bookkeeping of its own beyond what the broker stores: what a copy handed
//! out again looks like (a stale handle), in what order first deliveries come, what a nack
//! does, and where a delayed redelivery waits.

use std::time::Duration;

use inbox_core::Capabilities;
use rand::RngExt;
use tokio::time::Instant;

use crate::broker::{Broker, Conn, Handout};
use crate::world::Core;

/// Which broker's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Model {
    /// A RabbitMQ queue: one lane, any order; a message whose visibility runs out comes back
    /// under a new handle, the old one stale.
    Queue,
}

impl Model {
    pub(crate) fn lanes(self) -> usize {
        match self {
            Model::Queue => 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Ready,
    Held(Conn),
    Settled,
}

#[derive(Debug)]
struct Entry {
    lane: usize,
    /// The handle that settles this entry now; a delivery with an older one is stale.
    handle: u64,
    state: State,
    deliveries: u32,
    /// Delayed redeliveries asked for so far, kept with the message by the broker.
    redeliveries: u32,
    /// Not handed out before then (a visibility timeout, a delayed redelivery).
    not_before: Option<Instant>,
}

/// A broker of one [`Model`].
#[derive(Debug)]
pub(crate) struct Basic {
    model: Model,
    entries: Vec<Entry>,
    next_conn: Conn,
}

impl Basic {
    pub(crate) fn new(model: Model) -> Self {
        Self {
            model,
            entries: Vec::new(),
            next_conn: 0,
        }
    }

    /// The entry goes back to the queue under a new handle: every copy out there is stale.
    fn release(&mut self, i: usize, not_before: Option<Instant>) {
        let entry = &mut self.entries[i];
        entry.state = State::Ready;
        entry.handle += 1;
        entry.not_before = not_before;
    }

    fn current(&self, h: &Handout) -> bool {
        let entry = &self.entries[h.entry];
        matches!(entry.state, State::Held(_)) && entry.handle == h.handle
    }
}

impl Broker for Basic {
    fn capabilities(&self) -> Capabilities {
        let capabilities = Capabilities::NONE
            .with_delivery_count()
            .with_delayed_redelivery();
        if self.model.lanes() > 1 {
            capabilities.with_lanes()
        } else {
            capabilities
        }
    }

    fn connect(&mut self, _core: &mut Core) -> Conn {
        self.next_conn += 1;
        self.next_conn
    }

    fn disconnect(&mut self, _core: &mut Core, conn: Conn) {
        for i in 0..self.entries.len() {
            if self.entries[i].state == State::Held(conn) {
                self.release(i, None);
            }
        }
    }

    fn publish(&mut self, core: &mut Core, i: usize) {
        debug_assert_eq!(i, self.entries.len());
        self.entries.push(Entry {
            lane: core.entries[i].lane % self.model.lanes(),
            handle: 0,
            state: State::Ready,
            deliveries: 0,
            redeliveries: 0,
            not_before: None,
        });
    }

    /// A visibility timeout runs out: a held entry goes back under a new handle.
    fn disturb(&mut self, core: &mut Core, _conn: Conn) {
        let held: Vec<usize> = (0..self.entries.len())
            .filter(|&i| matches!(self.entries[i].state, State::Held(_)))
            .collect();
        if held.is_empty() {
            return;
        }
        let i = held[core.rng.random_range(0..held.len())];
        core.note(format!("entry {i}: visibility ran out, new handle"));
        self.release(i, None);
    }

    fn receive(&mut self, core: &mut Core, conn: Conn, max: usize) -> Vec<Handout> {
        let now = Instant::now();
        let mut batch = Vec::new();
        let due = |e: &Entry| e.state == State::Ready && e.not_before.is_none_or(|t| t <= now);
        while batch.len() < max {
            let candidates: Vec<usize> = match self.model {
                Model::Queue => (0..self.entries.len())
                    .filter(|&i| due(&self.entries[i]))
                    .collect(),
            };
            if candidates.is_empty() {
                break;
            }
            let i = candidates[core.rng.random_range(0..candidates.len())];
            let entry = &mut self.entries[i];
            entry.state = State::Held(conn);
            entry.not_before = None;
            entry.deliveries += 1;
            batch.push((i, entry.handle));
        }
        let lanes = self.model.lanes() > 1;
        batch
            .into_iter()
            .map(|(i, handle)| {
                let entry = &self.entries[i];
                Handout {
                    entry: i,
                    handle,
                    lane: lanes.then_some(entry.lane),
                    delivery_count: Some(entry.deliveries),
                    redeliveries: entry.redeliveries,
                }
            })
            .collect()
    }

    fn ack(&mut self, _core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        if !self.current(h) {
            return false;
        }
        self.entries[h.entry].state = State::Settled;
        true
    }

    fn nack(&mut self, _core: &mut Core, _conn: Conn, h: &Handout, retry_after: Duration) {
        if self.current(h) {
            let delayed = !retry_after.is_zero();
            self.release(h.entry, delayed.then(|| Instant::now() + retry_after));
        }
    }

    fn redeliver(
        &mut self,
        core: &mut Core,
        _conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> bool {
        if !self.current(h) {
            return false;
        }
        // The broker's own lateness: a visibility timeout or a pending entry is seen a little
        // after it is due.
        let late = Duration::from_millis(core.rng.random_range(0..50));
        self.release(h.entry, Some(Instant::now() + delay + late));
        self.entries[h.entry].redeliveries = redelivery + 1;
        true
    }

    fn dead_letter(&mut self, _core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        if !self.current(h) {
            return false;
        }
        self.entries[h.entry].state = State::Settled;
        true
    }

    fn is_stale(&self, _core: &Core, _conn: Conn, _h: &Handout) -> bool {
        false
    }

    fn open(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.state != State::Settled)
            .count()
    }
}
