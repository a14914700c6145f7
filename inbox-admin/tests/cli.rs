//! `inbox-admin` run as an operator runs it, against a real PostgreSQL: migrate, purge, stats and
//! the errors a typo gets.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::process::{Command, Output};
use std::time::Duration;

use inbox_postgres::testkit::TestDb;

const DAY: Duration = Duration::from_secs(24 * 3600);

fn admin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inbox-admin"))
        .args(args)
        .output()
        .expect("the inbox-admin binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn migrate_creates_the_table_in_the_named_schema_with_the_key_mode() {
    let db = TestDb::new().await;
    let args = [
        "migrate",
        "--schema",
        &db.schema,
        "--table",
        "orders_inbox",
        "--key-mode",
        "uuid",
    ];
    let out = admin(&args);
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains("orders_inbox"), "{out:?}");
    let key_type: String = sqlx::query_scalar(
        "SELECT data_type FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = 'orders_inbox' AND column_name = 'message_id'",
    )
    .bind(&db.schema)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(key_type, "uuid");

    // Running it again changes nothing and succeeds.
    let again = admin(&args);
    assert!(again.status.success(), "{again:?}");
    db.drop().await;
}

#[tokio::test]
async fn purge_deletes_expired_rows_batch_by_batch_and_keeps_fresh_ones() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 2_500, 20 * DAY).await;
    db.insert_aged_rows("billing", 10, DAY).await;

    let out = admin(&[
        "purge",
        "--schema",
        &db.schema,
        "--older-than",
        "14d",
        "--batch",
        "1000",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    for line in [
        "batch 1: 1000 rows",
        "batch 2: 1000 rows",
        "batch 3: 500 rows",
        "deleted 2500 rows older than 14d",
    ] {
        assert!(stdout.contains(line), "`{line}` missing from:\n{stdout}");
    }
    assert_eq!(db.inbox_rows().await, 10);
    db.drop().await;
}

#[tokio::test]
async fn stats_exits_2_when_a_consumer_remembers_less_than_the_minimum_window() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 30, 20 * DAY).await;

    let long_enough = admin(&["stats", "--schema", &db.schema, "--min-window", "7d"]);
    assert_eq!(long_enough.status.code(), Some(0), "{long_enough:?}");
    let stdout = text(&long_enough.stdout);
    assert!(stdout.contains("rows         30"), "{stdout}");
    assert!(stdout.contains("billing"), "{stdout}");
    assert!(!stdout.contains("SHORTER"), "{stdout}");

    db.insert_aged_rows("shipping", 5, 2 * DAY).await;
    let short = admin(&["stats", "--schema", &db.schema, "--min-window", "7d"]);
    assert_eq!(short.status.code(), Some(2), "{short:?}");
    let stdout = text(&short.stdout);
    let shipping = stdout.lines().find(|l| l.starts_with("shipping")).unwrap();
    assert!(shipping.contains("SHORTER THAN --min-window"), "{shipping}");
    let billing = stdout.lines().find(|l| l.starts_with("billing")).unwrap();
    assert!(!billing.contains("SHORTER"), "{billing}");
    assert!(text(&short.stderr).contains("less than 7d"), "{short:?}");
    db.drop().await;
}

#[test]
fn bad_input_fails_with_a_message_that_names_it() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["stats", "--table", "inbox; DROP TABLE x"],
            "table name `inbox; DROP TABLE x` is not a plain SQL identifier",
        ),
        (
            &["migrate", "--key-mode", "sha1"],
            "`--key-mode sha1` is not text, uuid or hashed",
        ),
        (&["purge"], "`purge` needs `--older-than`"),
        (&["purge", "--older-than", "2 weeks"], "is not a duration"),
        (
            &["stats", "--min-windw", "7d"],
            "`stats` does not take `--min-windw`",
        ),
    ];
    for (args, expected) in cases {
        let out = admin(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(expected),
            "{args:?}: `{expected}` missing from:\n{stderr}"
        );
    }
}

#[test]
fn help_prints_every_command() {
    let out = admin(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    for command in ["migrate", "purge", "stats", "measure-storage"] {
        assert!(stdout.contains(command), "{command} missing:\n{stdout}");
    }
}
