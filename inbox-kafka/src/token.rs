//! SASL OAUTHBEARER tokens from code of your own: the [`TokenProvider`] a cloud IAM library
//! plugs into (AWS MSK IAM, Azure Event Hubs, Confluent Cloud OAuth), called by librdkafka
//! before it connects and again before each token expires.

use std::fmt;
use std::future::Future;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use rdkafka::client::OAuthToken;
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::failure::Failures;
use crate::{Error, Result};

/// What a [`TokenProvider`] fails with: any error, shown to the source's caller and logged.
pub type TokenError = Box<dyn std::error::Error + Send + Sync>;

/// An OAUTHBEARER token: what the broker checks, who it names, and when it expires.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    /// The token itself (a JWT, a signed URL, whatever the broker expects). Never shown by
    /// `Debug`.
    pub value: String,
    /// The principal the token names (the user or role), as the broker will see it.
    pub principal: String,
    /// When the token stops being valid. librdkafka asks for a new one at 80 % of its lifetime.
    pub expires_at: SystemTime,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("value", &inbox_core::REDACTED)
            .field("principal", &self.principal)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Hands out SASL OAUTHBEARER tokens: implement it over your cloud's IAM library and give it to
/// [`KafkaConnection::token_provider`](crate::KafkaConnection::token_provider). Needs the crate
/// feature `tls` (librdkafka builds OAUTHBEARER with OpenSSL only); without it `connect` fails
/// saying so.
///
/// Each client (a source's consumer and its dead-letter producer each) calls
/// [`token`](TokenProvider::token) when it starts, before its first login, and again when 80 %
/// of the current token's lifetime has passed. An error fails the source's next receive with
/// [`Error::TokenProvider`](crate::Error::TokenProvider) (retryable), and librdkafka asks again
/// 10 s later; the current token, if it has life left, stays in use meanwhile.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use inbox_kafka::{Token, TokenError, TokenProvider};
///
/// /// Tokens from the company's token service (here: made up).
/// struct CompanyIam {
///     role: String,
/// }
///
/// impl TokenProvider for CompanyIam {
///     async fn token(&self) -> Result<Token, TokenError> {
///         // let signed = iam_client.sign(&self.role).await?;
///         Ok(Token {
///             value: format!("signed-for-{}", self.role),
///             principal: self.role.clone(),
///             expires_at: SystemTime::now() + Duration::from_secs(900),
///         })
///     }
/// }
/// ```
///
/// # Runtime
///
/// librdkafka asks for tokens from a synchronous callback, on whatever thread polls the client.
/// The provider runs as a task of the runtime the client was made in, and that thread waits for
/// it (inside [`tokio::task::block_in_place`] when it is a worker of the runtime). This needs
/// tokio's multi-thread runtime (the default of `#[tokio::main]`): on a current-thread runtime
/// the provider is not called and the source reports an error saying so. The wait is bounded by
/// the builder's operation timeout.
pub trait TokenProvider: Send + Sync + 'static {
    /// A fresh token, or why there is none.
    fn token(&self) -> impl Future<Output = Result<Token, TokenError>> + Send;
}

/// [`TokenProvider`] as a trait object, as a connection keeps it: `TokenProvider::token`
/// returns `impl Future`, which a `dyn` object cannot; this returns a boxed future.
pub(crate) trait DynTokenProvider: Send + Sync + 'static {
    /// [`TokenProvider::token`].
    fn dyn_token(&self) -> BoxFuture<'_, Result<Token, TokenError>>;
}

impl<P: TokenProvider> DynTokenProvider for P {
    fn dyn_token(&self) -> BoxFuture<'_, Result<Token, TokenError>> {
        Box::pin(TokenProvider::token(self))
    }
}

/// A provider is not required to be `Debug`: a connection's output only says there is one.
impl fmt::Debug for dyn DynTokenProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TokenProvider")
    }
}

/// Sets `sasl.mechanism=OAUTHBEARER` on a client with a token provider, and refuses another
/// mechanism, with which the provider would never be called.
pub(crate) fn require_oauthbearer(config: &mut rdkafka::ClientConfig) -> Result<()> {
    if !cfg!(feature = "tls") {
        return Err(Error::Config(
            "a token provider needs the crate feature `tls`: librdkafka builds OAUTHBEARER \
             with OpenSSL only"
                .into(),
        ));
    }
    match config
        .get("sasl.mechanism")
        .or(config.get("sasl.mechanisms"))
    {
        None => {
            config.set("sasl.mechanism", "OAUTHBEARER");
            Ok(())
        }
        Some(m) if m.eq_ignore_ascii_case("OAUTHBEARER") => Ok(()),
        Some(other) => Err(Error::Config(format!(
            "a token provider is set but sasl.mechanism is {other}: the provider serves \
             OAUTHBEARER only; remove the property or the provider"
        ))),
    }
}

/// A provider as a client's context holds it: with the runtime it runs on, how long it may
/// take, and where its failures are reported.
#[derive(Clone)]
pub(crate) struct TokenRefresh {
    provider: Arc<dyn DynTokenProvider>,
    /// The runtime the client was built in, for callbacks on librdkafka's own threads.
    runtime: Handle,
    timeout: Duration,
    failures: Failures,
}

