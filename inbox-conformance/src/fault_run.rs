//! What a run of the wallet under a network or broker fault came to: the measures every adapter's
//! fault test takes, with the broker's own beside them.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use crate::wallet::{applied, Summary};
use crate::TestStore;
use inbox_core::StatsSnapshot;
use inbox_testkit::eventually;

/// What one run under a fault came to. `B` is what the broker had left at the end, in the
/// adapter's own terms (records not committed, entries pending, copies on the queue); it shows in
/// [`report`](Self::report) and in every failed assertion.
#[derive(Debug)]
pub struct FaultRun<B> {
    /// The ledger at the end.
    pub ledger: Summary,
    /// The consumer's counters at the end.
    pub stats: StatsSnapshot,
    /// Events in the ledger when the fault started.
    pub applied_at_fault: i64,
    /// Events in the ledger when the fault was over.
    pub applied_at_restore: i64,
    /// From the fault's start to the consumer's first counted error or failed ack, if it saw one.
    pub detected: Option<Duration>,
    /// From the fault's start to its end.
    pub fault_lasted: Duration,
    /// From the fault's end to the next event applied (or to the end, when none was left).
    pub first_progress: Duration,
    /// From the fault's end to every event applied and the broker done with them.
    pub all_done: Duration,
    /// What the broker had left at the end.
    pub broker: B,
}

impl<B: Debug> FaultRun<B> {
    /// Prints the run on one line, `name` first, for `events` published.
    pub fn report(&self, name: &str, events: i64) {
        println!(
            "{name}: {events} events; duplicates {}, lost {}, balances exact {}; fault lasted \
             {:?} from {} applied events to {}; first failure {:?} after the fault started; \
             after restore: next event applied in {:?}, all done in {:?}; {:?}; {:?}",
            self.ledger.duplicates(),
            self.ledger.lost(events),
            self.ledger.balances_exact,
            self.fault_lasted,
            self.applied_at_fault,
            self.applied_at_restore,
            self.detected,
            self.first_progress,
            self.all_done,
            self.broker,
            self.stats,
        );
    }

    /// Asserts that each of the `events` published is in the ledger exactly once, the balances
    /// add up to `total` and nothing was dead-lettered. What the broker had left is the
    /// caller's to check.
    ///
    /// # Panics
    /// When any of that is not so, with the whole run in the message.
    pub fn assert_exactly_once(&self, events: i64, total: i64) {
        assert_eq!(self.ledger.duplicates(), 0, "applied twice: {self:?}");
        assert_eq!(self.ledger.lost(events), 0, "lost: {self:?}");
        assert!(self.ledger.balances_exact, "balances off: {self:?}");
        assert_eq!(self.ledger.total_balance, total, "{self:?}");
        assert_eq!(self.stats.dead_lettered, 0, "dead-lettered: {self:?}");
    }
}

/// Waits until the ledger in `db` holds a third of the `events` published, the moment a fault
/// test strikes; returns how many it holds then.
///
/// # Panics
/// When it does not within `limit`.
pub async fn wait_for_a_third<D: TestStore>(db: &D, events: i64, limit: Duration) -> i64 {
    let started = eventually(limit, || async { applied(db).await >= events / 3 }).await;
    assert!(started, "the consumer applied too little before the fault");
    applied(db).await
}

/// The end of a fault as the ledger saw it.
#[derive(Debug, Clone, Copy)]
pub struct Restored {
    /// When the fault was over.
    pub at: Instant,
    /// Events in the ledger then.
    pub applied: i64,
    /// Whether one more event was applied (or all were) within the limit.
    pub progressed: bool,
    /// From the fault's end to that event, or to the limit.
    pub first_progress: Duration,
}

impl Restored {
    /// Call as the fault ends: waits up to `limit` for the ledger in `db` to grow past what it
    /// holds now, or to hold all of the `events` published.
    pub async fn measure<D: TestStore>(db: &D, events: i64, limit: Duration) -> Self {
        let at = Instant::now();
        let applied_then = applied(db).await;
        let progressed = eventually(limit, || async {
            let now = applied(db).await;
            now > applied_then || now >= events
        })
        .await;
        Self {
            at,
            applied: applied_then,
            progressed,
            first_progress: at.elapsed(),
        }
    }
}
