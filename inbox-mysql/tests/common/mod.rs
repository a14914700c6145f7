//! What the broker tests share: the wallet on MySQL (`inbox_conformance::mysql_wallet`), a drain
//! loop and what is left on the broker.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::Summary;
use inbox_conformance::TestQueue;
use inbox_core::StatsSnapshot;

pub use inbox_conformance::mysql_wallet::{inbox, wallet_db, Credit};

/// The accounts the events credit.
pub const ACCOUNTS: i64 = 7;

/// What the ledger says.
pub async fn summary(pool: &sqlx::MySqlPool) -> Summary {
    inbox_conformance::mysql_wallet::summary(pool)
        .await
        .expect("the ledger")
}

/// Runs consumers (`run`, given a new source of `member`) until idle, one after another,
/// until the ledger holds `events` distinct events or `limit` passes.
pub async fn drain<Q, R, F>(
    queue: &Q,
    db: &MySqlDb,
    member: &str,
    events: i64,
    limit: Duration,
    mut run: R,
) -> Vec<StatsSnapshot>
where
    Q: TestQueue,
    R: FnMut(Q::Source) -> F,
    F: Future<Output = inbox_core::Result<StatsSnapshot>>,
{
    let start = Instant::now();
    let mut runs = Vec::new();
    loop {
        let stats = run(queue.source(member).await)
            .await
            .unwrap_or_else(|e| panic!("consumer {member}: {e}"));
        runs.push(stats);
        let done = summary(&db.pool).await.distinct_events;
        if done >= events {
            return runs;
        }
        assert!(
            start.elapsed() < limit,
            "not drained within {limit:?}: {done} of {events}; {runs:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What is left on the broker once it had a few seconds to settle.
pub async fn left<Q: TestQueue>(queue: &Q) -> u64 {
    let start = Instant::now();
    loop {
        let left = queue.left().await;
        if left == 0 || start.elapsed() > Duration::from_secs(10) {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
