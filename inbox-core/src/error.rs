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

/// Exponential backoff from `initial`, doubling per attempt, capped at `max`.
pub(crate) fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempt.saturating_sub(1).min(16));
    initial.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let ms = Duration::from_millis;
        assert_eq!(backoff(ms(100), ms(1000), 1), ms(100));
        assert_eq!(backoff(ms(100), ms(1000), 2), ms(200));
        assert_eq!(backoff(ms(100), ms(1000), 4), ms(800));
        assert_eq!(backoff(ms(100), ms(1000), 5), ms(1000));
        assert_eq!(backoff(ms(100), ms(1000), 400), ms(1000));
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
