//! No password in `Debug` output or error messages: a source connected with a password URL (a
//! real ACL user on the test server) shows none, nor does the error for a URL that does not
//! parse.

use crate::common;

use common::{raw, redis_url, stream_key};
use inbox_redis_streams::redis;
use inbox_redis_streams::RedisConnection;

/// `REDIS_URL` with `user:password@` as its user information.
fn with_credentials(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("REDIS_URL has a scheme");
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}:{password}@{host}")
}

#[tokio::test]
async fn a_source_connected_with_a_password_shows_none() {
    let user = format!("inbox-redaction-{}", uuid::Uuid::new_v4().simple());
    let secret = format!("s3cret-{}", uuid::Uuid::new_v4().simple());
    let mut admin = raw().await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("on")
        .arg(format!(">{secret}"))
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER (Redis 6 or later)");

    let url = with_credentials(&redis_url(), &user, &secret);
    let builder = RedisConnection::new(&url).source(stream_key("redaction"), "g");
    let shown_builder = format!("{builder:?}");
    let connected = builder.connect().await;
    let _: () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut admin)
        .await
        .expect("ACL DELUSER");
    let source = connected.expect("the ACL user connects");
    let shown = format!("{source:?}");
    assert!(!shown.contains(&secret), "{shown}");
    assert!(!shown_builder.contains(&secret), "{shown_builder}");
    assert!(shown.contains("RedisStreamSource"), "{shown}");
}

#[tokio::test]
async fn a_url_that_does_not_parse_is_reported_without_its_password() {
    let url = "redis://app:pw-9f8e7d@127.0.0.1:notaport/0";
    let error = RedisConnection::new(url)
        .source(stream_key("redaction"), "g")
        .connect()
        .await
        .expect_err("the port does not parse");
    for shown in [error.to_string(), format!("{error:?}")] {
        assert!(!shown.contains("pw-9f8e7d"), "{shown}");
        assert!(
            shown.contains("redis://app:***@127.0.0.1:notaport/0"),
            "{shown}"
        );
    }
}
