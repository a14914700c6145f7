//! Kafka: a consumer group over three partitions (lanes), and on each member the adapter's own
//! bookkeeping, a real [`inbox_kafka::tracker::Tracker`], driven as `inbox-kafka`'s I/O shell
//! drives it (`source.rs`, `ack.rs`, `commit.rs`, `redelivery.rs`, `context.rs`).
//!
//! The broker side is this module's: each partition's log, its committed offset and the
//! committed metadata string, the group's assignment and its rebalances (eager: every member is
//! revoked everything and assigned again, reading from the committed offsets), members evicted
//! for missing a poll (zombies: they learn it at their next poll, and meanwhile their commits are
//! refused), and each member's librdkafka state: fetch positions, paused partitions (a pause
//! outlives a revoke and a re-assignment, as librdkafka's does) and the resume tasks.
//!
//! Every decision is the tracker's: what a delivery reports (its generation, delivery count and
//! redeliveries), what is stale, what may be committed and when, the metadata a commit carries,
//! the redelivery counts read back from it on assignment, what a nack seeks, whether a
//! redelivery pauses, and when a pause is over.
//!
//! Two checks of its own: a commit never moves past a record whose ID is neither committed in
//! the store nor dead-lettered; and a paused partition is paused on behalf of its current
//! assignment, with a resume on its way (a redelivery of a delivery received before a revoke
//! must leave the new assignment alone: issue 41, defect 4).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_core::{Capabilities, SourceError};
use inbox_kafka::redelivery_counts::RedeliveryCounts;
use inbox_kafka::tracker::{Commit, Resume, Tracker};
use rand::RngExt;
use tokio::time::Instant;

use crate::broker::{Broker, Conn, Handout};
use crate::world::Core;

const PARTITIONS: usize = 3;
const TOPIC: &str = "topic";

/// One partition as the broker keeps it.
#[derive(Debug, Default)]
struct Partition {
    /// Entries by offset.
    log: Vec<usize>,
    /// The committed offset: the next one to read after a (re)assignment.
    committed: usize,
    /// What the last commit carried with the offset (the tracker's redelivery marks).
    metadata: String,
    owner: Option<Conn>,
}

/// One member of the group: its librdkafka consumer and the adapter's tracker.
#[derive(Debug)]
struct Member {
    tracker: Tracker,
    /// The member's assignment as its rebalance callbacks told it, with each partition's fetch
    /// position.
    positions: BTreeMap<usize, usize>,
    /// Partitions paused in librdkafka.
    paused: BTreeSet<usize>,
    /// The resume tasks (`redelivery::resume_at`): which partition, and when.
    resumes: Vec<(usize, std::time::Instant)>,
    /// `KafkaSourceBuilder::commit_interval`: zero, every ack commits; otherwise the commit task
    /// does, this often.
    commit_interval: Duration,
    next_commit: Instant,
    /// Evicted from the group at this instant (it missed a poll): it learns it at its next poll
    /// after it, and meanwhile believes its assignment is still its own.
    evicted: Option<Instant>,
    /// How many revokes of each partition the member was told of.
    revokes: [u64; PARTITIONS],
    /// The revokes of its partition told before each tracker generation's first delivery.
    received_after: BTreeMap<u64, u64>,
}

/// The simulated clocks: the tracker takes `std` instants and wall-clock time, the simulation
/// runs on tokio's paused clock.
#[derive(Debug)]
struct Clock {
    start: Instant,
    std: std::time::Instant,
}

impl Clock {
    fn now(&self) -> (std::time::Instant, SystemTime) {
        let elapsed = Instant::now() - self.start;
        // A fixed wall-clock start keeps the commit metadata, and so a seed, the same each run.
        let wall = UNIX_EPOCH + Duration::from_millis(1_800_000_000_000) + elapsed;
        (self.std + elapsed, wall)
    }
}

