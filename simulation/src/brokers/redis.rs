//! Redis Streams: one stream read by one consumer group, each connection a consumer of its own
//! name, driven by the adapter's own sweep ([`inbox_redis_streams::sweep`]).
//!
//! What Redis stores lives here: the stream's entries, the group's last-delivered ID, the
//! pending entries list (PEL: owner, delivery time, delivery count) and the hash of redelivery
//! marks. Every decision the adapter makes goes through its plain state, as
//! `inbox-redis-streams/src/source/` drives it: a consumer rereads its own pending entries
//! first (after it connects, and after a lost connection), then, every `claim_interval`, takes
//! one step of the sweep (`XAUTOCLAIM` while no entry is marked; `XPENDING`, the marks,
//! [`Sweep::due`] and `XCLAIM` by minimum idle time once one is), then reads new entries
//! (`XREADGROUP >`). Each copy reports [`Reported::new`] of its `XPENDING` count (within the
//! range the adapter asks for) and its [`Mark`]; a redelivery writes `Mark::new` and restarts
//! the idle time (`XCLAIM … 0 JUSTID`); an ack is `XACK` by entry ID (from any copy) and deletes
//! the mark of a copy that reported one.
//!
//! Two consumers share the group, so one may claim an entry the other still works on (a zombie
//! that acks late). The model counts, per entry, the copies that failed: handed back, held by
//! a consumer that went away or lost its connection, or held past `claim_idle`. A copy handed
//! out with a delivery count above those failures + 1 is an extra copy, and a violation: the
//! handler runs twice for nothing, and `max_deliveries` parks a message that failed fewer times
//! than it allows.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use inbox_core::{Capabilities, SourceError};
use inbox_redis_streams::sweep::{entry_id_key, id_range, Mark, Pending, Reported, Sweep};
use rand::RngExt;
use tokio::time::Instant;

use crate::broker::{Broker, Conn, Handout};
use crate::world::Core;

/// The stream entry ID of entry `i`.
fn entry_id(i: usize) -> String {
    format!("{}-0", i + 1)
}

/// The entry of a stream entry ID.
fn entry_of(id: &str) -> usize {
    usize::try_from(entry_id_key(id).0).unwrap() - 1
}

/// One pending entry, as `XPENDING` shows it.
#[derive(Debug)]
struct Pel {
    /// The consumer name that holds it.
    owner: usize,
    /// When it was last delivered, or its idle time restarted.
    since: Instant,
    delivery_count: u32,
}

/// One connection: a consumer of the group, and the source's state.
#[derive(Debug)]
struct Reader {
    name: usize,
    /// Where the reread of its own pending entries goes on; `None` once drained.
    history: Option<String>,
    sweep: Sweep,
    next_claim: Instant,
}

/// One copy handed out, as the simulation follows it.
#[derive(Debug)]
struct Copy {
    entry: usize,
    conn: Conn,
    reported: Reported,
    /// Neither settled, nor failed.
    live: bool,
}

/// A Redis stream and its consumer group.
#[derive(Debug, Default)]
pub(crate) struct Redis {
    /// Entries added so far; entry `i` has ID `i+1-0`.
    entries: usize,
    /// The group's last-delivered entry: `XREADGROUP >` reads from here.
    read: usize,
    pel: BTreeMap<usize, Pel>,
    acked: BTreeSet<usize>,
    /// `<stream>:<group>:redeliveries`.
    marks: BTreeMap<usize, String>,
    /// `claim_idle` and `claim_interval`, drawn at the first connection.
    settings: Option<(Duration, Duration)>,
    readers: BTreeMap<Conn, Reader>,
    next_conn: Conn,
    copies: BTreeMap<u64, Copy>,
    next_copy: u64,
    /// Copies of each entry that failed.
    failures: BTreeMap<usize, u32>,
    /// Entries already reported for an extra copy.
    extra: BTreeSet<usize>,
}

impl Redis {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn claim_idle(&self) -> Duration {
        self.settings.unwrap().0
    }

    fn idle_ms(pel: &Pel, now: Instant) -> u64 {
        u64::try_from(now.duration_since(pel.since).as_millis()).unwrap()
    }

    /// Ends copy `copy`, a failure unless it settled its entry.
    fn end(&mut self, copy: u64, failed: bool) {
        let Some(c) = self.copies.get_mut(&copy) else {
            return;
        };
        if c.live {
            c.live = false;
            if failed {
                *self.failures.entry(c.entry).or_default() += 1;
            }
        }
    }

