//! `inbox-admin` run as an operator runs it, against a real PostgreSQL: migrate, purge, stats and
//! the errors a typo gets. Its `--json` output and progress lines are in `json_and_progress.rs`.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::process::Command;

use inbox_conformance::TestDb;

use crate::common;
use common::*;

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
    assert_eq!(short.status.code(), Some(3), "{short:?}");
    let stdout = text(&short.stdout);
    let shipping = stdout.lines().find(|l| l.starts_with("shipping")).unwrap();
    assert!(shipping.contains("SHORTER THAN --min-window"), "{shipping}");
    let billing = stdout.lines().find(|l| l.starts_with("billing")).unwrap();
    assert!(!billing.contains("SHORTER"), "{billing}");
    assert!(text(&short.stderr).contains("less than 7d"), "{short:?}");
    db.drop().await;
}

#[tokio::test]
async fn purge_refuses_a_window_below_one_hour_unless_forced() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 40, 2 * DAY).await;

    for (window, named) in [("0s", "`--older-than 0s`"), ("14m", "`--older-than 14m`")] {
        let out = admin(&["purge", "--schema", &db.schema, "--older-than", window]);
        assert_eq!(out.status.code(), Some(2), "{window}: {out:?}");
        let stderr = text(&out.stderr);
        for expected in [named, "1h", "--force"] {
            assert!(
                stderr.contains(expected),
                "{window}: `{expected}` missing from:\n{stderr}"
            );
        }
        assert_eq!(db.inbox_rows().await, 40, "{window} purged without --force");
    }

    let forced = admin(&[
        "purge",
        "--schema",
        &db.schema,
        "--older-than",
        "14m",
        "--force",
    ]);
    assert!(forced.status.success(), "{forced:?}");
    assert!(
        text(&forced.stdout).contains("deleted 40 rows"),
        "{forced:?}"
    );
    assert_eq!(db.inbox_rows().await, 0);

    // `--yes` is the same confirmation, and the floor itself is not below the floor.
    db.insert_aged_rows("billing", 3, 2 * DAY).await;
    for flags in [
        &["--older-than", "30m", "--yes"][..],
        &["--older-than", "1h"][..],
    ] {
        let mut args = vec!["purge", "--schema", &db.schema];
        args.extend_from_slice(flags);
        let out = admin(&args);
        assert!(out.status.success(), "{flags:?}: {out:?}");
    }
    assert_eq!(db.inbox_rows().await, 0);
    db.drop().await;
}

#[tokio::test]
async fn help_as_a_value_or_a_stray_word_never_reports_success() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 30, 20 * DAY).await;

    // `help` taken as the schema's name: there is no inbox in a schema `help`.
    let out = admin(&["purge", "--older-than", "14d", "--schema", "help"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("help"), "{out:?}");

    let usage_errors: [&[&str]; 3] = [
        &["purge", "--schema", &db.schema, "--older-than", "help"],
        &[
            "purge",
            "--schema",
            &db.schema,
            "--older-than",
            "14d",
            "help",
        ],
        &["stats", "--schema", &db.schema, "--min-window", "help"],
    ];
    for args in usage_errors {
        let out = admin(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(text(&out.stderr).contains("help"), "{args:?}: {out:?}");
    }
    assert_eq!(db.inbox_rows().await, 30);
    db.drop().await;
}

#[tokio::test]
async fn purge_takes_weeks_and_other_humantime_durations() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 7, 20 * DAY).await;
    db.insert_aged_rows("billing", 3, 10 * DAY).await;
    db.insert_aged_rows("billing", 2, DAY).await;

    let out = admin(&["purge", "--schema", &db.schema, "--older-than", "2w"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(db.inbox_rows().await, 5);
    let out = admin(&["purge", "--schema", &db.schema, "--older-than", "5days 12h"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(db.inbox_rows().await, 2);
    db.drop().await;
}

#[test]
fn usage_errors_exit_2_and_name_the_input() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["migrate", "--key-mode", "sha1"],
            "invalid value 'sha1' for '--key-mode",
        ),
        (&["purge"], "--older-than"),
        (&["purge", "--older-than", "14"], "`14` is not a duration"),
        (&["stats", "--min-windw", "7d"], "'--min-windw'"),
        (&["purge", "--older-than", "14d", "--batch", "0"], "--batch"),
    ];
    for (args, expected) in cases {
        let out = admin(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(expected),
            "{args:?}: `{expected}` missing from:\n{stderr}"
        );
    }
}

