//! What every part of the simulation shares, behind one lock: the seed's random draws, the
//! schedule written so far, the store's committed state, and the broker.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use rand::rngs::StdRng;
use rand::RngExt;

use crate::broker::Broker;
use crate::replay::Letter;

/// One published entry: its message ID, the lane it was published to, and whether it is a
/// replay's copy (marked [`REPLAYED`](inbox_core::REPLAYED)).
#[derive(Debug, Clone)]
pub(crate) struct Published {
    pub(crate) id: String,
    pub(crate) lane: usize,
    pub(crate) replayed: bool,
}

/// The world apart from the broker: what the store committed, what the invariants found, and
/// the seed's draws.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) rng: StdRng,
    /// Faults are drawn only while this is set: the last consumer runs without them.
    pub(crate) faults: bool,
    pub(crate) schedule: Vec<String>,
    pub(crate) violations: Vec<String>,
    /// Every entry the broker holds or held, by index.
    pub(crate) entries: Vec<Published>,
    /// IDs whose claim committed.
    pub(crate) claims: BTreeSet<String>,
    /// How often each ID's effect committed.
    pub(crate) applied: BTreeMap<String, u32>,
    /// How often each ID was dead-lettered.
    pub(crate) parked: BTreeMap<String, u32>,
    /// The dead letters now parked, oldest first: a replay takes them out.
    pub(crate) letters: Vec<Letter>,
    /// IDs that fail in their handler every time, whatever the faults: a poison message.
    pub(crate) poison: BTreeSet<String>,
    /// How often the broker took a request to redeliver each entry later (`Ack::redeliver`).
    pub(crate) redeliveries: BTreeMap<usize, u32>,
    /// The entries applied, per lane and store shard, in the order committed.
    pub(crate) order: BTreeMap<(usize, usize), Vec<usize>>,
    /// Whether the store has two shards.
    pub(crate) sharded: bool,
}

impl Core {
    pub(crate) fn new(rng: StdRng) -> Self {
        Self {
            rng,
            faults: true,
            schedule: Vec::new(),
            violations: Vec::new(),
            entries: Vec::new(),
            claims: BTreeSet::new(),
            applied: BTreeMap::new(),
            parked: BTreeMap::new(),
            letters: Vec::new(),
            poison: BTreeSet::new(),
            redeliveries: BTreeMap::new(),
            order: BTreeMap::new(),
            sharded: false,
        }
    }

    /// A fault with probability `p`, while faults are on.
    pub(crate) fn fault(&mut self, p: f64) -> bool {
        self.faults && self.rng.random_bool(p)
    }

    pub(crate) fn note(&mut self, line: String) {
        self.schedule.push(line);
    }

    pub(crate) fn violation(&mut self, what: String) {
        self.note(format!("VIOLATION: {what}"));
        self.violations.push(what);
    }

    /// Whether entry `i`'s ID is committed or dead-lettered: only then may it be acked.
    pub(crate) fn settled(&self, i: usize) -> bool {
        let id = &self.entries[i].id;
        self.claims.contains(id) || self.parked.contains_key(id)
    }
}

/// The broker and the rest, behind one lock.
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) core: Core,
    pub(crate) broker: Box<dyn Broker>,
}

pub(crate) type Shared = Arc<Mutex<World>>;

pub(crate) fn world(shared: &Shared) -> MutexGuard<'_, World> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}