/// A Kafka topic of three partitions and its consumer group.
#[derive(Debug)]
pub(crate) struct Kafka {
    partitions: Vec<Partition>,
    members: BTreeMap<Conn, Member>,
    next_conn: Conn,
    /// The offset of each entry, by entry index.
    offsets: Vec<(usize, usize)>,
    clock: Clock,
}

fn partition_of(commit: &Commit) -> usize {
    usize::try_from(commit.partition).unwrap()
}

fn offset(offset: usize) -> i64 {
    i64::try_from(offset).unwrap()
}

fn index(p: usize) -> i32 {
    i32::try_from(p).unwrap()
}

/// A commit request reaching the broker (`commit.rs`): refused from a member the group evicted,
/// failing now and then; then the tracker hears of it (`commit_failed`) when the request is
/// one it is waiting for. A commit that moves a partition past a record whose ID is neither
/// committed nor dead-lettered is an ack before the commit.
fn commit(
    partitions: &mut [Partition],
    core: &mut Core,
    conn: Conn,
    member: &mut Member,
    mut commits: Vec<Commit>,
) {
    if commits.is_empty() {
        return;
    }
    commits.sort_by_key(|c| c.partition);
    let refused = if member.evicted.is_some() {
        Some("refused: the member was evicted")
    } else if core.fault(0.03) {
        Some("fails")
    } else {
        None
    };
    let what: Vec<String> = commits
        .iter()
        .map(|c| {
            format!(
                "partition {} offset {} [{}]",
                c.partition, c.offset, c.metadata
            )
        })
        .collect();
    if let Some(why) = refused {
        core.note(format!(
            "connection {conn}: commit of {} {why}",
            what.join(", ")
        ));
        for c in &commits {
            member.tracker.commit_failed(TOPIC, c.partition, c.offset);
        }
        return;
    }
    core.note(format!("connection {conn} committed {}", what.join(", ")));
    apply(partitions, core, &commits);
}

/// The broker keeps each commit's offset and metadata.
fn apply(partitions: &mut [Partition], core: &mut Core, commits: &[Commit]) {
    for c in commits {
        let p = partition_of(c);
        let partition = &mut partitions[p];
        let to = usize::try_from(c.offset).unwrap();
        for at in partition.committed..to.min(partition.log.len()) {
            let i = partition.log[at];
            if !core.settled(i) {
                let id = core.entries[i].id.clone();
                core.violation(format!(
                    "partition {p} committed past offset {at} (entry {i}, {id}), but {id} is \
                     neither committed nor dead-lettered"
                ));
            }
        }
        partition.committed = to;
        partition.metadata.clone_from(&c.metadata);
    }
}

impl Kafka {
    pub(crate) fn new() -> Self {
        Self {
            partitions: (0..PARTITIONS).map(|_| Partition::default()).collect(),
            members: BTreeMap::new(),
            next_conn: 0,
            offsets: Vec::new(),
            clock: Clock {
                start: Instant::now(),
                std: std::time::Instant::now(),
            },
        }
    }

    /// An eager rebalance: every member in the group is revoked its partitions (its revoke
    /// callback commits what the tracker hands over, `context.rs`), then every partition is
    /// assigned again, round robin; the new owner reads it from its committed offset once its
    /// redelivery marks are read.
    fn rebalance(&mut self, core: &mut Core) {
        for (&conn, member) in &mut self.members {
            if member.evicted.is_some() {
                continue;
            }
            let mut last = Vec::new();
            for &p in member.positions.keys() {
                member.revokes[p] += 1;
                last.extend(member.tracker.revoke(TOPIC, index(p)));
            }
            member.positions.clear();
            if !last.is_empty() {
                // `commit_on_revoke`: asynchronous, its failure only logged.
                if core.fault(0.03) {
                    core.note(format!("connection {conn}: the revoke's last commit fails"));
                } else {
                    core.note(format!("connection {conn}: the revoke's last commit"));
                    apply(&mut self.partitions, core, &last);
                }
            }
        }
        let members: Vec<Conn> = self
            .members
            .iter()
            .filter(|(_, m)| m.evicted.is_none())
            .map(|(&conn, _)| conn)
            .collect();
        let start = if members.is_empty() {
            0
        } else {
            core.rng.random_range(0..members.len())
        };
        for (p, partition) in self.partitions.iter_mut().enumerate() {
            partition.owner = (!members.is_empty()).then(|| members[(start + p) % members.len()]);
            if let Some(owner) = partition.owner {
                let member = self.members.get_mut(&owner).unwrap();
                member.tracker.assigned(TOPIC, index(p));
                member.positions.insert(p, partition.committed);
            }
        }
        core.note(format!(
            "rebalance: partitions to {:?}, read again from their commits",
            self.partitions.iter().map(|p| p.owner).collect::<Vec<_>>()
        ));
    }

