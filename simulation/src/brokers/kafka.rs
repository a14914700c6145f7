//! Kafka: a consumer group over three partitions (lanes), each read in offset order from its
//! committed offset.
//!
//! Members join and leave (each connection is one), and a rebalance hands every partition to a
//! member under a new generation: a member that lost a partition may still be working on its
//! records (a zombie), and its acks then commit nothing. An ack commits the partition's finished
//! prefix only. A nack seeks back: the record and the later ones are read again under the same
//! generation. A delayed redelivery pauses the partition until it is due and seeks back, its
//! count committed with the partition's offset, so it survives a rebalance.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use inbox_core::Capabilities;
use rand::RngExt;
use tokio::time::Instant;

use crate::broker::{Broker, Conn, Handout};
use crate::world::Core;

const PARTITIONS: usize = 3;

#[derive(Debug, Default)]
struct Partition {
    /// Entries by offset.
    log: Vec<usize>,
    /// The next offset to read after a (re)assignment: the committed one.
    committed: usize,
    /// Redelivery counts committed with the offset: by offset.
    redeliveries: BTreeMap<usize, u32>,
    owner: Option<Conn>,
    generation: u64,
    /// The owner's next offset to fetch.
    position: usize,
    /// Offsets received in this generation, `true` once finished.
    in_flight: BTreeMap<usize, bool>,
    paused_until: Option<Instant>,
}

/// A Kafka topic of three partitions and its consumer group.
#[derive(Debug, Default)]
pub(crate) struct Kafka {
    partitions: Vec<Partition>,
    members: BTreeSet<Conn>,
    next_conn: Conn,
    next_generation: u64,
    /// The offset of each entry, by entry index.
    offsets: Vec<(usize, usize)>,
}

impl Kafka {
    pub(crate) fn new() -> Self {
        Self {
            partitions: (0..PARTITIONS).map(|_| Partition::default()).collect(),
            ..Self::default()
        }
    }

    /// Every partition revoked and assigned again, round robin over the members: each reads
    /// from its committed offset under a new generation.
    fn rebalance(&mut self, core: &mut Core) {
        let members: Vec<Conn> = self.members.iter().copied().collect();
        let start = if members.is_empty() {
            0
        } else {
            core.rng.random_range(0..members.len())
        };
        for (p, partition) in self.partitions.iter_mut().enumerate() {
            self.next_generation += 1;
            partition.generation = self.next_generation;
            partition.owner = (!members.is_empty()).then(|| members[(start + p) % members.len()]);
            partition.position = partition.committed;
            partition.in_flight.clear();
        }
        core.note(format!(
            "rebalance: partitions to {:?}, read again from their commits",
            self.partitions.iter().map(|p| p.owner).collect::<Vec<_>>()
        ));
    }

    fn current(&self, conn: Conn, h: &Handout) -> bool {
        let (p, _) = self.offsets[h.entry];
        let partition = &self.partitions[p];
        partition.owner == Some(conn) && partition.generation == h.handle
    }

    /// Whether the delivery's offset is current and not finished yet: a copy of a finished
    /// offset handed back moves nothing.
    fn unfinished(&self, conn: Conn, h: &Handout) -> bool {
        let (p, offset) = self.offsets[h.entry];
        let partition = &self.partitions[p];
        self.current(conn, h)
            && offset >= partition.committed
            && partition.in_flight.get(&offset) != Some(&true)
    }

    /// Marks `offset` finished and commits the partition's finished prefix.
    fn finish(&mut self, p: usize, offset: usize) {
        let partition = &mut self.partitions[p];
        if let Some(done) = partition.in_flight.get_mut(&offset) {
            *done = true;
        }
        while let Some(entry) = partition.in_flight.first_entry() {
            if !*entry.get() {
                break;
            }
            let offset = *entry.key();
            entry.remove();
            partition.committed = partition.committed.max(offset + 1);
            partition.redeliveries.retain(|&o, _| o > offset);
        }
    }