    /// Ends, as failed, the live copies of `entry` that `keep` says not to keep.
    fn fail_copies(&mut self, keep: impl Fn(&Copy) -> bool) {
        let ended: Vec<u64> = self
            .copies
            .iter()
            .filter(|(_, c)| c.live && !keep(c))
            .map(|(&n, _)| n)
            .collect();
        for n in ended {
            self.end(n, true);
        }
    }

    /// `XCLAIM <name> <min_idle> <ids>` (or `XAUTOCLAIM`'s claim of one entry): the entry
    /// moves to `name` if idle that long, its delivery count raised unless `just_id`. A copy
    /// held past `claim_idle` fails here.
    fn xclaim(&mut self, name: usize, min_idle: u64, i: usize, just_id: bool) -> bool {
        let now = Instant::now();
        let claim_idle = u64::try_from(self.claim_idle().as_millis()).unwrap();
        let Some(pel) = self.pel.get_mut(&i) else {
            return false;
        };
        let idle = Self::idle_ms(pel, now);
        if idle < min_idle {
            return false;
        }
        pel.owner = name;
        pel.since = now;
        if !just_id {
            pel.delivery_count += 1;
            if idle >= claim_idle {
                self.fail_copies(|c| c.entry != i);
            }
        }
        true
    }

    /// `XPENDING <start> <end> <count> [<owner>]`, the bounds inclusive by ID.
    fn xpending(&self, start: &str, end: &str, count: usize, owner: Option<usize>) -> Vec<Pending> {
        let now = Instant::now();
        let key = |id: &str| match id {
            "-" => (0, 0),
            "+" => (u64::MAX, u64::MAX),
            id => entry_id_key(id),
        };
        let (start, end) = (key(start), key(end));
        self.pel
            .iter()
            .filter(|(&i, p)| {
                let k = entry_id_key(&entry_id(i));
                start <= k && k <= end && owner.is_none_or(|o| p.owner == o)
            })
            .take(count)
            .map(|(&i, p)| Pending {
                id: entry_id(i),
                idle_ms: Self::idle_ms(p, now),
                delivery_count: p.delivery_count,
            })
            .collect()
    }

    /// `HMGET` of the marks of `ids`, parsed as the adapter does.
    fn marks_of(&self, ids: &[usize]) -> Vec<Option<Mark>> {
        ids.iter()
            .map(|i| self.marks.get(i).and_then(|m| Mark::parse(m)))
            .collect()
    }

    /// The source's `deliver_pending`: counts from `XPENDING` of its own entries from the
    /// first to the last in stream order (`sweep::id_range`), and their marks.
    fn deliver_pending(&mut self, core: &mut Core, conn: Conn, entries: &[usize]) -> Vec<Handout> {
        let name = self.readers[&conn].name;
        let ids: Vec<String> = entries.iter().map(|&i| entry_id(i)).collect();
        let counts: BTreeMap<String, u32> = match id_range(ids.iter().map(String::as_str)) {
            Some((first, last)) => self
                .xpending(first, last, entries.len() + 1000, Some(name))
                .into_iter()
                .map(|p| (p.id, p.delivery_count))
                .collect(),
            None => BTreeMap::new(),
        };
        let marks = self.marks_of(entries);
        entries
            .iter()
            .zip(marks)
            .map(|(&i, mark)| {
                let count = counts.get(&entry_id(i)).copied();
                self.hand_out(core, conn, i, Reported::new(count, mark.as_ref()))
            })
            .collect()
    }

    fn hand_out(&mut self, core: &mut Core, conn: Conn, i: usize, reported: Reported) -> Handout {
        let count = self.pel[&i].delivery_count;
        let failed = self.failures.get(&i).copied().unwrap_or(0);
        if count > failed + 1 && self.extra.insert(i) {
            let id = &core.entries[i].id;
            core.violation(format!(
                "entry {i} ({id}) handed out for delivery {count}, but only {failed} of its \
                 copies failed (handed back, their consumer gone, or held past claim_idle): an \
                 extra copy, which max_deliveries counts as a failure"
            ));
        }
        if reported.delivery_count != Some(count) {
            core.violation(format!(
                "entry {i}: delivery {count} reports the count {:?}: max_deliveries cannot \
                 count it",
                reported.delivery_count
            ));
        }
        self.next_copy += 1;
        self.copies.insert(
            self.next_copy,
            Copy {
                entry: i,
                conn,
                reported,
                live: true,
            },
        );
        Handout {
            entry: i,
            handle: self.next_copy,
            lane: None,
            delivery_count: reported.delivery_count,
            redeliveries: reported.redeliveries,
        }
    }

