//! What a liveness and a readiness probe answer for a set of consumers, for whichever HTTP
//! server the application already runs (axum, hyper, actix-web): no server here.
//!
//! ```
//! use inbox_core::{Health, Probes};
//!
//! let probes = Probes::new().consumer(Health::default()); // from `Consumer::health`
//! // In the server's handler for GET `path`:
//! let answer = probes.answer("/readyz").expect("a probe path");
//! assert_eq!(answer.status, 503); // built, not running yet
//! assert_eq!(answer.body, "not ready: consumer #1 starting\n");
//! ```
//!
//! | path | 200 | 503 |
//! |---|---|---|
//! | `/healthz`, `/livez` | every consumer is live ([`Health::is_live`]): its loop turned within `stalled_after` | one is stalled or stopped: restart the process |
//! | `/readyz` | every consumer is ready ([`Health::is_ready`]) | one is starting, backing off after a broker or store error, stopping or stopped: take the instance out of rotation, do not restart it |
//!
//! With no consumer added, both probes answer 200. `examples/src/bin/observability.rs` serves
//! them, with `/metrics`, in a few lines of hyper.

use std::time::Duration;

use crate::Health;

/// The consumers a process's probes answer for. Build it, then ask [`Probes::answer`] per
/// request.
#[derive(Debug, Clone)]
pub struct Probes {
    consumers: Vec<Health>,
    stalled_after: Duration,
}

/// One probe's answer: its HTTP status and a line of text saying which consumer is not live or
/// not ready, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// 200 or 503.
    pub status: u16,
    /// `live\n`, `ready\n`, or `not ready: wallet backoff\n`.
    pub body: String,
}

impl Default for Probes {
    fn default() -> Self {
        Self::new()
    }
}

impl Probes {
    /// How long a consumer's loop may go without turning before it is not live, by default.
    pub const DEFAULT_STALLED_AFTER: Duration = Duration::from_secs(120);

    /// Probes watching no consumer yet.
    pub fn new() -> Self {
        Self {
            consumers: Vec::new(),
            stalled_after: Self::DEFAULT_STALLED_AFTER,
        }
    }

    /// Watches a consumer ([`Consumer::health`](crate::Consumer::health)); both probes answer
    /// for all watched consumers together.
    pub fn consumer(mut self, health: Health) -> Self {
        self.consumers.push(health);
        self
    }

    /// How long a consumer's loop may go without turning before it counts as stalled (default
    /// [`Probes::DEFAULT_STALLED_AFTER`]). The loop turns at least once per broker poll and per
    /// finished batch, so keep it above the poll wait, the handler timeout and the longest
    /// batch.
    pub fn stalled_after(mut self, wait: Duration) -> Self {
        self.stalled_after = wait;
        self
    }

    /// The liveness probe: 200 while every consumer's loop turns.
    pub fn live(&self) -> Answer {
        self.check("live", |h| h.is_live(self.stalled_after))
    }

    /// The readiness probe: 200 while every consumer runs without a broker or store failing.
    pub fn ready(&self) -> Answer {
        self.check("ready", Health::is_ready)
    }

    /// The answer for a request path: `/healthz` or `/livez` ([`Probes::live`]), `/readyz`
    /// ([`Probes::ready`]); `None` for any other path.
    pub fn answer(&self, path: &str) -> Option<Answer> {
        match path {
            "/healthz" | "/livez" => Some(self.live()),
            "/readyz" => Some(self.ready()),
            _ => None,
        }
    }

    fn check(&self, what: &str, passes: impl Fn(&Health) -> bool) -> Answer {
        let failing: Vec<String> = self
            .consumers
            .iter()
            .enumerate()
            .filter(|(_, h)| !passes(h))
            .map(|(i, h)| {
                let name = h
                    .consumer()
                    .map_or_else(|| format!("consumer #{}", i + 1), str::to_owned);
                format!("{name} {}", h.state().as_str())
            })
            .collect();
        let (status, body) = if failing.is_empty() {
            (200, format!("{what}\n"))
        } else {
            (503, format!("not {what}: {}\n", failing.join(", ")))
        };
        Answer { status, body }
    }
}
