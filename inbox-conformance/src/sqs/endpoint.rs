//! The SQS endpoint: a client for it, and one that reaches it through a fault proxy.

use std::time::Duration;

use crate::FaultProxy;
use inbox_sqs::aws_sdk_sqs::config::timeout::TimeoutConfig;
use inbox_sqs::aws_sdk_sqs::config::{Credentials, Region};
use inbox_sqs::aws_sdk_sqs::Client;

/// The local SQS endpoint (moto's standalone server) used when the environment names none.
pub const LOCAL_ENDPOINT: &str = "http://127.0.0.1:4566";

/// The timeout per attempt of [`proxied_client`]: a black-holed call fails after this.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The timeout per call of [`proxied_client`], its retries included.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// A client configured as the environment says where it says (so the same tests run against
/// AWS), and otherwise for the local endpoint: no `AWS_ENDPOINT_URL_SQS`/`AWS_ENDPOINT_URL`
/// means [`LOCAL_ENDPOINT`], no region or profile means `us-east-1`, no key, profile or web
/// identity means dummy credentials.
pub async fn client() -> Client {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    let mut loader = inbox_sqs::config_loader();
    if !set("AWS_ENDPOINT_URL_SQS") && !set("AWS_ENDPOINT_URL") {
        loader = loader.endpoint_url(LOCAL_ENDPOINT);
    }
    if !set("AWS_REGION") && !set("AWS_DEFAULT_REGION") && !set("AWS_PROFILE") {
        loader = loader.region(Region::new("us-east-1"));
    }
    let configured = [
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ]
    .iter()
    .any(|name| set(name));
    if !configured {
        loader = loader.credentials_provider(Credentials::new("test", "test", None, None, "local"));
    }
    Client::new(&loader.load().await)
}

/// A proxy in front of the SQS endpoint, when it is plain HTTP (a local endpoint such as moto):
/// the proxy forwards bytes, so it cannot stand between a client and an HTTPS endpoint such as
/// AWS.
///
/// # Panics
/// When the endpoint does not resolve.
pub async fn proxy() -> Option<FaultProxy> {
    let url = ["AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|v| !v.is_empty())
        .unwrap_or_else(|| LOCAL_ENDPOINT.to_owned());
    if !url.starts_with("http://") {
        return None;
    }
    let proxied = FaultProxy::in_front_of_url(&url, 80).await;
    Some(
        proxied
            .unwrap_or_else(|e| panic!("a proxy in front of the SQS endpoint: {e}"))
            .0,
    )
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