    /// What runs on its own in each member: the commit task (`commit::commit_task`).
    fn tick(&mut self, core: &mut Core) {
        let now = Instant::now();
        for (&conn, member) in &mut self.members {
            if member.commit_interval.is_zero() || now < member.next_commit {
                continue;
            }
            member.next_commit = now + member.commit_interval;
            let dirty = member.tracker.take_dirty();
            commit(&mut self.partitions, core, conn, member, dirty);
        }
    }

    /// A member evicted before this poll learns it now: its assignment is lost, nothing of it
    /// is committed, and it joins again.
    fn learn_eviction(&mut self, core: &mut Core, conn: Conn) {
        let Some(member) = self.members.get_mut(&conn) else {
            return;
        };
        if member
            .evicted
            .is_none_or(|evicted| evicted >= Instant::now())
        {
            return;
        }
        for &p in member.positions.keys() {
            member.revokes[p] += 1;
            member.tracker.revoke(TOPIC, index(p));
        }
        member.positions.clear();
        member.evicted = None;
        core.note(format!(
            "connection {conn} learns it was evicted: its assignment is lost, nothing committed; \
             it joins again"
        ));
        self.rebalance(core);
    }

    /// `restore_assigned`: the redelivery marks of newly assigned partitions read back from
    /// their committed offsets' metadata; a partition whose latest mark is not due yet is
    /// paused until it is.
    fn restore(&mut self, core: &mut Core, conn: Conn) {
        let member = self.members.get_mut(&conn).unwrap();
        let mut awaiting = member.tracker.awaiting();
        if awaiting.is_empty() {
            return;
        }
        if core.fault(0.05) {
            core.note(format!(
                "connection {conn}: reading the committed offsets fails; the partitions wait"
            ));
            return;
        }
        awaiting.sort();
        let (now, wall) = self.clock.now();
        for (_, p) in awaiting {
            let at = usize::try_from(p).unwrap();
            let metadata = &self.partitions[at].metadata;
            let committed = i64::try_from(self.partitions[at].committed).ok();
            match member
                .tracker
                .restore(TOPIC, p, committed, metadata, now, wall)
            {
                Some(Resume::At(until)) => {
                    member.paused.insert(at);
                    member.resumes.push((at, until));
                    core.note(format!(
                        "connection {conn}: partition {p} paused for {:?}, its record's delay",
                        until.saturating_duration_since(now)
                    ));
                }
                Some(Resume::Now) => {
                    member.paused.remove(&at);
                }
                None => {}
            }
        }
    }

    /// Whether the member's partition `p` is paused with no resume on its way: then it stays
    /// paused for good, whatever its assignment becomes.
    fn stuck(member: &Member, p: usize) -> bool {
        member.paused.contains(&p) && !member.resumes.iter().any(|&(q, _)| q == p)
    }

    /// Seeks the member's partition back to `offset` when the tracker says so (`ack::nack`).
    fn rewind(member: &mut Member, p: usize, generation: u64, at: usize) {
        if member
            .tracker
            .rewind(TOPIC, index(p), generation, offset(at))
        {
            if let Some(position) = member.positions.get_mut(&p) {
                *position = at;
            }
        }
    }
}

