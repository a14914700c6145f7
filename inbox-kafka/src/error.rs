//! This crate's errors, and how a Kafka error maps to what the consumer loop does next.

use inbox_core::{Recovery, SourceError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// An error from the Kafka adapter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable; the message says which setting and how to fix it.
    #[error("invalid Kafka configuration: {0}")]
    Config(String),
    /// The TLS handshake with a broker failed: the CA in `ssl.ca.location` did not sign the
    /// broker's certificate, or the certificate does not name the host the client connected to.
    /// Retrying cannot fix it: the consumer stops.
    #[error(
        "the TLS handshake with the Kafka brokers failed: {0}; check that ssl.ca.location holds \
         the CA that signed the brokers' certificates and that they name the hosts in the broker \
         list (and what the brokers advertise)"
    )]
    Tls(String),
    /// A broker refused the SASL login: a wrong user name or password, a mechanism the broker
    /// does not offer, a token it does not accept. Retrying cannot fix it: the consumer stops.
    #[error(
        "the Kafka brokers refused the SASL login: {0}; check sasl.mechanism, sasl.username and \
         sasl.password (or what the token provider returns)"
    )]
    Authentication(String),
    /// The [`TokenProvider`](crate::TokenProvider) failed; librdkafka asks it again 10 s
    /// later, and a token with life left stays in use meanwhile.
    #[error("no OAUTHBEARER token for Kafka: {0}")]
    TokenProvider(String),
    /// librdkafka refused or failed an operation.
    #[error("{context}: {source}")]
    Kafka {
        /// What was being done.
        context: String,
        /// The client's error.
        #[source]
        source: KafkaError,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn kafka(context: impl Into<String>, source: KafkaError) -> Self {
        Self::Kafka {
            context: context.into(),
            source,
        }
    }

    /// What the consumer loop should do after this error.
    pub fn recovery(&self) -> Recovery {
        match self {
            Error::Config(_) | Error::Tls(_) | Error::Authentication(_) => Recovery::Fatal,
            Error::TokenProvider(_) => Recovery::Retry,
            Error::Kafka { source, .. } => recovery(source),
        }
    }

    /// Wraps this error for the consumer loop.
    pub(crate) fn into_source(self) -> SourceError {
        let recovery = self.recovery();
        match self {
            Error::Kafka { context, source } => SourceError::new(recovery, context, source),
            refused @ (Error::Tls(_) | Error::Authentication(_) | Error::TokenProvider(_)) => {
                SourceError::new(recovery, "connecting to Kafka", refused)
            }
            other => SourceError::new(recovery, "Kafka adapter", other),
        }
    }
}

impl From<Error> for SourceError {
    fn from(e: Error) -> Self {
        e.into_source()
    }
}

/// Retrying cannot fix missing permissions, failed authentication or a fatal client state;
/// everything else (a broker down, a leader moving, a coordinator loading) passes.
pub(crate) fn recovery(e: &KafkaError) -> Recovery {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::SaslAuthenticationFailed
            // A TLS handshake that failed (a connection lost during one is a transport error).
            | C::SSL
            | C::InvalidArgument
            | C::Fatal,
        ) => Recovery::Fatal,
        _ if matches!(e, KafkaError::MessageConsumptionFatal(_)) => Recovery::Fatal,
        // A topic name with a NUL byte never becomes valid.
        _ if matches!(e, KafkaError::Nul(_)) => Recovery::Fatal,
        _ => Recovery::Retry,
    }
}

/// The commit failed because this member no longer owns the partition (a rebalance moved it,
/// or the group evicted this member). The new owner re-reads from the last committed offset and
/// finds the inbox rows, so this is logged, not reported.
pub(crate) fn partition_moved(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::UnknownMemberId
                | C::RebalanceInProgress
                | C::IllegalGeneration
                | C::AssignmentLost
                | C::StaleMemberEpoch
                | C::FencedInstanceId
                | C::State
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moved_partitions_are_recognised_and_auth_failures_are_fatal() {
        let moved = KafkaError::ConsumerCommit(RDKafkaErrorCode::UnknownMemberId);
        assert!(partition_moved(&moved));
        assert_eq!(recovery(&moved), Recovery::Retry);
        let timeout = KafkaError::ConsumerCommit(RDKafkaErrorCode::RequestTimedOut);
        assert!(!partition_moved(&timeout));
        let denied = KafkaError::MessageConsumption(RDKafkaErrorCode::TopicAuthorizationFailed);
        assert_eq!(recovery(&denied), Recovery::Fatal);
    }

    /// rdkafka reports a topic name with a NUL byte as an error (it used to panic).
    #[tokio::test]
    async fn a_topic_name_with_a_nul_byte_is_refused_for_good() {
        // Nothing listens on port 9: the name is refused before any broker is asked.
        let producer = crate::KafkaConnection::new("127.0.0.1:9")
            .producer()
            .connect()
            .await
            .expect("a producer");
        let e = producer
            .send_to(
                "orders\0x",
                None,
                &inbox_core::OutgoingMessage::generate("x"),
            )
            .await
            .expect_err("the name is refused");
        assert_eq!(e.recovery(), Recovery::Fatal, "{e}");
    }
}
