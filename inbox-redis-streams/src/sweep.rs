//! The pending-entry sweep's decisions, as plain state: which pending entries to claim now,
//! whether a redelivery mark still holds its entry back, what a delivery reports.
//!
//! [`RedisStreamSource`](crate::RedisStreamSource) drives this with what Redis answers
//! (`XPENDING` rows, the marks in `<stream>:<group>:redeliveries`) and does what it decides
//! (`XCLAIM`, `HSET`); nothing here talks to Redis, waits or reads a clock, so a simulation can
//! drive the same rules over a model of Redis. While any entry is marked, the sweep lists the
//! pending entries with `XPENDING` instead of `XAUTOCLAIM`ing them, and claims each due one with
//! `XCLAIM` and the minimum idle time it was due at, so two sweeps cannot both take it.
//!
//! # Redelivery marks
//!
//! [`Ack::redeliver`](inbox_core::Ack::redeliver) leaves the entry pending and writes a
//! [`Mark`]: the redelivery count, the delay, and the entry's delivery count when it was handed
//! back. Redis raises that count each time the entry is handed out again (the reread after a
//! reconnect, a claim), and the hand-back itself leaves it alone (`XCLAIM … JUSTID`). So while the
//! count is still the one in the mark, the entry *waits*: it is claimed once idle for its delay.
//! Once it rose, the copy the delay was for is *out*, being worked on: the entry is claimed only
//! once idle for `claim_idle`, like any other, so a handler that takes longer than the delay is
//! not handed a second copy (nor has its delivery count raised towards `max_deliveries`). The
//! mark stays until the entry is settled, so a copy claimed after a crash still reports its
//! redelivery count.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// A pending entry's redelivery mark: the value of its field in `<stream>:<group>:redeliveries`,
/// `<redeliveries>:<delay in ms>:<delivery count at the hand-back>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// Times the entry was handed back under the redelivery schedule, this hand-back included.
    pub redeliveries: u32,
    /// How long it waits, idle, before it is claimed again; at least 1 ms.
    pub delay_ms: u64,
    /// Its delivery count when it was handed back; `None` in a mark written without one (by an
    /// earlier version), which then waits for its delay every time.
    pub handed_back_at: Option<u32>,
}

impl Mark {
    /// The mark of a hand-back: the `redeliveries`-th, to wait `delay`, of a copy delivered
    /// `delivery_count` times.
    pub fn new(redeliveries: u32, delay: Duration, delivery_count: Option<u32>) -> Self {
        Self {
            redeliveries,
            delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX).max(1),
            handed_back_at: delivery_count,
        }
    }

    /// Reads a mark as stored; `None` when it does not parse (it is then ignored).
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(':');
        let redeliveries = parts.next()?.parse().ok()?;
        let delay_ms = parts.next()?.parse().ok()?;
        let handed_back_at = parts.next().map(str::parse).transpose().ok()?;
        if parts.next().is_some() {
            return None;
        }
        Some(Self {
            redeliveries,
            delay_ms,
            handed_back_at,
        })
    }

    /// Whether the entry still waits for its delay, given its delivery count now: no copy has
    /// been handed out since the hand-back.
    pub fn waits(&self, delivery_count: Option<u32>) -> bool {
        match (self.handed_back_at, delivery_count) {
            (Some(then), Some(now)) => now <= then,
            // A mark without its count, or a row without one: the delay, as before.
            _ => true,
        }
    }
}

/// As stored: `<redeliveries>:<delay in ms>[:<delivery count>]`.
impl fmt::Display for Mark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.redeliveries, self.delay_ms)?;
        if let Some(count) = self.handed_back_at {
            write!(f, ":{count}")?;
        }
        Ok(())
    }
}

/// One row of `XPENDING key group start end count`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The entry ID.
    pub id: String,
    /// Milliseconds since it was last delivered (or its idle time restarted).
    pub idle_ms: u64,
    /// Times it was delivered.
    pub delivery_count: u32,
}

