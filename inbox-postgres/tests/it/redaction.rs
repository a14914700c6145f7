//! No password in `Debug` output: the store and its pool show none, and neither does the URL
//! as the test kit shows it in messages.

use inbox_postgres::PgInbox;
use sqlx::postgres::PgPoolOptions;

#[tokio::test]
async fn the_inbox_and_its_pool_show_no_password() {
    let secret = "pg-s3cret-7e1f";
    let url = format!("postgres://app:{secret}@127.0.0.1:5432/inbox?password={secret}");
    // A lazy pool parses the URL, password included, without connecting.
    let pool = PgPoolOptions::new()
        .connect_lazy(&url)
        .expect("the URL parses");
    let inbox = PgInbox::new(pool);
    let shown = format!("{inbox:?}");
    assert!(!shown.contains(secret), "{shown}");
    assert!(shown.contains("PgInbox"), "{shown}");

    let redacted = inbox_core::redact_url(&url);
    assert!(!redacted.contains(secret), "{redacted}");
    assert_eq!(
        redacted,
        "postgres://app:***@127.0.0.1:5432/inbox?password=***"
    );
}
