//! A profile whose credentials come from `credential_process` (as credential helpers, `aws
//! configure export-credentials` or a vault agent set it up) signs the client's requests:
//! aws-config is built with its `credentials-process` feature. Checked against the local SQS
//! endpoint (`AWS_ENDPOINT_URL_SQS`), which takes any signature.

use inbox_sqs::aws_config::Region;
use inbox_sqs::aws_sdk_sqs::config::ProvideCredentials;
use inbox_sqs::aws_sdk_sqs::Client;

#[tokio::test]
async fn a_credential_process_profile_gives_the_client_its_credentials() {
    let dir = std::env::temp_dir().join(inbox_conformance::unique_name("inbox-sqs-profile"));
    std::fs::create_dir_all(&dir).expect("a directory for the profile");
    let config = dir.join("config");
    std::fs::write(
        &config,
        "[profile helper]\n\
         credential_process = echo '{\"Version\": 1, \"AccessKeyId\": \"from-the-process\", \"SecretAccessKey\": \"its-secret\"}'\n",
    )
    .expect("the profile");
    // The only test of this binary: the environment is the process's alone. The profile, not
    // keys in the environment, must give the credentials.
    std::env::set_var("AWS_CONFIG_FILE", &config);
    for keys in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ] {
        std::env::remove_var(keys);
    }
    let endpoint = std::env::var("AWS_ENDPOINT_URL_SQS")
        .unwrap_or_else(|_| inbox_conformance::sqs::LOCAL_ENDPOINT.to_owned());
    let config = inbox_sqs::config_loader()
        .profile_name("helper")
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .load()
        .await;

    let credentials = config
        .credentials_provider()
        .expect("a credentials chain")
        .provide_credentials()
        .await
        .expect("credentials from the process");
    assert_eq!(credentials.access_key_id(), "from-the-process");
    Client::new(&config)
        .list_queues()
        .send()
        .await
        .expect("a request signed with the process's credentials");
    let _ = std::fs::remove_dir_all(&dir);
}
