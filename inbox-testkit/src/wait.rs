//! Waiting in tests: for a condition, and for a consumer's first failure.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{Delivery, MessageSource, Stats, StatsSnapshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Polls `check` every 50 ms until it returns true or `limit` passes; returns whether it did.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Receives from `source` until `n` deliveries arrived.
///
/// # Panics
/// When `limit` passes first, or a receive fails.
pub async fn receive<S: MessageSource>(
    source: &mut S,
    n: usize,
    limit: Duration,
) -> Vec<Delivery<S::Ack>> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} deliveries in {limit:?}",
            out.len()
        );
        match source.receive(n - out.len()).await {
            Ok(received) => out.extend(received),
            Err(e) => panic!("receive failed: {e}"),
        }
    }
    out
}

/// Watches a consumer's `stats` from now on: the task ends with how long after now the
/// consumer first counted an error or a failed ack, or `None` after 300 s without one.
pub fn watch_errors(stats: Arc<Stats>) -> (std::time::Instant, JoinHandle<Option<Duration>>) {
    let started = std::time::Instant::now();
    let seen = |s: StatsSnapshot| s.errors + s.ack_failures;
    let before = seen(stats.snapshot());
    let task = tokio::spawn(async move {
        while started.elapsed() < Duration::from_secs(300) {
            if seen(stats.snapshot()) > before {
                return Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    });
    (started, task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn eventually_says_whether_the_condition_came_true_in_time() {
        let mut calls = 0;
        assert!(
            eventually(Duration::from_secs(5), || {
                calls += 1;
                let done = calls == 3;
                async move { done }
            })
            .await
        );
        assert_eq!(calls, 3);
        let started = std::time::Instant::now();
        assert!(!eventually(Duration::from_millis(200), || async { false }).await);
        assert!(started.elapsed() >= Duration::from_millis(200));
    }
}