/// The sweep over the group's pending list: where the next step starts, and which entries of a
/// step are due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sweep {
    claim_idle_ms: u64,
    /// Where the next step starts; `0-0` at the beginning.
    cursor: String,
}

impl Sweep {
    /// A sweep at the beginning of the pending list, claiming entries of dead consumers once
    /// idle for `claim_idle`.
    pub fn new(claim_idle: Duration) -> Self {
        Self {
            claim_idle_ms: u64::try_from(claim_idle.as_millis()).unwrap_or(u64::MAX),
            cursor: "0-0".to_owned(),
        }
    }

    /// Where the next step starts, as `XAUTOCLAIM`'s start: `0-0` at the beginning.
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// Where the next step starts, as `XPENDING`'s start: `-` at the beginning.
    pub fn range_start(&self) -> &str {
        if self.cursor == "0-0" {
            "-"
        } else {
            &self.cursor
        }
    }

    /// Moves to the cursor a step answered; `true` when the sweep went through the whole list
    /// (the cursor is back at `0-0`), and the next one waits for the claim interval.
    pub fn advance(&mut self, cursor: &str) -> bool {
        cursor.clone_into(&mut self.cursor);
        self.cursor == "0-0"
    }

    /// How long `entry` must have been idle before it is claimed: its delay while its mark
    /// holds it back, `claim_idle` otherwise.
    pub fn min_idle_ms(&self, entry: &Pending, mark: Option<&Mark>) -> u64 {
        match mark {
            Some(mark) if mark.waits(Some(entry.delivery_count)) => mark.delay_ms,
            _ => self.claim_idle_ms,
        }
    }

    /// One `XPENDING` step of at most `max` rows, each with its mark: the entries to claim now,
    /// grouped by the minimum idle time their `XCLAIM` must ask for (so a peer's sweep that
    /// claimed one first makes this claim of it a no-op), and the cursor after the step.
    pub fn due(&self, rows: &[Pending], marks: &[Option<Mark>], max: usize) -> Due {
        let mut claims: BTreeMap<u64, Vec<String>> = BTreeMap::new();
        for (entry, mark) in rows
            .iter()
            .zip(marks.iter().chain(std::iter::repeat(&None)))
        {
            let min_idle = self.min_idle_ms(entry, mark.as_ref());
            if entry.idle_ms >= min_idle {
                claims.entry(min_idle).or_default().push(entry.id.clone());
            }
        }
        let cursor = match rows.last() {
            Some(last) if rows.len() >= max => next_id(&last.id),
            _ => "0-0".to_owned(),
        };
        Due { claims, cursor }
    }
}

/// The outcome of one step: what to claim, and where the next step starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Due {
    /// Entry IDs to claim, by the minimum idle time of their `XCLAIM`.
    pub claims: BTreeMap<u64, Vec<String>>,
    /// The cursor after this step, for [`Sweep::advance`].
    pub cursor: String,
}

/// What a delivery of an entry reports, given its delivery count (1 for a new entry, from
/// `XPENDING` for a reread or claimed one) and its mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    /// [`Metadata::delivery_count`](inbox_core::Metadata::delivery_count).
    pub delivery_count: Option<u32>,
    /// [`Metadata::redelivered`](inbox_core::Metadata::redelivered).
    pub redelivered: bool,
    /// [`Metadata::redeliveries`](inbox_core::Metadata::redeliveries).
    pub redeliveries: u32,
}

impl Reported {
    /// What a copy reports: Redis's delivery count as it is (each redelivery is one more), and
    /// the redelivery count of its mark, whether it waited for its delay or not.
    pub fn new(delivery_count: Option<u32>, mark: Option<&Mark>) -> Self {
        Self {
            delivery_count,
            redelivered: delivery_count.is_some_and(|n| n > 1),
            redeliveries: mark.map_or(0, |m| m.redeliveries),
        }
    }