#[test]
fn a_command_without_a_database_url_names_the_setting_and_touches_nothing() {
    let out = Command::new(env!("CARGO_BIN_EXE_inbox-admin"))
        .arg("stats")
        .env_remove("DATABASE_URL")
        .output()
        .expect("the inbox-admin binary runs");
    assert!(!out.status.success(), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("--database-url") && stderr.contains("DATABASE_URL"),
        "the error names neither way to set it:\n{stderr}"
    );
    // The DDL needs no database.
    let out = Command::new(env!("CARGO_BIN_EXE_inbox-admin"))
        .args(["migrate", "--print-sql"])
        .env_remove("DATABASE_URL")
        .output()
        .expect("the inbox-admin binary runs");
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn migrate_print_sql_prints_the_statements_without_a_database() {
    // Nothing listens on port 1: a connection attempt would fail the command.
    let nowhere = "postgres://nobody:secret@127.0.0.1:1/none";
    let args = [
        "migrate",
        "--print-sql",
        "--database-url",
        nowhere,
        "--schema",
        "billing",
        "--key-mode",
        "uuid",
    ];
    let out = admin(&args);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
    let sql = text(&out.stdout);
    assert!(sql.starts_with("-- "), "stdout is not only SQL:\n{sql}");
    for expected in [
        r#"CREATE TABLE IF NOT EXISTS "billing"."inbox_consumers" ("#,
        r#"CREATE TABLE IF NOT EXISTS "billing"."inbox" ("#,
        "message_id uuid NOT NULL",
        "USING brin (processed_minute);",
    ] {
        assert!(sql.contains(expected), "`{expected}` missing from:\n{sql}");
    }
    assert!(!sql.contains("PARTITION"), "{sql}");

    let out = admin(&[
        "migrate",
        "--print-sql",
        "--partitioned",
        "--database-url",
        nowhere,
    ]);
    assert!(out.status.success(), "{out:?}");
    let sql = text(&out.stdout);
    for expected in [
        r#"CREATE TABLE IF NOT EXISTS "inbox" ("#,
        "PARTITION BY RANGE (message_id);",
        r#"CREATE TABLE "inbox_default" PARTITION OF "inbox" DEFAULT;"#,
    ] {
        assert!(sql.contains(expected), "`{expected}` missing from:\n{sql}");
    }
}

#[test]
fn runtime_errors_exit_1_and_name_the_input() {
    let args = ["stats", "--table", "inbox; DROP TABLE x"];
    let out = admin(&args);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    let expected = "table name `inbox; DROP TABLE x` is not a plain SQL identifier";
    assert!(
        stderr.contains(expected),
        "`{expected}` missing from:\n{stderr}"
    );
}

#[test]
fn no_arguments_prints_usage_and_exits_2() {
    let out = admin(&[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let usage = text(&out.stderr);
    assert!(usage.contains("Usage: inbox-admin"), "{usage}");
    for command in ["migrate", "purge", "stats", "measure-storage"] {
        assert!(usage.contains(command), "{command} missing:\n{usage}");
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

#[test]
fn each_command_has_its_own_help_and_the_tool_has_a_version() {
    let cases: [(&str, &[&str]); 4] = [
        ("migrate", &["--key-mode", "--schema", "--print-sql"]),
        ("purge", &["--older-than", "--batch", "--force", "1h"]),
        ("stats", &["--min-window", "--json", "exit status 3"]),
        ("measure-storage", &["--rows", "--runs"]),
    ];
    for (command, expected) in cases {
        let out = admin(&[command, "--help"]);
        assert!(out.status.success(), "{command}: {out:?}");
        let stdout = text(&out.stdout);
        assert!(
            stdout.contains(&format!("Usage: inbox-admin {command}")),
            "{command}:\n{stdout}"
        );
        for word in expected {
            assert!(
                stdout.contains(word),
                "{command}: `{word}` missing:\n{stdout}"
            );
        }
    }

    let out = admin(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        text(&out.stdout).trim(),
        concat!("inbox-admin ", env!("CARGO_PKG_VERSION"))
    );
}
