//! Errors, each saying what the consumer loop does next.

use std::fmt;
use std::time::Duration;

/// A boxed error from a broker client, a database driver or a handler.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What to do after an error from a broker or a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recovery {
    /// Transient: try again after a backoff (a timeout, a serialization failure, a full pool).
    Retry,
    /// The connection is gone: the adapter reconnects on its next call; try again after a backoff.
    Reconnect,
    /// Retrying cannot help (bad configuration, missing table, no permission): stop the consumer
    /// and report.
    Fatal,
}

/// An operation on a broker or a store failed: what was being done, the underlying error, and
/// what to do next ([`Recovery`]).
///
/// Sources, acks, stores and publishers all fail with this one type, under the names their
/// traits use: [`SourceError`], [`StoreError`] and [`PublishError`](crate::PublishError).
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct OperationError {
    recovery: Recovery,
    context: String,
    #[source]
    source: BoxError,
}

impl OperationError {
    /// Wraps a broker or database error with what was being done and what to do next.
    pub fn new(
        recovery: Recovery,
        context: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self {
            recovery,
            context: context.into(),
            source: source.into(),
        }
    }

    /// What the caller does next: [`Recovery::Retry`] or [`Recovery::Reconnect`] after a
    /// backoff (the adapter or pool reconnects on its next call), [`Recovery::Fatal`] stop and
    /// report.
    pub fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// What was being done when it failed.
    pub fn context(&self) -> &str {
        &self.context
    }
}

/// An error from a [`MessageSource`](crate::MessageSource) or an [`Ack`](crate::Ack).
pub type SourceError = OperationError;

/// An error from an [`InboxStore`](crate::InboxStore).
pub type StoreError = OperationError;

/// How a handler failure is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// Might succeed on another attempt: roll back, back off, retry up to the attempt limit, then
    /// dead-letter.
    Transient,
    /// Cannot succeed (an unparsable payload, a business rule): roll back and dead-letter now.
    Permanent,
}

/// A handler's failure. Any `std::error::Error`, `anyhow::Error` or `eyre::Report` converts
/// into a transient one with `?`; use [`HandlerError::permanent`] for failures no retry can
/// fix.
pub struct HandlerError {
    failure: Failure,
    source: BoxError,
    /// Which message of a batch failed, when known.
    index: Option<usize>,
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn transient(source: impl Into<BoxError>) -> Self {
        Self {
            failure: Failure::Transient,
            source: source.into(),
            index: None,
        }
    }

    /// A failure no retry can fix: the message is dead-lettered at once.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self {
            failure: Failure::Permanent,
            source: source.into(),
            index: None,
        }
    }

    /// Says that the message at `index` of the batch given to a
    /// [`BatchHandler`](crate::BatchHandler) caused this failure, so the consumer can retry the
    /// others together instead of splitting the batch in halves to find it.
    #[must_use]
    pub fn at(mut self, index: usize) -> Self {
        self.index = Some(index);
        self
    }

    /// The index given with [`HandlerError::at`].
    pub fn index(&self) -> Option<usize> {
        self.index
    }

    /// Transient or permanent.
    pub fn failure(&self) -> Failure {
        self.failure
    }

    /// The underlying error.
    pub fn source(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }
}

/// Any error a boxed `std::error::Error` can be made from: every `std::error::Error + Send +
/// Sync`, `anyhow::Error`, `eyre::Report`, a `String` or a `&str`. So `?` works in a handler
/// on whatever it calls, and the failure is transient.
impl<E: Into<BoxError>> From<E> for HandlerError {
    fn from(e: E) -> Self {
        Self::transient(e)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("failure", &self.failure)
            .field("source", &self.source)
            .finish()
    }
}

/// Why [`Consumer::run`](crate::Consumer::run) stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker said retrying cannot help; fix the configuration and restart.
    #[error("message source failed for good: {0}")]
    Source(#[source] SourceError),
    /// The store said retrying cannot help (run the migrations? check permissions?).
    #[error("inbox store failed for good: {0}")]
    Store(#[source] StoreError),
    /// The configuration is unusable.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The consumer's wait before attempt `attempt` (from 1) after a failure, for the tools beside
/// it (the outbox relay) to wait alike: exponential from `initial`, doubling per attempt,
/// capped at `max`, then shortened
/// by up to half by a draw from this process's ID and the attempt: consumers in processes that
/// failed together (a database outage, a broker restart) do not come back in lockstep, while
/// one process waits the same on every run (a simulation replays).
pub fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    jittered(initial, max, attempt, std::process::id())
}

/// [`backoff`] for the process `salt`.
fn jittered(initial: Duration, max: Duration, attempt: u32, salt: u32) -> Duration {
    use std::hash::{Hash, Hasher};
    let factor = 2u32.saturating_pow(attempt.saturating_sub(1).min(16));
    let full = initial.saturating_mul(factor).min(max);
    // `DefaultHasher::new` hashes alike in every run: the draw depends on its inputs only.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (salt, attempt).hash(&mut hasher);
    // A uniform draw in [0, 1) from 53 bits.
    #[allow(clippy::cast_precision_loss)]
    let draw = (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64;
    full.mul_f64(1.0 - draw / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps_and_each_process_waits_its_own_share() {
        let ms = Duration::from_millis;
        // (attempt, the full wait): the jitter takes up to half of it.
        for (attempt, full) in [(1, 100), (2, 200), (4, 800), (5, 1000), (400, 1000)] {
            let waits: Vec<Duration> = (1..=50)
                .map(|process| jittered(ms(100), ms(1000), attempt, process))
                .collect();
            assert!(
                waits.iter().all(|w| *w > ms(full) / 2 && *w <= ms(full)),
                "attempt {attempt}: {waits:?}"
            );
            let distinct: std::collections::BTreeSet<_> = waits.iter().collect();
            assert!(distinct.len() > 40, "50 processes, in lockstep: {waits:?}");
            assert_eq!(
                jittered(ms(100), ms(1000), attempt, 7),
                jittered(ms(100), ms(1000), attempt, 7),
                "one process waits the same every time"
            );
        }
    }

    #[test]
    fn any_error_converts_into_a_transient_handler_error() {
        fn fails() -> Result<(), HandlerError> {
            Err(std::io::Error::other("disk on fire"))?;
            Ok(())
        }
        let e = fails().unwrap_err();
        assert_eq!(e.failure(), Failure::Transient);
        assert_eq!(e.to_string(), "disk on fire");
        assert_eq!(HandlerError::permanent("bad").failure(), Failure::Permanent);
    }
}