impl TokenRefresh {
    /// Refused outside a tokio runtime: the provider would have nothing to run on.
    pub(crate) fn new(
        provider: Arc<dyn DynTokenProvider>,
        timeout: Duration,
        failures: Failures,
    ) -> Result<Self> {
        let runtime = Handle::try_current().map_err(|_| {
            Error::Config(
                "a client with a token provider is made inside a tokio runtime: call \
                 `connect` from async code"
                    .into(),
            )
        })?;
        Ok(Self {
            provider,
            runtime,
            timeout,
            failures,
        })
    }

    /// Calls the provider and waits for it, for librdkafka's synchronous refresh callback.
    pub(crate) fn fetch(&self) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        self.call().map_err(|e| {
            let reason = format!("the token provider failed: {e}");
            tracing::warn!("{reason}");
            self.failures.token_provider(&reason);
            reason.into()
        })
    }

    fn call(&self) -> Result<OAuthToken, TokenError> {
        let here = Handle::try_current().ok();
        if here
            .as_ref()
            .is_some_and(|h| h.runtime_flavor() == RuntimeFlavor::CurrentThread)
        {
            // Waiting here would keep the only thread from running the provider.
            return Err(
                "a token provider needs tokio's multi-thread runtime (the default of \
                        #[tokio::main]; #[tokio::test(flavor = \"multi_thread\")]): \
                        librdkafka asks for tokens from a synchronous callback"
                    .into(),
            );
        }
        // The provider runs as a task of the client's runtime, and this thread waits for its
        // answer: no timer or driver of the runtime is needed here, so a runtime shutting down
        // (the task is dropped) ends the wait at once instead of panicking.
        let (answer, answered) = std::sync::mpsc::sync_channel(1);
        let provider = Arc::clone(&self.provider);
        drop(self.runtime.spawn(async move {
            let _ = answer.send(provider.dyn_token().await);
        }));
        let wait = || answered.recv_timeout(self.timeout);
        let received = match here {
            // A worker of the multi-thread runtime (the consumer is polled in `receive`): the
            // other workers run the provider meanwhile.
            Some(_) => tokio::task::block_in_place(wait),
            // A thread of librdkafka or rdkafka (the producer's polling thread).
            None => wait(),
        };
        let token = match received {
            Ok(token) => token?,
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!("no token within {:?}", self.timeout).into())
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err("the tokio runtime the client was made in has shut down".into())
            }
        };
        let expires_ms = token
            .expires_at
            .duration_since(UNIX_EPOCH)
            .map_err(|_| "the token expires before 1970")?
            .as_millis();
        Ok(OAuthToken {
            token: token.value,
            principal_name: token.principal,
            lifetime_ms: i64::try_from(expires_ms).map_err(|_| "the token's expiry is too far")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;

    impl TokenProvider for Fixed {
        async fn token(&self) -> Result<Token, TokenError> {
            Ok(Token {
                value: "t".into(),
                principal: "app".into(),
                expires_at: SystemTime::now() + Duration::from_secs(60),
            })
        }
    }

    fn refresh() -> TokenRefresh {
        TokenRefresh::new(Arc::new(Fixed), Duration::from_secs(5), Failures::default())
            .expect("inside a runtime")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_of_a_multi_thread_runtime_waits_for_the_provider() {
        let token = refresh().fetch().expect("a token");
        assert_eq!(token.principal_name, "app");
        assert!(token.lifetime_ms > 0);
    }

    /// librdkafka asks on the thread that polls the client: on a current-thread runtime that
    /// is the runtime's only thread, which cannot wait for the provider.
    #[tokio::test]
    async fn a_current_thread_runtime_is_refused_saying_what_is_needed() {
        let refresh = refresh();
        let Err(e) = refresh.fetch() else {
            panic!("a token on a current-thread runtime")
        };
        assert!(e.to_string().contains("multi-thread runtime"), "{e}");
        let reason = refresh
            .failures
            .take_reason()
            .expect("reported to the source");
        assert!(reason.contains("multi-thread runtime"), "{reason}");
    }

    #[test]
    fn a_thread_outside_the_runtime_waits_and_a_runtime_shut_down_ends_the_wait() {
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        let refresh = runtime.block_on(async { refresh() });
        let token = refresh
            .fetch()
            .expect("a token from a thread outside the runtime");
        assert_eq!(token.token, "t");
        drop(runtime);
        let Err(e) = refresh.fetch() else {
            panic!("a token without a runtime")
        };
        assert!(e.to_string().contains("shut down"), "{e}");
    }

    #[test]
    fn debug_hides_the_token() {
        let token = Token {
            value: "secret-token".into(),
            principal: "app".into(),
            expires_at: SystemTime::now(),
        };
        let shown = format!("{token:?}");
        assert!(!shown.contains("secret-token"), "{shown}");
        assert!(shown.contains("app"), "{shown}");
    }
}
