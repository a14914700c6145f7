//! Connections the brokers refused: a TLS handshake that failed (a CA that did not sign the
//! broker's certificate, a certificate for another host name), a SASL login that failed, a
//! token provider that failed.
//!
//! librdkafka retries all of them forever, in the background, and by the time a consumer sees
//! the error it is only a code (`Local: SSL error`): its reason went to the log. A source keeps
//! the last reason here, from its clients' error and log callbacks, so that it can fail the
//! receive at once and say why, instead of polling on with a warning.

use std::sync::Arc;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientConfig;
use tokio::sync::watch;

use crate::Error;

/// Lets librdkafka log at least at `INFO`, where it reports a connection the broker closed.
/// rdkafka sets librdkafka's level from the `log` crate's, which an application logging with
/// `tracing` alone leaves at its lowest; `tracing` still filters what is shown.
pub(crate) fn log_connection_failures(config: &mut ClientConfig) {
    if (config.log_level as i32) < RDKafkaLogLevel::Info as i32 {
        config.set_log_level(RDKafkaLogLevel::Info);
    }
}

/// What refused the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The TLS handshake failed (librdkafka's `Local: SSL error`).
    Tls,
    /// The SASL login failed.
    Authentication,
    /// The OAUTHBEARER token provider returned an error.
    TokenProvider,
}

impl Refusal {
    /// The refusal an error code stands for; `None` for every other failure (a broker down, a
    /// timeout), which librdkafka recovers from by itself.
    fn of(code: RDKafkaErrorCode, reason: &str) -> Option<Self> {
        match code {
            RDKafkaErrorCode::SSL => Some(Self::Tls),
            // librdkafka reports a failed token refresh as an authentication failure.
            RDKafkaErrorCode::Authentication if reason.contains(TOKEN_FAILURE) => {
                Some(Self::TokenProvider)
            }
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
                Some(Self::Authentication)
            }
            _ => None,
        }
    }

    /// This crate's error for the refusal, with `reason`.
    pub(crate) fn error(self, reason: String) -> Error {
        match self {
            Self::Tls => Error::Tls(reason),
            Self::Authentication => Error::Authentication(reason),
            Self::TokenProvider => Error::TokenProvider(reason),
        }
    }
}

/// What a failure probably means, where its reason alone does not say.
fn hint(reason: &str) -> Option<&'static str> {
    // librdkafka's first request on a new connection; a broker that closes the connection
    // then did not understand it.
    reason.contains("APIVERSION_QUERY").then_some(
        "a broker that closes the connection at the first request may expect TLS or SASL: \
         check security.protocol",
    )
}

/// How librdkafka words a failed token refresh (`rd_kafka_oauthbearer_set_token_failure`).
const TOKEN_FAILURE: &str = "OAUTHBEARER token";

/// A failure librdkafka reported, with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// `None` for a failure known from a log line only.
    pub(crate) refusal: Option<Refusal>,
    pub(crate) reason: String,
}

/// The last connection failure of a source's clients (its consumer and its dead-letter
/// producer share one), written from librdkafka's callbacks and read by the source.
#[derive(Debug, Clone)]
pub(crate) struct Failures(Arc<watch::Sender<Option<Failure>>>);

impl Default for Failures {
    fn default() -> Self {
        Self(Arc::new(watch::channel(None).0))
    }
}

impl Failures {
    /// An error event: its code and its reason.
    pub(crate) fn error(&self, error: &KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        if code == Some(RDKafkaErrorCode::AllBrokersDown) {
            // A summary ("1/1 brokers are down"): each broker's failure says why.
            return;
        }
        let refusal = code.and_then(|code| Refusal::of(code, reason));
        self.record(refusal, reason);
    }

    /// A `FAIL` log line: a broker connection failed, at any level (a connection the broker
    /// closed is only `INFO`). A consumer's error events carry only a code; the line before
    /// them says why.
    pub(crate) fn log(&self, facility: &str, line: &str) {
        if facility == "FAIL" {
            self.record(None, line);
        }
    }

    /// The token provider failed with `reason`.
    pub(crate) fn token_provider(&self, reason: &str) {
        self.record(Some(Refusal::TokenProvider), reason);
    }

    fn record(&self, refusal: Option<Refusal>, reason: &str) {
        self.0.send_if_modified(|last| {
            let keep = match last {
                // A refusal stays until it is reported: the failures that follow it (the
                // brokers down, the same handshake failing again) say less.
                Some(Failure {
                    refusal: Some(_), ..
                }) if refusal.is_none() => true,
                // librdkafka follows a failed refresh with its own error repeating the reason.
                Some(Failure {
                    refusal: Some(Refusal::TokenProvider),
                    reason: earlier,
                }) => reason.contains(earlier.as_str()),
                _ => false,
            };
            if !keep {
                *last = Some(Failure {
                    refusal,
                    reason: reason.to_owned(),
                });
            }
            !keep
        });
    }

