//! How often each record of a partition was handed back under a redelivery schedule, and until
//! when it waits: kept with the partition's committed offset, so that a rebalance or a restart
//! goes on with the schedule instead of starting it again.
//!
//! Kafka has no per-record delivery count, and the adapter's in-process count is dropped with
//! the partition when it is revoked. Where else could the count live?
//!
//! - **In the committed offset's metadata** (chosen). A commit carries a string per partition
//!   that the broker keeps with the offset, and whoever owns the partition next reads the two
//!   together. The count then lives exactly as long as the record is unfinished: the commit
//!   that moves past the record drops it. It costs nothing on the data path and needs no topic
//!   of its own, and every commit of the partition carries the marks of its unfinished records
//!   (so an ordinary commit never erases them).
//! - A header on a re-produced copy would put the record at the end of its partition, after
//!   later records of the same key: the order a paused partition exists to keep.
//! - A topic or table of its own would be a second write per redelivery and a second thing to
//!   keep in step with the offset.
//!
//! The metadata is plain text, `inbox-redeliveries/1` followed by one `offset:count:due` per
//! record (`due` in milliseconds since the Unix epoch), at most [`MAX_METADATA_BYTES`], lowest
//! offsets first (the record a partition waits for is its lowest unfinished one). Metadata that
//! does not start with that tag, written by another tool, reads as no marks.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The tag that starts the metadata this module writes.
pub const METADATA_TAG: &str = "inbox-redeliveries/1";

/// The longest metadata written, well under the broker's `offset.metadata.max.bytes` (4096 by
/// default): a commit with more would be refused, and the partition could commit nothing.
pub const MAX_METADATA_BYTES: usize = 1024;

/// One record's place in its redelivery schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// Redeliveries so far: the copy read next reports it in
    /// [`Metadata::redeliveries`](inbox_core::Metadata::redeliveries).
    pub count: u32,
    /// When the record may be read again (wall-clock time, as it crosses processes).
    pub due: SystemTime,
}

/// The marks of one partition's unfinished records, by offset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedeliveryCounts {
    marks: BTreeMap<i64, Mark>,
}

impl RedeliveryCounts {
    /// The redeliveries of the record at `offset` so far (0 when it has none).
    pub fn count(&self, offset: i64) -> u32 {
        self.marks.get(&offset).map_or(0, |mark| mark.count)
    }

    /// The record at `offset` was handed back: `mark` is its new place in the schedule.
    pub fn set(&mut self, offset: i64, mark: Mark) {
        self.marks.insert(offset, mark);
    }

    /// The record at `offset` is finished; `true` when it had a mark.
    pub fn remove(&mut self, offset: i64) -> bool {
        self.marks.remove(&offset).is_some()
    }

    /// Takes in marks read elsewhere, keeping the higher count of a record known to both.
    pub fn merge(&mut self, other: Self) {
        for (offset, mark) in other.marks {
            let known = self.marks.entry(offset).or_insert(mark);
            if mark.count > known.count {
                *known = mark;
            }
        }
    }

    /// Drops the marks of records before `offset` (a commit passed them: they are finished).
    pub fn retain_from(&mut self, offset: i64) {
        self.marks = self.marks.split_off(&offset);
    }

    /// The latest time a record of the partition waits for: its partition stays paused until
    /// then.
    pub fn latest_due(&self) -> Option<SystemTime> {
        self.marks.values().map(|mark| mark.due).max()
    }

    /// Whether no record has a mark.
    pub fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }

    /// The marks as offset commit metadata; empty when there are none.
    pub fn to_metadata(&self) -> String {
        if self.marks.is_empty() {
            return String::new();
        }
        let mut out = String::from(METADATA_TAG);
        for (offset, mark) in &self.marks {
            let due = mark
                .due
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis();
            let entry = format!(" {offset}:{}:{due}", mark.count);
            if out.len() + entry.len() > MAX_METADATA_BYTES {
                break;
            }
            out.push_str(&entry);
        }
        out
    }

    /// The marks read back from offset commit metadata; none from metadata this module did not
    /// write, and a malformed entry is skipped.
    pub fn from_metadata(metadata: &str) -> Self {
        let mut counts = Self::default();
        let Some(entries) = metadata.strip_prefix(METADATA_TAG) else {
            return counts;
        };
        for entry in entries.split_whitespace() {
            let mut parts = entry.split(':');
            let (Some(offset), Some(count), Some(due), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let (Ok(offset), Ok(count), Ok(due)) =
                (offset.parse(), count.parse(), due.parse::<u64>())
            else {
                continue;
            };
            let due = UNIX_EPOCH + Duration::from_millis(due);
            counts.set(offset, Mark { count, due });
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    /// Marks of `(offset, count, due in ms)`.
    fn counts(marks: &[(i64, u32, u64)]) -> RedeliveryCounts {
        let mut counts = RedeliveryCounts::default();
        for &(offset, count, due) in marks {
            counts.set(
                offset,
                Mark {
                    count,
                    due: at(due),
                },
            );
        }
        counts
    }

    #[test]
    fn marks_round_trip_through_commit_metadata() {
        assert_eq!(counts(&[]).to_metadata(), "", "no marks, no metadata");
        let counts = counts(&[(17, 2, 1_700_000_000_123), (9, 1, 1_700_000_000_000)]);
        let metadata = counts.to_metadata();
        assert_eq!(
            metadata,
            "inbox-redeliveries/1 9:1:1700000000000 17:2:1700000000123"
        );
        let back = RedeliveryCounts::from_metadata(&metadata);
        assert_eq!(back, counts);
        assert_eq!(back.count(17), 2);
        assert_eq!(back.count(18), 0);
        assert_eq!(back.latest_due(), Some(at(1_700_000_000_123)));
    }

    #[test]
    fn foreign_or_malformed_metadata_reads_as_no_marks() {
        assert!(RedeliveryCounts::from_metadata("written by another tool").is_empty());
        let counts =
            RedeliveryCounts::from_metadata("inbox-redeliveries/1 x:1:2 5:1 6:2:3:4 7:3:10");
        assert_eq!(counts.count(7), 3);
        assert_eq!(counts.latest_due(), Some(at(10)));
        assert_eq!(counts.count(5), 0);
    }

    #[test]
    fn metadata_stays_under_its_limit_keeping_the_lowest_offsets() {
        let many: Vec<_> = (0..1_000)
            .map(|offset| (offset, 1, 1_700_000_000_000))
            .collect();
        let metadata = counts(&many).to_metadata();
        assert!(metadata.len() <= MAX_METADATA_BYTES);
        let back = RedeliveryCounts::from_metadata(&metadata);
        assert_eq!(back.count(0), 1, "the lowest offset is kept");
        assert_eq!(back.count(999), 0);
    }

    #[test]
    fn a_merge_keeps_the_higher_count() {
        let mut here = counts(&[(3, 2, 5), (4, 1, 5)]);
        here.merge(counts(&[(3, 1, 1), (4, 3, 9), (6, 1, 2)]));
        assert_eq!((here.count(3), here.count(4), here.count(6)), (2, 3, 1));
    }
}
