//! [`Health`]: whether a running consumer is live and ready, for liveness and readiness probes.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a consumer is doing, as [`Health::state`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConsumerState {
    /// Built, not running yet.
    Starting,
    /// Receiving and applying.
    Running,
    /// Waiting out a backoff after the broker or the store failed.
    Backoff,
    /// Shutdown was asked for: the work in flight is finishing.
    Stopping,
    /// `run` returned.
    Stopped,
}

impl ConsumerState {
    const ALL: [ConsumerState; 5] = [
        ConsumerState::Starting,
        ConsumerState::Running,
        ConsumerState::Backoff,
        ConsumerState::Stopping,
        ConsumerState::Stopped,
    ];

    /// The state as a label (`running`, `backoff`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ConsumerState::Starting => "starting",
            ConsumerState::Running => "running",
            ConsumerState::Backoff => "backoff",
            ConsumerState::Stopping => "stopping",
            ConsumerState::Stopped => "stopped",
        }
    }
}

/// A cheap, cloneable view of one consumer's health, from
/// [`Consumer::health`](crate::Consumer::health), readable from a probe handler while the
/// consumer runs.
///
/// - **live**: the consumer's loop has turned within the last `stalled_after` (it turns at
///   least once per broker poll, so allow a few poll timeouts). A consumer that is not live is
///   stuck: restart it.
/// - **ready**: running, and neither the broker nor the store is failing (no error backoff, no
///   store outage). Not ready is normal for a moment during a rebalance or a database failover;
///   take the instance out of rotation, do not restart it.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<Cells>);

#[derive(Debug, Default)]
struct Cells {
    state: AtomicU8,
    /// Milliseconds since the Unix epoch; 0 for never.
    last_turn_ms: AtomicU64,
    last_batch_ms: AtomicU64,
    /// Set when the consumer starts: its name and its state gauges.
    gauges: OnceLock<Gauges>,
}

/// `inbox_consumer_ready` and `inbox_consumer_state` of one consumer.
#[derive(Debug)]
struct Gauges {
    consumer: String,
    ready: metrics::Gauge,
    /// One per [`ConsumerState::ALL`], in that order.
    states: Vec<metrics::Gauge>,
}

impl Gauges {
    fn show(&self, state: ConsumerState) {
        self.ready.set(if state == ConsumerState::Running {
            1.0
        } else {
            0.0
        });
        for (gauge, s) in self.states.iter().zip(ConsumerState::ALL) {
            gauge.set(if s == state { 1.0 } else { 0.0 });
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn time_of(ms: u64) -> Option<SystemTime> {
    (ms != 0).then(|| UNIX_EPOCH + Duration::from_millis(ms))
}

impl Health {
    /// What the consumer is doing now.
    pub fn state(&self) -> ConsumerState {
        let index = usize::from(self.0.state.load(Ordering::Relaxed));
        ConsumerState::ALL
            .get(index)
            .copied()
            .unwrap_or(ConsumerState::Stopped)
    }

    /// Whether the loop has turned within `stalled_after` and the consumer has not stopped.
    pub fn is_live(&self, stalled_after: Duration) -> bool {
        if self.state() == ConsumerState::Stopped {
            return false;
        }
        match self.last_turn() {
            Some(at) => at.elapsed().map_or(true, |age| age <= stalled_after),
            // Not started yet: live, as a process that is still starting up.
            None => true,
        }
    }

    /// Whether the consumer runs with its broker and store answering.
    pub fn is_ready(&self) -> bool {
        self.state() == ConsumerState::Running
    }

    /// The name of the consumer this handle watches, once it has started.
    pub fn consumer(&self) -> Option<&str> {
        self.0.gauges.get().map(|g| g.consumer.as_str())
    }

    /// When the loop last turned.
    pub fn last_turn(&self) -> Option<SystemTime> {
        time_of(self.0.last_turn_ms.load(Ordering::Relaxed))
    }

    /// When a transaction last committed (or a batch of duplicates was settled).
    pub fn last_batch(&self) -> Option<SystemTime> {
        time_of(self.0.last_batch_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn set(&self, state: ConsumerState) {
        // `ALL` lists the states in declaration order: the discriminant is the index.
        self.0.state.store(state as u8, Ordering::Relaxed);
        if let Some(gauges) = self.0.gauges.get() {
            gauges.show(state);
        }
    }

    /// Names the consumer and registers its state gauges (`inbox_consumer_ready`,
    /// `inbox_consumer_state`) with the recorder installed now; they follow every state change.
    pub(crate) fn attach(&self, consumer: &str) {
        let gauges = self.0.gauges.get_or_init(|| Gauges {
            consumer: consumer.to_owned(),
            ready: metrics::gauge!(crate::telemetry::CONSUMER_READY, "consumer" => consumer.to_owned()),
            states: ConsumerState::ALL
                .iter()
                .map(|s| {
                    metrics::gauge!(
                        crate::telemetry::CONSUMER_STATE,
                        "consumer" => consumer.to_owned(),
                        "state" => s.as_str()
                    )
                })
                .collect(),
        });
        gauges.show(self.state());
    }

    /// From backoff back to running, leaving a stopping consumer as it is.
    pub(crate) fn recovered(&self) {
        if self.state() == ConsumerState::Backoff {
            self.set(ConsumerState::Running);
        }
    }

    /// From running to backoff.
    pub(crate) fn failing(&self) {
        if self.state() == ConsumerState::Running {
            self.set(ConsumerState::Backoff);
        }
    }

    pub(crate) fn turned(&self) {
        self.0.last_turn_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn batch_done(&self) {
        self.0.last_batch_ms.store(now_ms(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_while_running_and_live_until_stopped() {
        let health = Health::default();
        assert_eq!(health.state(), ConsumerState::Starting);
        assert!(!health.is_ready());
        assert!(health.is_live(Duration::from_secs(1)));
        health.set(ConsumerState::Running);
        health.turned();
        assert!(health.is_ready());
        health.failing();
        assert_eq!(health.state(), ConsumerState::Backoff);
        assert!(!health.is_ready());
        assert!(health.is_live(Duration::from_secs(1)));
        health.recovered();
        assert!(health.is_ready());
        health.set(ConsumerState::Stopping);
        health.recovered();
        assert_eq!(health.state(), ConsumerState::Stopping);
        health.set(ConsumerState::Stopped);
        assert!(!health.is_live(Duration::from_secs(1)));
    }

    #[test]
    fn a_loop_that_stopped_turning_is_not_live() {
        let health = Health::default();
        health.set(ConsumerState::Running);
        health
            .0
            .last_turn_ms
            .store(now_ms() - 10_000, Ordering::Relaxed);
        assert!(!health.is_live(Duration::from_secs(5)));
        assert!(health.is_live(Duration::from_secs(15)));
    }
}