impl Broker for Kafka {
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE.with_lanes().with_delayed_redelivery()
    }

    fn connect(&mut self, core: &mut Core) -> Conn {
        self.next_conn += 1;
        let commit_interval = if core.rng.random_bool(0.5) {
            Duration::ZERO
        } else {
            Duration::from_millis(core.rng.random_range(50..1_000))
        };
        self.members.insert(
            self.next_conn,
            Member {
                tracker: Tracker::default(),
                positions: BTreeMap::new(),
                paused: BTreeSet::new(),
                resumes: Vec::new(),
                commit_interval,
                next_commit: Instant::now() + commit_interval,
                evicted: None,
                revokes: [0; PARTITIONS],
                received_after: BTreeMap::new(),
            },
        );
        core.note(format!(
            "connection {} joins the group, commit interval {commit_interval:?}",
            self.next_conn
        ));
        self.rebalance(core);
        self.next_conn
    }

    /// Closed (the revoke commits what the tracker hands over) or killed (nothing more is
    /// committed); either way the group rebalances without it.
    fn disconnect(&mut self, core: &mut Core, conn: Conn) {
        self.tick(core);
        let Some(mut member) = self.members.remove(&conn) else {
            return;
        };
        if member.evicted.is_none() && !core.fault(0.5) {
            let mut last = Vec::new();
            for &p in member.positions.keys() {
                last.extend(member.tracker.revoke(TOPIC, index(p)));
            }
            if !last.is_empty() {
                core.note(format!(
                    "connection {conn} closes: the revoke's last commit"
                ));
                apply(&mut self.partitions, core, &last);
            }
        } else {
            core.note(format!("connection {conn} killed: nothing more committed"));
        }
        self.rebalance(core);
    }

    fn publish(&mut self, core: &mut Core, i: usize) {
        let p = core.entries[i].lane % PARTITIONS;
        let partition = &mut self.partitions[p];
        self.offsets.push((p, partition.log.len()));
        partition.log.push(i);
    }

    /// A rebalance (a member joined or left elsewhere), or a member evicted for missing a
    /// poll: it goes on working, a zombie, until its next poll.
    fn disturb(&mut self, core: &mut Core, _conn: Conn) {
        let in_group: Vec<Conn> = self
            .members
            .iter()
            .filter(|(_, m)| m.evicted.is_none())
            .map(|(&conn, _)| conn)
            .collect();
        if in_group.is_empty() || core.rng.random_bool(0.6) {
            core.note("a member joined or left elsewhere".into());
            self.rebalance(core);
            return;
        }
        let victim = in_group[core.rng.random_range(0..in_group.len())];
        self.members.get_mut(&victim).unwrap().evicted = Some(Instant::now());
        core.note(format!(
            "connection {victim} evicted from the group (a poll came too late); it does not know yet"
        ));
        self.rebalance(core);
    }

    fn receive(&mut self, core: &mut Core, conn: Conn, max: usize) -> Vec<Handout> {
        self.tick(core);
        self.learn_eviction(core, conn);
        if self.members.get(&conn).is_none_or(|m| m.evicted.is_some()) {
            return Vec::new();
        }
        // The resume tasks that are due.
        let (now, _) = self.clock.now();
        let member = self.members.get_mut(&conn).unwrap();
        member.resumes.retain(|&(p, until)| {
            if until > now {
                return true;
            }
            if member.tracker.pause_over(TOPIC, index(p), now) {
                member.paused.remove(&p);
            }
            false
        });
        self.restore(core, conn);
        let member = self.members.get_mut(&conn).unwrap();
        let stuck: Vec<usize> = member
            .positions
            .keys()
            .copied()
            .filter(|&p| !member.tracker.is_awaiting(TOPIC, index(p)) && Self::stuck(member, p))
            .collect();
        for p in stuck {
            core.violation(format!(
                "stall: connection {conn}'s partition {p} is paused and nothing will resume it"
            ));
            // Once is enough.
            member.paused.remove(&p);
        }
        let mut batch = Vec::new();
        for (&p, position) in &mut member.positions {
            if member.paused.contains(&p) || member.tracker.is_awaiting(TOPIC, index(p)) {
                continue;
            }
            let log = &self.partitions[p].log;
            while batch.len() < max && *position < log.len() {
                let at = *position;
                *position += 1;
                let Some(tracked) = member.tracker.received(TOPIC, index(p), offset(at)) else {
                    continue;
                };
                member
                    .received_after
                    .entry(tracked.generation)
                    .or_insert(member.revokes[p]);
                batch.push(Handout {
                    entry: log[at],
                    handle: tracked.generation,
                    lane: Some(p),
                    delivery_count: (tracked.delivery_count > 1).then_some(tracked.delivery_count),
                    redeliveries: tracked.redeliveries,
                });
            }
        }
        batch
    }

    /// `ack_all`: finished in the tracker; with a zero commit interval, the new finished
    /// prefix committed at once.
    fn ack(&mut self, core: &mut Core, conn: Conn, h: &Handout) -> bool {
        self.tick(core);
        let (p, at) = self.offsets[h.entry];
        let Some(member) = self.members.get_mut(&conn) else {
            return false;
        };
        if !member.tracker.is_current(TOPIC, index(p), h.handle) {
            return false;
        }
        let next = member.tracker.finish(TOPIC, index(p), h.handle, offset(at));
        if member.commit_interval.is_zero() {
            let sending =
                next.and_then(|next| member.tracker.sending(TOPIC, index(p), h.handle, next));
            commit(
                &mut self.partitions,
                core,
                conn,
                member,
                sending.into_iter().collect(),
            );
        }
        true
    }

    /// A seek back, when the tracker says so; `retry_after` is not honoured.
    fn nack(&mut self, core: &mut Core, conn: Conn, h: &Handout, _retry_after: Duration) {
        self.tick(core);
        let (p, at) = self.offsets[h.entry];
        if let Some(member) = self.members.get_mut(&conn) {
            Self::rewind(member, p, h.handle, at);
        }
    }

    /// `ack::redeliver`: the tracker decides; then the partition is paused with a resume task
    /// for the delay, the commit carrying the new count is sent, and the partition is sought
    /// back as a nack does.
    fn redelivery_floor(&self, h: &Handout) -> Option<u32> {
        let (p, at) = *self.offsets.get(h.entry)?;
        Some(RedeliveryCounts::from_metadata(&self.partitions[p].metadata).count(offset(at)))
    }

    fn redeliver(
        &mut self,
        core: &mut Core,
        conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> Result<bool, SourceError> {
        self.tick(core);
        let (p, at) = self.offsets[h.entry];
        let (now, wall) = self.clock.now();
        let Some(member) = self.members.get_mut(&conn) else {
            return Ok(false);
        };
        let Some(commit_count) = member.tracker.delay(
            TOPIC,
            index(p),
            h.handle,
            offset(at),
            redelivery + 1,
            delay,
            now,
            wall,
        ) else {
            return Ok(false);
        };
        if member.received_after.get(&h.handle) != Some(&member.revokes[p]) {
            core.violation(format!(
                "connection {conn} paused partition {p} for a redelivery of entry {} received \
                 before the partition was revoked: its new assignment waits {delay:?} for \
                 nothing",
                h.entry
            ));
        }
        member.paused.insert(p);
        member.resumes.push((p, now + delay));
        commit(&mut self.partitions, core, conn, member, vec![commit_count]);
        Self::rewind(member, p, h.handle, at);
        Ok(true)
    }

    fn dead_letter(&mut self, core: &mut Core, conn: Conn, h: &Handout) -> bool {
        self.ack(core, conn, h)
    }

    fn is_stale(&self, _core: &Core, conn: Conn, h: &Handout) -> bool {
        let (p, _) = self.offsets[h.entry];
        self.members
            .get(&conn)
            .is_none_or(|m| !m.tracker.is_current(TOPIC, index(p), h.handle))
    }

    fn open(&self) -> usize {
        self.partitions
            .iter()
            .map(|p| p.log.len().saturating_sub(p.committed))
            .sum()
    }
}
