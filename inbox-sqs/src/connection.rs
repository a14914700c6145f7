//! Building an SQS client from the usual AWS configuration chain.

use std::time::Duration;

use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_sdk_sqs::Client;
use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};

/// An SQS client from the standard AWS configuration: credentials and region from the
/// environment, profile files (SSO profiles excepted: aws-config is built without `sso`), web
/// identity tokens or the instance/container role, and the
/// endpoint from `AWS_ENDPOINT_URL_SQS` (or `AWS_ENDPOINT_URL`) when set, which is how a local
/// SQS-compatible endpoint is used.
///
/// HTTPS goes through rustls on the `ring` crypto provider with the system's root certificates.
pub async fn connect() -> Client {
    Client::new(&sdk_config(None).await)
}

/// Like [`connect`], with an explicit endpoint URL (e.g. `http://127.0.0.1:4566`) that wins
/// over the environment.
pub async fn connect_to(endpoint_url: &str) -> Client {
    Client::new(&sdk_config(Some(endpoint_url)).await)
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

async fn sdk_config(endpoint_url: Option<&str>) -> aws_config::SdkConfig {
    let mut loader = config_loader();
    if let Some(url) = endpoint_url {
        loader = loader.endpoint_url(url);
    }
    loader.load().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_sqs::config::{Credentials, Region};

    #[tokio::test]
    async fn the_loader_sets_timeouts_that_outlast_a_long_poll() {
        let config = config_loader()
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "test"))
            .load()
            .await;
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
