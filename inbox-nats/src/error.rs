//! This crate's errors, each saying what the consumer loop does next.

use inbox_core::{BoxError, OperationError, Recovery};

/// Why building or using a NATS source, producer or dead-letter reader failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable (no address, an empty name, an ID convention NATS cannot
    /// carry); the message names the setting to fix.
    #[error("invalid NATS configuration: {0}")]
    Config(String),
    /// The JetStream stream the source reads does not exist.
    #[error(
        "the JetStream stream `{stream}` does not exist: create it (`nats stream add {stream} \
         --subjects ...`) or name an existing one"
    )]
    StreamMissing {
        /// The stream's name.
        stream: String,
    },
    /// No JetStream stream stores the dead-letter subject, so a dead letter would be lost.
    #[error(
        "no JetStream stream stores the dead-letter subject `{subject}`: add it to a stream's \
         subjects (the source's own, or a stream of its own such as `nats stream add DLQ \
         --subjects {subject}`), or set `dead_letter_subject` to a subject one stores"
    )]
    DeadLetterSubjectMissing {
        /// The dead-letter subject.
        subject: String,
    },
    /// Connecting to the server failed (unreachable, TLS refused, login refused).
    #[error("connecting to NATS at {server} for {purpose}: {source}")]
    Connect {
        /// The server(s), without credentials.
        server: String,
        /// What the connection is for (`the source`, `the producer`, `the dead-letter reader`).
        purpose: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// A JetStream request failed.
    #[error("{context}: {source}")]
    Nats {
        /// What was being done.
        context: String,
        /// Whether another attempt can help.
        recovery: Recovery,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn nats(
        context: impl Into<String>,
        recovery: Recovery,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Nats {
            context: context.into(),
            recovery,
            source: source.into(),
        }
    }

    /// What the caller does next: retrying helps for a failed request or connection, not for a
    /// configuration or a missing stream.
    pub fn recovery(&self) -> Recovery {
        match self {
            Self::Config(_)
            | Self::StreamMissing { .. }
            | Self::DeadLetterSubjectMissing { .. } => Recovery::Fatal,
            Self::Connect { .. } => Recovery::Reconnect,
            Self::Nats { recovery, .. } => *recovery,
        }
    }
}

impl From<Error> for OperationError {
    fn from(e: Error) -> Self {
        let recovery = e.recovery();
        match e {
            Error::Nats {
                context, source, ..
            } => OperationError::new(recovery, context, source),
            other => OperationError::new(recovery, "NATS", other),
        }
    }
}
