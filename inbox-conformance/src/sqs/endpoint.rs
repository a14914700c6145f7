//! The SQS endpoint: a client for it, and one that reaches it through a fault proxy.

use std::net::SocketAddr;
use std::time::Duration;

use inbox_sqs::aws_sdk_sqs::config::timeout::TimeoutConfig;
use inbox_sqs::aws_sdk_sqs::config::{Credentials, Region};
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_testkit::FaultProxy;

/// The local SQS endpoint (moto's standalone server) used when the environment names none.
pub const LOCAL_ENDPOINT: &str = "http://127.0.0.1:4566";

/// The timeout per attempt of [`proxied_client`]: a black-holed call fails after this.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The timeout per call of [`proxied_client`], its retries included.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// A client for `AWS_ENDPOINT_URL_SQS` (default the local endpoint), with region us-east-1 and
/// dummy credentials only where none are configured, so the same tests run against AWS.
pub async fn client() -> Client {
    inbox_sqs::connect_or_local(LOCAL_ENDPOINT).await
}

/// The SQS endpoint's socket address, when it is plain HTTP (a local endpoint such as moto): the
/// proxy forwards bytes, so it cannot stand between a client and an HTTPS endpoint such as AWS.
pub async fn plain_http_endpoint() -> Option<SocketAddr> {
    let url = ["AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|v| !v.is_empty())
        .unwrap_or_else(|| LOCAL_ENDPOINT.to_owned());
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let mut addrs = tokio::net::lookup_host(&authority)
        .await
        .unwrap_or_else(|e| panic!("resolve the SQS endpoint {authority}: {e}"));
    addrs.next()
}

/// A client for the endpoint behind `proxy`, with short timeouts so a black-holed call fails
/// in seconds rather than the default 30.
pub async fn proxied_client(proxy: &FaultProxy) -> Client {
    let config = inbox_sqs::config_loader()
        .endpoint_url(format!("http://{}", proxy.addr()))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(1))
                .operation_attempt_timeout(ATTEMPT_TIMEOUT)
                .operation_timeout(OPERATION_TIMEOUT)
                .build(),
        )
        .load()
        .await;
    Client::new(&config)
}