    /// `XREADGROUP … STREAMS key <after>`: the consumer's own pending entries after `after`,
    /// each delivered again.
    fn reread(&mut self, name: usize, after: &str, max: usize) -> Vec<usize> {
        let after = entry_id_key(after);
        let now = Instant::now();
        let mine: Vec<usize> = self
            .pel
            .iter()
            .filter(|(&i, p)| p.owner == name && entry_id_key(&entry_id(i)) > after)
            .map(|(&i, _)| i)
            .take(max)
            .collect();
        for i in &mine {
            let pel = self.pel.get_mut(i).unwrap();
            pel.since = now;
            pel.delivery_count += 1;
        }
        mine
    }

    /// One step of the sweep while entries are marked: the source's `claim_due`.
    fn claim_due(&mut self, conn: Conn, max: usize) -> (String, Vec<usize>) {
        let reader = &self.readers[&conn];
        let name = reader.name;
        let rows = self.xpending(reader.sweep.range_start(), "+", max, None);
        let ids: Vec<usize> = rows.iter().map(|r| entry_of(&r.id)).collect();
        let marks = self.marks_of(&ids);
        let due = self.readers[&conn].sweep.due(&rows, &marks, max);
        let mut claimed = Vec::new();
        for (min_idle, ids) in &due.claims {
            for id in ids {
                let i = entry_of(id);
                if self.xclaim(name, *min_idle, i, false) {
                    claimed.push(i);
                }
            }
        }
        (due.cursor, claimed)
    }

    /// One step of `XAUTOCLAIM … <claim_idle> <cursor> COUNT <max>`: at most `max` claimed,
    /// `max × 10` looked at.
    fn autoclaim(&mut self, conn: Conn, max: usize) -> (String, Vec<usize>) {
        let reader = &self.readers[&conn];
        let name = reader.name;
        let start = entry_id_key(reader.sweep.cursor());
        let claim_idle = u64::try_from(self.claim_idle().as_millis()).unwrap();
        let scan: Vec<usize> = self
            .pel
            .keys()
            .copied()
            .filter(|&i| entry_id_key(&entry_id(i)) >= start)
            .collect();
        let mut claimed = Vec::new();
        let mut next = None;
        for (looked, &i) in scan.iter().enumerate() {
            if claimed.len() == max || looked == max * 10 {
                next = Some(i);
                break;
            }
            if self.xclaim(name, claim_idle, i, false) {
                claimed.push(i);
            }
        }
        (next.map_or_else(|| "0-0".to_owned(), entry_id), claimed)
    }

    /// `XACK`, then `HDEL` of the mark when the copy reported one: `true` when it was pending.
    fn settle(&mut self, h: &Handout) -> bool {
        let i = h.entry;
        let acked = self.pel.remove(&i).is_some();
        if acked {
            self.acked.insert(i);
        }
        if h.redeliveries > 0 {
            self.marks.remove(&i);
        }
        self.end(h.handle, false);
        acked
    }
}