    /// The last failure's reason, if any, forgetting it: each is reported once, and a failure
    /// that comes again is recorded again.
    pub(crate) fn take_reason(&self) -> Option<String> {
        let reason = self.0.send_replace(None)?.reason;
        Some(match hint(&reason) {
            Some(hint) => format!("{reason} ({hint})"),
            None => reason,
        })
    }

    /// Waits for a refusal (a failure that is not one librdkafka recovers from by itself), and
    /// forgets it.
    pub(crate) async fn refused(&self) -> Error {
        let mut watch = self.0.subscribe();
        let _ = watch
            .wait_for(|last| last.as_ref().is_some_and(|f| f.refusal.is_some()))
            .await;
        // The sender lives in `self`: the wait ends only with a refusal.
        self.take_refusal()
            .unwrap_or_else(|| Error::Config("the connection failure record closed".into()))
    }

    /// The refusal recorded so far, if any, forgetting it.
    pub(crate) fn take_refusal(&self) -> Option<Error> {
        let mut taken = None;
        self.0.send_if_modified(|last| match last.take() {
            Some(Failure {
                refusal: Some(refusal),
                reason,
            }) => {
                taken = Some(refusal.error(reason));
                true
            }
            other => {
                *last = other;
                false
            }
        });
        taken
    }

    /// The refusal a consumer error stands for (a broker refused the connection: TLS or SASL),
    /// with the reason of the last failure (its log line), forgetting it; `None`, and the last
    /// failure kept, for an error that is not a refusal.
    pub(crate) fn refusal_of(&self, error: &KafkaError) -> Option<Error> {
        let code = error.rdkafka_error_code()?;
        Refusal::of(code, "")?;
        let last = self.0.send_replace(None);
        let reason = last
            .as_ref()
            .map_or_else(|| code.to_string(), |f| f.reason.clone());
        let refusal = match last.and_then(|f| f.refusal) {
            // The provider's own failure, recorded before librdkafka's code-only event.
            Some(Refusal::TokenProvider) if code == RDKafkaErrorCode::Authentication => {
                Refusal::TokenProvider
            }
            _ => Refusal::of(code, &reason)?,
        };
        Some(refusal.error(reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_error_takes_its_reason_from_the_log_line_before_it() {
        let failures = Failures::default();
        failures.log(
            "FAIL",
            "ssl://localhost:1/bootstrap: SSL handshake failed: certificate verify failed",
        );
        let e = failures
            .refusal_of(&KafkaError::MessageConsumption(RDKafkaErrorCode::SSL))
            .expect("a refusal");
        assert!(matches!(e, Error::Tls(_)), "{e}");
        assert!(e.to_string().contains("certificate verify failed"), "{e}");
        let down = KafkaError::MessageConsumption(RDKafkaErrorCode::AllBrokersDown);
        assert!(failures.refusal_of(&down).is_none());
    }

    #[test]
    fn a_provider_failure_is_not_overwritten_by_librdkafka_repeating_it() {
        let failures = Failures::default();
        failures.token_provider("the token provider failed: no credentials");
        failures.error(
            &KafkaError::Global(RDKafkaErrorCode::Authentication),
            "Failed to acquire SASL OAUTHBEARER token: the token provider failed: no credentials",
        );
        let e = failures
            .refusal_of(&KafkaError::MessageConsumption(
                RDKafkaErrorCode::Authentication,
            ))
            .expect("a refusal");
        assert!(matches!(e, Error::TokenProvider(_)), "{e}");
        assert_eq!(e.recovery(), inbox_core::Recovery::Retry);
    }

    #[test]
    fn a_refusal_is_not_hidden_by_the_failures_after_it() {
        let failures = Failures::default();
        failures.error(
            &KafkaError::Global(RDKafkaErrorCode::SSL),
            "SSL handshake failed: certificate verify failed",
        );
        failures.error(
            &KafkaError::Global(RDKafkaErrorCode::AllBrokersDown),
            "1/1 brokers are down",
        );
        failures.log(
            "FAIL",
            "Connect to ipv4#127.0.0.1:1 failed: Connection refused",
        );
        let reason = failures.take_reason().expect("a reason");
        assert!(reason.contains("certificate verify failed"), "{reason}");
        assert_eq!(failures.take_reason(), None, "reported once");
    }
}
