//! Building an SQS client from the usual AWS configuration chain.

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

/// The standard AWS configuration loader with this crate's HTTPS client, to adjust (region,
/// credentials provider, endpoint, timeouts) before `load().await` and
/// `aws_sdk_sqs::Client::new(&config)`.
///
/// This crate builds the SDK without its default HTTPS client (which compiles aws-lc from C);
/// a loader from plain `aws_config::defaults` would have no HTTP client at all.
pub fn config_loader() -> aws_config::ConfigLoader {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    aws_config::defaults(BehaviorVersion::latest()).http_client(http)
}

async fn sdk_config(endpoint_url: Option<&str>) -> aws_config::SdkConfig {
    let mut loader = config_loader();
    if let Some(url) = endpoint_url {
        loader = loader.endpoint_url(url);
    }
    loader.load().await
}