impl Broker for Redis {
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_delivery_count()
            .with_delayed_redelivery()
    }

    fn connect(&mut self, core: &mut Core) -> Conn {
        if self.settings.is_none() {
            let claim_idle = Duration::from_millis(core.rng.random_range(300..3_000));
            let claim_interval = Duration::from_millis(core.rng.random_range(50..1_000));
            core.note(format!(
                "Redis: claim_idle {claim_idle:?}, claim_interval {claim_interval:?}"
            ));
            self.settings = Some((claim_idle, claim_interval));
        }
        self.next_conn += 1;
        let used: BTreeSet<usize> = self.readers.values().map(|r| r.name).collect();
        let name = (0..).find(|n| !used.contains(n)).unwrap();
        core.note(format!(
            "connection {} is consumer c{name}: rereads its pending entries",
            self.next_conn
        ));
        self.readers.insert(
            self.next_conn,
            Reader {
                name,
                history: Some("0".to_owned()),
                sweep: Sweep::new(self.claim_idle()),
                next_claim: Instant::now(),
            },
        );
        self.next_conn
    }

    /// Its pending entries stay under its name, for the next consumer of that name or a claim.
    fn disconnect(&mut self, _core: &mut Core, conn: Conn) {
        self.readers.remove(&conn);
        self.fail_copies(|c| c.conn != conn);
    }

    fn publish(&mut self, _core: &mut Core, i: usize) {
        debug_assert_eq!(i, self.entries);
        self.entries += 1;
    }

    /// The connection is lost and made again: the source rereads its own pending entries.
    fn disturb(&mut self, core: &mut Core, conn: Conn) {
        let reader = self.readers.get_mut(&conn).unwrap();
        if reader.history.is_none() {
            reader.history = Some("0".to_owned());
        }
        let name = reader.name;
        core.note(format!(
            "connection {conn} (c{name}) lost and made again: rereads its pending entries"
        ));
        let reread: BTreeSet<usize> = self
            .pel
            .iter()
            .filter(|(_, p)| p.owner == name)
            .map(|(&i, _)| i)
            .collect();
        self.fail_copies(|c| c.conn != conn || !reread.contains(&c.entry));
    }

    /// The source's `read`.
    fn receive(&mut self, core: &mut Core, conn: Conn, max: usize) -> Vec<Handout> {
        let max = max.max(1);
        let name = self.readers[&conn].name;
        if let Some(after) = self.readers[&conn].history.clone() {
            let entries = self.reread(name, &after, max);
            let reader = self.readers.get_mut(&conn).unwrap();
            match entries.last() {
                Some(&last) => {
                    reader.history = Some(entry_id(last));
                    return self.deliver_pending(core, conn, &entries);
                }
                None => reader.history = None,
            }
        }
        if Instant::now() >= self.readers[&conn].next_claim {
            let (cursor, claimed) = if self.marks.is_empty() {
                self.autoclaim(conn, max)
            } else {
                self.claim_due(conn, max)
            };
            let claim_interval = self.settings.unwrap().1;
            let reader = self.readers.get_mut(&conn).unwrap();
            if reader.sweep.advance(&cursor) {
                reader.next_claim = Instant::now() + claim_interval;
            }
            if !claimed.is_empty() {
                core.note(format!("c{name} claimed entries {claimed:?}"));
                return self.deliver_pending(core, conn, &claimed);
            }
        }
        let now = Instant::now();
        let new: Vec<usize> = (self.read..self.entries).take(max).collect();
        self.read += new.len();
        new.into_iter()
            .map(|i| {
                self.pel.insert(
                    i,
                    Pel {
                        owner: name,
                        since: now,
                        delivery_count: 1,
                    },
                );
                self.hand_out(core, conn, i, Reported::new(Some(1), None))
            })
            .collect()
    }

    fn ack(&mut self, _core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        self.settle(h)
    }

    /// The entry stays pending, for a claim after `claim_idle`.
    fn nack(&mut self, _core: &mut Core, _conn: Conn, h: &Handout, _retry_after: Duration) {
        self.end(h.handle, true);
    }

    /// `XPENDING` of the entry; unless a later copy is out, `HSET` of the mark, then
    /// `XCLAIM … 0 <id> JUSTID`: the entry waits, idle, for its delay.
    fn redeliver(
        &mut self,
        core: &mut Core,
        conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> Result<bool, SourceError> {
        self.end(h.handle, true);
        let reported = self.copies[&h.handle].reported;
        let now = self.pel.get(&h.entry).map(|p| p.delivery_count);
        if !reported.may_hand_back(now) {
            core.note(format!(
                "entry {}: a copy of delivery {:?} hands back, delivery {now:?} is out: left",
                h.entry, reported.delivery_count
            ));
            return Ok(false);
        }
        let mark = Mark::new(redelivery + 1, delay, reported.delivery_count);
        self.marks.insert(h.entry, mark.to_string());
        let name = self.readers[&conn].name;
        Ok(self.xclaim(name, 0, h.entry, true))
    }

    /// The dead letter's `XADD` and `XACK` in one script, then `HDEL` of the mark.
    fn dead_letter(&mut self, _core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        self.settle(h)
    }

    fn is_stale(&self, _core: &Core, _conn: Conn, _h: &Handout) -> bool {
        false
    }

    fn open(&self) -> usize {
        self.entries - self.acked.len()
    }
}
