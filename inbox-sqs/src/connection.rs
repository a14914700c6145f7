//! [`SqsConnection`]: how to reach SQS, shared by everything built on it; and the SQS client
//! from the usual AWS configuration chain.

use std::time::Duration;

use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_sdk_sqs::Client;
use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};

use crate::{SqsDeadLettersBuilder, SqsProducerBuilder, SqsSourceBuilder};

/// How to reach SQS: a client (its endpoint, region, credentials and timeouts), or the
/// environment's. The source, the producer and the dead-letter reader are all built from it,
/// so a setting made once (a local endpoint, a role's credentials) reaches the three.
///
/// ```no_run
/// # async fn run() -> Result<(), inbox_sqs::Error> {
/// let config = inbox_sqs::config_loader().endpoint_url("http://127.0.0.1:4566").load().await;
/// let sqs = inbox_sqs::SqsConnection::new(inbox_sqs::aws_sdk_sqs::Client::new(&config));
/// let queue = "http://127.0.0.1:4566/000000000000/payments";
/// let source = sqs.source(queue).connect().await?;
/// let producer = sqs.producer().connect().await?;
/// let dead_letters = sqs.dead_letters(format!("{queue}-dlq")).connect().await?;
/// # let _ = (source, producer, dead_letters); Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct SqsConnection {
    /// `None`: built from the environment by each `connect`, as [`connect`] does.
    client: Option<Client>,
}

impl SqsConnection {
    /// SQS through `client`, as it is configured (from [`config_loader`], say).
    pub fn new(client: Client) -> Self {
        Self {
            client: Some(client),
        }
    }

    /// SQS as the environment describes it, the AWS SDK's own chain, loaded as each builder
    /// connects (see [`connect`]): there is no local default address, so without settings the
    /// calls go to AWS.
    pub fn from_env() -> Self {
        Self { client: None }
    }

    /// A source receiving from the queue at `queue_url`; finish with
    /// [`connect`](SqsSourceBuilder::connect).
    pub fn source(&self, queue_url: impl Into<String>) -> SqsSourceBuilder {
        SqsSourceBuilder::new(self.clone(), queue_url.into())
    }

    /// A producer sending to any queue; finish with [`connect`](SqsProducerBuilder::connect).
    pub fn producer(&self) -> SqsProducerBuilder {
        SqsProducerBuilder::new(self.clone())
    }

    /// A reader of the dead-letter queue at `queue_url`, for [`inbox_core::replay`]; finish
    /// with [`connect`](SqsDeadLettersBuilder::connect).
    pub fn dead_letters(&self, queue_url: impl Into<String>) -> SqsDeadLettersBuilder {
        SqsDeadLettersBuilder::new(self.clone(), queue_url.into())
    }

    /// The client given, or one from the environment.
    pub(crate) async fn client(self) -> Client {
        match self.client {
            Some(client) => client,
            None => connect().await,
        }
    }
}

/// An SQS client from the standard AWS configuration: credentials and region from the
/// environment, profile files (`credential_process` included; SSO profiles excepted:
/// aws-config is built without `sso`), web
/// identity tokens or the instance/container role, and the
/// endpoint from `AWS_ENDPOINT_URL_SQS` (or `AWS_ENDPOINT_URL`) when set, which is how a local
/// SQS-compatible endpoint is used.
///
/// HTTPS goes through rustls on the `ring` crypto provider with the system's root certificates.
pub async fn connect() -> Client {
    Client::new(&config_loader().load().await)
}

/// Like [`connect`], with an explicit endpoint URL (e.g. `http://127.0.0.1:4566`) that wins
/// over the environment.
pub async fn connect_to(endpoint_url: &str) -> Client {
    Client::new(&config_loader().endpoint_url(endpoint_url).load().await)
}

/// The standard AWS configuration loader with this crate's HTTPS client and
/// [`default_timeouts`], to adjust (region, credentials provider, endpoint, timeouts) before
/// `load().await` and `aws_sdk_sqs::Client::new(&config)`.
///
/// This crate builds the SDK without its default HTTPS client (which compiles aws-lc from C);
/// a loader from plain `aws_config::defaults` would have no HTTP client at all.
///
/// Other timeouts replace the defaults with `.timeout_config(..)`; keep the timeout per attempt
/// longer than the source's [`poll_timeout`](crate::SqsSourceBuilder::poll_timeout), which
/// [`connect`](crate::SqsSourceBuilder::connect) checks.
pub fn config_loader() -> aws_config::ConfigLoader {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    aws_config::defaults(BehaviorVersion::latest())
        .http_client(http)
        .timeout_config(default_timeouts())
}

/// The timeouts [`config_loader`] (and so [`connect`] and [`connect_to`])
/// sets: 3.1 s to connect (the SDK's own default), 30 s per attempt, 90 s per call with its
/// retries.
///
/// The SDK sets none but the connect timeout by itself, so a connection that stalls after
/// connecting would hang a receive, an ack or a heartbeat forever. 30 s per attempt outlasts
/// SQS's longest long poll (20 s) with room for the answer.
pub fn default_timeouts() -> TimeoutConfig {
    TimeoutConfig::builder()
        .connect_timeout(Duration::from_millis(3100))
        .operation_attempt_timeout(Duration::from_secs(30))
        .operation_timeout(Duration::from_secs(90))
        .build()
}

/// A client that makes no call, for tests of what the adapter builds and reads.
#[cfg(test)]
pub(crate) fn offline_client() -> Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .build();
    Client::from_conf(config)
}

/// [`config_loader`] for tests: the endpoint at `endpoint_url`, a region and fixed credentials.
#[cfg(test)]
pub(crate) fn test_loader(endpoint_url: &str) -> aws_config::ConfigLoader {
    use aws_sdk_sqs::config::{Credentials, Region};
    config_loader()
        .endpoint_url(endpoint_url)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_loader_sets_timeouts_that_outlast_a_long_poll() {
        let config = test_loader("http://127.0.0.1:9").load().await;
        let timeouts = config.timeout_config().expect("a timeout config");
        assert!(timeouts.connect_timeout().is_some());
        let attempt = timeouts
            .operation_attempt_timeout()
            .expect("a timeout per attempt");
        // A receive long-polls for up to 20 s before it answers.
        assert!(attempt > Duration::from_secs(20), "{attempt:?}");
        let operation = timeouts.operation_timeout().expect("a timeout per call");
        assert!(operation >= attempt, "{operation:?}");
    }
}