    /// Whether this copy may hand its entry back for a delayed redelivery, given the entry's
    /// delivery count now (from `XPENDING`; `None`: no longer pending). Only the latest copy
    /// may: once the entry was handed out again (reread after a lost connection, claimed), an
    /// earlier copy's mark would rewind the schedule to its own counts, stop the entry from
    /// waiting for its delay, and take it from the consumer of the latest copy. That copy
    /// settles or hands back the entry; the earlier one leaves it, as a nack does. A copy
    /// that knows no count hands back as before.
    pub fn may_hand_back(&self, delivery_count_now: Option<u32>) -> bool {
        match (self.delivery_count, delivery_count_now) {
            (_, None) => false,
            (Some(then), Some(now)) => then >= now,
            (None, Some(_)) => true,
        }
    }
}

/// The smallest entry ID after `id`, for a sweep cursor (inclusive, as `XAUTOCLAIM`'s is).
pub fn next_id(id: &str) -> String {
    let (ms, seq) = entry_id_key(id);
    match seq.checked_add(1) {
        Some(seq) => format!("{ms}-{seq}"),
        None => format!("{}-0", ms.saturating_add(1)),
    }
}

/// A stream entry ID as numbers, for ordering (`10-0` after `9-0`); an ID that does not parse
/// sorts first.
pub fn entry_id_key(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

/// The first and the last of `ids` in stream order, for one `XPENDING` range over them all:
/// claimed entries come grouped by the idle time they were claimed at, not in stream order.
pub fn id_range<'a>(ids: impl IntoIterator<Item = &'a str>) -> Option<(&'a str, &'a str)> {
    let ids: Vec<&str> = ids.into_iter().collect();
    let first = ids.iter().copied().min_by_key(|id| entry_id_key(id))?;
    let last = ids.iter().copied().max_by_key(|id| entry_id_key(id))?;
    Some((first, last))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLAIM_IDLE: Duration = Duration::from_secs(60);

    #[test]
    fn the_range_of_claimed_entries_is_in_stream_order() {
        assert_eq!(
            id_range(["12-0", "10-0", "15-0", "10-1"]),
            Some(("10-0", "15-0"))
        );
        assert_eq!(id_range(["9-0"]), Some(("9-0", "9-0")));
        assert_eq!(id_range([]), None);
    }

    fn row(id: &str, idle_ms: u64, delivery_count: u32) -> Pending {
        Pending {
            id: id.to_owned(),
            idle_ms,
            delivery_count,
        }
    }

    fn claimed(due: &Due) -> Vec<(u64, Vec<&str>)> {
        due.claims
            .iter()
            .map(|(idle, ids)| (*idle, ids.iter().map(String::as_str).collect()))
            .collect()
    }

    #[test]
    fn a_mark_round_trips_and_reads_the_earlier_form() {
        let mark = Mark::new(2, Duration::from_millis(300), Some(3));
        assert_eq!(mark.to_string(), "2:300:3");
        assert_eq!(Mark::parse("2:300:3"), Some(mark));
        assert_eq!(
            Mark::parse("1:500"),
            Some(Mark {
                redeliveries: 1,
                delay_ms: 500,
                handed_back_at: None
            })
        );
        assert_eq!(Mark::new(1, Duration::ZERO, Some(1)).delay_ms, 1);
        for bad in ["", "1", "x:5", "1:5:x", "1:5:2:9"] {
            assert_eq!(Mark::parse(bad), None, "{bad:?}");
        }
    }

    /// Defect 7 of issue 41: the copy a delay was for is out once the delivery count rose, and
    /// is then claimed only after `claim_idle`, however long past its delay it is worked on.
    #[test]
    fn a_marked_entry_waits_for_its_delay_once_then_for_claim_idle() {
        let sweep = Sweep::new(CLAIM_IDLE);
        let first = Mark::new(1, Duration::from_millis(300), Some(1));
        // Handed back again by the copy delivered twice: waits for its new delay.
        let again = Mark::new(2, Duration::from_secs(1), Some(2));
        // (mark, idle ms, delivery count, the min idle it is claimed with, if due)
        for (mark, idle, count, claimed_at) in [
            (first, 299, 1, None),
            (first, 300, 1, Some(300)),
            // Claimed: count 2. Idle for many delays while its handler runs: left alone.
            (first, 5_000, 2, None),
            // Its holder died: claimed like any other entry, with claim_idle.
            (first, 60_000, 2, Some(60_000)),
            (again, 999, 2, None),
            (again, 1_000, 2, Some(1_000)),
        ] {
            let due = sweep.due(&[row("5-0", idle, count)], &[Some(mark)], 10);
            let expected: Vec<_> = claimed_at.map(|at| (at, vec!["5-0"])).into_iter().collect();
            assert_eq!(claimed(&due), expected, "{mark} idle {idle} count {count}");
        }
    }

    #[test]
    fn a_step_groups_due_entries_by_the_idle_time_their_claim_asks_for() {
        let sweep = Sweep::new(CLAIM_IDLE);
        let rows = [
            row("1-0", 61_000, 1), // unmarked, idle past claim_idle
            row("2-0", 100, 1),    // unmarked, busy
            row("3-0", 250, 1),    // waits 200 ms: due
            row("4-0", 250, 1),    // waits 500 ms: not yet
            row("5-0", 700, 1),    // waits 500 ms: due
            row("6-0", 61_000, 1), // a mark from an earlier version: its delay
        ];
        let marks = [
            None,
            None,
            Some(Mark::new(1, Duration::from_millis(200), Some(1))),
            Some(Mark::new(1, Duration::from_millis(500), Some(1))),
            Some(Mark::new(1, Duration::from_millis(500), Some(1))),
            Mark::parse("1:900"),
        ];
        let due = sweep.due(&rows, &marks, 100);
        assert_eq!(
            claimed(&due),
            [
                (200, vec!["3-0"]),
                (500, vec!["5-0"]),
                (900, vec!["6-0"]),
                (60_000, vec!["1-0"]),
            ]
        );
        assert_eq!(
            due.cursor, "0-0",
            "fewer rows than asked: the sweep is done"
        );
    }

    #[test]
    fn the_cursor_goes_on_after_a_full_step_and_restarts_after_a_short_one() {
        let mut sweep = Sweep::new(CLAIM_IDLE);
        assert_eq!((sweep.cursor(), sweep.range_start()), ("0-0", "-"));
        let due = sweep.due(&[row("7-0", 0, 1), row("9-5", 0, 1)], &[], 2);
        assert_eq!(due.cursor, "9-6");
        assert!(!sweep.advance(&due.cursor));
        assert_eq!((sweep.cursor(), sweep.range_start()), ("9-6", "9-6"));
        let due = sweep.due(&[row("10-0", 0, 1)], &[], 2);
        assert!(sweep.advance(&due.cursor));
        assert_eq!(sweep.range_start(), "-");
        assert_eq!(next_id(&format!("3-{}", u64::MAX)), "4-0");
        assert!(entry_id_key("10-0") > entry_id_key("9-9"));
    }

    #[test]
    fn only_the_latest_copy_hands_its_entry_back() {
        let latest = Reported::new(Some(2), None);
        assert!(latest.may_hand_back(Some(2)));
        assert!(!Reported::new(Some(1), None).may_hand_back(Some(2)));
        assert!(!latest.may_hand_back(None), "settled meanwhile");
        assert!(Reported::new(None, None).may_hand_back(Some(5)));
    }

    #[test]
    fn a_copy_reports_redis_counts_and_its_marks_redeliveries() {
        assert_eq!(
            Reported::new(Some(1), None),
            Reported {
                delivery_count: Some(1),
                redelivered: false,
                redeliveries: 0
            }
        );
        let mark = Mark::new(2, Duration::from_secs(1), Some(2));
        assert_eq!(
            Reported::new(Some(3), Some(&mark)),
            Reported {
                delivery_count: Some(3),
                redelivered: true,
                redeliveries: 2
            }
        );
    }
}
