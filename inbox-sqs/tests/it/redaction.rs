//! SQS configuration holds no secret of its own: the credentials live in the SDK client, whose
//! `Debug` output (inside the builder's, the sender's and the source's) must not show them.

use crate::common;

use inbox_sqs::aws_sdk_sqs::config::{Credentials, Region};
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::SqsConnection;

const SECRET_KEY: &str = "wJalrXUtnFEMI-secret-7c2a";
const SESSION_TOKEN: &str = "session-token-5b1d";

#[tokio::test]
async fn debug_output_shows_no_credentials() {
    let endpoint =
        std::env::var("AWS_ENDPOINT_URL_SQS").unwrap_or_else(|_| common::LOCAL_ENDPOINT.to_owned());
    let config = inbox_sqs::config_loader()
        .endpoint_url(&endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(
            "AKIDEXAMPLE",
            SECRET_KEY,
            Some(SESSION_TOKEN.to_owned()),
            None,
            "redaction-test",
        ))
        .load()
        .await;
    let client = Client::new(&config);
    let url = format!("{endpoint}/000000000000/inbox-redaction");
    let shown = [
        format!("{:?}", SqsConnection::new(client.clone()).source(&url)),
        format!("{:?}", common::producer(&client).await),
        format!("{client:?}"),
    ];
    let local =
        endpoint.starts_with("http://127.0.0.1") || endpoint.starts_with("http://localhost");
    let built = if local {
        // The local endpoint takes any credentials: build the source the consumer would get.
        let queue = common::queue(&client, "redaction", 30).await;
        let source = SqsConnection::new(client)
            .source(&queue)
            .connect()
            .await
            .expect("the source builds against the local endpoint");
        Some(format!("{source:?}"))
    } else {
        None
    };
    for shown in shown.into_iter().chain(built) {
        assert!(!shown.contains(SECRET_KEY), "{shown}");
        assert!(!shown.contains(SESSION_TOKEN), "{shown}");
        assert!(
            shown.contains("us-east-1") || shown.contains("queue_url"),
            "{shown}"
        );
    }
}