    /// Reads the partition again from `offset` (a seek), in this generation: what is
    /// unfinished stays so until a copy of it is acked.
    fn seek(&mut self, p: usize, offset: usize) {
        let partition = &mut self.partitions[p];
        partition.position = partition.position.min(offset);
    }
}

impl Broker for Kafka {
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE.with_lanes().with_delayed_redelivery()
    }

    fn connect(&mut self, core: &mut Core) -> Conn {
        self.next_conn += 1;
        self.members.insert(self.next_conn);
        self.rebalance(core);
        self.next_conn
    }

    fn disconnect(&mut self, core: &mut Core, conn: Conn) {
        self.members.remove(&conn);
        if self.partitions.iter().any(|p| p.owner == Some(conn)) {
            self.rebalance(core);
        }
    }

    fn publish(&mut self, core: &mut Core, i: usize) {
        let p = core.entries[i].lane % PARTITIONS;
        let partition = &mut self.partitions[p];
        self.offsets.push((p, partition.log.len()));
        partition.log.push(i);
    }

    /// A rebalance (a member joined or left elsewhere), or a seek back within the generation.
    fn disturb(&mut self, core: &mut Core, conn: Conn) {
        if core.rng.random_bool(0.5) {
            self.rebalance(core);
            return;
        }
        let mine: Vec<usize> = (0..PARTITIONS)
            .filter(|&p| self.partitions[p].owner == Some(conn))
            .collect();
        if mine.is_empty() {
            return;
        }
        let p = mine[core.rng.random_range(0..mine.len())];
        let Some(&offset) = self.partitions[p].in_flight.keys().next() else {
            return;
        };
        core.note(format!(
            "partition {p} read again from offset {offset}, same generation"
        ));
        self.seek(p, offset);
    }

    fn receive(&mut self, _core: &mut Core, conn: Conn, max: usize) -> Vec<Handout> {
        let now = Instant::now();
        let mut batch = Vec::new();
        for p in 0..PARTITIONS {
            let partition = &mut self.partitions[p];
            if partition.owner != Some(conn) {
                continue;
            }
            match partition.paused_until {
                Some(until) if until > now => continue,
                Some(_) => partition.paused_until = None,
                None => {}
            }
            while batch.len() < max && partition.position < partition.log.len() {
                let offset = partition.position;
                partition.position += 1;
                partition.in_flight.entry(offset).or_insert(false);
                batch.push(Handout {
                    entry: partition.log[offset],
                    handle: partition.generation,
                    lane: Some(p),
                    delivery_count: None,
                    redeliveries: partition.redeliveries.get(&offset).copied().unwrap_or(0),
                });
            }
        }
        batch
    }

    fn ack(&mut self, _core: &mut Core, conn: Conn, h: &Handout) -> bool {
        if !self.current(conn, h) {
            return false;
        }
        let (p, offset) = self.offsets[h.entry];
        self.finish(p, offset);
        true
    }

    fn nack(&mut self, _core: &mut Core, conn: Conn, h: &Handout, _retry_after: Duration) {
        if self.unfinished(conn, h) {
            let (p, offset) = self.offsets[h.entry];
            self.seek(p, offset);
        }
    }

    fn redeliver(
        &mut self,
        core: &mut Core,
        conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> bool {
        if !self.unfinished(conn, h) {
            return false;
        }
        let (p, offset) = self.offsets[h.entry];
        let late = Duration::from_millis(core.rng.random_range(0..50));
        let partition = &mut self.partitions[p];
        partition.redeliveries.insert(offset, redelivery + 1);
        partition.paused_until = Some(Instant::now() + delay + late);
        self.seek(p, offset);
        true
    }

    fn dead_letter(&mut self, core: &mut Core, conn: Conn, h: &Handout) -> bool {
        self.ack(core, conn, h)
    }

    fn is_stale(&self, _core: &Core, conn: Conn, h: &Handout) -> bool {
        !self.current(conn, h)
    }

    fn open(&self) -> usize {
        self.partitions
            .iter()
            .map(|p| p.log.len() - p.committed)
            .sum()
    }
}
